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
  and wants bigger batches.
"""

from __future__ import annotations

from core.messages import PoolingEngineInput

# Below this many requests a batch grows whatever the padding (per-batch overhead dominates).
MIN_BATCH_BEFORE_PADDING_LIMIT = 4


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_padding_fraction: float) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_padding_fraction = max_padding_fraction
        # Insertion order is arrival order; keyed by external id (and chunk window) so a re-sent
        # request replaces itself.
        self.waiting: dict[tuple[str, int], PoolingEngineInput] = {}

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, request: PoolingEngineInput) -> None:
        self.waiting[(request.request_id, request.window)] = request

    def abort(self, request_ids: list[str]) -> list[str]:
        """Removes these requests (every window of a chunked one); returns the ids that were not
        here (still on their way)."""
        wanted = set(request_ids)
        found = set()
        for key in [k for k in self.waiting if k[0] in wanted]:
            del self.waiting[key]
            found.add(key[0])
        return [rid for rid in request_ids if rid not in found]

    def next_batch(self) -> list[PoolingEngineInput]:
        if not self.waiting:
            return []
        # The anchor: the oldest among the most urgent (lowest priority value) waiting requests.
        oldest = next(iter(self.waiting.values()))
        if oldest.priority != 0 or any(r.priority for r in self.waiting.values()):
            oldest = min(self.waiting.values(), key=lambda r: r.priority)  # min() keeps the first of ties
        by_length = sorted(self.waiting.values(), key=lambda r: len(r.token_ids))
        lengths = [len(r.token_ids) for r in by_length]
        lo = next(i for i, r in enumerate(by_length) if r is oldest)  # identity: windows share ids
        hi = lo + 1  # the batch is by_length[lo:hi]
        longest = real = lengths[lo]
        while hi - lo < self.max_num_seqs:
            count = hi - lo
            # (padding it adds, side, longest after, its length): a shorter request pads itself
            # up to `longest`; a longer one pads every request already in the batch.
            options = []
            if lo > 0:
                options.append((longest - lengths[lo - 1], "left", longest, lengths[lo - 1]))
            if hi < len(lengths):
                options.append(((lengths[hi] - longest) * count, "right", lengths[hi], lengths[hi]))
            options = [o for o in options if o[2] * (count + 1) <= self.max_num_batched_tokens]
            if not options:
                break
            _, side, new_longest, length = min(options)
            padded, new_real = new_longest * (count + 1), real + length
            if count >= MIN_BATCH_BEFORE_PADDING_LIMIT and padded - new_real > self.max_padding_fraction * padded:
                break
            if side == "left":
                lo -= 1
            else:
                hi += 1
            longest, real = new_longest, new_real
        batch = by_length[lo:hi]
        for request in batch:
            del self.waiting[(request.request_id, request.window)]
        return batch
