"""ST's StaticEmbedding module (model2vec / potion models, ST's static-retrieval models): what its
folder says, read without torch.

ST's StaticEmbedding is an `nn.EmbeddingBag` (mean) over the text's token ids; its tokenizer is the
module folder's tokenizer.json loaded as it is (`tokenizers.Tokenizer.from_file`, no transformers
adjustments), padding off, with no special tokens added, and its own truncation (when the file saves
one) as the only limit on a text's length. The weights are `embedding.weight` (ST's save) or
model2vec's `embeddings` with an optional `mapping` (token id -> row) and per-token `weights`, which
ST folds into one row per token id (`fold_model2vec_weights`).
"""

from __future__ import annotations

import json
from pathlib import Path

# A StaticEmbedding whose tokenizer saves no truncation keeps every token in ST (its
# max_seq_length is infinite); the pipeline keeps up to this many tokens of a text (about 4 MB of
# English), the most one request may carry; a longer text is cut there (see the README).
STATIC_MAX_TOKENS = 1 << 20
# The weight dtypes served: ST's EmbeddingBag and the modules after it then compute in float32.
SERVED_DTYPES = ("F32",)


def static_folder_facts(where: Path) -> tuple[int, int, int | None, bool]:
    """(vocabulary rows, embedding width, max tokens kept or None for no limit, truncate from the
    left) of a StaticEmbedding folder; anything ST would not load, or would load differently from
    the pipeline, is a ValueError naming the file."""
    tokenizer = where / "tokenizer.json"
    if not tokenizer.is_file():
        raise ValueError(f"{where}: a StaticEmbedding module needs its tokenizer.json (ST loads no other tokenizer "
                         "file for it)")
    rows, width = _weights_shape(where)
    truncation = _tokenizer_truncation(tokenizer)
    if truncation is None:
        return rows, width, None, False
    return rows, width, truncation[0], truncation[1]


def _weights_shape(where: Path) -> tuple[int, int]:
    path = where / "model.safetensors"
    if not path.is_file():
        if (where / "pytorch_model.bin").is_file():
            raise ValueError(f"{where}: StaticEmbedding weights in pytorch_model.bin are not supported (only "
                             "model.safetensors, which ST writes by default)")
        raise ValueError(f"{where}: a StaticEmbedding module has no weights (model.safetensors)")
    header = safetensors_header(path)
    if "embedding.weight" in header:
        key = "embedding.weight"
    elif "embeddings" in header:  # model2vec's own file
        key = "embeddings"
    else:
        raise ValueError(f"{path}: no 'embedding.weight' (ST) or 'embeddings' (model2vec) tensor; found "
                         f"{sorted(k for k in header if k != '__metadata__')}")
    entry = header[key]
    shape, dtype = entry.get("shape"), entry.get("dtype")
    if not (isinstance(shape, list) and len(shape) == 2):
        raise ValueError(f"{path}: '{key}' has shape {shape}, not [vocabulary, width]")
    if dtype not in SERVED_DTYPES:
        raise ValueError(f"{path}: static embedding weights in {dtype}: only float32 ({', '.join(SERVED_DTYPES)}) is "
                         "served (ST computes a float16 or bfloat16 table in that precision, and cannot use int8)")
    rows = int(shape[0])
    if "mapping" in header:  # model2vec: one row per token id of the mapping
        mapping = header["mapping"].get("shape")
        if not (isinstance(mapping, list) and len(mapping) == 1):
            raise ValueError(f"{path}: model2vec 'mapping' has shape {mapping}, not [vocabulary]")
        rows = int(mapping[0])
    return rows, int(shape[1])


def _tokenizer_truncation(path: Path) -> tuple[int, bool] | None:
    """The truncation tokenizer.json saves (kept tokens, from the left), or None."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8")).get("truncation")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON: {e}") from None
    if not saved:
        return None
    if saved.get("stride", 0) or not isinstance(saved.get("max_length"), int) or saved["max_length"] < 1:
        raise ValueError(f"{path}: truncation {saved} is not supported (a positive max_length, no stride)")
    return int(saved["max_length"]), str(saved.get("direction", "Right")).lower() == "left"


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor names, dtypes and shapes), read without torch."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size <= 0 or size > 100 * 1024 * 1024:
                raise ValueError(f"header size {size}")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header is not an object)")
    return header


def load_static_weights(where: str):
    """The [vocabulary, width] float32 table ST's StaticEmbedding.load builds: `embedding.weight`, or
    model2vec's `embeddings` folded with its `mapping` and per-token `weights` (as ST folds them:
    row[id] = embeddings[mapping[id]] * weights[id])."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(Path(where) / "model.safetensors"))
    if "embedding.weight" in weights:
        return weights["embedding.weight"].contiguous()
    embeddings = weights["embeddings"]
    if weights.get("mapping") is not None:
        embeddings = embeddings[weights["mapping"].to(torch.long)]
    if weights.get("weights") is not None:
        embeddings = (embeddings.to(torch.promote_types(embeddings.dtype, torch.float32))
                      * weights["weights"][:, None]).to(embeddings.dtype)
    return embeddings.contiguous()
