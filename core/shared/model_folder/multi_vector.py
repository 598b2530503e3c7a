"""Multi-vector (ColBERT) models as ST's MultiVectorEncoder loads them: its own saves and PyLate's."""

from __future__ import annotations

import string
from pathlib import Path

import msgspec

from pooling_pipeline.core.shared.config import HeadModule, ModelSpec, MultiVectorSpec, QueryExpansion
from pooling_pipeline.core.shared.model_folder.st_files import (
    IGNORED_TYPES,
    Module,
    dense_chain_width,
    dense_module,
    read_json,
    read_modules,
    read_optional_json,
)
from pooling_pipeline.core.shared.model_folder.st_layout import STLayout

# config_sentence_transformers.json model_type of the layouts ST's MultiVectorEncoder loads: its own
# saves, and PyLate v3's (modules.json [Transformer, Dense]; masking and normalization implicit).
MULTI_VECTOR_TYPES = ("MultiVectorEncoder", "ColBERT")
_PYLATE_KNOBS = ("query_length", "document_length", "query_expansion")
_PYLATE_MARKERS = (*_PYLATE_KNOBS, "do_query_expansion", "attend_to_expansion_tokens", "attend_to_mask_tokens",
                   "query_prefix", "document_prefix", "skiplist_words")
_MASK_KEYS = {"skiplist_words", "skiplist_tasks", "keep_only_token_ids"}


def multi_vector_config(st_config: dict, root: Path) -> MultiVectorSpec | None:
    """A MultiVectorEncoder's top-level settings, as ST's `_parse_model_config` reads them: the
    similarity (maxsim, or meanmaxsim), PyLate's legacy knobs (query_length, document_length,
    do_query_expansion / attend_to_expansion_tokens, skiplist_words) and prefixes. Saved
    Transformer settings (sentence_bert_config.json) override the knobs later."""
    model_type = st_config.get("model_type")
    if model_type not in MULTI_VECTOR_TYPES:
        return None
    mv = MultiVectorSpec(length_normalize=st_config.get("similarity_fn_name") == "meanmaxsim")
    mv.legacy_prefixes = [st_config[key] or "" for key in ("query_prefix", "document_prefix") if key in st_config]
    knobs = {key: st_config[key] for key in _PYLATE_KNOBS
             if key in st_config and (st_config[key] is not None or key == "query_expansion")}
    if "query_expansion" not in knobs and any(key in st_config for key in _PYLATE_MARKERS):
        if st_config.get("do_query_expansion") is False:
            knobs["query_expansion"] = None
        else:  # PyLate's default: pad queries to query_length (32) with [MASK]
            attend = st_config.get("attend_to_expansion_tokens", st_config.get("attend_to_mask_tokens"))
            length = knobs.pop("query_length", None) or 32
            knobs["query_expansion"] = {"strategy": "fixed", "attend": bool(attend), "length": length}
    _set_lengths(mv, knobs, root / "config_sentence_transformers.json")
    if model_type == "ColBERT":  # PyLate v3 masked punctuation unless told otherwise
        words = st_config.get("skiplist_words")
        mv.skiplist_words = list(string.punctuation) if words is None else _skiplist(words, root)
    return mv


def compose_legacy_prefixes(st_config: dict, mv: MultiVectorSpec) -> dict:
    """PyLate's query_prefix / document_prefix become the front of the query / document prompts (ST
    puts a saved prompt's text after the prefix)."""
    prompts = dict(st_config.get("prompts") or {})
    for prefix_key, prompt_key in (("query_prefix", "query"), ("document_prefix", "document")):
        if prefix_key in st_config:
            prefix = st_config[prefix_key] or ""
            prompts[prompt_key] = prefix + (prompts.get(prompt_key) or "").removeprefix(prefix)
    return {**st_config, "prompts": prompts}


def _set_lengths(mv: MultiVectorSpec, values: dict, where: Path) -> None:
    """query_length / document_length / query_expansion, where `values` has them (checked as ST's
    Transformer checks them)."""
    for key in ("query_length", "document_length"):
        if key in values:
            value = values[key]
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{where}: {key} must be a positive int, got {value!r}")
            setattr(mv, key, value)
    if "query_expansion" in values:
        mv.query_expansion = _query_expansion(values["query_expansion"], where)
    if mv.query_expansion is not None and mv.query_length is not None and mv.query_length < mv.query_expansion.length:
        raise ValueError(f"{where}: query_length={mv.query_length} is smaller than query_expansion length "
                         f"{mv.query_expansion.length} (ST refuses it too)")


def _query_expansion(value: object, where: Path) -> QueryExpansion | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"strategy", "attend", "token", "length"}:
        raise ValueError(f"{where}: query_expansion {value!r} must be a dict of strategy, attend, token, length")
    strategy, attend, token, length = (value.get("strategy"), value.get("attend", False), value.get("token"),
                                       value.get("length"))
    if (strategy not in ("fixed", "min") or not isinstance(attend, bool) or (token is not None and not isinstance(token, str))
            or not isinstance(length, int) or isinstance(length, bool) or length < 1):
        raise ValueError(f"{where}: query_expansion {value!r} is not valid (strategy 'fixed' or 'min', attend a "
                         "bool, token a str or null, length a positive int)")
    return QueryExpansion(strategy=strategy, attend=attend, token=token, length=length)


def _skiplist(words: object, where: Path) -> list[str]:
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise ValueError(f"{where}: skiplist_words must be a list of strings, got {words!r}")
    return list(words)


def read_multi_vector_lengths(mv: MultiVectorSpec, cfg: dict, where: Path) -> dict:
    """The Transformer's own query_length / document_length / query_expansion (they win over
    PyLate's top-level knobs, as in ST); the config without them, for the other checks."""
    _set_lengths(mv, cfg, where / "sentence_bert_config.json")
    return {key: value for key, value in cfg.items() if key not in _PYLATE_KNOBS}


def read_multi_vector_module(mv: MultiVectorSpec, module: Module, modules_path: Path,
                              trust_remote_code: bool) -> None:
    """A module after the Transformer of a multi-vector model: token-level Dense / Normalize, the
    MultiVectorMask; anything else (Pooling, token pooling, ...) is refused."""
    kind, where = module.kind, module.where
    if kind == "Dense":
        cfg = read_json(where / "config.json")
        for key in ("module_input_name", "module_output_name"):
            if cfg.get(key, "token_embeddings") != "token_embeddings":
                raise ValueError(f"{where}/config.json: a Dense module on {cfg[key]!r} in a multi-vector model is "
                                 "not supported (only on the token embeddings)")
        cfg = {k: v for k, v in cfg.items() if k not in ("module_input_name", "module_output_name")}
        mv.token_modules.append(dense_module(cfg, where, trust_remote_code))
    elif kind == "Normalize":
        cfg = read_optional_json(where / "config.json")
        if cfg.get("module_input_name", "token_embeddings") != "token_embeddings":
            raise ValueError(f"{where}: a Normalize on {cfg['module_input_name']!r} in a multi-vector model is "
                             "not supported (only on the token embeddings)")
        mv.token_modules.append(HeadModule(kind="normalize"))
    elif kind == "MultiVectorMask":
        _read_mask(mv, read_optional_json(where / "config.json"), where)
    elif kind not in IGNORED_TYPES:
        raise ValueError(f"{modules_path}: module type {module.saved_type!r} in a multi-vector model is not "
                         "supported (supported: Transformer, Dense and Normalize on token embeddings, "
                         "MultiVectorMask, Dropout); it would change the output, so the model is refused")


def _read_mask(mv: MultiVectorSpec, cfg: dict, where: Path) -> None:
    unknown = set(cfg) - _MASK_KEYS
    if unknown:
        raise ValueError(f"{where}/config.json: MultiVectorMask keys {sorted(unknown)} are not supported")
    mv.mask_module = True
    mv.skiplist_words = _skiplist(cfg.get("skiplist_words") or [], where)
    tasks = cfg.get("skiplist_tasks")
    tasks = ["document"] if tasks is None else [tasks] if isinstance(tasks, str) else tasks
    if not isinstance(tasks, list) or not set(tasks) <= {"query", "document"}:
        raise ValueError(f"{where}/config.json: skiplist_tasks {tasks!r} must name 'query' and/or 'document'")
    mv.skiplist_tasks = list(tasks)
    keep = cfg.get("keep_only_token_ids")
    if keep is not None and (not isinstance(keep, list) or not all(isinstance(i, int) for i in keep)):
        raise ValueError(f"{where}/config.json: keep_only_token_ids must be a list of ints, got {keep!r}")
    mv.keep_only_token_ids = keep


def finish_multi_vector(layout: STLayout, root: Path) -> None:
    """After modules.json: PyLate v3 saves list [Transformer, Dense] only (ST appends the
    punctuation mask and a Normalize); a final token Normalize becomes the `normalize` default."""
    mv = layout.multi_vector
    if layout.pooling_module or layout.head_modules or layout.sparse is not None:
        raise ValueError(f"{root}/modules.json: pooling or sentence-level modules in a multi-vector model")
    pylate_v3 = read_optional_json(root / "config_sentence_transformers.json").get("model_type") == "ColBERT"
    if pylate_v3:
        if _has_mask_module(root):
            raise ValueError(f"{root}/modules.json: a PyLate save (model_type 'ColBERT') that lists a "
                             "MultiVectorMask is not supported (ST would add a second one)")
        mv.mask_module = True
        mv.token_modules.append(HeadModule(kind="normalize"))
    elif not _has_mask_module(root):
        mv.mask_module, mv.skiplist_words = False, []
    if mv.token_modules and mv.token_modules[-1].kind == "normalize":
        mv.token_modules.pop()
        layout.normalize = True


def _has_mask_module(root: Path) -> bool:
    return any(m.kind == "MultiVectorMask" for m in read_modules(root / "modules.json"))


def with_multi_vector(spec: ModelSpec, st: STLayout, path: Path) -> ModelSpec:
    """A MultiVectorEncoder's spec: token vectors only (task token_embed and MaxSim scores), the
    query / document routes, and the checks of what the engine cannot do as ST does."""
    if "HF_ColBERT" in spec.architectures:
        raise ValueError(f"{path}: Stanford-NLP ColBERT checkpoints (architecture HF_ColBERT, the projection "
                         "inline in the weights) are not supported; a PyLate or sentence-transformers save is")
    mv = st.multi_vector
    if mv is None:
        return spec
    if spec.head != "none" or spec.model_class != "auto":
        raise ValueError(f"{path}: a multi-vector model must be a plain encoder (got head {spec.head!r})")
    for name, length in (("query_length", mv.query_length), ("document_length", mv.document_length),
                         ("query_expansion length", mv.query_expansion and mv.query_expansion.length)):
        if length is not None and length > spec.max_model_len:
            raise ValueError(f"{path}: {name}={length} is more than the model's {spec.max_model_len} positions")
    tokenizer_config = read_optional_json(path / "tokenizer_config.json")
    if mv.query_expansion is not None and tokenizer_config.get("padding_side") == "left":
        raise ValueError(f"{path}: query expansion with a left-padding tokenizer is not supported")
    size = dense_chain_width(spec.hidden_size, mv.token_modules)
    return msgspec.structs.replace(
        spec, multi_vector=mv, late_interaction=True, normalize=st.normalize, embedding_size=size,
        tasks=["token_embed", "score"], routes=["query", "document"], default_route=None)
