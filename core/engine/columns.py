"""The engine core's requests in columns: a message's, the window's, a step's.

`Requests` holds requests as numpy columns (one entry per request) and their token ids packed in
one array: what the input thread makes of an EngineInputBatch, and what a step's batch is. The
engine never makes a Python object per request: admitting, batching, collating and packing the
outputs are array operations per message or per step.

`RequestTable` holds the waiting requests: a slot each (their columns at that slot) and their
token ids in one arena, so that a step's batch -- requests from many messages, picked by length --
is gathered with a few fancy-indexing operations whatever the number of messages it draws from.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

import numpy as np

from pooling_pipeline.core.shared.options import TASKS
from pooling_pipeline.core.shared.schema import DEFAULTS, PARAM_CODES, TABLE_COLUMNS, blank_table, ragged_positions

# Each request is one row of an int64 matrix whose columns are `schema.TABLE_COLUMNS`, so that
# selecting, storing and gathering requests is one array operation, not one per column.
COL = {name: k for k, name in enumerate(TABLE_COLUMNS)}
TASK_CODE = {task: code for code, task in enumerate(TASKS)}


def _option_code(value: bool | int | None) -> int:
    return -1 if value is None else int(value)


class Requests:
    """Requests in columns: `calls`, an object array of call ids (one per request); `cols`, the
    [n, len(TABLE_COLUMNS)] int64 matrix (each column also as an attribute: `lengths`, `indices`, ...);
    `token_ids`, the requests' ids back to back (int32); `starts`, where each request's begin;
    `pixels`, a dual encoder's images: uint8 [n, C, H, W], row i's pixels where row i is an image
    (`modality` 1; other rows' are zeros), None when no row is one."""

    __slots__ = ("calls", "cols", "token_ids", "pixels", "_starts")

    def __init__(self, calls: np.ndarray, cols: np.ndarray, token_ids: np.ndarray,
                 pixels: np.ndarray | None = None) -> None:
        self.calls = calls
        self.cols = cols
        self.token_ids = token_ids
        self.pixels = pixels
        self._starts = None

    @property
    def starts(self) -> np.ndarray:
        """Where each request's ids begin in `token_ids` (made when first asked: a step's batch
        usually never is)."""
        if self._starts is None:
            lengths = self.cols[:, COL["lengths"]]
            self._starts = np.cumsum(lengths) - lengths
        return self._starts

    @classmethod
    def from_message(cls, msg) -> Requests:
        """An EngineInputBatch's columns (the message checked with `msg.check()`); `task` is
        the code of the task named (-2 for a task the vocabulary does not know)."""
        n = len(msg.indices)
        cols = blank_table(n)
        # (in the order of PARAM_CODES)
        codes = np.asarray([[TASK_CODE.get(t, -2), _option_code(p.normalize), _option_code(p.dimensions),
                             _option_code(p.use_activation)] for t, p in zip(msg.tasks, msg.params)], dtype=np.int64)
        param_of = msg.columns.get("param_of")
        cols[:, COL[PARAM_CODES[0]]:COL[PARAM_CODES[-1]] + 1] = codes[0] if param_of is None else codes[param_of]
        cols[:, COL["indices"]] = msg.indices
        cols[:, COL["lengths"]] = msg.lengths
        for name, values in msg.columns.items():
            if name != "param_of":
                cols[:, COL[name]] = values
        calls = np.empty(n, dtype=object)
        # (Interned: every message of a call then holds one string object, and comparing the calls
        # of a step -- `pack_outputs` -- finds them equal by identity, without comparing characters.)
        calls[:] = sys.intern(msg.call)
        return cls(calls, cols, msg.token_ids, msg.pixels)

    def __len__(self) -> int:
        return len(self.cols)

    def ids(self, row: int) -> np.ndarray:
        start = int(self.starts[row])
        return self.token_ids[start:start + int(self.lengths[row])]

    def select(self, rows) -> Requests:
        """These rows (positions, in any order), as a Requests of their own."""
        rows = np.asarray(rows, dtype=np.int64)
        cols = self.cols.take(rows, axis=0)
        return Requests(self.calls.take(rows), cols,
                        self.token_ids.take(ragged_positions(self.starts.take(rows), cols[:, COL["lengths"]])),
                        None if self.pixels is None else self.pixels.take(rows, axis=0))

    def padded(self, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """The [n, longest] int64 matrix of the ids, each row padded with `pad_id`, and the
        [n, longest] bool mask of real tokens: one masked assignment, no loop over requests."""
        lengths = self.lengths
        longest = int(lengths.max()) if len(self) else 0
        mask = np.arange(longest)[None, :] < lengths[:, None]
        ids = np.full(mask.shape, pad_id, dtype=np.int64)
        ids[mask] = self.token_ids
        return ids, mask


# Every column of the table is also an attribute of Requests (`requests.lengths`, `.priority`,
# `.chunk`, ...): a view of that column of `cols`.
for _k, _name in enumerate(TABLE_COLUMNS):
    setattr(Requests, _name, property(lambda self, k=_k: self.cols[:, k], doc=f"the column {_name!r} (a view of `cols`)"))
del _k, _name


class RequestTable:
    """Waiting requests: a slot each (their columns there) and their ids in one token arena.

    `put` stores a message's requests (a slice copy of its ids, one fancy assignment of its
    columns); `take` gathers a batch's slots into a Requests and frees them. The arena is a bump
    allocator: when it is full, the live requests' ids (the owner says which slots are live) are
    moved to its start with one gather, and it grows when more than half of it is live. Slots
    come from a stack of free ones."""

    def __init__(self, capacity: int) -> None:
        self.capacity = 0
        self.calls = np.empty(0, dtype=object)
        self.cols = np.zeros((0, len(TABLE_COLUMNS)), np.int64)
        self.offsets = np.zeros(0, np.int64)  # where each slot's ids begin in the arena
        self.free = np.zeros(0, np.int64)  # a stack: free[:top] are free slots
        self.top = 0
        self.arena = np.zeros(max(1 << 16, 64 * capacity), np.int32)
        self.head = 0
        self.pixels: np.ndarray | None = None  # a slot's image, once a message of images came (zeros: untouched pages)
        self._grow(max(1, capacity))

    def _grow(self, capacity: int) -> None:
        old, extra = self.capacity, capacity - self.capacity
        self.calls = np.concatenate([self.calls, np.empty(extra, dtype=object)])
        self.cols = np.concatenate([self.cols, np.zeros((extra, len(TABLE_COLUMNS)), np.int64)])
        self.offsets = np.concatenate([self.offsets, np.zeros(extra, np.int64)])
        if self.pixels is not None:
            self.pixels = np.concatenate([self.pixels, np.zeros((extra, *self.pixels.shape[1:]), np.uint8)])
        stack = np.concatenate([np.arange(capacity - 1, old - 1, -1), self.free[:self.top]])
        self.free = np.zeros(capacity, np.int64)
        self.free[:len(stack)] = stack
        self.top = len(stack)
        self.capacity = capacity

    def put(self, requests: Requests, live) -> np.ndarray:
        """Stores the requests; returns their slots. `live()` gives the slots in use (asked only
        when the arena must be compacted)."""
        n = len(requests)
        if n > self.top:  # (the engine's window keeps this from happening; never fail for it)
            self._grow(max(2 * self.capacity, self.capacity + n))
        slots = self.free[self.top - n:self.top].copy()
        self.top -= n
        total = requests.token_ids.size
        if self.head + total > self.arena.size:
            self._compact(np.asarray(live(), dtype=np.int64), total)
        self.arena[self.head:self.head + total] = requests.token_ids
        self.offsets[slots] = self.head + requests.starts
        self.head += total
        self.calls[slots] = requests.calls
        self.cols[slots] = requests.cols
        if requests.pixels is not None:
            if self.pixels is None or self.pixels.shape[1:] != requests.pixels.shape[1:]:
                # (the engine refused images of any other shape than the model's before they got here)
                self.pixels = np.zeros((self.capacity, *requests.pixels.shape[1:]), np.uint8)
            self.pixels[slots] = requests.pixels
        return slots

    def take(self, slots: np.ndarray) -> Requests:
        """The requests at these slots (an int64 array), in that order, as a Requests; their slots are freed."""
        # (ndarray.take: a gather 2-4x faster than fancy indexing)
        cols = self.cols.take(slots, axis=0)
        images = self.pixels is not None and bool(cols[:, COL["modality"]].any())
        requests = Requests(self.calls.take(slots), cols,
                            self.arena.take(ragged_positions(self.offsets.take(slots), cols[:, COL["lengths"]])),
                            self.pixels.take(slots, axis=0) if images else None)
        self.release(slots)
        return requests

    def release(self, slots: np.ndarray) -> None:
        self.calls[slots] = None  # (no reference kept to a finished call's id)
        self.free[self.top:self.top + len(slots)] = slots
        self.top += len(slots)

    def _compact(self, live: np.ndarray, needed: int) -> None:
        lengths = self.cols[live, COL["lengths"]]
        kept = self.arena[ragged_positions(self.offsets[live], lengths)]
        size = self.arena.size
        while kept.size + needed > size // 2:
            size *= 2
        arena = self.arena if size == self.arena.size else np.zeros(size, np.int32)
        arena[:kept.size] = kept
        self.arena = arena
        self.offsets[live] = np.cumsum(lengths) - lengths
        self.head = kept.size


def task_lookup(tasks) -> np.ndarray:
    """Whether each task code is one of `tasks`, indexed by code + 2 (codes -2, -1: no task)."""
    return np.asarray([False, False] + [task in tasks for task in TASKS])


# ---- the rules a row of an engine input keeps ----------------------------------------------------


class RowRule(NamedTuple):
    """A rule every row of an engine input keeps. `reads`: the request columns (`core.shared.schema`) it
    checks -- a message that carried none of them holds their defaults, which keep it, so the usual
    message is not gone through it (a rule that reads none is one of the whole-message checks in
    `invalid_rows`). `broken(requests, model, runs_task)`: a bool per row; `why(requests, model,
    row)`: that row's reason."""

    reads: tuple[str, ...]
    broken: Callable[[Requests, Any, np.ndarray], np.ndarray]
    why: Callable[[Requests, Any, int], str]


def _no_image_tower(r: Requests, model, runs_task: np.ndarray) -> np.ndarray:
    return (r.modality != 0) & (model.image is None)


def _not_a_modality(r: Requests, model, runs_task: np.ndarray) -> np.ndarray:
    return ((r.modality < 0) | (r.modality > 1)) & (model.image is not None)


def _image_shape(model) -> tuple[int, int, int]:
    return (model.image.channels, model.image.height, model.image.width)


def _wrong_pixels(r: Requests, model, runs_task: np.ndarray) -> np.ndarray:
    if model.image is None:
        return np.zeros(len(r), bool)
    return (r.modality == 1) & (r.pixels is None or r.pixels.shape[1:] != _image_shape(model))


def _wrong_vision_tokens(r: Requests, model, runs_task: np.ndarray) -> np.ndarray:
    if model.image is None:
        return np.zeros(len(r), bool)
    return (r.modality == 1) & (r.lengths != model.image.tokens)


def _ids_outside_vocabulary(r: Requests, model, runs_task: np.ndarray) -> np.ndarray:
    ids = r.token_ids.view(np.uint32)  # read as unsigned, a negative id is huge
    if not ids.size or int(ids.max()) < model.vocab_size:
        return np.zeros(len(r), bool)
    rows = np.flatnonzero(r.lengths > 0)
    row_max = np.zeros(len(r), np.uint32)
    row_max[rows] = np.maximum.reduceat(ids, r.starts[rows])
    return row_max >= model.vocab_size


# In the order a row's reason is chosen (its first broken rule). A new request column with values
# the engine must refuse gets its rule here, naming the column in `reads`; one any value of which
# is valid (priority) needs none.
ROW_RULES: tuple[RowRule, ...] = (
    RowRule((), lambda r, model, runs: ~runs.take(r.task + 2),
            lambda r, model, row: f"the task is not one this model runs ({model.tasks})"),
    RowRule(("token_type_start",), lambda r, model, runs: (r.token_type_start < -1) | (r.token_type_start >= r.lengths),
            lambda r, model, row: f"token_type_start {r.token_type_start[row]} is outside the prompt"),
    RowRule(("pool_start",), lambda r, model, runs: r.pool_start < 0,
            lambda r, model, row: f"pool_start {r.pool_start[row]} is negative"),
    RowRule((), lambda r, model, runs: (r.dimensions == 0) | (r.dimensions < -1),
            lambda r, model, row: f"dimensions {r.dimensions[row]} is not a positive count"),
    RowRule(("chunk", "num_chunks"), lambda r, model, runs: (r.chunk != -1) & ((r.chunk < 0) | (r.chunk >= r.num_chunks)),
            lambda r, model, row: f"chunk {r.chunk[row]} of {r.num_chunks[row]} is not a chunk of its document"),
    RowRule(("route",), lambda r, model, runs: (r.route < -1) | (r.route >= len(model.routes)),
            lambda r, model, row: f"route {r.route[row]} is not one of the model's {len(model.routes)} routes"),
    RowRule(("expansion_start",),
            lambda r, model, runs: (r.expansion_start != -1) & ((r.expansion_start < 1) | (r.expansion_start > r.lengths)),
            lambda r, model, row: f"expansion_start {r.expansion_start[row]} is not a token of the row's {r.lengths[row]}"),
    RowRule((), lambda r, model, runs: (r.lengths < 1) | (r.lengths > model.max_model_len) & (r.modality == 0),
            lambda r, model, row: f"engine input has {r.lengths[row]} tokens; the model takes 1 to {model.max_model_len}"),
    # Image rows (`modality` 1): a model with an image tower, pixels of its shape, and as many
    # placeholder ids as its vision sequence.
    RowRule(("modality",), _no_image_tower, lambda r, model, row: "an image input, but the model takes no images"),
    RowRule(("modality",), _not_a_modality,
            lambda r, model, row: f"modality {r.modality[row]} is not 0 (text) or 1 (image)"),
    RowRule(("modality",), _wrong_pixels,
            lambda r, model, row: f"an image's pixels must have the shape {_image_shape(model)}"),
    RowRule(("modality",), _wrong_vision_tokens,
            lambda r, model, row: f"an image row must count the model's {model.image.tokens} vision tokens"),
    RowRule((), _ids_outside_vocabulary,
            lambda r, model, row: f"engine input has token ids outside [0, {model.vocab_size})"),
)
# The request columns some rule reads: a message that carries one of them is gone through the rules.
CHECKED_COLUMNS = frozenset(name for rule in ROW_RULES for name in rule.reads)
if CHECKED_COLUMNS - DEFAULTS.keys():
    raise RuntimeError(f"a row rule reads {sorted(CHECKED_COLUMNS - DEFAULTS.keys())}, which core.shared.schema does not "
                       "declare: this is a bug")


def invalid_rows(requests: Requests, model, runs_task: np.ndarray, sent: AbstractSet[str] | None = None
                 ) -> list[tuple[int, str]]:
    """The rows an engine must refuse, each with the first rule of `ROW_RULES` it breaks; [] for a
    valid message, the usual case, found with a few array operations over the whole message.
    `model` is the ModelSpec; `runs_task`, its `task_lookup`; `sent`, the request columns the
    message carried (None: any): a column it did not carry holds its default, which is valid."""
    n = len(requests)
    if not n:
        return []
    if requests.token_ids.dtype != np.int32:  # (the wire carries any allowed dtype)
        return [(row, f"engine input must be int32 token ids, got {requests.token_ids.dtype}")
                for row in range(n)]
    lengths, ids = requests.lengths, requests.token_ids
    # The usual message carries no column a rule reads and passes the rest as a few whole-message
    # checks; only one that does not is gone through rule by rule. (Without `param_of` every row has
    # the message's one (task, params): its task and dimensions are checked once, on row 0.)
    params = slice(0, 1) if sent is not None and "param_of" not in sent else slice(None)
    task, dims = requests.task[params], requests.dimensions[params]
    if (sent is not None and not sent & CHECKED_COLUMNS
            and int(lengths.min()) >= 1 and int(lengths.max()) <= model.max_model_len
            and not (ids.size and int(ids.view(np.uint32).max()) >= model.vocab_size)
            and runs_task.take(task + 2).all() and int(dims.min()) >= -1 and not (dims == 0).any()):
        return []
    masks = [rule.broken(requests, model, runs_task) for rule in ROW_RULES]
    broken = np.logical_or.reduce(masks)
    out = []
    for row in np.flatnonzero(broken).tolist():
        first = next(k for k, mask in enumerate(masks) if mask[row])
        out.append((row, ROW_RULES[first].why(requests, model, row)))
    return out


def probe_batch(num_rows: int, num_tokens: int, token: int, task: str) -> Requests:
    """A synthetic batch (the step-cost probe): `num_rows` requests of `num_tokens` ids each."""
    cols = blank_table(num_rows)
    cols[:, COL["indices"]] = np.arange(num_rows)
    cols[:, COL["lengths"]] = num_tokens
    cols[:, COL["task"]] = TASK_CODE[task]
    calls = np.empty(num_rows, dtype=object)
    calls[:] = "probe"
    return Requests(calls, cols, np.full(num_rows * num_tokens, token, np.int32))


def option_groups(batch: Requests, normalize: np.ndarray) -> list[tuple[tuple[str, int | None, bool | None], np.ndarray]]:
    """The batch's rows grouped by what finishes their vectors: (task, dimensions, normalize -- None
    where the request leaves it to the model), each with its rows (ascending). One group, without a
    loop over rows, in the usual case."""
    combo = np.stack([batch.task, batch.dimensions, normalize], axis=1)

    def key(row: np.ndarray) -> tuple[str, int | None, bool | None]:
        task, dimensions, norm = (int(v) for v in row)
        return TASKS[task], None if dimensions < 0 else dimensions, None if norm < 0 else bool(norm)

    if not len(combo) or (combo == combo[0]).all():
        return [(key(combo[0]), np.arange(len(combo)))] if len(combo) else []
    unique, inverse = np.unique(combo, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    return [(key(row), np.flatnonzero(inverse == g)) for g, row in enumerate(unique)]
