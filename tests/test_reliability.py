"""Failures as tested paths: killed or stopped processes, failing steps, interrupts, hostile frames."""

import gc
import os
import random
import signal
import threading
import time

import corpus
import numpy as np
import psutil
import pytest
import zmq
from helpers import wait_gone
from tiny_models import faulty_model_dir

from pooling_pipeline import EngineDeadError, Pipeline, StepError
from pooling_pipeline.core import messages as m
from pooling_pipeline.core.serial import Encoder

TOL = 1e-5


def test_killed_render_worker_is_replaced_and_nothing_is_lost_or_doubled(st_model):
    texts = corpus.sentences(500, seed=71)
    reference = st_model.encode(texts)
    rng = random.Random(7)
    with Pipeline(num_render_workers=2, max_num_seqs=16) as pipe:
        restarts = 0
        for _ in range(3):
            victim = rng.choice(pipe.pids["workers"])
            killer = threading.Timer(rng.uniform(0.1, 1.0), os.kill, (victim, signal.SIGKILL))
            killer.start()
            outs = list(pipe.embed_stream(iter(texts)))
            killer.join()
            assert [o.index for o in outs] == list(range(len(texts)))  # none lost, none doubled
            np.testing.assert_allclose(np.stack([o.embedding for o in outs]), reference, atol=TOL, rtol=0)
            restarts += pipe.stats()["worker_restarts"]
            assert victim not in pipe.pids["workers"] or restarts == 0
            deadline = time.monotonic() + 10
            while any(not psutil.pid_exists(p) for p in pipe.pids["workers"]) and time.monotonic() < deadline:
                time.sleep(0.1)
        assert restarts >= 1  # at least one kill landed during a run and was handled there
        assert len(pipe.pids["workers"]) == 2


def test_step_failure_raise_names_only_the_culprit_and_return_isolates_it(tmp_path, model_path, st_model):
    trigger = st_model.tokenizer.convert_tokens_to_ids("zebra")
    good = corpus.sentences(40, seed=72)
    prompts = good + ["A zebra walks into the engine core."] + good
    reference = st_model.encode(good)
    with Pipeline(model=str(faulty_model_dir(tmp_path, model_path, trigger)), trust_remote_code=True) as pipe:
        with pytest.raises(StepError, match="fault token") as info:
            pipe.embed(prompts, use_tqdm=False)
        assert info.value.indices == [40]
        outs = pipe.embed(prompts, errors="return", use_tqdm=False)
        assert outs[40].error is not None and "request 40" in outs[40].error and "fault token" in outs[40].error
        assert outs[40].embedding is None
        got = np.stack([o.embedding for i, o in enumerate(outs) if i != 40])
        np.testing.assert_allclose(got, np.concatenate([reference, reference]), atol=TOL, rtol=0)
        assert all(o.error is None for i, o in enumerate(outs) if i != 40)
        assert pipe.stats()["errors"] == 1


def test_bad_inputs_with_errors_return_fail_alone(pipe, st_model):
    prompts = ["good one", None, [101, -3, 102], "", "   ", "bad \udcff", [], {"x": 1}, "good two", 7]
    outs = pipe.embed(prompts, errors="return", use_tqdm=False)
    bad = {1, 2, 5, 6, 7, 9}
    assert [o.index for o in outs] == list(range(len(prompts)))
    for i, out in enumerate(outs):
        if i in bad:
            assert out.error.startswith(f"request {i}: ") and out.embedding is None
        else:
            assert out.error is None
            np.testing.assert_allclose(out.embedding, st_model.encode(prompts[i]), atol=TOL, rtol=0)


def test_keyboard_interrupt_aborts_the_call_and_the_group_stays_usable(pipe, st_model):
    texts = corpus.sentences(300, seed=73) * 20
    # Collect garbage first: CPython loses a KeyboardInterrupt raised while a __del__ runs, and
    # earlier tests (Ray's, in this process) leave objects with finalizers behind.
    gc.collect()
    # Python's own Ctrl-C handler, whatever this process inherited (a shell's background job
    # starts with SIGINT ignored, and then no KeyboardInterrupt would ever come).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Timer(0.8, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            pipe.embed(texts, use_tqdm=False)
        timer.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    outs = pipe.embed(texts[:30], use_tqdm=False)
    np.testing.assert_allclose(np.stack([o.embedding for o in outs]), st_model.encode(texts[:30]), atol=TOL, rtol=0)
    assert pipe.stats()["requests"] == 30 and pipe.stats()["duplicates_dropped"] >= 0


def test_hostile_frames_on_every_socket_are_dropped(pipe, st_model):
    group = pipe._group
    rng = random.Random(11)
    enc = Encoder()
    valid_wrong_type = [enc.encode(msg) for msg in (
        m.Shutdown(), m.Abort(["nope"]), m.Ready("engine", 0, 1),
        m.RenderBatch([m.RenderParams("x", 0, "embed", 8, m.PoolingParams(), prompt="stray")]),
        m.OutputBatch([m.PoolingOutput("ghost", 3, 2, data=np.ones(384, np.float32))], 0.1, 2, 1),
        m.OutputBatch.pack([m.PoolingOutput("ghost", 4, 2, data=np.ones(384, np.float32))], 0.1, 2, 1),
        m.OutputBatch([m.PoolingOutput("ghost", 5, 2)], 0.1, 2, 1, np.ones((3, 384), np.float32)),
        m.EngineInputBatch.pack(0, [m.PoolingEngineInput("ghost", 0, "embed", np.array([101, 102], np.int32),
                                                    m.PoolingParams())]),
        m.EngineInputBatch.pack(0, [m.PoolingEngineInput("bad", 0, "embed", np.array([10**6], np.int32),
                                                    m.PoolingParams())]),
    )]
    valid = enc.encode(m.RenderBatch([m.RenderParams("y", 1, "embed", 16, m.PoolingParams(), prompt="hi")]))[0]

    def garbage():
        kind = rng.randrange(3)
        if kind == 0:
            return [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 200)))]
        if kind == 1:
            return [valid[: rng.randrange(len(valid))]]
        return list(rng.choice(valid_wrong_type))

    ctx = zmq.Context.instance()
    to_results = ctx.socket(zmq.PUSH)
    to_results.connect(group.endpoints["results"])
    to_engine = ctx.socket(zmq.PUSH)
    to_engine.connect(group.endpoints["engine_in"])
    try:
        for i in range(2000):
            frames = garbage()
            if frames == list(valid_wrong_type[0]) and i % 4 in (2, 3):
                continue  # a genuine Shutdown is legitimate on the control and work sockets
            to_results.send_multipart(frames)
            to_engine.send_multipart(frames)
            if not (len(frames) == 1 and frames[0] == valid_wrong_type[0][0]):
                group.control.send_multipart(frames if i % 2 else [frames[0]])
                group.work[0].send_multipart(frames)
        time.sleep(1.5)
    finally:
        to_results.close(0)
        to_engine.close(0)
    for child in group.children:
        if child.role == "engine" or child is group.workers[child.index]:
            assert child.alive(), f"{child.name} died: {child.log_tail()[-2000:]}"
    texts = corpus.sentences(40, seed=74)
    outs = pipe.embed(texts, use_tqdm=False)
    np.testing.assert_allclose(np.stack([o.embedding for o in outs]), st_model.encode(texts), atol=TOL, rtol=0)


def test_no_tcp_port_and_a_private_socket_dir(pipe):
    for pid in [os.getpid(), pipe.pids["engine"], *pipe.pids["workers"]]:
        assert psutil.Process(pid).net_connections(kind="inet") == []
    assert oct(os.stat(pipe._group.dir).st_mode & 0o777) == "0o700"
    assert all(e.startswith(f"ipc://{pipe._group.dir}/") for e in pipe._group.endpoints.values())


def test_stopped_worker_is_detected_killed_and_replaced(st_model):
    texts = corpus.sentences(400, seed=75)
    with Pipeline(num_render_workers=2, max_num_seqs=8, heartbeat_timeout_s=2.0) as pipe:
        victim = pipe.pids["workers"][0]
        stopper = threading.Timer(0.3, os.kill, (victim, signal.SIGSTOP))
        stopper.start()
        outs = pipe.embed(texts * 3, use_tqdm=False)
        stopper.join()
        np.testing.assert_allclose(np.stack([o.embedding for o in outs[:400]]), st_model.encode(texts),
                                   atol=TOL, rtol=0)
        assert [o.index for o in outs] == list(range(1200))
        assert victim not in pipe.pids["workers"]
    assert wait_gone([victim], 5.0) == []


def test_stopped_engine_is_a_clear_error_within_the_heartbeat_timeout():
    pipe = Pipeline(heartbeat_timeout_s=2.0)
    try:
        engine, workers = pipe.pids["engine"], pipe.pids["workers"]
        texts = corpus.sentences(200, seed=76)
        os.kill(engine, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="no heartbeat"):
            pipe.embed(texts, use_tqdm=False)
        assert time.monotonic() - start < 2.0 + 5.0
        assert wait_gone([engine, *workers], 5.0) == []
    finally:
        pipe.close()
