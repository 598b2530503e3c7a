"""An engine core that dies (SIGKILL, a crash, the exit after a sticky CUDA error) or wedges is
restarted by its group: the calls that had requests in it or on their way to it fail with
EngineRestartedError naming it; every other call, and every call after, is served; what the workers
had queued for the dead process is dropped, never handed to a call; past a limit of restarts, or
when the restarted engine core cannot start, the group fails as before."""

from __future__ import annotations

import os
import signal
import threading
import time

import corpus
import httpx
import numpy as np
import psutil
import pytest
from helpers import running, wait_gone
from serve_helpers import started_server
from tiny_models import build_tiny_model

import pooling_pipeline.frontend.receiver as receiver
import pooling_pipeline.process_group as process_group
from pooling_pipeline import EngineDeadError, EngineRestartedError, Pipeline, PipelineError

pytestmark = pytest.mark.slow

TOL = 1e-5


def _vectors(outs) -> np.ndarray:
    return np.stack([o.embedding for o in outs])


def _wait_until(check, what: str, timeout_s: float = 120.0) -> None:
    """Waits for `check()` (a bound for a hung restart, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.05)


def test_a_killed_engine_core_fails_the_call_it_held_and_the_pipeline_serves_on(st_model):
    texts = corpus.sentences(600, seed=201)
    with Pipeline(num_render_workers=1, max_num_seqs=16) as pipe:
        before = _vectors(pipe.embed(texts[:64], use_tqdm=False))
        np.testing.assert_allclose(before, st_model.encode(texts[:64]), atol=TOL, rtol=0)
        engine, workers = pipe.pids["engine"], pipe.pids["workers"]
        got = 0
        with pytest.raises(EngineRestartedError) as info:
            for got, _ in enumerate(pipe.embed_stream(iter(texts)), 1):
                if got == 1:  # the first result is out: the rest of the window is in the engine or on its way
                    os.kill(engine, signal.SIGKILL)
        message = str(info.value)
        assert isinstance(info.value, EngineDeadError)
        assert "engine core exited with code -9" in message and "restarted" in message, message
        assert "request(s) of this call were lost with it" in message, message
        assert got < len(texts)
        # The same Pipeline serves the next call with the new engine core: the same vectors.
        after = pipe.embed(texts[:64], use_tqdm=False)
        assert [o.index for o in after] == list(range(64))
        np.testing.assert_allclose(_vectors(after), before, atol=1e-6, rtol=0)
        assert pipe.healthy()
        assert pipe.stats()["group"]["engine_restarts"] == 1
        assert pipe.stats()["group"]["worker_restarts"] == 0
        new_engine = pipe.pids["engine"]
        assert new_engine != engine and running(new_engine) and not running(engine)
        assert pipe.pids["workers"] == workers  # the workers were left alone
    assert wait_gone([engine, new_engine, *workers], 10.0) == []


def test_a_call_with_nothing_in_the_engine_when_it_dies_goes_on_through_the_restart():
    """A stream whose every request was handed back when the engine core died is not failed: what it
    sends next (during the restart) is served by the new engine core, in order, none lost or doubled."""
    texts = corpus.sentences(160, seed=202)
    with Pipeline(device="sim", num_render_workers=1, max_num_seqs=16, max_inflight=16) as pipe:
        reference = _vectors(pipe.embed(texts, use_tqdm=False))
        engine = pipe.pids["engine"]
        outs = []
        for out in pipe.embed_stream(iter(texts)):
            outs.append(out)
            # (16 in flight at most: every request handed back and none sent yet, at a batch's end)
            if engine == pipe.pids["engine"] and len(outs) >= 16 and pipe.stats()["group"]["inflight"] == 0:
                os.kill(engine, signal.SIGKILL)
                _wait_until(lambda: pipe.pids["engine"] != engine, "the restart")
        assert pipe.pids["engine"] != engine  # (the kill happened inside the stream)
        assert [o.index for o in outs] == list(range(len(texts)))
        np.testing.assert_array_equal(_vectors(outs), reference)


def test_inputs_queued_for_the_dead_engine_core_are_dropped_not_handed_to_a_call(monkeypatch):
    """A call sent while the engine core is dead but before the group noticed: the workers queue its
    inputs for the dead process, and ZeroMQ delivers them to the new one. The call fails (its
    requests went towards the dead process); what the new engine core gets for it is aborted there or
    its results dropped; a later call gets its own results only, each once."""
    monkeypatch.setattr(receiver, "HEALTH_CHECK_INTERVAL_S", 2.0)  # (the death noticed late: room to send)
    texts = corpus.sentences(64, seed=203)
    with Pipeline(device="sim", num_render_workers=1, max_num_seqs=16) as pipe:
        reference = _vectors(pipe.embed(texts, use_tqdm=False))
        engine = pipe.pids["engine"]
        os.kill(engine, signal.SIGKILL)
        # Gone, its socket closed, and the worker's connection seen closed: what the worker sends now
        # is queued for the engine's address (before, it could be written into the dying socket).
        _wait_until(lambda: not running(engine), "the engine core's exit")
        time.sleep(0.2)
        with pytest.raises(EngineRestartedError, match="engine core exited with code -9"):
            pipe.embed(texts, use_tqdm=False)
        outs = pipe.embed(texts, use_tqdm=False)
        assert [o.index for o in outs] == list(range(len(texts)))
        np.testing.assert_array_equal(_vectors(outs), reference)

        def stale_dropped() -> float:
            aborted = pipe.stats()["engine"].get("aborted_requests", 0.0)  # (the new engine core's heartbeat)
            return pipe.stats()["group"]["stray_outputs_dropped"] + aborted

        # Each of the failed call's inputs reached the new engine core: aborted there (the abort held for
        # it until it connected) or computed and its result dropped in the frontend.
        _wait_until(lambda: stale_dropped() == len(texts), "the stale inputs to be dropped", 30.0)
        assert pipe.stats()["group"]["engine_restarts"] == 1


def test_an_engine_core_that_keeps_dying_fails_the_group(monkeypatch):
    monkeypatch.setattr(process_group, "MAX_ENGINE_RESTARTS_PER_MINUTE", 1)
    texts = corpus.sentences(32, seed=204)
    with Pipeline(device="sim", num_render_workers=1) as pipe:
        first = pipe.pids["engine"]
        os.kill(first, signal.SIGKILL)
        _wait_until(lambda: pipe.stats()["group"]["engine_restarts"] == 1, "the death to be seen")
        assert len(pipe.embed(texts, use_tqdm=False)) == len(texts)  # served by the restarted engine core
        second = pipe.pids["engine"]
        workers = pipe.pids["workers"]
        os.kill(second, signal.SIGKILL)
        _wait_until(lambda: not pipe.healthy(), "the group to fail")
        with pytest.raises(EngineDeadError, match="engine core keeps dying: 2 restarts within a minute") as info:
            pipe.embed(texts, use_tqdm=False)
        assert not isinstance(info.value, EngineRestartedError)
        with pytest.raises(PipelineError, match="closed"):  # the group was stopped, as before restarts
            pipe.embed(texts, use_tqdm=False)
    assert wait_gone([first, second, *workers], 10.0) == []


def test_a_restarted_engine_core_that_cannot_start_fails_the_group_not_a_restart_loop(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    with Pipeline(model=model, num_render_workers=1, backend="torch") as pipe:
        texts = corpus.sentences(16, seed=205)
        assert len(pipe.embed(texts, use_tqdm=False)) == len(texts)
        workers = pipe.pids["workers"]
        for weights in tmp_path.glob("tiny/*.safetensors"):  # the next start cannot load the model
            weights.unlink()
        os.kill(pipe.pids["engine"], signal.SIGKILL)
        _wait_until(lambda: not pipe.healthy(), "the group to fail")
        with pytest.raises(EngineDeadError, match="after a restart|did not start again") as info:
            pipe.embed(texts, use_tqdm=False)
        assert not isinstance(info.value, EngineRestartedError)
        assert "safetensors" in str(info.value) or "weights" in str(info.value), str(info.value)  # its reason
    assert wait_gone(workers, 10.0) == []


def _engine_of(server) -> int:
    engines = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)
               if "pooling_pipeline.core.engine.main" in " ".join(p.cmdline())]
    assert len(engines) == 1, engines
    return engines[0]


def _gauge(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_serve_answers_503_for_the_request_a_killed_engine_held_and_200_after():
    # A simulated device with slow steps: 64 inputs in batches of 4 take 16 steps of 0.2 s.
    body = {"input": corpus.sentences(64, seed=206)}
    with started_server("--device", "sim", "--sim-device", "0.2,0", "--max-num-seqs", "4",
                        "--num-render-workers", "1") as server, httpx.Client(base_url=server.url, timeout=120) as client:
        assert client.post("/v1/embeddings", json=body).status_code == 200
        engine = _engine_of(server)
        with httpx.Client(base_url=server.url, timeout=120) as other:
            answer = {}
            sent = threading.Thread(target=lambda: answer.update(r=other.post("/v1/embeddings", json=body)))
            sent.start()
            _wait_until(lambda: _gauge(client, "pipeline_group_inflight") > 0, "the request to be in flight", 30.0)
            os.kill(engine, signal.SIGKILL)
            sent.join(60)
        lost = answer["r"]
        assert lost.status_code == 503, lost.text
        assert "engine core exited with code -9" in lost.text and "restarted" in lost.text, lost.text
        again = client.post("/v1/embeddings", json=body)  # (waits for the new engine core)
        assert again.status_code == 200, again.text
        assert len(again.json()["data"]) == len(body["input"])
        assert client.get("/health").status_code == 200
        assert _gauge(client, "pipeline_engine_restarts_total") == 1
        new_engine = _engine_of(server)
        assert new_engine != engine
