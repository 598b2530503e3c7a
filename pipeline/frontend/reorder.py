"""A call's reorder ring: answers stored by request index as they arrive, in any order, and handed
back as results in input order.

One slot per request in flight or answered and not yet handed back, so `index & mask` is a slot of
its own. The ring is sized by what the call holds, not by the in-flight bound: it starts small and
doubles (`make_room`) before the call draws requests its slots cannot hold, so a one-prompt call
costs about a kilobyte under any `max_inflight`, and a stream at most ~49 bytes a slot of its
share of the bound. The columns are numpy arrays written for a whole message at once: the usual
answer, one vector per request, is one fancy assignment (of each vector's own copy, into the
object column `vectors`), and the results handed back are made from a run of slots by C loops
(`map`): no Python bytecode runs per request here (a Python loop per request cost the frontend
~0.3 us a request). Answers that are not one vector each -- errors, per-token arrays, sparse
vectors, a long document pooled from its chunks (`core.shared.vectors.ChunkSum`) -- are result objects in
`special`. An answer whose slot holds another index (re-sent, aborted, forged) is a duplicate,
dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from pooling_pipeline.call_stats import CallStats
from pooling_pipeline.core.shared import messages as m
from pooling_pipeline.core.shared.vectors import ChunkSum
from pooling_pipeline.outputs import PoolingRequestOutput

# A new call's ring: enough for a few prompts (16 slots: ~800 bytes of columns).
MIN_CAPACITY = 16


class Ring:
    """The slots of one call's requests (see the module docstring). The call writes the columns of
    what it sends (`out_index`, `ticket_of`, `size_of`) and reads them to settle what comes back."""

    def __init__(self, max_inflight: int, prefix: str, result_type: type, stats: CallStats, *,
                 default_normalize: bool, truncate_dim: int | None = None, keep_all: bool) -> None:
        self.max_inflight = max_inflight  # what the call may hold at most (a larger ring is a bug)
        self.prefix = prefix
        self.result_type = result_type
        self.stats = stats
        self.default_normalize = default_normalize  # the model's final Normalize (chunk mode's default)
        self.truncate_dim = truncate_dim  # the model's saved truncate_dim (chunk mode)
        # keep_all (a list call: every result is kept): the results of one answer share one
        # array; in a stream each result gets a copy of its own row, so that keeping a few of
        # them does not keep their neighbours' memory too.
        self.keep_all = keep_all
        self.special: dict[int, PoolingRequestOutput] = {}  # answered otherwise, by index
        self.chunks: dict[int, ChunkSum] = {}  # chunk mode: documents with chunks still out, by index
        self.ready_count = 0  # answered and not handed back (the reorder buffer)
        self.next_index = 0  # results before it are handed back
        self._allocate(MIN_CAPACITY)

    def _allocate(self, capacity: int) -> None:
        """Fresh columns of `capacity` slots (a power of two)."""
        self.mask = capacity - 1
        self.out_index = np.full(capacity, -1, np.int64)  # slot -> the index sent and not answered
        self.ticket_of = np.zeros(capacity, np.int64)  # slot -> the call's ticket it was sent in
        self.size_of = np.zeros(capacity, np.int64)  # slot -> its text's size (the text budget)
        self.answered = np.zeros(capacity, dtype=bool)  # slot -> answered, not handed back yet
        self.tokens = np.zeros(capacity, np.int64)
        self.scratch = np.zeros(capacity, np.int64)  # (for _live_rows)
        self.vectors = np.full(capacity, None, object)  # slot -> its answer's vector (the usual outputs)

    def make_room(self, issued: int, end: int) -> None:
        """Room for the indices `next_index` .. `end` - 1 (the call's slots: issued before `issued`,
        the rest about to be drawn): the ring doubles until they fit, the slots of those issued
        moved to their places in the larger one. They are at most the slots the call holds,
        within the in-flight bound."""
        needed = end - self.next_index
        capacity = self.mask + 1
        if needed <= capacity:
            return
        if needed > max(MIN_CAPACITY, self.max_inflight):
            raise RuntimeError(f"a call's reorder ring was asked for {needed} slots, more than the in-flight bound "
                               f"{self.max_inflight} (this is a bug)")
        old_mask, columns = self.mask, (self.out_index, self.ticket_of, self.size_of, self.answered, self.tokens,
                                        self.vectors)
        self._allocate(1 << (needed - 1).bit_length())
        live = np.arange(self.next_index, issued, dtype=np.int64)
        old, new = live & old_mask, live & self.mask
        for mine, theirs in zip((self.out_index, self.ticket_of, self.size_of, self.answered, self.tokens,
                                 self.vectors), columns):
            mine[new] = theirs[old]

    def owns(self, index: int) -> bool:
        """Whether request `index` is out now (an answer for it is not a duplicate)."""
        return index >= 0 and self.out_index[index & self.mask] == index

    def answer(self, index: int, result: PoolingRequestOutput) -> None:
        """A request answered with a result object of its own (an error, a refused request, ...)."""
        self.special[index] = result
        self.answered[index & self.mask] = True
        self.ready_count += 1

    def accept_vectors(self, indices: np.ndarray, data: np.ndarray,
                       num_tokens: np.ndarray) -> tuple[np.ndarray, int] | None:
        """The usual answer, one vector each, in array operations: (the slots accepted, their
        tokens), or None when every row was a duplicate."""
        slots = indices & self.mask
        rows = _live_rows(self.out_index, self.scratch, indices, slots)
        if rows is not None:  # some are not (or no longer) out: re-sent, aborted or forged
            self.stats.duplicates_dropped += len(indices) - len(rows)
            indices, slots, data, num_tokens = indices[rows], slots[rows], data[rows], num_tokens[rows]
            if not len(indices):
                return None
        # Each answer's own vector (the frame they came in is released): for a list call one copy
        # of the message's rows, each a view of it (every result is kept anyway); in a stream a
        # copy per row, so that a caller keeping a few results keeps no neighbours' memory.
        # (An object column, filled by C loops: `fromiter` makes it a column of arrays, not a 2-D array.)
        rows = iter(data.copy()) if self.keep_all else map(np.ndarray.copy, data)
        self.vectors[slots] = np.fromiter(rows, object, len(slots))
        self.tokens[slots] = num_tokens
        self.out_index[slots] = -1
        self.answered[slots] = True
        self.ready_count += len(slots)
        return slots, int(num_tokens.sum())

    def accept_special(self, msg: m.OutputBatch,
                       options_of: Callable[[int], m.RenderOptions]) -> tuple[np.ndarray, int] | None:
        """Answers that are not one vector each in the ring: chunks of long documents (pooled back
        into one vector when the last arrives, as `options_of(index)` asks), sparse vectors (their
        token ids), per-token arrays. (The slots of the requests now answered, their tokens), or None."""
        arrays = list(msg.data) if msg.data is not None else msg.arrays
        chunk_of = None if msg.chunks is None else msg.chunks.tolist()
        sparse_ids = msg.sparse_ids
        mask, out_index, stats = self.mask, self.out_index, self.stats
        settled: list[int] = []
        tokens = 0
        for i, (index, num_tokens) in enumerate(zip(msg.indices.tolist(), msg.num_prompt_tokens.tolist())):
            slot = index & mask
            if index < 0 or out_index[slot] != index:
                stats.duplicates_dropped += 1  # re-sent, aborted or from an earlier call
                continue
            data, num_chunks = arrays[i], 1
            if msg.data is not None:
                data = data.copy()  # (a row of the received frame)
            if chunk_of is not None and chunk_of[i][0] >= 0:
                chunk, num_chunks = chunk_of[i]
                chunks = self.chunks.get(index)
                if chunks is None:
                    chunks = self.chunks[index] = ChunkSum(num_chunks)
                if not chunks.add(chunk, data, num_tokens):
                    stats.duplicates_dropped += 1
                if not chunks.complete:
                    continue
                params = options_of(index).params
                data = chunks.finish(params.dimensions, params.normalize, self.default_normalize, self.truncate_dim)
                num_tokens = chunks.tokens
                del self.chunks[index]
            result = self.result_type(self.prefix, index, data, num_tokens, num_chunks)
            if sparse_ids is not None:
                result.indices = sparse_ids[i]
            out_index[slot] = -1
            self.answer(index, result)
            settled.append(slot)
            tokens += num_tokens
        if not settled:
            return None
        return np.asarray(settled, dtype=np.int64), tokens

    def hand_back(self, issued: int) -> list[PoolingRequestOutput]:
        """The answered results from `next_index` on (of the `issued` so far), up to the first
        still out, in order; their slots are free again."""
        first, count, mask = self.next_index, issued - self.next_index, self.mask
        start = first & mask
        answered = self.answered
        window = answered[start:start + count]
        if len(window) < count:  # the range wraps around the ring
            window = np.concatenate([window, answered[:count - len(window)]])
        run = count if window.all() else int(window.argmin())
        if not run:
            return []
        # The slots start .. start + run (a slice), or the ring's end and start when it wraps.
        slots = slice(start, start + run) if start + run <= mask + 1 else np.arange(first, first + run) & mask
        answered[slots] = False
        make, prefix, special = self.result_type, self.prefix, self.special
        tokens = self.tokens[slots].tolist()
        indices = range(first, first + run)
        stored = self.vectors
        vectors = stored[slots].tolist()  # (an object column's items are its objects)
        stored[slots] = None  # (the results hold them now)
        if not special:
            out = list(map(make, itertools.repeat(prefix), indices, vectors, tokens))
        else:
            out = [special.pop(index, None) or make(prefix, index, row, num_tokens)
                   for index, row, num_tokens in zip(indices, vectors, tokens)]
        self.next_index = first + run
        self.ready_count -= run
        return out

    def clear(self) -> None:
        """The call was aborted: its results and partial documents are dropped."""
        self.special.clear()
        self.chunks.clear()


def _live_rows(out_index: np.ndarray, scratch: np.ndarray, indices: np.ndarray, slots: np.ndarray) -> np.ndarray | None:
    """The rows of an answer to accept -- those whose index is out (a stale index may share its
    slot with a live one: only the live one counts), each index once -- or None for all.
    `scratch` (one entry per slot) finds a slot named twice without a sort: each row writes its
    position there, and only the last writer of a slot reads its own back."""
    live = out_index[slots] == indices
    positions = np.arange(len(slots))
    scratch[slots] = positions
    once = scratch[slots] == positions
    if live.all() and once.all():
        return None
    rows = np.flatnonzero(live)
    scratch[slots[rows[::-1]]] = rows[::-1]  # the first live row of each slot writes last: it is kept
    return rows[scratch[slots[rows]] == rows]
