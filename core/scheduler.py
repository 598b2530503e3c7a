"""Admitted requests and how they are cut into batches.

The engine admits at most `window` requests (it stops reading its socket while full); they wait
in a `RequestTable` (columns and one token arena), and a batch is gathered from it as a
`Requests` (columns) with a few array operations. Each step
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

from pooling_pipeline.core.columns import COL, Requests, RequestTable
from pooling_pipeline.core.step_shapes import rows_at_most

# Below this many requests a batch grows whatever the padding (per-batch overhead dominates).
MIN_BATCH_BEFORE_PADDING_LIMIT = 4
# On a device a step of more requests than this is cut to a row bucket's size (step_shapes.rows_at_most).
MIN_ROWS_CUT = 8
LENGTH, PRIORITY = COL["lengths"], COL["priority"]


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_padding_fraction: float,
                 overhead_tokens: float = 0.0, capacity: int = 1024, shape=None) -> None:
        """`shape`: on an accelerator, the (rows, length) a step of (rows, longest) is padded to
        (core.step_shapes.bucket_shape for the model's limit): a step past the padding limit still
        takes a request that fits in that shape (`_free`), so it fills the rows its bucket
        computes anyway. (Counting the padding in bucketed shapes instead stopped steps at a full
        bucket: one more row is a whole bucket more -- 94 rows a step where 566 fit, measured.)"""
        self.shape = shape
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_padding_fraction = max_padding_fraction
        self.overhead_tokens = overhead_tokens
        self.table = RequestTable(capacity)
        # Arrival number -> slot in the table; insertion order is arrival order (a re-sent
        # request replaces its waiting copy and arrives anew, last).
        self.waiting: dict[int, int] = {}
        # The same requests in (length, arrival) order, as buckets: one list of arrivals per
        # length (ascending: arrivals only grow, so adding is an append) and the lengths that
        # have a bucket, sorted (a few hundred at most). Adding costs no sort and no comparison
        # with the rest of the window; a batch is a run of that order, walked bucket by bucket.
        self._buckets: dict[int, list[int]] = {}
        self._lengths: list[int] = []
        # Each waiting request's arrival number, by call and then by its key within the call
        # (`Requests.keys`: the index, an int -- cheap to hash -- or (index, chunk)).
        self._arrival: dict[str, dict] = {}
        self._next_arrival = 0
        self._urgent = 0  # waiting requests with a priority other than 0

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, requests: Requests) -> int:
        """Adds one call's requests (their keys unique among them: the engine checks) in arrival
        order; returns how many replaced a waiting copy of themselves (re-sent requests)."""
        if not len(requests):
            return 0
        keys = requests.keys()
        call = requests.calls[0]
        arrival_of = self._arrival.get(call)
        if arrival_of is None:
            arrival_of = self._arrival[call] = {}
        replaced = 0
        if not arrival_of.keys().isdisjoint(keys):
            for key in keys:
                arrival = arrival_of.pop(key, None)
                if arrival is not None:
                    self._forget(arrival)
                    replaced += 1
        slots = self.table.put(requests, self._live_slots)
        first = self._next_arrival
        arrivals = range(first, first + len(keys))
        self._next_arrival += len(keys)
        arrival_of.update(zip(keys, arrivals))
        self.waiting.update(zip(arrivals, slots.tolist()))
        buckets = self._buckets
        for arrival, length in zip(arrivals, requests.lengths.tolist()):
            bucket = buckets.get(length)
            if bucket is None:
                buckets[length] = [arrival]
                bisect.insort(self._lengths, length)
            else:
                bucket.append(arrival)
        self._urgent += int(np.count_nonzero(requests.priority))
        return replaced

    def abort(self, call: str, indices: list[int] | None = None) -> int:
        """Removes these requests of a call (every chunk of a chunked one; every request of the
        call when `indices` is None); returns how many were removed."""
        arrival_of = self._arrival.get(call)
        if not arrival_of:
            return 0
        wanted = None if indices is None else set(indices)
        keys = [k for k in arrival_of
                if wanted is None or (k if type(k) is int else k[0]) in wanted]
        for key in keys:
            self._forget(arrival_of.pop(key))
        if not arrival_of:
            del self._arrival[call]
        return len(keys)

    def _live_slots(self) -> list[int]:
        return list(self.waiting.values())

    def take_all(self) -> Requests:
        """Empties the scheduler, returning what was waiting (in arrival order)."""
        batch = self.table.take(np.asarray(self._live_slots(), dtype=np.int64))
        self.waiting.clear()
        self._buckets.clear()
        self._lengths.clear()
        self._arrival.clear()
        self._urgent = 0
        return batch

    def _forget(self, arrival: int) -> None:
        """Takes this waiting request out of `waiting`, the buckets and the table (not out of `_arrival`)."""
        slot = self.waiting.pop(arrival)
        length, priority = int(self.table.cols[slot, LENGTH]), int(self.table.cols[slot, PRIORITY])
        self._urgent -= priority != 0
        bucket = self._buckets[length]
        del bucket[bisect.bisect_left(bucket, arrival)]
        if not bucket:
            del self._buckets[length]
            del self._lengths[bisect.bisect_left(self._lengths, length)]
        self.table.release(np.asarray([slot], dtype=np.int64))

    def next_batch(self) -> Requests | None:
        if not self.waiting:
            return None
        # The anchor: the oldest among the most urgent (lowest priority value) waiting requests.
        anchor, slot = next(iter(self.waiting.items()))
        if self._urgent:  # (argmin keeps the first, the oldest, of ties)
            slots = np.asarray(self._live_slots(), dtype=np.int64)
            pick = int(np.argmin(self.table.cols[slots, PRIORITY]))
            anchor, slot = list(self.waiting)[pick], int(slots[pick])
        lengths, buckets = self._lengths, self._buckets
        # The batch is a run of the (length, arrival) order: from offset `lo_off` of bucket
        # `lo_li` (an index into `lengths`) to offset `hi_off` of bucket `hi_li`, both included.
        longest = real = real_anchor = int(self.table.cols[slot, LENGTH])
        lo_li = hi_li = bisect.bisect_left(lengths, longest)
        anchor_bucket = buckets[longest]
        lo_off = hi_off = anchor_off = bisect.bisect_left(anchor_bucket, anchor)
        hi_size = len(anchor_bucket)  # of bucket hi_li
        count = 1
        max_seqs, max_tokens, max_padding = self.max_num_seqs, self.max_num_batched_tokens, self.max_padding_fraction
        while count < max_seqs:
            # The neighbours of the run: the request just before it and the one just after.
            left = None
            if longest * (count + 1) <= max_tokens and (lo_off > 0 or lo_li > 0):
                shorter = lengths[lo_li] if lo_off > 0 else lengths[lo_li - 1]
                left = longest - shorter
            right = None
            if hi_off + 1 < hi_size or hi_li + 1 < len(lengths):
                longer = lengths[hi_li] if hi_off + 1 < hi_size else lengths[hi_li + 1]
                if longer * (count + 1) <= max_tokens:
                    right = (longer - longest) * count
            if left is None and right is None:
                break
            # Grow by the side that adds less padding (the shorter side on a tie): a shorter
            # request pads itself up to `longest`; a longer one pads every request already in.
            go_left = right is None or (left is not None and left <= right)
            new_longest, length = (longest, shorter) if go_left else (longer, longer)
            padded, new_real = new_longest * (count + 1), real + length
            if (count >= MIN_BATCH_BEFORE_PADDING_LIMIT and padded - new_real > max_padding * padded
                    and not self._cheaper_per_token(real, longest * count, new_real, padded)
                    and not self._free(count, longest, new_longest)):
                break
            if go_left:
                if lo_off > 0:
                    lo_off -= 1
                else:
                    lo_li -= 1
                    lo_off = len(buckets[lengths[lo_li]]) - 1
            elif hi_off + 1 < hi_size:
                hi_off += 1
            else:
                hi_li += 1
                hi_off = 0
                hi_size = len(buckets[lengths[hi_li]])
            longest, real = new_longest, new_real
            count += 1
        if self.shape is not None and count > MIN_ROWS_CUT:
            lo_li, lo_off, hi_li, hi_off = self._cut(count - rows_at_most(count), (lo_li, lo_off), (hi_li, hi_off),
                                                     (bisect.bisect_left(lengths, real_anchor), anchor_off))
        return self._take(lo_li, lo_off, hi_li, hi_off)

    def _cut(self, drop: int, lo: tuple[int, int], hi: tuple[int, int], anchor: tuple[int, int]):
        """The run less `drop` requests, from its long end while the anchor stays in, then from its
        short end: a step of a row bucket's size computes no added row, and those left wait."""
        lengths, buckets = self._lengths, self._buckets
        (lo_li, lo_off), (hi_li, hi_off) = lo, hi
        for _ in range(drop):
            if (hi_li, hi_off) > anchor:
                if hi_off > 0:
                    hi_off -= 1
                else:
                    hi_li -= 1
                    hi_off = len(buckets[lengths[hi_li]]) - 1
            elif lo_off + 1 < len(buckets[lengths[lo_li]]):
                lo_off += 1
            else:
                lo_li, lo_off = lo_li + 1, 0
        return lo_li, lo_off, hi_li, hi_off

    def _take(self, lo_li: int, lo_off: int, hi_li: int, hi_off: int) -> Requests:
        """Removes the run from (lo_li, lo_off) to (hi_li, hi_off) and returns its requests."""
        lengths, buckets, waiting = self._lengths, self._buckets, self.waiting
        slots: list[int] = []
        emptied = []
        for li in range(lo_li, hi_li + 1):
            bucket = buckets[lengths[li]]
            start = lo_off if li == lo_li else 0
            end = hi_off + 1 if li == hi_li else len(bucket)
            slots += [waiting.pop(arrival) for arrival in bucket[start:end]]
            del bucket[start:end]
            if not bucket:
                emptied.append(li)
        for li in reversed(emptied):
            del buckets[lengths[li]]
            del lengths[li]
        batch = self.table.take(np.asarray(slots, dtype=np.int64))
        self._forget_keys(batch)
        if self._urgent:
            self._urgent -= int(np.count_nonzero(batch.priority))
        return batch

    def _forget_keys(self, batch: Requests) -> None:
        """The batch's requests are no longer waiting: out of `_arrival` (call by call)."""
        calls = batch.calls
        keys = batch.keys()
        if (calls == calls[0]).all():  # one call, as usual
            groups = [(calls[0], keys)]
        else:
            per_call: dict[str, list] = {}
            for call, key in zip(calls.tolist(), keys):
                per_call.setdefault(call, []).append(key)
            groups = per_call.items()
        for call, call_keys in groups:
            arrival_of = self._arrival[call]
            for key in call_keys:
                del arrival_of[key]
            if not arrival_of:
                del self._arrival[call]

    def _free(self, count: int, longest: int, new_longest: int) -> bool:
        """Whether one more request (making the longest `new_longest`) fits in the bucketed shape a
        step of `count` up to `longest` computes anyway: it is then taken whatever its padding (an
        empty row of the bucket would be padding too). Off a device, never."""
        return self.shape is not None and self.shape(count + 1, new_longest) == self.shape(count, longest)

    def _cheaper_per_token(self, real: int, padded: int, new_real: int, new_padded: int) -> bool:
        """Whether real tokens per unit of step cost (overhead + padded tokens) go up."""
        return new_real * (self.overhead_tokens + padded) > real * (self.overhead_tokens + new_padded)
