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

from pooling_pipeline.core.shared.config import PayloadSpec
from pooling_pipeline.core.shared.messages import Payload
from pooling_pipeline.core.shared.options import TASKS
from pooling_pipeline.core.shared.schema import (
    DEFAULTS,
    MODALITIES,
    PARAM_CODES,
    TABLE_COLUMNS,
    blank_table,
    ragged_positions,
)

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
    `payloads`, the rows' other arrays by name (`messages.Payload`: each row's items back to back,
    their counts; a name only where some row has items), as the model's family declares them."""

    __slots__ = ("calls", "cols", "token_ids", "payloads", "_starts")

    def __init__(self, calls: np.ndarray, cols: np.ndarray, token_ids: np.ndarray,
                 payloads: dict[str, Payload] | None = None) -> None:
        self.calls = calls
        self.cols = cols
        self.token_ids = token_ids
        self.payloads = {} if payloads is None else payloads
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
        return cls(calls, cols, msg.token_ids, msg.payloads)

    def __len__(self) -> int:
        return len(self.cols)

    def ids(self, row: int) -> np.ndarray:
        start = int(self.starts[row])
        return self.token_ids[start:start + int(self.lengths[row])]

    def select(self, rows) -> Requests:
        """These rows (positions, in any order), as a Requests of their own."""
        rows = np.asarray(rows, dtype=np.int64)
        cols = self.cols.take(rows, axis=0)
        payloads = {name: payload.rows(rows) for name, payload in self.payloads.items()}
        return Requests(self.calls.take(rows), cols,
                        self.token_ids.take(ragged_positions(self.starts.take(rows), cols[:, COL["lengths"]])),
                        {name: payload for name, payload in payloads.items() if payload.counts.any()})

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


class Arena:
    """Items of one dtype and item shape for a table's slots, bump-allocated: slot s's items are
    `data[offsets[s]:offsets[s] + counts[s]]`. When it is full, the live slots' items are moved to
    its start with one gather (the owner says which slots are live), and it grows when more than
    half of it is live. A step's items are gathered with one `take`, whatever the messages they
    came in: never a copy per row."""

    def __init__(self, slots: int, size: int, item_shape: tuple[int, ...] = (), dtype=np.int32) -> None:
        self.data = np.zeros((size, *item_shape), dtype)
        self.head = 0
        self.offsets = np.zeros(slots, np.int64)
        self.counts = np.zeros(slots, np.int64)

    def grow(self, slots: int) -> None:
        extra = slots - len(self.offsets)
        self.offsets = np.concatenate([self.offsets, np.zeros(extra, np.int64)])
        self.counts = np.concatenate([self.counts, np.zeros(extra, np.int64)])

    def put(self, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray, values: np.ndarray, live) -> None:
        """Stores `values` (the slots' items back to back; slot i's from `starts[i]`, `counts[i]` of them)."""
        total = len(values)
        if self.head + total > len(self.data):
            self._compact(np.asarray(live(), dtype=np.int64), total)
        self.data[self.head:self.head + total] = values
        self.offsets[slots] = self.head + starts
        self.counts[slots] = counts
        self.head += total

    def clear(self, slots: np.ndarray) -> None:
        """These slots have no items."""
        self.counts[slots] = 0

    def gather(self, slots: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The items of these slots (`counts`: theirs), back to back."""
        # (ndarray.take: a gather 2-4x faster than fancy indexing)
        return self.data.take(ragged_positions(self.offsets.take(slots), counts), axis=0)

    def _compact(self, live: np.ndarray, needed: int) -> None:
        counts = self.counts[live]
        kept = self.data[ragged_positions(self.offsets[live], counts)]
        size = max(len(self.data), 1)
        while len(kept) + needed > size // 2:
            size *= 2
        data = self.data if size == len(self.data) else np.zeros((size, *self.data.shape[1:]), self.data.dtype)
        data[:len(kept)] = kept
        self.data = data
        self.offsets[live] = np.cumsum(counts) - counts
        self.head = len(kept)


class RequestTable:
    """Waiting requests: a slot each (their columns there), their ids in one token arena and each
    payload's items in an arena of its own (`Arena`).

    `put` stores a message's requests (a slice copy of its ids and of each payload's items, one
    fancy assignment of its columns); `take` gathers a batch's slots into a Requests and frees
    them. Slots come from a stack of free ones."""

    def __init__(self, capacity: int) -> None:
        self.capacity = 0
        self.calls = np.empty(0, dtype=object)
        self.cols = np.zeros((0, len(TABLE_COLUMNS)), np.int64)
        self.free = np.zeros(0, np.int64)  # a stack: free[:top] are free slots
        self.top = 0
        self.tokens = Arena(0, max(1 << 16, 64 * capacity))
        self.payloads: dict[str, Arena] = {}  # made when a message first carries the name
        self._grow(max(1, capacity))

    def _grow(self, capacity: int) -> None:
        old, extra = self.capacity, capacity - self.capacity
        self.calls = np.concatenate([self.calls, np.empty(extra, dtype=object)])
        self.cols = np.concatenate([self.cols, np.zeros((extra, len(TABLE_COLUMNS)), np.int64)])
        for arena in (self.tokens, *self.payloads.values()):
            arena.grow(capacity)
        stack = np.concatenate([np.arange(capacity - 1, old - 1, -1), self.free[:self.top]])
        self.free = np.zeros(capacity, np.int64)
        self.free[:len(stack)] = stack
        self.top = len(stack)
        self.capacity = capacity

    def put(self, requests: Requests, live) -> np.ndarray:
        """Stores the requests; returns their slots. `live()` gives the slots in use (asked only
        when an arena must be compacted)."""
        n = len(requests)
        if n > self.top:  # (the engine's window keeps this from happening; never fail for it)
            self._grow(max(2 * self.capacity, self.capacity + n))
        slots = self.free[self.top - n:self.top].copy()
        self.top -= n
        self.tokens.put(slots, requests.starts, requests.lengths, requests.token_ids, live)
        self.calls[slots] = requests.calls
        self.cols[slots] = requests.cols
        if requests.payloads or self.payloads:
            self._put_payloads(slots, requests, live)
        return slots

    def _put_payloads(self, slots: np.ndarray, requests: Requests, live) -> None:
        for name, payload in requests.payloads.items():
            arena = self.payloads.get(name)
            if arena is None or arena.data.shape[1:] != payload.data.shape[1:] or arena.data.dtype != payload.data.dtype:
                # (the engine refused items of another dtype or shape than the family declares before
                # they got here: a first message of a name makes its arena)
                arena = self.payloads[name] = Arena(self.capacity, 2 * len(payload.data), payload.data.shape[1:],
                                                    payload.data.dtype)
            arena.put(slots, np.cumsum(payload.counts) - payload.counts, payload.counts, payload.data, live)
        for name, arena in self.payloads.items():
            if name not in requests.payloads:
                arena.clear(slots)

    def take(self, slots: np.ndarray) -> Requests:
        """The requests at these slots (an int64 array), in that order, as a Requests; their slots are freed."""
        cols = self.cols.take(slots, axis=0)
        requests = Requests(self.calls.take(slots), cols, self.tokens.gather(slots, cols[:, COL["lengths"]]))
        for name, arena in self.payloads.items():
            counts = arena.counts.take(slots)
            if counts.any():
                requests.payloads[name] = Payload(counts=counts, data=arena.gather(slots, counts))
        self.release(slots)
        return requests

    def release(self, slots: np.ndarray) -> None:
        self.calls[slots] = None  # (no reference kept to a finished call's id)
        self.free[self.top:self.top + len(slots)] = slots
        self.top += len(slots)


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
    # (a text row's length is its tokens'; another modality's rows count what their family says)
    RowRule((), lambda r, model, runs: (r.lengths < 1) | (r.lengths > model.max_model_len) & (r.modality == 0),
            lambda r, model, row: f"engine input has {r.lengths[row]} tokens; the model takes 1 to {model.max_model_len}"),
    RowRule((), _ids_outside_vocabulary,
            lambda r, model, row: f"engine input has token ids outside [0, {model.vocab_size})"),
)


class RowChecks(NamedTuple):
    """What one engine checks its rows against: everyone's `ROW_RULES`, the modalities its model's
    family takes, then the family's own rules (`ModelFamily.row_rules`); `checked`, the request
    columns some rule reads (a message that carries one of them is gone through the rules);
    `payloads`, the arrays the family declares (`ModelFamily.payloads`)."""

    rules: tuple[RowRule, ...]
    checked: frozenset[str]
    payloads: dict[str, PayloadSpec]


def row_checks(modalities: AbstractSet[str] = frozenset({"text"}), payloads: dict[str, PayloadSpec] | None = None,
               family_rules: tuple[RowRule, ...] = ()) -> RowChecks:
    takes = np.asarray([name in modalities for name in MODALITIES] + [False])  # (the last: a code none has)

    def why(r: Requests, model, row: int) -> str:
        code = int(r.modality[row])
        if 0 <= code < len(MODALITIES):
            return f"an {MODALITIES[code]} input, but the model takes no {MODALITIES[code]}s"
        return f"modality {code} is not one of {MODALITIES}"

    rules = (*ROW_RULES,
             RowRule(("modality",), lambda r, model, runs: ~takes.take(np.clip(r.modality, -1, len(MODALITIES))), why),
             *family_rules)
    checked = frozenset(name for rule in rules for name in rule.reads)
    if checked - DEFAULTS.keys():
        raise RuntimeError(f"a row rule reads {sorted(checked - DEFAULTS.keys())}, which core.shared.schema does "
                           "not declare: this is a bug")
    return RowChecks(rules, checked, dict(payloads or {}))


TEXT_ONLY = row_checks()  # a text model's (the family of a model that takes more says so: EngineCore)


def _payload_problems(requests: Requests, specs: dict[str, PayloadSpec]) -> list[tuple[np.ndarray, str]]:
    """Per payload a message carries that the family does not declare as it came: the rows that
    have items, and why (a name it does not take, another dtype or item shape, too many items)."""
    problems = []
    for name, payload in requests.payloads.items():
        has = payload.counts > 0
        spec = specs.get(name)
        if spec is None:
            problems.append((has, f"payload {name!r} is not one this model takes ({sorted(specs) or 'none'})"))
        elif payload.data.dtype.str != spec.dtype or payload.data.shape[1:] != spec.item_shape:
            problems.append((has, f"payload {name!r} must be {spec.dtype} items of shape {spec.item_shape}, got "
                                  f"{payload.data.dtype.str} {payload.data.shape[1:]}"))
        else:
            problems.append((payload.counts > spec.max_items, f"payload {name!r}: at most {spec.max_items} items a row"))
    return problems


def invalid_rows(requests: Requests, model, runs_task: np.ndarray, sent: AbstractSet[str] | None = None,
                 checks: RowChecks = TEXT_ONLY) -> list[tuple[int, str]]:
    """The rows an engine must refuse, each with its first problem: a payload the model's family
    does not declare as it came, then the first rule of `checks` it breaks; [] for a valid message,
    the usual case, found with a few array operations over the whole message. `model` is the
    ModelSpec; `runs_task`, its `task_lookup`; `sent`, the request columns the message carried
    (None: any): a column it did not carry holds its default, which is valid."""
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
    if (sent is not None and not sent & checks.checked and not requests.payloads
            and int(lengths.min()) >= 1 and int(lengths.max()) <= model.max_model_len
            and not (ids.size and int(ids.view(np.uint32).max()) >= model.vocab_size)
            and runs_task.take(task + 2).all() and int(dims.min()) >= -1 and not (dims == 0).any()):
        return []
    problems = _payload_problems(requests, checks.payloads)
    masks = [mask for mask, _ in problems] + [rule.broken(requests, model, runs_task) for rule in checks.rules]
    broken = np.logical_or.reduce(masks)
    out = []
    for row in np.flatnonzero(broken).tolist():
        first = next(k for k, mask in enumerate(masks) if mask[row])
        out.append((row, problems[first][1] if first < len(problems)
                    else checks.rules[first - len(problems)].why(requests, model, row)))
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
