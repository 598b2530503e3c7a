"""The one producer of EngineInputBatch: rows appended as they are rendered, packed into messages.

Each row is a request's index, its token ids and the values of the per-request columns that
`core.shared.schema` declares: those of its per-request options (priority, route, ...) and its pooling
params' entry, copied from the RenderOptions it was rendered with, and those rendering computes
(pool_start, chunks, ...: the keywords of `add` / `extend`). A column is kept as a list only from the
first row that differs from its default, and a message carries it only when one of its rows does,
so the usual message (every row default) carries none. Ids are range-checked once per message
before they are narrowed to int32, so no id can wrap into range.
"""

from __future__ import annotations

import itertools

import msgspec
import numpy as np

from pooling_pipeline.core.shared.messages import EngineInputBatch, Payload, PoolingParams, RenderOptions
from pooling_pipeline.core.shared.schema import DEFAULTS, OPTION_COLUMNS, ids_out_of_range


class EngineInputPacker:
    """One call's rendered requests, on their way to the engine core."""

    def __init__(self) -> None:
        self.indices: list[int] = []
        self.ids: list = []  # a list of ints or an integer array per row
        self.kinds: dict[tuple, int] = {}  # (task, encoded params) -> entry of tasks/params
        self.tasks: list[str] = []
        self.params: list[PoolingParams] = []
        self.columns: dict[str, list[int]] = {}  # only the columns some row set to a non-default value
        self.payloads: dict[str, dict[int, np.ndarray]] = {}  # name -> {row: its items [k, *item shape]}
        self._options_seen: tuple = (None, None)  # the RenderOptions (and params) `_from_options` saw last ...
        self._options_values: dict[str, int] = {}  # ... and their columns' values

    def __len__(self) -> int:
        return len(self.indices)

    def kind(self, task: str, params: PoolingParams) -> int:
        """The entry of (task, params) in the message's table: the `param_of` of its rows."""
        key = (task, msgspec.msgpack.encode(params))
        entry = self.kinds.get(key)
        if entry is None:
            entry = self.kinds[key] = len(self.tasks)
            self.tasks.append(task)
            self.params.append(params)
        return entry

    def add(self, index: int, ids, options: RenderOptions | None = None, *, params: PoolingParams | None = None,
            payloads: dict[str, np.ndarray] | None = None, **values: int) -> None:
        """One row, rendered with `options` (its per-request options' columns and its params' entry;
        `params`: other params than the options', as a long document's chunks have); `payloads`: its
        arrays beyond the ids, by name, each [items, *item shape] as the model's family declares them
        (an image's pixels: one item); `values` are the columns rendering computed, by name (the
        others take their default)."""
        if payloads:
            row = len(self.indices)
            for name, items in payloads.items():
                self.payloads.setdefault(name, {})[row] = items
        self.extend([index], [ids], options, params=params, **values)

    def extend(self, indices: list[int], ids: list, options: RenderOptions | None = None, *,
               params: PoolingParams | None = None, **values: int) -> None:
        """Rows that share their options and column values (the usual case: a batch's)."""
        if options is not None:
            values = {**self._from_options(options, params), **values}
        n = len(indices)
        for name, value in values.items():
            column = self.columns.get(name)
            if column is None:
                default = DEFAULTS[name]  # (a KeyError here is a name the schema does not declare: a bug)
                if value == default:
                    continue
                column = self.columns[name] = [default] * len(self.indices)
            column.extend([value] * n)
        for name, column in self.columns.items():
            if name not in values:
                column.extend([DEFAULTS[name]] * n)
        self.indices.extend(indices)
        self.ids.extend(ids)

    def _from_options(self, options: RenderOptions, params: PoolingParams | None) -> dict[str, int]:
        """The columns a row takes from its RenderOptions: its (task, params) entry and every
        per-request option's value (worked out once for a batch's shared options)."""
        seen_options, seen_params = self._options_seen
        if options is not seen_options or params is not seen_params:
            self._options_values = {"param_of": self.kind(options.task, options.params if params is None else params),
                                    **{name: getattr(options, name) for name in OPTION_COLUMNS}}
            self._options_seen = (options, params)
        return self._options_values

    def messages(self, worker: int, call: str, max_items: int, vocab_size: int, render_s: float = 0.0
                 ) -> tuple[list[EngineInputBatch], list[tuple[int, str]]]:
        """EngineInputBatch of at most `max_items` rows each, and the rows refused (no tokens, or
        ids the model cannot take): one check per message, row by row only when it fails."""
        out, failed = [], []
        for rows in self._groups(max_items):
            ids = self.ids[rows.start:rows.stop] if isinstance(rows, range) else [self.ids[i] for i in rows]
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            flat = _flat_ids(ids, int(lengths.sum()))
            if len(ids) and (int(lengths.min()) < 1 or ids_out_of_range(flat, vocab_size)):
                rows = [i for i in rows if not self._refused(i, vocab_size, failed)]
                if not rows:
                    continue
                ids = [self.ids[i] for i in rows]
                lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
                flat = _flat_ids(ids, int(lengths.sum()))
            out.append(EngineInputBatch(
                worker=worker, call=call, indices=_pick(self.indices, rows), lengths=lengths,
                token_ids=flat.astype(np.int32), tasks=self.tasks, params=self.params,
                columns={name: _pick(column, rows) for name, column in self.columns.items()
                         if _differs(column, rows, DEFAULTS[name])},
                render_s=render_s, payloads=self._payloads(rows)))
            render_s = 0.0
        return out, failed

    def _groups(self, max_items: int) -> list[range]:
        """The rows of each message, at most `max_items`: consecutive rows."""
        n = len(self.indices)
        return [range(start, min(start + max_items, n)) for start in range(0, n, max_items)]

    def _payloads(self, rows: range | list[int]) -> dict[str, Payload]:
        """The message's payloads: each name some of its rows carry, their items back to back."""
        out = {}
        for name, per_row in self.payloads.items():
            items = [per_row[row] for row in rows if row in per_row]
            if items:
                counts = np.asarray([len(per_row[row]) if row in per_row else 0 for row in rows], np.int64)
                out[name] = Payload(counts=counts, data=np.concatenate(items))
        return out

    def _refused(self, row: int, vocab_size: int, failed: list[tuple[int, str]]) -> bool:
        ids = np.asarray(self.ids[row])
        if ids.size == 0:
            problem = "ValueError: prompt is empty after tokenization"
        elif ids_out_of_range(ids, vocab_size):
            problem = f"ValueError: token ids must be in [0, {vocab_size})"
        else:
            return False
        failed.append((self.indices[row], problem))
        return True


def _pick(column: list[int], rows: range | list[int]) -> np.ndarray:
    """A column's values at these rows, as int64."""
    values = column[rows.start:rows.stop] if isinstance(rows, range) else [column[i] for i in rows]
    return np.asarray(values, dtype=np.int64)


def _differs(column: list[int], rows: range | list[int], default: int) -> bool:
    if isinstance(rows, range):
        return any(v != default for v in itertools.islice(column, rows.start, rows.stop))
    return any(column[i] != default for i in rows)


def _flat_ids(ids: list, total: int) -> np.ndarray:
    """The rows' ids back to back, as int64 (Python lists from the tokenizer, or arrays): they
    are range-checked before they are narrowed to int32, so no id can wrap into range."""
    if all(type(x) is list for x in ids):
        return np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=total)
    if not ids:
        return np.zeros(0, np.int64)
    return np.concatenate([np.asarray(x).astype(np.int64, copy=False) for x in ids])
