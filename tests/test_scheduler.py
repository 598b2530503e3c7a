"""Batches always hold the oldest request, respect the limits and group similar lengths."""

import random
from typing import NamedTuple

import numpy as np
from helpers import engine_message

from pooling_pipeline.core.engine.columns import Requests
from pooling_pipeline.core.engine.scheduler import Scheduler
from pooling_pipeline.core.shared.messages import Payload, PoolingParams


class Req(NamedTuple):
    """A request as the plain rule below sees it."""

    index: int
    token_ids: np.ndarray
    priority: int = 0


def _req(i: int, length: int, priority: int = 0) -> Req:
    return Req(i, np.zeros(length, dtype=np.int32), priority)


def _columns(requests: list[Req]) -> Requests:
    """As the engine admits them: one message's columns, packed as a render worker packs them."""
    msg = engine_message("call", [(r.index, r.token_ids, PoolingParams(), {"priority": r.priority}) for r in requests])
    msg.check()
    return Requests.from_message(msg)


class Sched(Scheduler):
    """The scheduler, fed request by request (or a list at a time), its batches as indices."""

    def add(self, request, resent: bool = False) -> int:
        return super().add(_columns(request if isinstance(request, list) else [request]), resent)

    def next_indices(self) -> list[int]:
        batch = self.next_batch()
        return [] if batch is None else batch.indices.tolist()

    def oldest(self) -> int:
        return int(self.table.cols[self._order_slots[self.anchor_position()], 0])


def test_batches_hold_the_oldest_and_respect_limits():
    rng = random.Random(0)
    sched = Sched(max_num_seqs=16, max_num_batched_tokens=512, max_padding_fraction=0.1)
    arrivals = [_req(i, rng.choice([3, 5, 8, 20, 40, 120, 256])) for i in range(400)]
    for r in arrivals[:128]:
        sched.add(r)
    done, nxt = [], 128
    while len(sched):
        oldest = sched.oldest()
        batch = sched.next_batch()
        assert oldest in batch.indices.tolist()
        assert 1 <= len(batch) <= 16
        assert int(batch.lengths.max()) * len(batch) <= 512
        for i in range(len(batch)):  # each request's own ids come out of the token arena
            assert len(batch.ids(i)) == len(arrivals[int(batch.indices[i])].token_ids)
        done += batch.indices.tolist()
        while nxt < len(arrivals) and len(sched) < 128:
            sched.add(arrivals[nxt])
            nxt += 1
    assert sorted(done) == list(range(400))


def test_similar_lengths_are_grouped():
    sched = Sched(max_num_seqs=64, max_num_batched_tokens=4096, max_padding_fraction=0.05)
    for i in range(256):
        sched.add(_req(i, 10 if i % 2 else 200))
    padded = real = 0
    while len(sched):
        batch = sched.next_batch()
        padded += int(batch.lengths.max()) * len(batch)
        real += int(batch.lengths.sum())
    assert 1 - real / padded < 0.05


def test_abort_removes_waiting_and_counts_them():
    sched = Sched(8, 1024, 0.1)
    for i in range(4):
        assert sched.add(_req(i, 5)) == 0
    assert sched.add(_req(2, 5), resent=True) == 1  # a re-sent request replaces its waiting copy
    assert len(sched) == 4
    assert sched.abort("call", [1, 3, 99]) == 2
    assert sched.abort("another call") == 0
    assert sorted(sched.next_indices()) == [0, 2]
    sched.add([_req(i, 5) for i in range(5, 9)])
    assert sched.abort("call") == 4 and len(sched) == 0  # the whole call
    assert sched.next_batch() is None


def test_lower_priority_value_runs_first():
    sched = Sched(max_num_seqs=1, max_num_batched_tokens=1024, max_padding_fraction=0.0)
    for i in range(6):  # lengths far apart: one request per batch
        sched.add(_req(i, 10 + i * 50, priority=5 if i < 3 else -1))
    order = [i for _ in range(6) for i in sched.next_indices()]
    assert order[:3] == [3, 4, 5] and sorted(order[3:]) == [0, 1, 2]


def _reference_batch(waiting: list[Req], max_num_seqs: int, max_tokens: int, max_padding: float,
                     overhead_tokens: float) -> list[int]:
    """The batching rule written plainly (a full sort per step), to check the incremental index."""
    oldest = min(waiting, key=lambda r: r.priority)
    by_length = sorted(waiting, key=lambda r: len(r.token_ids))
    lengths = [len(r.token_ids) for r in by_length]
    lo = next(i for i, r in enumerate(by_length) if r is oldest)
    hi, longest, real = lo + 1, lengths[lo], lengths[lo]
    while hi - lo < max_num_seqs:
        count, options = hi - lo, []
        if lo > 0:
            options.append((longest - lengths[lo - 1], "left", longest, lengths[lo - 1]))
        if hi < len(lengths):
            options.append(((lengths[hi] - longest) * count, "right", lengths[hi], lengths[hi]))
        options = [o for o in options if o[2] * (count + 1) <= max_tokens]
        if not options:
            break
        _, side, new_longest, length = min(options)
        padded, new_real = new_longest * (count + 1), real + length
        cheaper = new_real * (overhead_tokens + longest * count) > real * (overhead_tokens + padded)
        if count >= 4 and padded - new_real > max_padding * padded and not cheaper:
            break
        lo, hi = (lo - 1, hi) if side == "left" else (lo, hi + 1)
        longest, real = new_longest, new_real
    return [r.index for r in by_length[lo:hi]]


def test_incremental_index_matches_the_plain_rule():
    rng = random.Random(3)
    for overhead in (0.0, 40.0, 5000.0):
        sched = Sched(32, 1024, 0.05, overhead_tokens=overhead, capacity=64)  # (the table grows as needed)
        waiting: list[Req] = []
        for i in range(3000):
            request = _req(i, rng.choice([4, 5, 6, 9, 17, 30, 31, 64, 200]), priority=rng.choice([0, 0, 0, 0, 1, -1]))
            sched.add(request)
            waiting.append(request)
            if rng.random() < 0.01:  # an abort now and then
                gone = waiting.pop(rng.randrange(len(waiting)))
                assert sched.abort("call", [gone.index, 10**9]) == 1
            if rng.random() < 0.3 and waiting:
                expected = _reference_batch(waiting, 32, 1024, 0.05, overhead)
                assert sched.next_indices() == expected
                waiting = [r for r in waiting if r.index not in set(expected)]
                assert len(sched) == len(waiting)


def test_step_overhead_fills_batches_past_the_padding_cap():
    lengths = [10, 20, 30, 40, 50, 60, 70, 80]
    tight, full = Sched(64, 4096, 0.05), Sched(64, 4096, 0.05, overhead_tokens=10_000)
    for i, length in enumerate(lengths):
        tight.add(_req(i, length))
        full.add(_req(i, length))
    assert len(tight.next_batch()) < len(lengths)  # padding cap: the batch stops early
    assert len(full.next_batch()) == len(lengths)  # a step that is mostly overhead takes them all


def test_adding_a_message_forms_the_same_batches_as_adding_one_by_one():
    rng = random.Random(7)
    one, many = Sched(32, 1024, 0.05, overhead_tokens=40), Sched(32, 1024, 0.05, overhead_tokens=40)
    next_id = 0
    for _ in range(200):
        chunk, seen = [], set()
        for _ in range(rng.randrange(1, 40)):
            # now and then a re-sent request (an id still waiting, or already taken; once a message)
            rid = rng.randrange(max(next_id, 1)) if rng.random() < 0.05 else next_id
            if rid in seen:
                continue
            seen.add(rid)
            next_id += rid == next_id
            chunk.append(_req(rid, rng.choice([3, 5, 8, 9, 20, 31, 64, 100])))
        replaced = sum(one.add(r, resent=True) for r in chunk)
        assert many.add(chunk, resent=True) == replaced
        for _ in range(rng.randrange(3)):
            assert one.next_indices() == many.next_indices()
    assert len(one) == len(many)


def test_the_token_arena_moves_and_grows_and_keeps_every_requests_ids():
    rng = random.Random(5)
    sched = Sched(8, 1 << 20, 1.0, capacity=16)
    sched.table.tokens.data = np.zeros(64, np.int32)  # tiny: it is compacted and grown over and over
    expected = {}
    for i in range(600):
        ids = np.asarray([rng.randrange(30000) for _ in range(rng.randrange(1, 40))], np.int32)
        expected[i] = ids
        sched.add(Req(i, ids))
        if rng.random() < 0.4:
            batch = sched.next_batch()
            for row, index in enumerate(batch.indices.tolist()):
                np.testing.assert_array_equal(batch.ids(row), expected.pop(index))
    while len(sched):
        batch = sched.next_batch()
        for row, index in enumerate(batch.indices.tolist()):
            np.testing.assert_array_equal(batch.ids(row), expected.pop(index))
    assert not expected


def test_payloads_of_any_shape_come_out_with_their_requests_whatever_the_messages():
    """Rows carry named arrays of their own lengths (here "patches", [k, 2, 3] float32, 0-4 items
    a row; "grid", [k, 3] int64 on some messages only): each batch's payload holds exactly its
    rows' items in its rows' order, across messages with and without the name, slots reused and
    arenas compacted and grown."""
    rng = np.random.default_rng(7)
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=1 << 20, max_padding_fraction=1.0, capacity=16)
    expected: dict[int, dict[str, np.ndarray]] = {}
    live = 0
    for index in range(0, 900, 3):
        rows = [(index + k, rng.integers(1, 500, int(rng.integers(1, 30))).astype(np.int32)) for k in range(3)]
        msg = engine_message("call", rows)
        counts = rng.integers(0, 5, 3)
        patches = rng.standard_normal((int(counts.sum()), 2, 3)).astype(np.float32)
        msg.payloads = {"patches": Payload(counts=counts, data=patches)}
        if index % 2:
            grid = rng.integers(1, 9, (3, 3))
            msg.payloads["grid"] = Payload(counts=np.ones(3, np.int64), data=grid)
        msg.check()
        starts = np.cumsum(counts) - counts
        for k in range(3):
            expected[index + k] = {"patches": patches[starts[k]:starts[k] + counts[k]],
                                   "grid": grid[k:k + 1] if index % 2 else np.zeros((0, 3), np.int64)}
        sched.add(Requests.from_message(msg))
        live += 3
        while live > 40 or (index >= 897 and len(sched)):
            batch = sched.next_batch()
            live -= len(batch)
            for name, empty in (("patches", np.zeros((0, 2, 3), np.float32)), ("grid", np.zeros((0, 3), np.int64))):
                want = [expected[i][name] for i in batch.indices.tolist()]
                if not sum(len(w) for w in want):
                    assert name not in batch.payloads  # (a name only where some row has items)
                    continue
                got = batch.payloads[name]
                np.testing.assert_array_equal(got.counts, [len(w) for w in want])
                np.testing.assert_array_equal(got.data, np.concatenate(want or [empty]))
                picked = batch.select([len(batch) - 1, 0])  # a step's rows regrouped (a runner's groups)
                np.testing.assert_array_equal(picked.payloads.get(name, Payload(counts=np.zeros(2, np.int64),
                                                                                data=empty)).data,
                                              np.concatenate([want[-1], want[0]]))
    assert not len(sched) and live == 0
    assert len(sched.table.payloads["patches"].data) < 2000  # (bounded by what waits, not by what passed)


class OneAtATime(Sched):
    """The walk that grows a batch one request at a time (what the runs taken whole must equal)."""

    TAKE_RUNS = False


def test_runs_taken_whole_form_the_same_batches_as_one_request_at_a_time():
    from pooling_pipeline.core.engine.step_shapes import bucket_shape

    rng = random.Random(11)
    shape = lambda rows, longest: bucket_shape(rows, longest, 512)  # noqa: E731
    for max_seqs, max_tokens, max_padding, overhead, shaped in [(256, 16384, 0.25, 5000.0, True),
                                                                (256, 16384, 0.25, 0.0, True),
                                                                (64, 2048, 0.05, 30.0, False),
                                                                (32, 1024, 0.05, 0.0, False)]:
        fast = Sched(max_seqs, max_tokens, max_padding, overhead_tokens=overhead, shape=shape if shaped else None)
        plain = OneAtATime(max_seqs, max_tokens, max_padding, overhead_tokens=overhead,
                           shape=shape if shaped else None)
        next_id, taken_whole = 0, 0
        for _ in range(300):
            # Messages of short texts (many of a length: the runs) and now and then long ones.
            message = [_req(next_id + i, rng.choice([rng.randint(8, 40)] * 6 + [rng.randint(1, 300)]),
                            priority=rng.choice([0] * 20 + [1, -1]))
                       for i in range(rng.randint(1, 120))]
            next_id += len(message)
            fast.add(message)
            plain.add(message)
            while len(plain) > rng.randint(0, 600):
                expected = plain.next_indices()
                assert fast.next_indices() == expected
                taken_whole += len(expected)
        while len(plain):
            assert fast.next_indices() == plain.next_indices()
        assert not len(fast) and taken_whole > 10_000


def test_only_a_resent_message_replaces_waiting_copies_and_abort_finds_requests_by_scanning():
    """The usual message is not looked up (no per-request index is kept): a request repeated
    without `resent` waits twice; a re-sent one replaces its waiting copy, chunk by chunk; aborts
    find a call's requests among those waiting."""
    sched = Sched(64, 4096, 0.5)
    sched.add([_req(i, 5 + i % 3) for i in range(6)])
    assert sched.add(_req(1, 6)) == 0 and len(sched) == 7  # not re-sent: kept as well
    assert sched.add([_req(1, 6), _req(4, 6), _req(50, 6)], resent=True) == 3  # both copies of 1, and 4
    assert len(sched) == 7
    assert sched.abort("call", [1]) == 1 and sched.abort("call", [50, 77]) == 1
    assert sorted(sched.next_indices()) == [0, 2, 3, 4, 5]
    # chunks of one document: (index, chunk) is the identity
    msg = engine_message("doc", [(7, np.zeros(4, np.int32), PoolingParams(), {"chunk": k, "num_chunks": 3})
                                 for k in range(3)])
    msg.check()
    Scheduler.add(sched, Requests.from_message(msg))
    again = engine_message("doc", [(7, np.zeros(4, np.int32), PoolingParams(), {"chunk": 1, "num_chunks": 3})])
    again.check()
    assert Scheduler.add(sched, Requests.from_message(again), resent=True) == 1 and len(sched) == 3
    assert sched.abort("doc", [7]) == 3 and len(sched) == 0
