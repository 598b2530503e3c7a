"""Admitted requests and how they are cut into batches.

The engine admits at most `window` requests (it stops reading its socket while full). Each step
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
  the step's fixed cost (`overhead_tokens`: the engine measures it as the padded tokens one
  step's overhead is worth). For a big model on a CPU that is a few tokens and changes nothing;
  for a small model, or a GPU, a step costs mostly overhead and batches fill up.
"""

from __future__ import annotations

import bisect
import itertools

from pooling_pipeline.core.messages import PoolingEngineInput

# Below this many requests a batch grows whatever the padding (per-batch overhead dominates).
MIN_BATCH_BEFORE_PADDING_LIMIT = 4

Key = tuple[str, int]  # (external id, chunk of a long document)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_padding_fraction: float,
                 overhead_tokens: float = 0.0) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_padding_fraction = max_padding_fraction
        self.overhead_tokens = overhead_tokens
        # Keyed by arrival number; insertion order is arrival order (a re-sent request replaces
        # its waiting copy and goes last, keeping its arrival number).
        self.waiting: dict[int, PoolingEngineInput] = {}
        # The same requests in (length, arrival) order, as buckets: one list of arrivals per
        # length (ascending: arrivals only grow, so adding is an append) and the lengths that
        # have a bucket, sorted (a few hundred at most). Adding costs no sort and no comparison
        # with the rest of the window; a batch is a run of that order, walked bucket by bucket.
        self._buckets: dict[int, list[int]] = {}
        self._lengths: list[int] = []
        self._arrival: dict[Key, int] = {}  # the arrival number of each waiting request, by external id (and chunk)
        self._counter = itertools.count()
        self._urgent = 0  # waiting requests with a priority other than 0

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, request: PoolingEngineInput) -> bool:
        """Adds a request; True when it replaced a waiting copy of itself (a re-sent request)."""
        return self.add_many([request]) == 1

    def add_many(self, requests: list[PoolingEngineInput]) -> int:
        """Adds requests in arrival order; returns how many replaced a waiting copy of themselves."""
        waiting, arrival_of, counter, buckets = self.waiting, self._arrival, self._counter, self._buckets
        replaced = 0
        for request in requests:
            key = (request.request_id, request.chunk)
            arrival = arrival_of.get(key)
            if arrival is None:
                arrival = arrival_of[key] = next(counter)
            else:  # a re-sent request: the new copy takes the waiting one's place
                self._forget(arrival)
                replaced += 1
            waiting[arrival] = request
            length = len(request.token_ids)
            bucket = buckets.get(length)
            if bucket is None:
                buckets[length] = [arrival]
                bisect.insort(self._lengths, length)
            elif bucket[-1] < arrival:
                bucket.append(arrival)
            else:  # a re-sent request keeps its first arrival
                bisect.insort(bucket, arrival)
            self._urgent += request.priority != 0
        return replaced

    def abort(self, request_ids: list[str]) -> int:
        """Removes these requests (every chunk of a chunked one); returns how many were removed."""
        wanted = set(request_ids)
        keys = [k for k in self._arrival if k[0] in wanted]
        for key in keys:
            self._forget(self._arrival.pop(key))
        return len(keys)

    def take_all(self) -> list[PoolingEngineInput]:
        """Empties the scheduler, returning what was waiting (in arrival order)."""
        batch = list(self.waiting.values())
        self.waiting.clear()
        self._buckets.clear()
        self._lengths.clear()
        self._arrival.clear()
        self._urgent = 0
        return batch

    def _forget(self, arrival: int) -> None:
        """Takes this waiting request out of `waiting` and the buckets (not out of `_arrival`)."""
        request = self.waiting.pop(arrival)
        self._urgent -= request.priority != 0
        length = len(request.token_ids)
        bucket = self._buckets[length]
        del bucket[bisect.bisect_left(bucket, arrival)]
        if not bucket:
            del self._buckets[length]
            del self._lengths[bisect.bisect_left(self._lengths, length)]

    def next_batch(self) -> list[PoolingEngineInput]:
        if not self.waiting:
            return []
        # The anchor: the oldest among the most urgent (lowest priority value) waiting requests.
        anchor, oldest = next(iter(self.waiting.items()))
        if self._urgent:  # (min() keeps the first of ties)
            anchor, oldest = min(self.waiting.items(), key=lambda item: item[1].priority)
        lengths, buckets = self._lengths, self._buckets
        # The batch is a run of the (length, arrival) order: from offset `lo_off` of bucket
        # `lo_li` (an index into `lengths`) to offset `hi_off` of bucket `hi_li`, both included.
        longest = real = len(oldest.token_ids)
        lo_li = hi_li = bisect.bisect_left(lengths, longest)
        anchor_bucket = buckets[longest]
        lo_off = hi_off = bisect.bisect_left(anchor_bucket, anchor)
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
                    and not self._cheaper_per_token(real, longest * count, new_real, padded)):
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
        return self._take(lo_li, lo_off, hi_li, hi_off)

    def _take(self, lo_li: int, lo_off: int, hi_li: int, hi_off: int) -> list[PoolingEngineInput]:
        """Removes the run from (lo_li, lo_off) to (hi_li, hi_off) and returns its requests."""
        lengths, buckets, arrival_of, waiting = self._lengths, self._buckets, self._arrival, self.waiting
        batch = []
        emptied = []
        for li in range(lo_li, hi_li + 1):
            bucket = buckets[lengths[li]]
            start = lo_off if li == lo_li else 0
            end = hi_off + 1 if li == hi_li else len(bucket)
            for arrival in bucket[start:end]:
                request = waiting.pop(arrival)
                del arrival_of[(request.request_id, request.chunk)]
                self._urgent -= request.priority != 0
                batch.append(request)
            del bucket[start:end]
            if not bucket:
                emptied.append(li)
        for li in reversed(emptied):
            del buckets[lengths[li]]
            del lengths[li]
        return batch

    def _cheaper_per_token(self, real: int, padded: int, new_real: int, new_padded: int) -> bool:
        """Whether real tokens per unit of step cost (overhead + padded tokens) go up."""
        return new_real * (self.overhead_tokens + padded) > real * (self.overhead_tokens + new_padded)
