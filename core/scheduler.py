"""Admitted requests and how they are cut into batches.

The engine admits at most `window` requests (it stops reading its socket while full). Each step
takes one batch that always contains the oldest waiting request -- so no request waits forever
and the frontend's reorder buffer keeps moving -- filled with the requests nearest to it in
length, so little of the forward pass is spent on padding. The batch holds at most
`max_num_seqs` requests and at most `max_num_batched_tokens` padded tokens.
"""

from __future__ import annotations

from core.messages import PoolingEngineInput


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Insertion order is arrival order; keyed by external id so a re-sent request replaces itself.
        self.waiting: dict[str, PoolingEngineInput] = {}

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, request: PoolingEngineInput) -> None:
        self.waiting[request.request_id] = request

    def abort(self, request_ids: list[str]) -> list[str]:
        """Removes these requests; returns the ids that were not here (still on their way)."""
        return [rid for rid in request_ids if self.waiting.pop(rid, None) is None]

    def next_batch(self) -> list[PoolingEngineInput]:
        if not self.waiting:
            return []
        oldest = next(iter(self.waiting.values()))
        by_length = sorted(self.waiting.values(), key=lambda r: len(r.token_ids))
        anchor = by_length.index(oldest)
        lo, hi = anchor, anchor + 1  # the batch is by_length[lo:hi]
        longest = len(oldest.token_ids)
        while hi - lo < self.max_num_seqs:
            count = hi - lo
            # Padding each choice adds: a shorter request pads itself up to `longest`;
            # a longer one pads every request already in the batch up to its own length.
            left_cost = longest - len(by_length[lo - 1].token_ids) if lo > 0 else None
            right_len = len(by_length[hi].token_ids) if hi < len(by_length) else None
            right_fits = right_len is not None and right_len * (count + 1) <= self.max_num_batched_tokens
            left_fits = left_cost is not None and longest * (count + 1) <= self.max_num_batched_tokens
            right_cost = (right_len - longest) * count if right_fits else None
            if left_fits and (not right_fits or left_cost <= right_cost):
                lo -= 1
            elif right_fits:
                hi += 1
                longest = right_len
            else:
                break
        batch = by_length[lo:hi]
        for request in batch:
            del self.waiting[request.request_id]
        return batch
