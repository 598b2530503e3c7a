"""The transformer's own config.json (and its tokenizer's model_max_length): the widths, the
lengths and the checks of what the engine can run, read as plain JSON without transformers where
the common families allow it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

from pooling_pipeline.core.shared.config import ENCODER_ONLY_CLASSES
from pooling_pipeline.core.shared.model_folder.st_files import read_json, read_optional_json

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.json")
# A SentencePiece model file (protobuf) is read only by the `sentencepiece` package; a folder whose sole
# vocabulary it is (no tokenizer.json to load instead) cannot be opened without that package.
SENTENCEPIECE_FILES = ("spiece.model", "tokenizer.model", "sentencepiece.bpe.model")
# Other vocabularies transformers reads without sentencepiece.
PLAIN_VOCAB_FILES = ("tokenizer.json", "vocab.txt", "vocab.json")
# Position embeddings of these families reserve padding_idx + 1 slots.
OFFSET_POSITION_FAMILIES = ("roberta", "xlm-roberta", "camembert", "longformer", "mpnet")


def transformer_config(path: Path, base: Path | None = None) -> dict:
    """The transformer's config.json, from a directory that holds a tokenizer too (or from `base`,
    a PEFT adapter's base model, while the tokenizer stays in `path`)."""
    config_dir = base or path
    if not (config_dir / "config.json").is_file():
        raise ValueError(f"model directory {str(config_dir)!r} has no config.json")
    check_tokenizer_files(path, f"model directory {str(path)!r}")
    return read_json(config_dir / "config.json")


def check_tokenizer_files(path: Path, where: str) -> None:
    """Refuses, in the caller, a tokenizer folder that a render worker could not open: no vocabulary at
    all, or only a SentencePiece model with the `sentencepiece` package absent (transformers then hands
    the protobuf file to tiktoken, which fails with "Error parsing line b'\\x0e' in .../spiece.model")."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{where} has no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})")
    if any((path / name).is_file() for name in PLAIN_VOCAB_FILES):
        return
    sentencepiece = [name for name in SENTENCEPIECE_FILES if _is_sentencepiece_model(path / name)]
    if sentencepiece and importlib.util.find_spec("sentencepiece") is None:
        raise ValueError(f"{where}: its tokenizer is only a SentencePiece model ({sentencepiece[0]}, no tokenizer.json), "
                         "which needs the sentencepiece package: `pip install sentencepiece`, or save the tokenizer "
                         "with a tokenizer.json (AutoTokenizer.from_pretrained(folder).save_pretrained(folder) where "
                         "sentencepiece is installed)")


def _is_sentencepiece_model(file: Path) -> bool:
    """A SentencePiece ModelProto, not a tiktoken BPE file (lines of base64 and a rank, also named
    tokenizer.model: Llama 3's), which transformers reads without sentencepiece. A protobuf's first
    byte is its first field's tag; a tiktoken file is printable ASCII."""
    if not file.is_file():
        return False
    with open(file, "rb") as f:
        head = f.read(64)
    return bool(head) and not all(32 <= byte < 127 or byte in (9, 10, 13) for byte in head)


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
COMPOSITE_CONFIG_KEYS = ("text_config", "vision_config", "audio_config", "vlm_config", "encoder", "decoder")


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


def check_remote_code(config: dict, model_type: str, path: Path, trust_remote_code: bool) -> None:
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


def check_text_model(config: dict, model_type: str, path: Path) -> None:
    """A composite (multi-modal) config has no text model of its own at the top: name it."""
    parts = [key for key in COMPOSITE_CONFIG_KEYS if isinstance(config.get(key), dict)]
    if parts and "hidden_size" not in config:
        architectures = ", ".join(map(str, config.get("architectures") or [])) or "unknown architecture"
        raise ValueError(f"{str(path)!r} holds {architectures} (model_type {model_type!r}), a composite model "
                         f"with {', '.join(parts)}: only text models, the dual encoders CLIP, SigLIP and SigLIP 2, "
                         "CLAP, ColPali, ColQwen2 and Qwen2-VL / Qwen3-VL embedders are supported (other page "
                         "retrievers, multimodal rerankers and video models are not yet)")


def widths(config: dict, model_type: str, path: Path) -> tuple[int, int]:
    """(hidden size, vocabulary size), under the names the families give them."""
    hidden_size = config_value(config, model_type, "hidden_size")
    vocab_size = config.get("vocab_size")
    if not isinstance(hidden_size, int) or not isinstance(vocab_size, int):
        architectures = ", ".join(map(str, config.get("architectures") or [])) or "no architectures"
        raise ValueError(f"config.json of {str(path)!r} ({architectures}, model_type {model_type!r}) lacks an integer "
                         "hidden_size and vocab_size (under its family's names too): not a text model the "
                         "pipeline supports")
    return hidden_size, vocab_size


def check_encoder_only(config: dict, model_type: str) -> None:
    if config.get("is_encoder_decoder") and model_type not in ENCODER_ONLY_CLASSES:
        raise ValueError(f"{model_type!r} is an encoder-decoder model; only the encoders of "
                         f"{sorted(ENCODER_ONLY_CLASSES)} are supported")


# A model with no max length anywhere (no max_seq_length, no tokenizer model_max_length, no position
# table: XLNet, for one): ST keeps the whole text, so the pipeline keeps it whole up to this many
# tokens and refuses a longer one (naming its length) unless the call gives a length. Why this
# bound: attention over relative positions grows with the square of the length -- one 2,048-token
# text through XLNet-base (768 wide, 12 heads) peaked at 1.5 GB above the model on a CPU, one of
# 8,192 passed 16 GB before it was stopped -- and 2,048 is the CPU engine's default step budget.
WHOLE_TEXT_MAX_TOKENS = 2048


class Lengths(NamedTuple):
    max_model_len: int  # the most tokens the model takes
    default_max_tokens: int  # what is kept of a text when the caller says nothing
    whole_text: bool  # ST keeps the whole text (see WHOLE_TEXT_MAX_TOKENS)


def model_lengths(max_seq_length: int | None, config: dict, model_type: str, path: Path) -> Lengths:
    """The most tokens the model takes, and what is kept of a text when the caller says nothing --
    ST's rule, exactly:

    - an old layout's `max_seq_length` (sentence_bert_config.json; None where it has none) is the tokenizer's model_max_length
      as it is, uncapped;
    - else the tokenizer's `model_max_length`, capped at the config's max_position_embeddings
      (under its family's name too) where it has one (and it is not -1);
    - else nothing: ST keeps the whole text, the pipeline up to WHOLE_TEXT_MAX_TOKENS (`whole_text`).

    Where that is more than an absolute position table holds (BERT-like, GPT-2), ST fails on a
    longer text; the pipeline keeps what the table holds instead. Rotary, ALiBi and relative
    positions (decoders, ModernBERT, T5, DeBERTa-v2) take what ST keeps."""
    positions = config_value(config, model_type, "max_position_embeddings")
    positions = positions if isinstance(positions, int) and positions > 0 else None
    kept = max_seq_length
    if kept is None:
        kept = tokenizer_max_length(path)
        if positions is not None:
            kept = positions if kept is None else min(kept, positions)
    table = _position_table(config, model_type, positions)
    if table is not None:
        return Lengths(table, min(kept or table, table), False)
    if kept is None:
        return Lengths(WHOLE_TEXT_MAX_TOKENS, WHOLE_TEXT_MAX_TOKENS, True)
    return Lengths(max(kept, positions or 0), kept, False)


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


# BigBirdConfig's defaults (config.json written by save_pretrained leaves out values at their default).
BIG_BIRD_DEFAULTS = {"attention_type": "block_sparse", "block_size": 64, "num_random_blocks": 3}


def padding_rules(config: dict, model_type: str, path: Path) -> dict[str, int]:
    """ModelSpec's `unpadded_above` / `block_sparse_above` for the families whose output for a row
    depends on the rows it is padded with (so that ST's vector for a text depends on its batch);
    the engine gives each text the vector ST gives it alone:

    - Funnel Transformer: its attention pools the sequence (stride 2) with the padding in it, and
      its relative positions are built for the padded length (ST batched against one text at a
      time: up to 0.25 apart on a tiny model) -- every row runs at its own length.
    - BigBird with attention_type "block_sparse": its first and last blocks attend globally, so the
      padding at the end changes every row's attention; and transformers switches the model to
      full attention, for good, the first time a batch is no longer than
      (5 + 2 * num_random_blocks) * block_size tokens. Alone, a text that short gets full attention,
      a longer one block-sparse attention: the engine picks the type for each forward by that rule,
      and runs the longer rows at their own length."""
    if model_type == "funnel":
        if "FunnelBaseModel" in (config.get("architectures") or []):
            raise ValueError(f"{str(path)!r} holds a FunnelBaseModel, whose output is pooled to a shorter sequence "
                             "than its input: ST pools those pooled states, which the pipeline does not support "
                             "(a FunnelModel, with its decoder, is supported)")
        return {"unpadded_above": 0}
    if model_type == "big_bird":
        big_bird = {**BIG_BIRD_DEFAULTS, **{k: config[k] for k in BIG_BIRD_DEFAULTS if k in config}}
        if big_bird["attention_type"] == "block_sparse":
            full_up_to = (5 + 2 * int(big_bird["num_random_blocks"])) * int(big_bird["block_size"])
            return {"unpadded_above": full_up_to, "block_sparse_above": full_up_to}
    return {}
