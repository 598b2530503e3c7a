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
# The sorted index holds one int per request, length << ARRIVAL_BITS | arrival: comparing ints is
# several times cheaper than comparing (length, arrival, key) tuples, and sorts and bisections
# compare a lot (a window of thousands).
ARRIVAL_BITS = 40
ARRIVAL_MASK = (1 << ARRIVAL_BITS) - 1


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_padding_fraction: float,
                 overhead_tokens: float = 0.0) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_padding_fraction = max_padding_fraction
        self.overhead_tokens = overhead_tokens
        # Insertion order is arrival order; keyed by external id (and chunk) so a re-sent
        # request replaces itself.
        self.waiting: dict[Key, PoolingEngineInput] = {}
        # The same requests sorted by (length, arrival) -- as `length << ARRIVAL_BITS | arrival`
        # -- kept sorted as they come and go, so a step costs a binary search and a slice rather
        # than a sort of the whole window.
        self._by_length: list[int] = []
        self._arrival: dict[Key, int] = {}
        self._key_of: dict[int, Key] = {}  # arrival -> key
        self._counter = itertools.count()
        self._urgent = 0  # waiting requests with a priority other than 0

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, request: PoolingEngineInput) -> bool:
        """Adds a request; True when it replaced a waiting copy of itself (a re-sent request)."""
        key = (request.request_id, request.chunk)
        replaced = key in self.waiting
        if replaced:  # the new copy takes the old one's place
            self._forget([key])
        arrival = self._arrival.setdefault(key, next(self._counter))
        self._key_of[arrival] = key
        self.waiting[key] = request
        bisect.insort(self._by_length, len(request.token_ids) << ARRIVAL_BITS | arrival)
        self._urgent += request.priority != 0
        return replaced

    def add_many(self, requests: list[PoolingEngineInput]) -> int:
        """Adds requests in arrival order (one sort for all of them); returns how many replaced a
        waiting copy of themselves."""
        waiting, arrival_of, key_of, counter, entries = self.waiting, self._arrival, self._key_of, self._counter, []
        replaced = 0
        for request in requests:
            key = (request.request_id, request.chunk)
            if key in waiting:  # a re-sent request: the new copy takes the old one's place
                if entries:  # the old copy may be among those not sorted in yet
                    self._by_length.extend(entries)
                    self._by_length.sort()
                    entries = []
                self._forget([key])
                replaced += 1
            arrival = arrival_of.setdefault(key, next(counter))
            key_of[arrival] = key
            waiting[key] = request
            entries.append(len(request.token_ids) << ARRIVAL_BITS | arrival)
            self._urgent += request.priority != 0
        self._by_length.extend(entries)
        self._by_length.sort()  # a sorted run and a short new one: merged in linear time
        return replaced

    def abort(self, request_ids: list[str]) -> int:
        """Removes these requests (every chunk of a chunked one); returns how many were removed."""
        wanted = set(request_ids)
        keys = [k for k in self.waiting if k[0] in wanted]
        self._forget(keys)
        for key in keys:
            del self._key_of[self._arrival.pop(key)]
        return len(keys)

    def take_all(self) -> list[PoolingEngineInput]:
        """Empties the scheduler, returning what was waiting (in arrival order)."""
        batch = list(self.waiting.values())
        self.waiting.clear()
        self._by_length.clear()
        self._arrival.clear()
        self._key_of.clear()
        self._urgent = 0
        return batch

    def _forget(self, keys: list[Key]) -> None:
        if not keys:
            return
        gone = {self._arrival[key] for key in keys}
        for key in keys:
            self._urgent -= self.waiting.pop(key).priority != 0
        self._by_length = [e for e in self._by_length if e & ARRIVAL_MASK not in gone]

    def next_batch(self) -> list[PoolingEngineInput]:
        if not self.waiting:
            return []
        # The anchor: the oldest among the most urgent (lowest priority value) waiting requests.
        oldest = next(iter(self.waiting.values()))
        if self._urgent:
            oldest = min(self.waiting.values(), key=lambda r: r.priority)  # min() keeps the first of ties
        anchor_key = (oldest.request_id, oldest.chunk)
        by_length = self._by_length
        lo = bisect.bisect_left(by_length, len(oldest.token_ids) << ARRIVAL_BITS | self._arrival[anchor_key])
        hi = lo + 1  # the batch is by_length[lo:hi]
        longest = real = by_length[lo] >> ARRIVAL_BITS
        max_seqs, max_tokens, max_padding = self.max_num_seqs, self.max_num_batched_tokens, self.max_padding_fraction
        size = len(by_length)
        while hi - lo < max_seqs:
            count = hi - lo
            # Grow by the side that adds less padding (the shorter side on a tie): a shorter
            # request pads itself up to `longest`; a longer one pads every request already in.
            left = longest - (by_length[lo - 1] >> ARRIVAL_BITS) if lo > 0 and longest * (count + 1) <= max_tokens \
                else None
            right = None
            if hi < size:
                longer = by_length[hi] >> ARRIVAL_BITS
                if longer * (count + 1) <= max_tokens:
                    right = (longer - longest) * count
            if left is None and right is None:
                break
            go_left = right is None or (left is not None and left <= right)
            new_longest, length = (longest, by_length[lo - 1] >> ARRIVAL_BITS) if go_left else (longer, longer)
            padded, new_real = new_longest * (count + 1), real + length
            if (count >= MIN_BATCH_BEFORE_PADDING_LIMIT and padded - new_real > max_padding * padded
                    and not self._cheaper_per_token(real, longest * count, new_real, padded)):
                break
            if go_left:
                lo -= 1
            else:
                hi += 1
            longest, real = new_longest, new_real
        key_of = self._key_of
        keys = [key_of.pop(code & ARRIVAL_MASK) for code in by_length[lo:hi]]
        del by_length[lo:hi]
        batch = []
        for key in keys:
            request = self.waiting.pop(key)
            del self._arrival[key]
            self._urgent -= request.priority != 0
            batch.append(request)
        return batch

    def _cheaper_per_token(self, real: int, padded: int, new_real: int, new_padded: int) -> bool:
        """Whether real tokens per unit of step cost (overhead + padded tokens) go up."""
        return new_real * (self.overhead_tokens + padded) > real * (self.overhead_tokens + new_padded)
