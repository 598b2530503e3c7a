"""The frontend's per-request work stays array work and C loops (issue 62, item 3): a stream's
results are handed out without a Python generator resumed per result, the reorder ring stores and
hands back a message's vectors without a Python loop per row, and the budget's sizes are a column.
What the caller gets is unchanged: the same result types, values, order and memory ownership."""

import sys
import time

import numpy as np
import pytest

from pooling_pipeline.call_stats import CallStats
from pooling_pipeline.core.shared import messages as m
from pooling_pipeline.frontend.reorder import Ring
from pooling_pipeline.inputs import build_requests
from pooling_pipeline.options import CallOptions
from pooling_pipeline.outputs import EmbeddingOutput

CO_GENERATOR = 0x20


def _generator_resumes(stream) -> tuple[list, int]:
    """The stream's results, and how many times a Python generator frame was entered (started or
    resumed) in this thread while they were drawn."""
    resumes = 0

    def count(frame, event, arg):
        nonlocal resumes
        if event == "call" and frame.f_code.co_flags & CO_GENERATOR:
            resumes += 1

    sys.setprofile(count)
    try:
        results = list(stream)
    finally:
        sys.setprofile(None)
    return results, resumes


def test_a_stream_hands_out_its_results_without_a_generator_step_each(pipe):
    """A stream resumes a generator once a turn (a turn hands back every result that is ready),
    not once or twice a result: two generator layers per result cost ~0.15 us a result."""
    texts = [f"sentence number {i} of the stream" for i in range(600)]
    stream = pipe.embed_stream(iter(texts))
    results, resumes = _generator_resumes(stream)
    assert [out.index for out in results] == list(range(len(texts)))
    assert all(type(out) is EmbeddingOutput and out.error is None for out in results)
    assert resumes < len(texts) // 2, resumes  # (one generator layer per result made it 600 at least)
    # The same vectors as a list call (the same path, gathered whole).
    listed = pipe.embed(texts, use_tqdm=False)
    np.testing.assert_array_equal(np.stack([o.embedding for o in results]), np.stack([o.embedding for o in listed]))


def test_a_stream_closed_early_aborts_its_call_and_the_group_serves_on(pipe):
    stream = pipe.embed_stream(iter([f"text {i}" for i in range(2000)]))
    first = next(stream)
    assert first.index == 0
    stream.close()
    assert list(stream) == []  # (closed: nothing more of its turn, as a closed generator)
    # The abort returns the call's slots through the receiver thread, at once but not synchronously.
    deadline = time.monotonic() + 30
    while pipe.stats()["group"]["calls_running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pipe.stats()["group"]["calls_running"] == 0 and pipe.stats()["group"]["inflight"] == 0
    assert [o.index for o in pipe.embed_stream(["a", "b"])] == [0, 1]


def _answered_ring(keep_all: bool) -> tuple[list, np.ndarray]:
    """A ring of 64 slots answered in two messages out of order, then handed back."""
    ring = Ring(64, "c-", EmbeddingOutput, CallStats(), default_normalize=False, keep_all=keep_all)
    ring.make_room(0, 40)
    sent = np.arange(40, dtype=np.int64)
    ring.out_index[sent & ring.mask] = sent
    rows = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    order = np.random.default_rng(3).permutation(40)
    out = []
    for part in (order[:25], order[25:]):
        data = rows[part].copy()  # (as a received frame's rows)
        ring.accept_vectors(part.astype(np.int64), data, part.astype(np.int64) + 1)
        data[:] = -1  # the frame is reused: the ring holds its own copies
        out += ring.hand_back(40)
    assert ring.hand_back(40) == [] and ring.ready_count == 0
    return out, rows


@pytest.mark.parametrize("keep_all", [False, True])
def test_the_ring_hands_back_each_vector_once_in_order(keep_all):
    out, rows = _answered_ring(keep_all)
    assert [r.index for r in out] == list(range(40))
    assert all(type(r) is EmbeddingOutput and r.num_chunks == 1 and r.error is None for r in out)
    assert [r.num_prompt_tokens for r in out] == list(range(1, 41))
    np.testing.assert_array_equal(np.stack([r.data for r in out]), rows)
    assert all(r.data.dtype == np.float32 and r.data.shape == (3,) and r.data.flags.writeable for r in out)


def test_a_streams_results_own_their_vectors_and_a_list_calls_share_one_copy_an_answer():
    """In a stream a result kept keeps only its own vector (no neighbours' memory); a list call
    keeps every result anyway, and its results of one answer share one copy."""
    streamed, _ = _answered_ring(keep_all=False)
    assert all(r.data.flags.owndata and r.data.base is None for r in streamed)
    listed, _ = _answered_ring(keep_all=True)
    assert all(r.data.base is not None for r in listed)
    assert len({id(r.data.base) for r in listed}) == 2  # one copy per answer
    listed[0].data[0] = 99.0  # (each result's row is its own part of it)
    assert listed[1].data[0] != 99.0


def test_a_batchs_sizes_are_one_int64_column_with_at_least_one_a_request():
    options = m.RenderOptions(task="embed", max_tokens=8, params=m.PoolingParams())
    indices = np.arange(3, dtype=np.int64)
    texts = m.RenderBatch(call="c-", indices=indices, options=options, texts=["abc", "", "de"])
    pairs = m.RenderBatch(call="c-", indices=indices, options=options, texts=["abc", "", ""], pairs=["x", "yz", ""])
    ids = m.RenderBatch(call="c-", indices=indices, options=options, token_ids=np.arange(5, dtype=np.int32),
                        lengths=np.array([2, 0, 3], dtype=np.int64))
    items = m.RenderBatch(call="c-", indices=indices, items=[
        m.RenderParams(options=options, prompt="hello"), m.RenderParams(options=options, prompt=""),
        m.RenderParams(options=options, token_ids=np.arange(4, dtype=np.int32))])
    for batch, want in ((texts, [3, 1, 2]), (pairs, [4, 2, 1]), (ids, [2, 1, 3]), (items, [5, 1, 4])):
        sizes = batch.sizes
        assert isinstance(sizes, np.ndarray) and sizes.dtype == np.int64, type(sizes)
        assert sizes.tolist() == want


@pytest.mark.parametrize("dtypes", [(np.int32,), (np.int64,), (np.int32, np.int64, np.uint16)],
                         ids=["int32", "int64", "mixed"])
def test_a_block_of_token_id_arrays_is_one_batch_of_their_ids(pipe, dtypes):
    """Arrays of one dtype are joined as such; of several, promoted as before: one batch either way,
    the caller's arrays copied (changing them later changes nothing sent)."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 1000, int(rng.integers(1, 9))).astype(dtypes[i % len(dtypes)]) for i in range(50)]
    want = np.concatenate([p.astype(np.int64) for p in prompts])
    source, _ = build_requests(iter(prompts), CallOptions(task="embed", use_tqdm=False), pipe.model_spec,
                               pipe._tokenization, "c-")
    (batch,) = source.take(64, 1 << 30)
    prompts[0][:] = 0
    assert isinstance(batch, m.RenderBatch) and batch.indices.tolist() == list(range(50))
    assert batch.token_ids.dtype == np.int32
    np.testing.assert_array_equal(batch.token_ids, want)
    assert batch.lengths.tolist() == [len(p) for p in prompts]


@pytest.mark.parametrize("odd", [np.array([True, False, True]), np.array([101.0, 102.0])], ids=["bool", "float"])
def test_an_array_that_is_not_token_ids_among_token_id_arrays_is_refused_naming_it(pipe, odd):
    """Arrays of mixed dtypes are joined only when each is token ids itself: a bool or float array
    among int ones would be promoted to ints and pass (a bool array was embedded as ids 0 and 1)."""
    prompts = [np.array([101, 2023, 102], np.int32), np.array([101, 102], np.int64), odd]
    with pytest.raises(TypeError, match="request 2: token ids must be"):
        pipe.embed(prompts)
    assert len(pipe.embed(prompts[:2])) == 2  # the group serves on


def _blocks(source, draws: list[tuple[int, int]]) -> list[tuple]:
    """What `source.take` hands out for these (limit, max_chars) draws: each batch's indices and inputs."""
    out = []
    for limit, max_chars in draws:
        for piece in source.take(limit, max_chars):
            ids = None if piece.token_ids is None else piece.token_ids.tolist()
            out.append((piece.indices.tolist(), piece.texts, ids))
    out.append(source.exhausted)
    return out


@pytest.mark.parametrize("kind", ["texts", "ids", "mixed"])
def test_a_list_is_drawn_in_the_blocks_a_generator_would_be(pipe, kind):
    """A list or a tuple is read a block at a time, its characters counted by C loops, and what is
    past a block's character bound is held for the next draw: the blocks drawn are those of the same
    prompts read one at a time from a generator, whatever the limits and bounds."""
    rng = np.random.default_rng(7)
    texts = ["word " * int(rng.integers(1, 12)) for _ in range(120)]
    arrays = [rng.integers(1, 1000, int(rng.integers(1, 30))).astype(np.int32) for _ in range(120)]
    prompts = {"texts": texts, "ids": arrays, "mixed": [t if k % 3 else a for k, (t, a) in enumerate(zip(texts, arrays))]}[kind]
    draws = [(16, 1 << 30), (40, 50), (3, 1), (64, 200), (64, 1 << 30), (64, 1 << 30)]
    opts = CallOptions(task="embed", use_tqdm=False)
    got = {}
    for form, given in (("generator", (p for p in prompts)), ("list", prompts), ("tuple", tuple(prompts))):
        source, _ = build_requests(iter(given), opts, pipe.model_spec, pipe._tokenization, "c-")
        assert source.read_ahead == (form != "generator")
        got[form] = _blocks(source, draws)
    assert got["list"] == got["generator"] and got["tuple"] == got["generator"]
    assert got["generator"][-1] is True and sum(len(block[0]) for block in got["generator"][:-1]) == 120
