"""Admitted requests and how they are cut into batches.

The engine admits at most `window` requests (it stops reading its socket while full); they wait
in a `RequestTable` (columns and one token arena), and a batch is gathered from it as a
`Requests` (columns) with a few array operations. Their order by (length, arrival) is one sorted
int64 array, so that adding a message, finding a batch and taking it out are array operations:
the only Python loop walks the distinct lengths of a batch, not its requests (the engine's CPU
per request is what caps one engine core's rate). No index by request is kept: the rare lookups
(an abort, a lost worker's re-sent requests) scan the waiting requests. Each step
takes one batch that always contains the oldest waiting request (the oldest of the lowest
`priority` value when priorities are given) -- so no request waits forever
and the frontend's reorder buffer keeps moving -- grown with the requests nearest to it in
length, so little of the forward pass is spent on padding:

* at most `max_num_seqs` requests and `max_num_batched_tokens` padded tokens;
* padding at most `max_padding_fraction` of the padded tokens (after a first few requests).
  On a CPU the forward pass costs about the same per padded token from ~100 tokens up, so a
  smaller, tighter batch is cheaper than a full one with padding; a GPU tolerates more padding
  and wants bigger batches;
* past that cap, a request still joins when it makes the step cheaper per real token, counting
  the step's fixed cost (`overhead_tokens`: the padded tokens one step's overhead is worth, which
  the engine learns from the steps it runs, see `step_cost`). For a big model on a CPU that is a few tokens and changes nothing;
  for a small model, or a GPU, a step costs mostly overhead and batches fill up.
"""

from __future__ import annotations

import bisect

import numpy as np

from pooling_pipeline.core.engine.columns import COL, Requests, RequestTable
from pooling_pipeline.core.engine.step_shapes import rows_at_most

# Below this many requests a batch grows whatever the padding (per-batch overhead dominates).
MIN_BATCH_BEFORE_PADDING_LIMIT = 4
# On a device a step of more requests than this is cut to a row bucket's size (step_shapes.rows_at_most).
MIN_ROWS_CUT = 8
PRIORITY, INDEX, CHUNK = COL["priority"], COL["indices"], COL["chunk"]
# The waiting requests are kept sorted by one int64 each: length << ARRIVAL_BITS | arrival number.
# (2**40 arrivals is 42 days at 300,000 requests/s; the numbers are rebased before they run out.)
ARRIVAL_BITS = 40
ARRIVAL_MASK = (1 << ARRIVAL_BITS) - 1


class Scheduler:
    # Whether runs of one move are taken at once (off: the walk takes one request at a time, the
    # rule the runs must equal; the tests compare the two).
    TAKE_RUNS = True

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_padding_fraction: float,
                 overhead_tokens: float = 0.0, capacity: int = 1024, shape=None) -> None:
        """`shape`: on an accelerator, the (rows, length) a step of (rows, longest) is padded to
        (core.engine.step_shapes.bucket_shape for the model's limit): a step past the padding limit still
        takes a request that fits in that shape (`_free`), so it fills the rows its bucket
        computes anyway. (Counting the padding in bucketed shapes instead stopped steps at a full
        bucket: one more row is a whole bucket more -- 94 rows a step where 566 fit, measured.)"""
        self.shape = shape
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_padding_fraction = max_padding_fraction
        self.overhead_tokens = overhead_tokens
        self.table = RequestTable(capacity)
        # The waiting requests in (length, arrival) order: their sort keys (length << ARRIVAL_BITS |
        # arrival) ascending, and their slots in the table in the same order. A re-sent request
        # replaces its waiting copy and arrives anew, last.
        self._order = np.zeros(0, np.int64)
        self._order_slots = np.zeros(0, np.int64)
        self._next_arrival = 0
        self._urgent = 0  # waiting requests with a priority other than 0

    def __len__(self) -> int:
        return len(self._order)

    def add(self, requests: Requests, resent: bool = False) -> int:
        """Adds one call's requests in arrival order; returns how many replaced a waiting copy of
        themselves. Only a message the frontend re-sent (`resent`: a lost render worker's requests,
        some of which may have reached the engine before it died) is looked up among those
        waiting: any other request is new, and the usual message costs no lookup per request."""
        n = len(requests)
        if not n:
            return 0
        replaced = self._remove_waiting_copies(requests) if resent else 0
        if self._next_arrival + n > ARRIVAL_MASK:
            self._rebase()
        slots = self.table.put(requests, self._live_slots)
        sort_keys = (requests.lengths << ARRIVAL_BITS) | np.arange(self._next_arrival, self._next_arrival + n)
        self._next_arrival += n
        # Merged into the order by one sort of both (two sorted runs: ~3x cheaper than np.insert's
        # two searched insertions, measured); the keys are unique, so the order is exact.
        keys = np.concatenate((self._order, sort_keys))
        order = np.argsort(keys, kind="stable")
        self._order = keys.take(order)
        self._order_slots = np.concatenate((self._order_slots, slots)).take(order)
        self._urgent += int(np.count_nonzero(requests.priority))
        return replaced

    def abort(self, call: str, indices: list[int] | None = None) -> int:
        """Removes these requests of a call (every chunk of a chunked one; every request of the
        call when `indices` is None); returns how many were removed. (Rare: a scan of the waiting
        requests, so that the usual path keeps no per-request index.)"""
        mine = self._waiting_of(call)
        if indices is not None and len(mine):
            mine = mine[np.isin(self.table.cols[mine, INDEX], np.asarray(indices, dtype=np.int64))]
        self._remove(mine)
        return len(mine)

    def _waiting_of(self, call: str) -> np.ndarray:
        """The slots of the call's waiting requests."""
        live = self._order_slots
        return live[self.table.calls.take(live) == call] if len(live) else live

    def _remove_waiting_copies(self, requests: Requests) -> int:
        """Removes the waiting requests these requests are copies of (same call, index and chunk)."""
        mine = self._waiting_of(requests.calls[0])
        if not len(mine):
            return 0
        cols = self.table.cols
        mine = mine[np.isin(cols[mine, INDEX], requests.indices)]  # (then exact, on those few)
        wanted = set(zip(requests.indices.tolist(), requests.chunk.tolist()))
        old = [slot for slot, index, chunk in zip(mine.tolist(), cols[mine, INDEX].tolist(), cols[mine, CHUNK].tolist())
               if (index, chunk) in wanted]
        self._remove(np.asarray(old, dtype=np.int64))
        return len(old)

    def _live_slots(self) -> np.ndarray:
        return self._order_slots

    def take_all(self) -> Requests:
        """Empties the scheduler, returning what was waiting (in arrival order)."""
        slots = self._order_slots.take(np.argsort(self._order & ARRIVAL_MASK))
        batch = self.table.take(slots)
        self._order = np.zeros(0, np.int64)
        self._order_slots = np.zeros(0, np.int64)
        self._urgent = 0
        return batch

    def _remove(self, slots: np.ndarray) -> None:
        """Takes these waiting requests out of the order and the table."""
        if not len(slots):
            return
        kept = ~np.isin(self._order_slots, slots)
        if int(np.count_nonzero(~kept)) != len(slots):  # a slot not waiting, or one twice
            raise RuntimeError(f"scheduler: {len(slots)} requests to remove, {int(np.count_nonzero(~kept))} waiting")
        self._order, self._order_slots = self._order[kept], self._order_slots[kept]
        self._urgent -= int(np.count_nonzero(self.table.cols[slots, PRIORITY]))
        self.table.release(slots)

    def _rebase(self) -> None:
        """Renumbers the waiting requests' arrivals from 0 (their order kept) before the numbers
        would reach ARRIVAL_BITS."""
        arrivals = self._order & ARRIVAL_MASK
        ranks = np.empty(len(arrivals), np.int64)
        ranks[np.argsort(arrivals)] = np.arange(len(arrivals))
        self._order = ((self._order >> ARRIVAL_BITS) << ARRIVAL_BITS) | ranks
        self._next_arrival = len(arrivals)

    def anchor_position(self) -> int:
        """Where the next batch's anchor is in the (length, arrival) order: the oldest among the
        most urgent (lowest priority value) waiting requests."""
        arrivals = self._order & ARRIVAL_MASK
        if not self._urgent:
            return int(np.argmin(arrivals))
        priority = self.table.cols[self._order_slots, PRIORITY]
        candidates = np.flatnonzero(priority == priority.min())
        return int(candidates[np.argmin(arrivals.take(candidates))])

    def next_batch(self) -> Requests | None:
        if not len(self._order):
            return None
        anchor = self.anchor_position()
        lengths, starts, sizes = self._buckets()
        # The batch is a run of the (length, arrival) order: from offset `lo_off` of bucket
        # `lo_li` (an index into `lengths`) to offset `hi_off` of bucket `hi_li`, both included.
        # (`longest` is always the length of bucket `hi_li`: the run's long end.)
        lo_li = hi_li = bisect.bisect_right(starts, anchor) - 1
        lo_off = hi_off = anchor_off = anchor - starts[lo_li]
        longest = real = real_anchor = lengths[lo_li]
        hi_size = sizes[hi_li]  # of bucket hi_li
        count = 1
        max_seqs, max_tokens, max_padding = self.max_num_seqs, self.max_num_batched_tokens, self.max_padding_fraction
        take_runs, num_buckets = self.TAKE_RUNS, len(lengths)
        shorter = longest  # (the left neighbour's length, once there is one)
        while count < max_seqs:
            # The neighbours of the run: the request just before it and the one just after.
            left = right = None
            if longest * (count + 1) <= max_tokens and (lo_off > 0 or lo_li > 0):
                shorter = lengths[lo_li] if lo_off > 0 else lengths[lo_li - 1]
                left = longest - shorter
            # (more of the longest bucket adds no padding)
            longer = longest if hi_off + 1 < hi_size else lengths[hi_li + 1] if hi_li + 1 < num_buckets else 0
            if longer and longer * (count + 1) <= max_tokens:
                right = (longer - longest) * count
            if left is None and right is None:
                break
            # Grow by the side that adds less padding (the shorter side on a tie): a shorter
            # request pads itself up to `longest`; a longer one pads every request already in.
            go_left = right is None or (left is not None and left <= right)
            if take_runs:
                run = self._run(go_left, (left if go_left else right), count, longest, real, shorter, sizes,
                                lo_li, lo_off, hi_size - hi_off - 1)
                if run:
                    length = shorter if go_left else longest
                    lo_li, lo_off, hi_off = self._moved(run, go_left, sizes, lo_li, lo_off, hi_off)
                    count += run
                    real += run * length
                    continue
            new_longest, length = (longest, shorter) if go_left else (longer, longer)
            padded, new_real = new_longest * (count + 1), real + length
            if (count >= MIN_BATCH_BEFORE_PADDING_LIMIT and padded - new_real > max_padding * padded
                    and not self._cheaper_per_token(real, longest * count, new_real, padded)
                    and not self._free(count, longest, new_longest)):
                break
            if go_left:
                lo_li, lo_off, hi_off = self._moved(1, True, sizes, lo_li, lo_off, hi_off)
            elif hi_off + 1 < hi_size:
                hi_off += 1
            else:  # into a longer bucket
                hi_li, hi_off, hi_size = hi_li + 1, 0, sizes[hi_li + 1]
            longest, real = new_longest, new_real
            count += 1
        if self.shape is not None and count > MIN_ROWS_CUT:
            lo_li, lo_off, hi_li, hi_off = self._cut(count - rows_at_most(count), sizes, (lo_li, lo_off),
                                                     (hi_li, hi_off), (bisect.bisect_left(lengths, real_anchor), anchor_off))
        return self._take(starts[lo_li] + lo_off, starts[hi_li] + hi_off + 1)

    def _buckets(self) -> tuple[list[int], list[int], list[int]]:
        """The order as runs of one length each ("buckets"): their lengths, where each begins, sizes."""
        lengths_in_order = self._order >> ARRIVAL_BITS
        begins = np.flatnonzero(lengths_in_order[1:] != lengths_in_order[:-1])
        begins += 1
        starts = [0, *begins.tolist()]
        # (a few dozen buckets: Python's lists beat numpy's per-call cost)
        sizes = [end - start for start, end in zip(starts, [*starts[1:], len(lengths_in_order)])]
        return lengths_in_order.take(starts).tolist(), starts, sizes

    def _run(self, go_left: bool, padding: int, count: int, longest: int, real: int, shorter: int,
             sizes: list[int], lo_li: int, lo_off: int, right_available: int) -> int:
        """How many requests the walk takes in a row on the side it grows by, when the one-at-a-time
        walk would take each of them without a second look; 0: take the next one by the rule.

        * Requests of the longest length (`padding` 0) pad nothing: the padding limit cannot stop
          them (the walk's check is not broken when the padding is 0, and otherwise the step gets
          cheaper per real token), so they run to the bucket's end, `max_num_seqs` or the token
          budget.
        * Shorter requests of one length to the left: the whole run when one more is cheaper per
          real token -- each adds the same padding (longest - shorter) while the right side's cost
          grows with the count, so the walk keeps going left, and "cheaper per token" holds along
          the run, since one more request changes both sides of that comparison by the same amount
          (checked at the run's two ends against rounding) -- so the padding limit cannot stop any
          of them.
        * A longer request to the right changes the step's longest: 0."""
        if padding and not go_left:
            return 0
        available = right_available if not go_left else lo_off if lo_off > 0 else sizes[lo_li - 1]
        run = min(available, self.max_num_seqs - count, self.max_num_batched_tokens // longest - count)
        if not padding:
            return run
        last = count + run - 1
        cheaper = self._cheaper_per_token
        if run > 1 and cheaper(real, longest * count, real + shorter, longest * (count + 1)) and cheaper(
                real + (run - 1) * shorter, longest * last, real + run * shorter, longest * (last + 1)):
            return run
        return 0

    @staticmethod
    def _moved(run: int, go_left: bool, sizes: list[int], lo_li: int, lo_off: int, hi_off: int) -> tuple[int, int, int]:
        """(lo_li, lo_off, hi_off) after `run` moves to one side within one bucket."""
        if not go_left:
            return lo_li, lo_off, hi_off + run
        if lo_off > 0:
            return lo_li, lo_off - run, hi_off
        return lo_li - 1, sizes[lo_li - 1] - run, hi_off

    def _cut(self, drop: int, sizes: list[int], lo: tuple[int, int], hi: tuple[int, int], anchor: tuple[int, int]):
        """The run less `drop` requests, from its long end while the anchor stays in, then from its
        short end: a step of a row bucket's size computes no added row, and those left wait."""
        (lo_li, lo_off), (hi_li, hi_off) = lo, hi
        for _ in range(drop):
            if (hi_li, hi_off) > anchor:
                if hi_off > 0:
                    hi_off -= 1
                else:
                    hi_li -= 1
                    hi_off = sizes[hi_li] - 1
            elif lo_off + 1 < sizes[lo_li]:
                lo_off += 1
            else:
                lo_li, lo_off = lo_li + 1, 0
        return lo_li, lo_off, hi_li, hi_off

    def _take(self, begin: int, end: int) -> Requests:
        """Removes the run [begin, end) of the (length, arrival) order and returns its requests."""
        slots = self._order_slots[begin:end]
        self._order = np.concatenate((self._order[:begin], self._order[end:]))
        self._order_slots = np.concatenate((self._order_slots[:begin], self._order_slots[end:]))
        batch = self.table.take(slots)
        if self._urgent:
            self._urgent -= int(np.count_nonzero(batch.priority))
        return batch

    def _free(self, count: int, longest: int, new_longest: int) -> bool:
        """Whether one more request (making the longest `new_longest`) fits in the bucketed shape a
        step of `count` up to `longest` computes anyway: it is then taken whatever its padding (an
        empty row of the bucket would be padding too). Off a device, never."""
        return self.shape is not None and self.shape(count + 1, new_longest) == self.shape(count, longest)

    def _cheaper_per_token(self, real: int, padded: int, new_real: int, new_padded: int) -> bool:
        """Whether real tokens per unit of step cost (overhead + padded tokens) go up."""
        return new_real * (self.overhead_tokens + padded) > real * (self.overhead_tokens + new_padded)
