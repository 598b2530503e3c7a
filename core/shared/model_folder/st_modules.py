"""modules.json: the chain of sentence-transformers modules in order -- a Transformer (or a
StaticEmbedding) first, then pooling and what runs after it -- read into an `STLayout`. A module
that would change the output and is not implemented is a ValueError naming it."""

from __future__ import annotations

from pathlib import Path

from pooling_pipeline.core.shared.config import POOLING_MODES, HeadModule, LogitScoreSpec, PoolingSpec, SparseSpec
from pooling_pipeline.core.shared.model_folder.multi_vector import finish_multi_vector, read_multi_vector_module
from pooling_pipeline.core.shared.model_folder.st_config import read_st_config
from pooling_pipeline.core.shared.model_folder.st_files import IGNORED_TYPES, Module, dense_module, read_json, read_modules
from pooling_pipeline.core.shared.model_folder.st_layout import STLayout
from pooling_pipeline.core.shared.model_folder.transformer_module import read_transformer_config

# ST's legacy pooling flags, in the order ST concatenates them.
LEGACY_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                        "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


_TRANSFORMER_TYPES = {"Transformer", "MLMTransformer"}


def read_st_layout(root: Path, trust_remote_code: bool) -> STLayout:
    layout = STLayout(transformer_dir=root)
    read_st_config(layout, root)
    if (root / "modules.json").is_file():
        _read_modules(layout, root, trust_remote_code)
        if layout.multi_vector is not None:
            finish_multi_vector(layout, root)
    elif layout.multi_vector is not None:
        raise ValueError(f"{root}: a multi-vector (ColBERT) model without modules.json is not supported "
                         "(ST would add a randomly initialised projection)")
    else:
        # A plain transformers directory: mean pooling, no normalization -- what ST builds for
        # such a directory (a cross-encoder or classifier ignores both).
        read_transformer_config(layout, root)
    return layout


def _read_modules(layout: STLayout, root: Path, trust_remote_code: bool) -> None:
    """modules.json in order: a Transformer first, then pooling and what runs after it."""
    read_chain(layout, read_modules(root / "modules.json"), root / "modules.json", trust_remote_code)


def read_chain(layout: STLayout, modules: list[Module], modules_path: Path, trust_remote_code: bool) -> None:
    """A chain of modules (modules.json's, or one Router route's) in order."""
    for position, module in enumerate(modules):
        if position == 0:
            _read_first_module(layout, module, modules_path)
        else:
            _read_later_module(layout, module, modules_path, trust_remote_code)
    if layout.sparse is not None and (layout.pooling_module or layout.head_modules):
        raise ValueError(f"{modules_path}: SpladePooling combined with other pooling or modules is not supported")
    # A final Normalize is the default of `PoolingParams.normalize` (callers may turn it off);
    # one earlier in the chain is part of the model and always runs.
    if layout.head_modules and layout.head_modules[-1].kind == "normalize":
        layout.head_modules.pop()
        layout.normalize = True


def _read_first_module(layout: STLayout, module: Module, modules_path: Path) -> None:
    if module.kind == "StaticEmbedding" and layout.multi_vector is None:
        layout.static_dir = module.where
        layout.pooling_module = True  # its output is the sentence embedding already
        return
    if module.kind == "CLIPModel":  # the legacy module of older clip-ViT-* saves
        layout.transformer_dir = module.where
        read_transformer_config(layout, module.where, legacy_clip=True)
        return
    if module.kind not in _TRANSFORMER_TYPES:
        raise ValueError(f"{modules_path}: the first module is {module.saved_type!r}; only a Transformer, "
                         "CLIPModel or StaticEmbedding first module is supported")
    layout.transformer_dir = module.where
    if module.kind == "MLMTransformer":
        layout.task = "fill-mask"
    read_transformer_config(layout, module.where)


def _read_later_module(layout: STLayout, module: Module, modules_path: Path, trust_remote_code: bool) -> None:
    """What one module after the Transformer adds to the layout."""
    kind, where = module.kind, module.where
    if kind in _TRANSFORMER_TYPES:
        raise ValueError(f"{modules_path}: the {kind} module must come first")
    if layout.multi_vector is not None:
        read_multi_vector_module(layout.multi_vector, module, modules_path, trust_remote_code)
        return
    if kind in ("Pooling", "SpladePooling") and (layout.static_dir is not None or layout.dual_encoder):
        first = "StaticEmbedding" if layout.static_dir is not None else "a dual encoder (CLIP, SigLIP)"
        raise ValueError(f"{modules_path}: a {kind} module after {first} is not supported (its output is a "
                         "sentence embedding already)")
    if kind == "Pooling":
        if layout.pooling_module:
            raise ValueError(f"{modules_path}: more than one Pooling module")
        layout.pooling_module = True
        layout.pooling = _pooling(read_json(where / "config.json"), where)
    elif kind == "SpladePooling":
        layout.sparse = _splade(read_json(where / "config.json"), where)
    elif kind == "Dense":
        if not layout.pooling_module:
            raise ValueError(f"{where}: a Dense module before pooling (on token embeddings) is not supported")
        layout.head_modules.append(dense_module(read_json(where / "config.json"), where, trust_remote_code))
    elif kind == "LayerNorm":
        layout.head_modules.append(HeadModule(kind="layer_norm", path=str(where.resolve()),
                                              in_features=int(read_json(where / "config.json")["dimension"])))
    elif kind == "Normalize":
        layout.head_modules.append(HeadModule(kind="normalize"))
    elif kind == "LogitScore":
        if layout.logit_score is not None:
            raise ValueError(f"{modules_path}: more than one LogitScore module")
        layout.logit_score = _logit_score(read_json(where / "config.json"), where)
    elif kind not in IGNORED_TYPES:
        raise ValueError(f"{modules_path}: module type {module.saved_type!r} is not supported (supported: "
                         "Transformer, MLMTransformer, Pooling, SpladePooling, Dense, LayerNorm, Normalize, "
                         "Dropout); it would change the output, so the model is refused")


def _logit_score(cfg: dict, where: Path) -> LogitScoreSpec:
    unknown = set(cfg) - {"true_token_id", "false_token_id", "module_input_name"}
    if unknown:
        raise ValueError(f"{where}/config.json: LogitScore keys {sorted(unknown)} are not supported")
    if cfg.get("module_input_name", "causal_logits") != "causal_logits":
        raise ValueError(f"{where}/config.json: LogitScore on {cfg['module_input_name']!r} is not supported "
                         "(causal_logits only)")
    true_id, false_id = cfg.get("true_token_id"), cfg.get("false_token_id")
    if not isinstance(true_id, int) or not (false_id is None or isinstance(false_id, int)):
        raise ValueError(f"{where}/config.json: LogitScore needs an integer true_token_id (and false_token_id "
                         f"or null), got {true_id!r} / {false_id!r}")
    return LogitScoreSpec(true_token_id=true_id, false_token_id=false_id)


def _pooling(cfg: dict, where: Path) -> PoolingSpec:
    known = {"embedding_dimension", "word_embedding_dimension", "pooling_mode", "include_prompt",
             *LEGACY_POOLING_FLAGS}
    unknown = set(cfg) - known
    if unknown:
        raise ValueError(f"{where}/config.json: Pooling keys {sorted(unknown)} are not supported")
    mode = cfg.get("pooling_mode")
    if mode is None:  # the older flags, concatenated in ST's order; none set means mean
        modes = [m for flag, m in LEGACY_POOLING_FLAGS.items() if cfg.get(flag)] or ["mean"]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode)
    for m in modes:
        if m not in POOLING_MODES:
            raise ValueError(f"{where}/config.json: pooling mode {m!r} is not supported ({POOLING_MODES})")
    return PoolingSpec(modes=modes, include_prompt=bool(cfg.get("include_prompt", True)))


def _splade(cfg: dict, where: Path) -> SparseSpec:
    unknown = set(cfg) - {"pooling_strategy", "activation_function", "embedding_dimension",
                          "word_embedding_dimension", "chunk_size"}
    if unknown:
        raise ValueError(f"{where}/config.json: SpladePooling keys {sorted(unknown)} are not supported")
    pooling = cfg.get("pooling_strategy", "max")
    activation = cfg.get("activation_function", "relu")
    if pooling not in ("max", "sum") or activation not in ("relu", "log1p_relu"):
        raise ValueError(f"{where}/config.json: SpladePooling {pooling!r} / {activation!r} is not supported")
    return SparseSpec(pooling=pooling, activation=activation)
