"""Failures as tested paths: killed or stopped processes, failing steps, interrupts, hostile frames."""

import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import corpus
import numpy as np
import psutil
import pytest
import zmq
from helpers import engine_message, wait_gone
from tiny_models import build_tiny_model, faulty_model_dir

import pooling_pipeline.process_group as process_group
from pooling_pipeline import EngineRestartedError, Pipeline, PipelineError, StepError
from pooling_pipeline.core.engine.columns import Requests
from pooling_pipeline.core.engine.main import LAUNCH_AHEAD_ENV, pack_outputs
from pooling_pipeline.core.shared import messages as m
from pooling_pipeline.core.shared.runtime import send_to
from pooling_pipeline.core.shared.serial import Encoder

TOL = 1e-5


@pytest.mark.slow
def test_killed_render_worker_is_replaced_and_nothing_is_lost_or_doubled(st_model):
    texts = corpus.sentences(500, seed=71)
    reference = st_model.encode(texts)
    rng = random.Random(7)

    def killing_at(position: int, victim: int):
        # The kill is sent from the input stream itself, so it always lands while the call
        # runs (a timer could fire after a fast machine had finished the whole stream).
        for i, text in enumerate(texts):
            if i == position:
                os.kill(victim, signal.SIGKILL)
            yield text

    with Pipeline(num_render_workers=2, max_num_seqs=16) as pipe:
        restarts = 0
        for _ in range(3):
            victim = rng.choice(pipe.pids["workers"])
            outs = list(pipe.embed_stream(killing_at(rng.randrange(20, 480), victim)))
            assert [o.index for o in outs] == list(range(len(texts)))  # none lost, none doubled
            np.testing.assert_allclose(np.stack([o.embedding for o in outs]), reference, atol=TOL, rtol=0)
            restarts += pipe.stats()["worker_restarts"]
            # The dead worker is replaced, by the call that saw it die or by the group's monitor.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (
                    victim in pipe.pids["workers"] or not all(psutil.pid_exists(p) for p in pipe.pids["workers"])):
                time.sleep(0.1)
            assert victim not in pipe.pids["workers"]
            assert len(pipe.pids["workers"]) == 2 and all(psutil.pid_exists(p) for p in pipe.pids["workers"])
        assert restarts >= 1  # at least one death was seen and handled inside a running call


@pytest.mark.slow
@pytest.mark.parametrize("launch_ahead", [False, True])
def test_step_failure_raise_names_only_the_culprit_and_return_isolates_it(tmp_path, model_path, st_model,
                                                                          launch_ahead, monkeypatch):
    # launch_ahead: the engine loop of an asynchronous device (CUDA), forced on this CPU.
    monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1" if launch_ahead else "0")
    trigger = st_model.tokenizer.convert_tokens_to_ids("zebra")
    good = corpus.sentences(40, seed=72)
    prompts = good + ["A zebra walks into the engine core."] + good
    reference = st_model.encode(good)
    with Pipeline(model=str(faulty_model_dir(tmp_path, model_path, trigger)), trust_remote_code=True) as pipe:
        assert pipe.stats()["engine"]["launch_ahead"] is launch_ahead
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


@pytest.mark.slow
@pytest.mark.parametrize("launch_ahead", [False, True])
def test_a_sticky_cuda_error_ends_the_engine_as_a_crash_does(tmp_path, model_path, st_model, launch_ahead, monkeypatch):
    """A step whose forward raises what a dead CUDA context raises (a device-side assert: every
    forward after it raises too, as a real context's calls do) ends the engine core with a clear
    message, handled as an engine that died: EngineRestartedError in the call (errors="return" too:
    no request of it is retried on the dead device), the engine core restarted with a fresh context
    and the next call served. (Before: the step was retried request by request on the dead context,
    each request failing in turn, and the engine lived on.)"""
    from pooling_pipeline.core.engine.main import DEVICE_LOST_EXIT

    monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1" if launch_ahead else "0")
    trigger = st_model.tokenizer.convert_tokens_to_ids("zebra")
    assert_error = ("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported "
                    "at some other API call, so the stacktrace below might be incorrect.")
    model = faulty_model_dir(tmp_path, model_path, trigger, message=assert_error, sticky=True)
    good = corpus.sentences(40, seed=72)
    reference = st_model.encode(good)
    with Pipeline(model=str(model), trust_remote_code=True) as pipe:
        np.testing.assert_allclose(np.stack([o.embedding for o in pipe.embed(good, use_tqdm=False)]),
                                   reference, atol=TOL, rtol=0)
        engine, workers = pipe.pids["engine"], pipe.pids["workers"]
        with pytest.raises(EngineRestartedError) as info:
            pipe.embed(good + ["A zebra walks into the engine core."] + good, errors="return", use_tqdm=False)
        message = str(info.value)
        assert f"exited with code {DEVICE_LOST_EXIT}" in message and "restarted" in message, message
        assert "CUDA context is lost" in message and "device-side assert triggered" in message, message
        assert "isolating the culprit" not in message and "step failed for" not in message, message
        assert wait_gone([engine], 10.0) == []
        # The group restarted the engine core (a fresh context): the next call is served.
        np.testing.assert_allclose(np.stack([o.embedding for o in pipe.embed(good, use_tqdm=False)]),
                                   reference, atol=TOL, rtol=0)
        assert pipe.pids["engine"] != engine and pipe.pids["workers"] == workers
        assert pipe.stats()["group"]["engine_restarts"] == 1


def test_sticky_cuda_errors_are_told_from_others():
    """Only the errors that leave a CUDA context unusable end the engine; out of memory, a shape
    error or a step that failed for one request's sake are retried request by request as before."""
    import torch

    from pooling_pipeline.core.engine.device_copies import sticky_device_error

    sticky = [RuntimeError("CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA`"),
              torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
              RuntimeError("CUDA error: unspecified launch failure"),
              RuntimeError("CUDA error: misaligned address")]
    others = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
              RuntimeError("The size of tensor a (4) must match the size of tensor b (5)"),
              ValueError("device-side assert triggered"),  # (not what torch raises: a model's own check)
              RuntimeError("fault token 7 in the batch")]
    assert [sticky_device_error(e) for e in sticky] == ["device-side assert triggered",
                                                         "an illegal memory access was encountered",
                                                         "unspecified launch failure", "misaligned address"]
    assert [sticky_device_error(e) for e in others] == [None] * len(others)


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_hostile_frames_on_every_socket_are_dropped(pipe, st_model):
    group = pipe._group
    rng = random.Random(11)
    enc = Encoder()
    options = m.RenderOptions(task="embed", max_tokens=8, params=m.PoolingParams())
    ghost = [(4, np.array([1, 2], np.int32))]
    valid_wrong_type = [enc.encode(msg) for msg in (
        m.Shutdown(), m.Abort(call="nope"), m.Abort(call="nope", indices=[1, 2]), m.Ready(role="engine", index=0, pid=1),
        m.RenderBatch(call="x-", indices=np.array([0]), options=options, texts=["stray"]),
        m.OutputBatch(calls=["ghost-"], indices=np.array([3]), num_prompt_tokens=np.array([2]), busy_s=0.1,
                      padded_tokens=2, in_core=1, call_of=None, data=None, arrays=[np.ones(384, np.float32)]),
        pack_outputs(Requests.from_message(engine_message("ghost-", ghost)), np.ones((1, 384), np.float32),
                     0.1, 2, 1),
        m.OutputBatch(calls=["ghost-"], indices=np.array([5]), num_prompt_tokens=np.array([2]), busy_s=0.1,
                      padded_tokens=2, in_core=1, call_of=None, data=np.ones((3, 384), np.float32)),
        engine_message("ghost-", [(0, np.array([101, 102], np.int32))]),
        engine_message("bad-", [(0, np.array([10**6], np.int32))]),
        engine_message("twice-", [(0, np.array([101], np.int32))] * 2),
    )]
    valid = enc.encode(m.RenderBatch(call="y-", indices=np.array([1]), options=options, texts=["hi"]))[0]

    def garbage():
        kind = rng.randrange(3)
        if kind == 0:
            return [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 200)))]
        if kind == 1:
            return [valid[: rng.randrange(len(valid))]]
        return list(rng.choice(valid_wrong_type))

    def send_when_there_is_room(sock, routing_id: bytes, frames: list) -> None:
        """As the frontend sends: a child slowed by a loaded machine fills its queue (zmq.Again),
        and the sender waits for room. (The group's own sockets, under the lock the frontend's
        threads share.)"""
        deadline = time.monotonic() + 60
        while True:
            with group.send_lock:
                try:
                    send_to(sock, routing_id, frames)
                    return
                except zmq.Again:
                    pass
            assert time.monotonic() < deadline, "a child took no message for 60 s"
            time.sleep(0.01)

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
                send_when_there_is_room(group.control, group.control_ids[0], frames if i % 2 else [frames[0]])
                send_when_there_is_room(group.work[0], group.worker_ids[0], frames)
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_stopped_engine_is_a_clear_error_within_the_heartbeat_timeout_and_is_restarted():
    pipe = Pipeline(heartbeat_timeout_s=2.0)
    try:
        engine, workers = pipe.pids["engine"], pipe.pids["workers"]
        texts = corpus.sentences(200, seed=76)
        os.kill(engine, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineRestartedError, match="no heartbeat.*it was killed"):
            pipe.embed(texts, use_tqdm=False)
        assert time.monotonic() - start < 2.0 + 5.0
        assert wait_gone([engine], 5.0) == []  # killed, and a new engine core started in its place
        assert len(pipe.embed(texts[:20], use_tqdm=False)) == 20
        assert pipe.pids["workers"] == workers and pipe.stats()["group"]["engine_restarts"] == 1
        new_engine = pipe.pids["engine"]
    finally:
        pipe.close()
    assert wait_gone([new_engine, *workers], 5.0) == []


@pytest.mark.slow
def test_forged_frames_with_the_calls_own_ids_cannot_replace_results(pipe, st_model):
    """Another process of the same user pushes well-formed OutputBatch (to the frontend) and
    EngineInputBatch (to the engine) carrying the running call's real external ids: without the
    group's key every one is dropped, and every result is the model's."""
    texts = corpus.sentences(300, seed=77)
    reference = st_model.encode(texts)
    group = pipe._group
    ctx = zmq.Context.instance()
    to_results, to_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    to_results.connect(group.endpoints["results"])
    to_engine.connect(group.endpoints["engine_in"])
    enc = Encoder()
    try:
        stream = pipe.embed_stream(iter(texts))
        first = next(stream)
        prefix = first.request_id[: -len(str(first.index))]  # learned from a result: the forger knows the ids
        fake = np.full(384, 1 / np.sqrt(384), np.float32)
        for start in range(1, len(texts), 50):
            inputs = [(i, np.array([101, 7592, 102], np.int32)) for i in range(start, min(start + 50, len(texts)))]
            msg = engine_message(prefix, inputs)
            outputs = pack_outputs(Requests.from_message(msg), np.tile(fake, (len(inputs), 1)), 0.0, 3, 1)
            to_results.send_multipart(enc.encode(outputs))
            to_engine.send_multipart(enc.encode(msg))
        outs = [first, *stream]
    finally:
        to_results.close(0)
        to_engine.close(0)
    assert [o.index for o in outs] == list(range(len(texts)))
    np.testing.assert_allclose(np.stack([o.embedding for o in outs]), reference, atol=TOL, rtol=0)


@pytest.mark.slow
def test_stopping_the_whole_job_longer_than_the_heartbeat_timeout_is_not_death(tmp_path, tiny_model):
    """Ctrl-Z (SIGSTOP of the process group), a pause longer than heartbeat_timeout_s, then
    SIGCONT: the job carries on; the silence happened while the frontend itself was stopped."""
    model = tiny_model
    flag = tmp_path / "enough"
    script = tmp_path / "job.py"
    script.write_text(
        "import itertools, json, os, sys\n"
        "from pooling_pipeline import Pipeline\n"
        f"with Pipeline(model={model!r}, heartbeat_timeout_s=2.0) as pipe:\n"
        "    children = pipe.pids\n"
        "    texts = (f'sentence number {i} of a job that is stopped and resumed' for i in itertools.count())\n"
        "    n = 0\n"
        "    for out in pipe.embed_stream(texts):\n"
        "        assert out.index == n\n"
        "        n += 1\n"
        "        if n == 1:\n"
        "            print('running', flush=True)\n"
        f"        if n % 100 == 0 and os.path.exists({str(flag)!r}):\n"
        "            break\n"
        "    same_children = pipe.pids == children\n"
        "    stopped_s = pipe.stats().get('group', {}).get('stopped_s', 0.0)\n"
        "    outs = pipe.embed(['after the pause'] * 20, use_tqdm=False)\n"
        "print(json.dumps({'n': n, 'same_children': same_children, 'stopped_s': stopped_s, 'after': len(outs)}))\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "running"
        os.killpg(proc.pid, signal.SIGSTOP)  # what the shell's Ctrl-Z does to the job
        time.sleep(5.0)  # > heartbeat_timeout_s
        os.killpg(proc.pid, signal.SIGCONT)
        time.sleep(3.0)  # the job goes on after the resume
        flag.write_text("")
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["n"] >= 100 and report["after"] == 20
    assert report["same_children"]  # no child was taken for dead (killed and replaced)
    assert report["stopped_s"] > 1.0  # the pause was seen as time the frontend did not run


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _kill_workers_during_a_stream(pipe, kills: int):
    """Kills a render worker `kills` times (each time the current process of a slot, alternating
    slots, once it is running) while one call streams; returns (outputs seen, error raised)."""
    done = threading.Event()
    killed = []

    def killer():
        slot = 0
        while len(killed) < kills and not done.is_set():
            pid = pipe.pids["workers"][slot]
            if pid not in killed:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
                slot = (slot + 1) % len(pipe.pids["workers"])
            time.sleep(0.05)

    def texts():
        for i in range(10**9):
            if done.is_set():
                return
            yield f"text {i} of a long job whose workers are killed now and then"

    thread = threading.Thread(target=killer)
    seen, error = 0, None
    try:
        for out in pipe.embed_stream(texts()):
            assert out.index == seen
            seen += 1
            if seen == 1:
                thread.start()
            if len(killed) >= kills and pipe.stats()["worker_restarts"] >= kills:
                done.set()
    except PipelineError as e:
        error = e
    finally:
        done.set()
        if thread.ident is not None:
            thread.join()
    return seen, error


@pytest.mark.slow
def test_worker_restarts_are_limited_per_minute_not_per_call(tiny_model, monkeypatch):
    """A long job whose workers get killed now and then (OOM killer) used to fail at the 9th
    restart of one call; within the rate (restarts per minute per worker) it goes on."""
    monkeypatch.setattr(process_group, "RESTART_BACKOFF_S", 0.0, raising=False)
    with Pipeline(model=tiny_model, num_render_workers=2, max_num_seqs=32) as pipe:
        seen, error = _kill_workers_during_a_stream(pipe, kills=10)
        assert error is None
        assert pipe.stats()["worker_restarts"] >= 10 and seen > 0
        outs = pipe.embed(["after the restarts"] * 40, use_tqdm=False)
        assert [o.index for o in outs] == list(range(40))


@pytest.mark.slow
def test_a_worker_that_keeps_dying_is_an_error_naming_it(tiny_model, monkeypatch):
    monkeypatch.setattr(process_group, "RESTART_BACKOFF_S", 0.0, raising=False)
    monkeypatch.setattr(process_group, "MAX_WORKER_RESTARTS_PER_MINUTE", 2, raising=False)
    with Pipeline(model=tiny_model, num_render_workers=1, max_num_seqs=32) as pipe:
        seen, error = _kill_workers_during_a_stream(pipe, kills=3)
        assert error is not None and "render worker 0 keeps dying: 3 restarts within a minute" in str(error)


@pytest.mark.slow
def test_work_goes_to_the_live_worker_while_another_restarts(tiny_model):
    texts = corpus.sentences(2000, seed=78)
    with Pipeline(model=tiny_model, num_render_workers=2, max_num_seqs=32) as pipe:
        reference = np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False)])

        def kill_worker_0() -> None:
            victim = pipe.pids["workers"][0]
            os.kill(victim, signal.SIGKILL)
            assert wait_gone([victim], 5.0) == []

        # A worker killed just now, before the group has noticed: the first send that finds it
        # gone makes the group look at its process, so it refuses at most that one batch.
        kill_worker_0()
        outs = pipe.embed(texts, use_tqdm=False)
        assert pipe.stats()["group"]["retried_sends"] <= 1
        np.testing.assert_allclose(np.stack([o.embedding for o in outs]), reference, atol=TOL, rtol=0)

        # A worker the group knows is lost: nothing goes to it, nor to its replacement before the
        # replacement's work socket is connected (its Ready comes on another socket and can arrive
        # first: see m.Probe); the live worker takes the work.
        sent_to_0 = pipe.stats()["group"]["batches_per_worker"][0]
        wait_until_ready = time.monotonic() + 30.0
        while pipe.stats()["group"]["batches_per_worker"][0] == sent_to_0 and time.monotonic() < wait_until_ready:
            pipe.embed(texts[:64], use_tqdm=False)  # until the first kill's replacement takes work
        kill_worker_0()
        deadline = time.monotonic() + 30.0  # the group's health check finds the loss (every 0.5 s)
        while pipe.stats()["group"]["worker_restarts"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pipe.stats()["group"]["worker_restarts"] == 2
        before = pipe.stats()["group"]
        outs = pipe.embed(texts, use_tqdm=False)  # while worker 0's replacement starts and connects
        after = pipe.stats()["group"]
        assert after["retried_sends"] == before["retried_sends"]
        assert after["batches_per_worker"][1] > before["batches_per_worker"][1]
        np.testing.assert_allclose(np.stack([o.embedding for o in outs]), reference, atol=TOL, rtol=0)


def _counting_faulty_model(tmp_path: Path, model_path: str, trigger: int, marker: int) -> tuple[Path, Path]:
    """A real model that raises on `trigger` and logs how many sequences holding `marker` it ran."""
    target = tmp_path / "counting-model"
    shutil.copytree(model_path, target)
    log = tmp_path / "forward.log"
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(auto_map={"AutoModel": "modeling_counting.CountingBertModel"}, fault_token_id=trigger,
               marker_token_id=marker, count_log=str(log))
    (target / "config.json").write_text(json.dumps(cfg))
    (target / "modeling_counting.py").write_text(
        "from transformers import BertModel\n\n\n"
        "class CountingBertModel(BertModel):\n"
        "    def forward(self, input_ids=None, **kwargs):\n"
        "        if input_ids is not None and bool((input_ids == self.config.fault_token_id).any()):\n"
        "            raise RuntimeError('fault token in the batch')\n"
        "        if input_ids is not None:\n"
        "            rows = int((input_ids == self.config.marker_token_id).any(dim=1).sum())\n"
        "            if rows:\n"
        "                with open(self.config.count_log, 'a') as f:\n"
        "                    f.write(f'{rows}\\n')\n"
        "        return super().forward(input_ids=input_ids, **kwargs)\n"
    )
    return target, log


@pytest.mark.slow
@pytest.mark.parametrize("launch_ahead", [False, True])
def test_a_failed_chunk_aborts_the_documents_other_chunks(tmp_path, model_path, st_model, launch_ahead, monkeypatch):
    """errors="raise": one failing chunk fails its document; the document's other chunks are not
    computed for nothing (they were: the whole failed batch was retried request by request)."""
    monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1" if launch_ahead else "0")
    tok = st_model.tokenizer
    trigger, marker = tok.convert_tokens_to_ids("zebra"), tok.convert_tokens_to_ids("elephant")
    model, log = _counting_faulty_model(tmp_path, model_path, trigger, marker)
    document = "zebra " + "elephant " * (30 * 20 - 1)  # 20 chunks of 30 content tokens, the first with the fault
    good = corpus.sentences(20, seed=79)
    with Pipeline(model=str(model), trust_remote_code=True) as pipe:
        with pytest.raises(StepError, match="fault token") as info:
            pipe.embed([document, *good], long_inputs="chunk", truncate_prompt_tokens=32, use_tqdm=False)
        assert info.value.indices == [0]
        outs = pipe.embed(good, use_tqdm=False)  # the engine has done all the failed call left it
        np.testing.assert_allclose(np.stack([o.embedding for o in outs]), st_model.encode(good), atol=TOL, rtol=0)
        assert _rows(log) == 0  # none of the document's 19 other chunks was computed
        outs = pipe.embed(["elephant " * 10, document], long_inputs="chunk", truncate_prompt_tokens=32,
                          errors="return", use_tqdm=False)
        assert outs[0].error is None and "fault token" in outs[1].error
        assert _rows(log) == 1  # errors="return": the good text only


def _rows(log: Path) -> int:
    return sum(int(line) for line in log.read_text().split()) if log.exists() else 0


@pytest.mark.slow
def test_odd_answers_with_the_groups_key_leave_a_running_call_exact(pipe, st_model):
    """Answers that a group member could send by mistake -- an empty one, one for an index long
    handed back (it shares its ring slot with one still out), one for an index never sent, one
    naming a request twice -- are dropped or counted once; every result is still the model's."""
    texts = corpus.sentences(2000, seed=78)
    reference = st_model.encode(texts)
    group = pipe._group
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(group.endpoints["results"])
    try:
        stream = pipe.embed_stream(iter(texts))
        outs = [next(stream) for _ in range(1200)]
        call = next(iter(pipe._dispatcher.calls.values()))
        capacity = call.ring.mask + 1
        fake = np.full((1, 384), 1 / np.sqrt(384), np.float32)
        odd = [m.OutputBatch(calls=[call.prefix], indices=np.zeros(0, np.int64),
                             num_prompt_tokens=np.zeros(0, np.int64), busy_s=0.0, padded_tokens=0, in_core=0, call_of=None,
                             data=np.zeros((0, 384), np.float32)),
               m.OutputBatch(calls=[call.prefix], indices=np.array([5]), num_prompt_tokens=np.array([3]), busy_s=0.0,
                             padded_tokens=3, in_core=1, call_of=None, data=fake),  # handed back
               m.OutputBatch(calls=[call.prefix], indices=np.array([10**9]), num_prompt_tokens=np.array([3]),
                             busy_s=0.0, padded_tokens=3, in_core=1, call_of=None, data=fake)]  # never sent
        stale = 1200 - capacity if 1200 >= capacity else 0
        odd.append(m.OutputBatch(calls=[call.prefix], indices=np.array([stale, stale]),
                                 num_prompt_tokens=np.array([3, 3]), busy_s=0.0, padded_tokens=6, in_core=1, call_of=None,
                                 data=np.tile(fake, (2, 1))))
        for msg in odd:
            sock.send_multipart(group.encoder.encode(msg))
        outs += list(stream)
    finally:
        sock.close(0)
    assert [o.index for o in outs] == list(range(len(texts)))
    np.testing.assert_allclose(np.stack([o.embedding for o in outs]), reference, atol=TOL, rtol=0)
    assert pipe.stats()["duplicates_dropped"] >= 3
