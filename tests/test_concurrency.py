"""Several calls at once on one Pipeline: threads and coroutines, each with its own results in its own
order, one in-flight bound for the group, and a failure or abort of one call touching no other."""

import asyncio
import gc
import itertools
import os
import signal
import threading

import corpus
import numpy as np
import pytest

from pooling_pipeline import Pipeline, PoolingParams

TOL = 1e-5  # float results depend on batch composition
MAX_INFLIGHT = 64


@pytest.fixture(scope="module")
def pipe():
    with Pipeline(max_inflight=MAX_INFLIGHT, max_num_seqs=16) as p:
        yield p


def _jobs():
    """(name, sync run, async run): mixed tasks, options and sizes."""
    s = corpus.sentences(260, seed=91)
    docs = corpus.medium_texts(6, seed=92)
    pairs_q, pairs_d = s[200], s[201:231]
    return [
        ("embed 1", lambda p: p.embed(s[0], use_tqdm=False),
         lambda p: p.aembed(s[0])),
        ("embed 150", lambda p: p.embed(s[:150], use_tqdm=False),
         lambda p: p.aembed(s[:150])),
        ("embed dims", lambda p: p.embed(s[10:60], pooling_params=PoolingParams(dimensions=32), use_tqdm=False),
         lambda p: p.aembed(s[10:60], pooling_params=PoolingParams(dimensions=32))),
        ("embed raw priority", lambda p: p.embed(s[60:100], pooling_params=PoolingParams(normalize=False),
                                                 priority=list(range(40, 0, -1)), use_tqdm=False),
         lambda p: p.aembed(s[60:100], pooling_params=PoolingParams(normalize=False), priority=list(range(40, 0, -1)))),
        ("token_embed", lambda p: p.encode(s[100:130], task="token_embed", use_tqdm=False),
         lambda p: p.aencode(s[100:130], task="token_embed")),
        ("score", lambda p: p.score(pairs_q, pairs_d, use_tqdm=False),
         lambda p: p.ascore(pairs_q, pairs_d)),
        ("chunks", lambda p: p.embed(docs, long_inputs="chunk", truncate_prompt_tokens=64, chunk_overlap=8,
                                     use_tqdm=False),
         lambda p: p.aembed(docs, long_inputs="chunk", truncate_prompt_tokens=64, chunk_overlap=8)),
        ("stream", lambda p: list(p.embed_stream(iter(s[130:230]), truncate_prompt_tokens=16)),
         lambda p: _collect(p.aembed_stream(iter(s[130:230]), truncate_prompt_tokens=16))),
    ]


async def _collect(stream):
    return [out async for out in stream]


def _vectors(outs) -> list[np.ndarray]:
    return [np.atleast_1d(np.asarray(o.score if hasattr(o, "score") else o.data, dtype=np.float64)) for o in outs]


def _assert_same(got, expected, what: str) -> None:
    assert len(got) == len(expected), what
    assert [o.index for o in got] == [o.index for o in expected], what
    for a, b in zip(_vectors(got), _vectors(expected)):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0, err_msg=what)


@pytest.mark.slow
def test_threads_and_coroutines_at_once_get_their_own_results(pipe):
    jobs = _jobs()
    expected = {name: run(pipe) for name, run, _ in jobs}  # one at a time
    got: dict[str, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs) + 1)

    def in_thread(name, run):
        try:
            start.wait()
            got[f"thread {name}"] = run(pipe)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=in_thread, args=(name, run)) for name, run, _ in jobs]
    for t in threads:
        t.start()

    async def coroutines():
        start.wait()  # the threads and this event loop's calls start together
        results = await asyncio.gather(*(arun(pipe) for _, _, arun in jobs))
        for (name, _, _), result in zip(jobs, results):
            got[f"coroutine {name}"] = result

    asyncio.run(coroutines())
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(got) == 2 * len(jobs)
    for name, _, _ in jobs:
        _assert_same(got[f"thread {name}"], expected[name], f"thread {name}")
        _assert_same(got[f"coroutine {name}"], expected[name], f"coroutine {name}")
    group = pipe.stats()["group"]
    assert group["max_inflight_seen"] <= MAX_INFLIGHT  # the bound held for the group, not per call
    assert group["inflight"] == 0 and group["calls_running"] == 0


@pytest.mark.slow
def test_a_cancelled_a_closed_and_a_failing_call_leave_the_others_intact(pipe):
    texts = corpus.sentences(240, seed=93)
    expected = pipe.embed(texts, use_tqdm=False)
    got: dict[str, object] = {}
    threads = [threading.Thread(target=call, args=(pipe, texts, got))
               for call in (_closed_early, _bad_input_midway, _refused_in_worker)]
    threads += [threading.Thread(target=_good, args=(pipe, texts, got, f"good {i}", slice(i * 30, i * 30 + 90)))
                for i in range(4)]
    for t in threads:
        t.start()
    async_results = asyncio.run(_a_cancelled_and_two_good_coroutines(pipe, texts, got))
    for t in threads:
        t.join(timeout=300)
    assert "request 150: prompt is None" in str(got["bad input"])
    assert "request 100" in str(got["refused"]) and "long_inputs='error'" in str(got["refused"])
    _assert_same(got["closed"], expected[:20], "closed stream")
    cancelled = got["cancelled"]  # 10, or a few more: the cancel lands at the stream's next wait
    assert len(cancelled) >= 10 and [o.index for o in cancelled] == list(range(len(cancelled)))
    _assert_same(cancelled, [_reindexed(expected[i % len(texts)], i) for i in range(len(cancelled))], "cancelled")
    for i in range(4):
        _assert_same(got[f"good {i}"], [_reindexed(o, o.index - i * 30) for o in expected[i * 30:i * 30 + 90]],
                     f"good {i}")
    for result in async_results:
        _assert_same(result, [_reindexed(o, o.index - 50) for o in expected[50:200]], "async")
    _wait_idle(pipe)
    outs = pipe.embed(texts[:40], use_tqdm=False)  # the group is clean for the next call
    _assert_same(outs, expected[:40], "after")


# The calls of the test above, each in its own thread or coroutine; what each got goes into `got`.


def _closed_early(pipe, texts, got):
    """A stream its caller stops after 20 results."""
    stream = pipe.embed_stream(itertools.cycle(texts))
    got["closed"] = [next(stream) for _ in range(20)]
    stream.close()


def _bad_input_midway(pipe, texts, got):
    """A bad prompt deep in a stream: that call raises, naming it."""
    def source():
        for i, t in enumerate(texts):
            yield None if i == 150 else t
    try:
        list(pipe.embed_stream(source()))
    except TypeError as e:
        got["bad input"] = e


def _refused_in_worker(pipe, texts, got):
    """A request the render worker refuses (too long, long_inputs="error")."""
    try:
        pipe.embed(texts[:100] + ["word " * 2000] + texts[:100], long_inputs="error", use_tqdm=False)
    except ValueError as e:
        got["refused"] = e


def _good(pipe, texts, got, name, part):
    got[name] = pipe.embed(texts[part], use_tqdm=False)


async def _a_cancelled_and_two_good_coroutines(pipe, texts, got):
    """A stream cancelled after 10 results, next to two calls that complete: their results."""
    async def cancelled():
        async for out in pipe.aembed_stream(itertools.cycle(texts)):
            got.setdefault("cancelled", []).append(out)
            if len(got["cancelled"]) == 10:
                asyncio.current_task().cancel()

    async def good_async():
        return await pipe.aembed(texts[50:200])

    task = asyncio.ensure_future(cancelled())
    results = await asyncio.gather(good_async(), good_async())
    with pytest.raises(asyncio.CancelledError):
        await task
    return results


def test_a_paused_stream_and_another_call_both_complete(pipe):
    """Interleaving: a stream its caller reads slowly does not end when another call starts (it
    used to raise "ended because a newer call started"); both get all their results."""
    texts = corpus.sentences(160, seed=94)
    expected = pipe.embed(texts, use_tqdm=False)
    stream = pipe.embed_stream(iter(texts))
    first = [next(stream) for _ in range(5)]
    other: dict[str, list] = {}
    worker = threading.Thread(target=lambda: other.setdefault("outs", pipe.embed(texts[:60], use_tqdm=False)))
    worker.start()
    rest = list(stream)  # reading on frees the slots the other call waits for
    worker.join(timeout=300)
    _assert_same(first + rest, expected, "paused stream")
    _assert_same(other["outs"], expected[:60], "other call")


@pytest.mark.slow
def test_two_streams_read_in_turn_by_one_thread_both_complete(pipe):
    """zip(stream_a, stream_b) in one thread (and the same with two async streams): while the thread
    waits on one stream it cannot read the other, so neither may wait for slots the other holds."""
    texts = corpus.sentences(150, seed=97)
    expected = pipe.embed(texts, use_tqdm=False)
    got: dict[str, list] = {}

    def in_turn():
        got["sync"] = list(zip(pipe.embed_stream(iter(texts)), pipe.embed_stream(iter(texts[::-1]))))

        async def async_in_turn():
            a, b = pipe.aembed_stream(iter(texts)), pipe.aembed_stream(iter(texts[::-1]))
            return [(await anext(a), await anext(b)) for _ in texts]
        got["async"] = asyncio.run(async_in_turn())

    thread = threading.Thread(target=in_turn, daemon=True)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive(), "two streams read in turn by one thread waited for each other"
    for name in ("sync", "async"):
        firsts, seconds = zip(*got[name])
        _assert_same(list(firsts), expected, name)
        _assert_same(list(seconds), [_reindexed(o, len(texts) - 1 - o.index) for o in expected[::-1]], name)
    _wait_idle(pipe)


def test_an_abandoned_stream_gives_its_slots_back_when_collected(pipe):
    texts = corpus.sentences(100, seed=95)
    expected = pipe.embed(texts, use_tqdm=False)
    stream = pipe.embed_stream(itertools.cycle(texts))
    next(stream)  # it holds most of the in-flight window now, and is never read again
    done: dict[str, list] = {}
    other = threading.Thread(target=lambda: done.setdefault("outs", pipe.embed(texts, use_tqdm=False)))
    other.start()
    del stream  # never closed by its caller: collecting it aborts it and returns its slots
    gc.collect()
    other.join(timeout=300)
    assert not other.is_alive(), "the other call never got the abandoned stream's slots"
    _assert_same(done["outs"], expected, "after an abandoned stream")
    _wait_idle(pipe)


def test_finished_calls_leave_no_reference_cycles(pipe):
    """Each call is freed by reference counting when it ends: with the collector off, a run of sync,
    streamed and async calls leaves nothing for it to find. (A call that held its own bound methods
    was a cycle of ~30 objects: a server's collector walked the heap for them, ~10% of its CPU.)"""
    texts = corpus.sentences(40, seed=97)
    loop = asyncio.new_event_loop()

    async def concurrent_calls() -> list:
        return await asyncio.gather(*(pipe.aembed(texts[i:i + 8]) for i in range(0, 40, 8)))
    try:
        pipe.embed(texts[:4], use_tqdm=False)  # (warm: lazy imports, first-call caches)
        loop.run_until_complete(concurrent_calls())
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                pipe.embed(texts, use_tqdm=False)
                list(pipe.embed_stream(iter(texts)))
                loop.run_until_complete(concurrent_calls())
            found = gc.collect()
        finally:
            gc.enable()
    finally:
        loop.close()
    assert found == 0, f"{found} objects in reference cycles after 9 finished calls"


@pytest.mark.slow
def test_a_worker_killed_under_several_calls_is_replaced_and_each_call_resends_its_own(pipe):
    texts = corpus.sentences(200, seed=96)
    expected = pipe.embed(texts, use_tqdm=False)
    got: dict[str, list] = {}
    running = [threading.Event() for _ in range(3)]

    def run(i, part):
        outs = got[f"call {i}"] = []
        for out in pipe.embed_stream(iter(texts[part])):
            outs.append(out)
            running[i].set()  # (the stream reads on: a paused one would hold its share of the window)

    threads = [threading.Thread(target=run, args=(i, slice(i * 50, i * 50 + 120))) for i in range(3)]
    for t in threads:
        t.start()
    for event in running:  # every call has started when the worker dies
        assert event.wait(timeout=300)
    restarts = pipe.stats()["group"]["worker_restarts"]
    os.kill(pipe.pids["workers"][0], signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    for i in range(3):
        _assert_same(got[f"call {i}"], [_reindexed(o, o.index - i * 50) for o in expected[i * 50:i * 50 + 120]],
                     f"call {i}")
    _wait_idle(pipe)
    assert pipe.stats()["group"]["worker_restarts"] == restarts + 1


def test_async_stream_is_lazy_and_bounded(pipe):
    drawn = []

    def source():
        for i in itertools.count():
            drawn.append(i)
            yield f"text number {i}"

    async def take(n):
        outs = []
        async for out in pipe.aembed_stream(source()):
            outs.append(out)
            if len(outs) == n:
                break
        return outs

    outs = asyncio.run(take(30))
    assert [o.index for o in outs] == list(range(30))
    assert len(drawn) <= 30 + MAX_INFLIGHT + 1  # never read ahead of the in-flight bound
    _wait_idle(pipe)


def _reindexed(out, index):
    copy = type(out)(out.request_id, index, out.data, out.num_prompt_tokens, out.num_chunks, out.error)
    return copy


def _ready_pids(pipe) -> set[int]:
    group = pipe._group
    return {w.proc.pid for i, w in enumerate(group.workers) if w is not None and group.worker_up(i)}


def _wait_idle(pipe, timeout_s: float = 30.0) -> None:
    """Calls that ended by an abort return their slots through the receiver thread, at once but
    not synchronously: wait until the group says so."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        group = pipe.stats()["group"]
        if group["inflight"] == 0 and group["calls_running"] == 0 and len(pipe.pids["workers"]) and all(
                pid in _ready_pids(pipe) for pid in pipe.pids["workers"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"the group is not idle: {pipe.stats()['group']}")


def test_an_answer_is_accepted_by_index_even_when_a_stale_one_shares_its_slot():
    """A call keeps what is out in a ring by index; a late duplicate (a request answered and
    handed back long ago, re-sent after its worker died) can land in the same slot as a request
    out now, in the same message. Only the live one counts, once; the stale one is dropped."""
    from pooling_pipeline.frontend.reorder import _live_rows

    mask = 255
    out_index = np.full(mask + 1, -1, np.int64)
    out_index[[75, 76, 80]] = [331, 332, 80]  # 331 and 332 are out; 75 was handed back long ago
    indices = np.array([75, 331, 332, 332, 80, 7])  # a stale one in 331's slot, 332 twice, 7 never sent
    scratch = np.zeros(mask + 1, np.int64)
    rows = _live_rows(out_index, scratch, indices, indices & mask)
    assert indices[rows].tolist() == [331, 332, 80]
    assert _live_rows(out_index, scratch, np.array([331, 332]), np.array([331, 332]) & mask) is None  # all live
    assert _live_rows(out_index, scratch, np.array([332, 331, 332]), np.array([332, 331, 332]) & mask).tolist() == [0, 1]


# ---- calls abandoned with their event loop; calls started from inside another call's input ----


def test_an_async_stream_left_open_when_its_loop_is_closed_is_aborted_when_collected(pipe):
    """asyncio closes a collected async generator only through its event loop: a stream iterated
    partly on a loop that was closed first (without shutdown_asyncgens) used to keep its slots and
    stay 'running' for the Pipeline's life. An `aembed` left pending on a closed loop too."""
    texts = corpus.sentences(60, seed=98)
    expected = pipe.embed(texts, use_tqdm=False)
    loop = asyncio.new_event_loop()
    stream = pipe.aembed_stream(itertools.cycle(texts))

    async def read_a_few(stream):
        return [await anext(stream) for _ in range(3)]

    first = loop.run_until_complete(read_a_few(stream))
    pending = loop.create_task(pipe.aembed(texts * 20))  # started, then left waiting on the loop
    loop.run_until_complete(asyncio.sleep(0.5))
    assert pipe.stats()["group"]["calls_running"] == 2 and pipe.stats()["group"]["inflight"] > MAX_INFLIGHT // 2
    loop.close()
    del stream, read_a_few, pending
    gc.collect()
    _wait_idle(pipe)
    _assert_same(first, expected[:3], "before the loop closed")
    _assert_same(pipe.embed(texts, use_tqdm=False), expected, "after")


def _finishes(pipe, fn, timeout_s: float = 240.0):
    """fn()'s result; a call that deadlocks fails the test (the Pipeline is closed to end it)."""
    got: dict[str, object] = {}

    def run():
        try:
            got["result"] = fn()
        except BaseException as e:  # noqa: BLE001 (re-raised in the test's thread)
            got["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        pipe.close()
        raise AssertionError(f"deadlocked: still waiting after {timeout_s:.0f} s")
    if "error" in got:
        raise got["error"]
    return got["result"]


@pytest.fixture(scope="module")
def own_pipe():
    """A small window (32; 16 requests a message, 8 of reserve): an outer call holds it all after
    two messages. Its own Pipeline, not the module's: a deadlocked call would leave a shared one
    unusable. The three tests of nested calls below share it (each ends with the group idle)."""
    with Pipeline(max_inflight=32, max_num_seqs=16, num_render_workers=1) as p:
        yield p


@pytest.mark.slow
def test_a_call_started_inside_a_streams_input_generator_completes(own_pipe):
    """The outer stream is suspended while its generator runs the inner call on the same thread,
    holding its slots (its results are handed out only when it is read on); the inner call gets
    the ledger's reserve instead of waiting for them forever. Sync and async streams alike."""
    pipe = own_pipe
    texts = corpus.sentences(40, seed=99)
    expected = pipe.embed(texts, use_tqdm=False)
    inner: dict[str, list] = {"sync": [], "async": []}

    def source(kind):
        for i, text in enumerate(texts):
            inner[kind].append(pipe.embed([texts[-1 - i], text], use_tqdm=False))
            yield text

    async def async_stream():
        return [out async for out in pipe.aembed_stream(source("async"))]

    for kind, run in (("sync", lambda: list(pipe.embed_stream(source("sync")))),
                      ("async", lambda: asyncio.run(async_stream()))):
        outs = _finishes(pipe, run)
        _assert_same(outs, expected, f"{kind} outer")
        for i, pair in enumerate(inner[kind]):
            _assert_same(pair, [_reindexed(expected[-1 - i], 0), _reindexed(expected[i], 1)], f"{kind} inner {i}")
        _wait_idle(pipe)


@pytest.mark.slow
def test_a_streams_input_waiting_for_a_call_in_another_thread_completes(own_pipe):
    """The outer stream's generator waits for a call it hands to another thread."""
    from concurrent.futures import ThreadPoolExecutor

    pipe = own_pipe
    texts = corpus.sentences(40, seed=100)
    expected = pipe.embed(texts, use_tqdm=False)
    inner = []
    with ThreadPoolExecutor(1) as helper:
        def source():
            for text in texts:
                inner.append(helper.submit(pipe.embed, [text], use_tqdm=False).result())
                yield text

        outs = _finishes(pipe, lambda: list(pipe.embed_stream(source())))
    _assert_same(outs, expected, "outer")
    _assert_same([pair[0] for pair in inner], [_reindexed(o, 0) for o in expected], "inner")
    _wait_idle(pipe)


@pytest.mark.slow
def test_a_call_nested_two_deep_in_input_generators_on_one_thread_is_refused_at_once(own_pipe):
    """Two suspended calls of the same thread may hold every slot: the third is a clear error, not a hang."""
    from pooling_pipeline import PipelineError

    pipe = own_pipe
    texts = corpus.sentences(40, seed=101)

    def innermost():
        for text in texts:
            pipe.embed([text], use_tqdm=False)
            yield text

    def middle():
        for text in texts:
            next(iter(pipe.embed_stream(innermost())))
            yield text

    with pytest.raises(PipelineError, match="would deadlock"):
        _finishes(pipe, lambda: list(pipe.embed_stream(middle())))
    _wait_idle(pipe)
    assert len(pipe.embed(texts, use_tqdm=False)) == len(texts)
