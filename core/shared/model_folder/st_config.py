"""config_sentence_transformers.json: prompts, similarity, truncate_dim, max_active_dims, a
cross-encoder's activation, and a multi-vector model's top-level settings."""

from __future__ import annotations

from pathlib import Path

from pooling_pipeline.core.shared.config import SIMILARITIES
from pooling_pipeline.core.shared.model_folder.multi_vector import compose_legacy_prefixes, multi_vector_config
from pooling_pipeline.core.shared.model_folder.st_files import read_optional_json
from pooling_pipeline.core.shared.model_folder.st_layout import STLayout


def read_st_config(layout: STLayout, root: Path) -> None:
    """config_sentence_transformers.json: prompts, similarity, truncate_dim, max_active_dims and a
    cross-encoder's activation."""
    st_config = read_optional_json(root / "config_sentence_transformers.json")
    layout.multi_vector = multi_vector_config(st_config, root)
    if layout.multi_vector is not None:
        st_config = compose_legacy_prefixes(st_config, layout.multi_vector)
    layout.prompts, layout.default_prompt_name = _prompts(st_config, root)
    if layout.multi_vector is None:  # (MaxSim: see multi_vector_config)
        layout.similarity = _similarity(st_config, root)
    layout.truncate_dim = positive_int(st_config, "truncate_dim", root)
    layout.max_active_dims = positive_int(st_config, "max_active_dims", root)
    layout.score_activation = st_config.get("activation_fn")


def _prompts(st_config: dict, root: Path) -> tuple[dict[str, str], str | None]:
    prompts = st_config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise ValueError(f"{root}/config_sentence_transformers.json: prompts must map names to strings")
    default = st_config.get("default_prompt_name")
    # ("query" / "document": ST's empty placeholder prompts, which its embedders always have.)
    if default is not None and default not in prompts and default not in ("query", "document"):
        raise ValueError(f"{root}/config_sentence_transformers.json: default_prompt_name {default!r} is not "
                         f"among the prompts {sorted(prompts)}")
    return dict(prompts), default


def _similarity(st_config: dict, root: Path) -> str:
    similarity = st_config.get("similarity_fn_name") or "cosine"
    if similarity not in SIMILARITIES:
        raise ValueError(f"{root}: similarity_fn_name {similarity!r} is not supported ({SIMILARITIES})")
    return similarity


def positive_int(st_config: dict, key: str, root: Path) -> int | None:
    value = st_config.get(key)
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{root}/config_sentence_transformers.json: {key} must be a positive int, got {value!r}")
    return value
