"""The per-request columns of an engine input, declared once, and the helpers every hop shares.

A request travels as one row of a batch in columns (see `core.shared.messages`). Its identity (the call's
id and its index), its token ids and its pooling params have fixed places in every message; every
other per-request integer is a `Column` here. The render worker's packer
(`workers.packer.EngineInputPacker`) sends a column only when some row of the message differs from
the default, `EngineInputBatch.check` accepts exactly these names, and the engine's request table
(`core.engine.columns`) has one int64 column for each, filled with the default where the message had none.
A column is either computed by rendering (declared here; its producer is the packer's
`add(..., name=value)` in the worker) or a per-request option's (declared in
`core.shared.options.REQUEST_OPTIONS`: the caller sets it and the packer copies it from the request's
RenderOptions); its consumer is `requests.name` in the engine.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pooling_pipeline.core.shared.options import COLUMN_OPTIONS


class Column(NamedTuple):
    name: str  # the wire name, the packer's keyword and the engine's attribute
    default: int  # what a row has when its message does not carry the column
    doc: str


# The columns rendering computes, then the per-request options' (the packer fills those from the options).
REQUEST_COLUMNS: tuple[Column, ...] = (
    Column("param_of", 0, "the row's entry in the message's (tasks, params) table"),
    Column("token_type_start", -1, "a text pair's first token of type 1 (types are zeros then ones); -1: none"),
    Column("pool_start", 0, "tokens at the start that pooling leaves out: the prompt's (ST's prompt_length)"),
    Column("chunk", -1, "chunk mode: the chunk's number in its document; -1: a whole request"),
    Column("num_chunks", 0, "chunk mode: how many chunks its document has"),
    Column("modality", 0, "what the row is, a position in MODALITIES (0: text); its arrays travel as the message's "
           "payloads (a dual encoder's image: its pixels, and placeholder ids that count its vision sequence "
           "for the step's budget)"),
    Column("expansion_start", -1, "query expansion (ColBERT): the first of the row's appended expansion tokens, "
           "which the encoder does not attend to (ST's attend=False); -1: none"),
    *(Column(o.name, o.column, o.doc) for o in COLUMN_OPTIONS),
)
OPTION_COLUMNS: tuple[str, ...] = tuple(o.name for o in COLUMN_OPTIONS)
# The `modality` column's codes: a row's position here. A family says which it takes
# (core/families/base.py, `modalities`); the engine refuses a row of any other.
MODALITIES: tuple[str, ...] = ("text", "image", "audio")
DEFAULTS: dict[str, int] = {c.name: c.default for c in REQUEST_COLUMNS}

# What the engine reads of a row's PoolingParams, as integer codes resolved once per message from
# its (tasks, params) table: the task's position in TASKS; for the optional ones -1 for None
# (normalize, use_activation: 0 or 1 otherwise; dimensions: the count).
PARAM_CODES: tuple[str, ...] = ("task", "normalize", "dimensions", "use_activation")

# The engine's [n, len(TABLE_COLUMNS)] int64 matrix of requests: identity and size, the params'
# codes, and the request columns (`param_of` is resolved into the codes, so it is not kept).
TABLE_COLUMNS: tuple[str, ...] = ("indices", "lengths", *PARAM_CODES,
                                  *(c.name for c in REQUEST_COLUMNS if c.name != "param_of"))
TABLE_DEFAULTS: tuple[int, ...] = (0, 0, 0, -1, -1, -1, *(c.default for c in REQUEST_COLUMNS if c.name != "param_of"))


def blank_table(n: int) -> np.ndarray:
    """An [n, len(TABLE_COLUMNS)] matrix with every column at its default."""
    table = np.empty((n, len(TABLE_COLUMNS)), dtype=np.int64)
    table[:] = _DEFAULT_ROW
    return table


_DEFAULT_ROW = np.asarray(TABLE_DEFAULTS, dtype=np.int64)


# ---- ragged arrays: many requests' token ids back to back, with their lengths ----------------


def packed_lengths(token_ids: np.ndarray | None, lengths: np.ndarray | None, n: int) -> list[int]:
    """The lengths, checked: one per request, non-negative, adding up to the packed ids."""
    if token_ids is None or token_ids.ndim != 1:
        raise ValueError("packed token ids must be one flat array")
    int_column(lengths, n, "lengths", optional=False)
    sizes = lengths.tolist()  # (a message's few dozen: Python's min and sum beat numpy's per-call cost)
    if sizes and min(sizes) < 0 or sum(sizes) != token_ids.size:
        raise ValueError("packed token ids do not match their lengths")
    return sizes


def split_packed(token_ids: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Each request's ids, as views of the packed array."""
    out, start = [], 0
    for size in sizes:
        out.append(token_ids[start:start + size])
        start += size
    return out


def ragged_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions starts[i] .. starts[i] + lengths[i] - 1 of every i, back to back."""
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, np.int64)
    out_starts = np.cumsum(lengths) - lengths
    return np.repeat(starts - out_starts, lengths) + np.arange(total)


def select_packed(token_ids: np.ndarray, lengths: np.ndarray, rows) -> tuple[np.ndarray, np.ndarray]:
    """The packed ids and the lengths of these rows (positions, in any order)."""
    rows = np.asarray(rows, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    picked = lengths.take(rows)
    return token_ids.take(ragged_positions(starts.take(rows), picked)), picked


# ---- checks -------------------------------------------------------------------------------


def payload_counts(counts: np.ndarray, data: np.ndarray, n: int, name: str) -> None:
    """ValueError unless `counts` (each row's items, along the first axis of `data`) are n
    non-negative integers adding up to data's first axis."""
    int_column(counts, n, f"payload {name!r} counts", optional=False)
    if data.ndim < 1:
        raise ValueError(f"payload {name!r} must be an array of items (at least one axis)")
    if n and int(counts.min()) < 0 or int(counts.sum()) != data.shape[0]:
        raise ValueError(f"payload {name!r}: its counts do not add up to its {data.shape[0]} items")


def int_column(values: np.ndarray | None, n: int, name: str, optional: bool = True, shape: tuple = ()) -> None:
    """ValueError unless `values` is an integer array of shape (n, *shape) (or None when optional)."""
    if values is None:
        if optional:
            return
        raise ValueError(f"{name} is missing")
    if values.dtype.kind != "i" or values.shape != (n, *shape):
        raise ValueError(f"{name} must be integers of shape {(n, *shape)}, got {values.dtype} {values.shape}")


def ids_out_of_range(ids: np.ndarray, vocab_size: int) -> bool:
    """True when some id of an integer array is outside [0, vocab_size): one reduction, since read
    as unsigned a negative id is huge (int64 and narrower are read through an int64 view; uint64
    ids past 2**63 stay huge)."""
    if not ids.size:
        return False
    if ids.dtype == np.int32:
        wide = ids.view(np.uint32)
    elif ids.dtype.kind == "u":
        wide = ids
    else:
        wide = ids.astype(np.int64, copy=False).view(np.uint64)
    return int(wide.max()) >= vocab_size
