"""Batches always hold the oldest request, respect the limits and group similar lengths."""

import random

import numpy as np

from core.messages import PoolingEngineInput, PoolingParams
from core.scheduler import Scheduler


def _req(i: int, length: int) -> PoolingEngineInput:
    return PoolingEngineInput(str(i), i, "embed", np.zeros(length, dtype=np.int32), PoolingParams())


def test_batches_hold_the_oldest_and_respect_limits():
    rng = random.Random(0)
    sched = Scheduler(max_num_seqs=16, max_num_batched_tokens=512, max_padding_fraction=0.1)
    arrivals = [_req(i, rng.choice([3, 5, 8, 20, 40, 120, 256])) for i in range(400)]
    for r in arrivals[:128]:
        sched.add(r)
    done, nxt = [], 128
    while len(sched):
        oldest = next(iter(sched.waiting.values())).request_id
        batch = sched.next_batch()
        assert oldest in {r.request_id for r in batch}
        assert 1 <= len(batch) <= 16
        assert max(len(r.token_ids) for r in batch) * len(batch) <= 512
        done += batch
        while nxt < len(arrivals) and len(sched) < 128:
            sched.add(arrivals[nxt])
            nxt += 1
    assert sorted(r.seq for r in done) == list(range(400))


def test_similar_lengths_are_grouped():
    sched = Scheduler(max_num_seqs=64, max_num_batched_tokens=4096, max_padding_fraction=0.05)
    for i in range(256):
        sched.add(_req(i, 10 if i % 2 else 200))
    padded = real = 0
    while len(sched):
        batch = sched.next_batch()
        longest = max(len(r.token_ids) for r in batch)
        padded += longest * len(batch)
        real += sum(len(r.token_ids) for r in batch)
    assert 1 - real / padded < 0.05


def test_abort_removes_waiting_and_reports_the_rest():
    sched = Scheduler(8, 1024, 0.1)
    for i in range(4):
        sched.add(_req(i, 5))
    assert sched.abort(["1", "3", "99"]) == ["99"]
    assert sorted(r.request_id for r in sched.waiting.values()) == ["0", "2"]


def test_lower_priority_value_runs_first():
    sched = Scheduler(max_num_seqs=1, max_num_batched_tokens=1024, max_padding_fraction=0.0)
    for i in range(6):
        r = _req(i, 10 + i * 50)  # lengths far apart: one request per batch
        r.priority = 5 if i < 3 else -1
        sched.add(r)
    order = [r.seq for _ in range(6) for r in sched.next_batch()]
    assert order[:3] == [3, 4, 5] and sorted(order[3:]) == [0, 1, 2]
