"""Data-parallel engine cores on one machine: `Pipeline(data_parallel_size=N)` starts N engine
core processes fed by the same render workers; results, order, failures and stats as with one."""

import itertools
import os
import re
import signal
import time

import corpus
import numpy as np
import psutil
import pytest
from helpers import running, stream_until_killed, wait_gone

from pooling_pipeline import EngineRestartedError, Pipeline
from pooling_pipeline.core.shared import messages as m
from pooling_pipeline.core.shared.runtime import send_to
from pooling_pipeline.cpu_plan import engine_devices, plan_cpu

TOL = 1e-5


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """300 real texts of very different lengths (a few words to a few hundred tokens), mixed."""
    pool = corpus.sentences(220, seed=91) + corpus.medium_texts(70, seed=92) + ["", "a", "word " * 400] * 3
    order = np.random.default_rng(93).permutation(len(pool))
    return [pool[i] for i in order[:300]]


@pytest.fixture(scope="module")
def dp_pipe():
    with Pipeline(data_parallel_size=2) as p:
        yield p


def _group_pids(pipe) -> list[int]:
    pids = pipe.pids
    return [*pids["engines"], *pids["workers"]]


def _vectors(outs) -> np.ndarray:
    return np.stack([o.embedding for o in outs])


@pytest.mark.slow
def test_two_cpu_engines_give_the_results_of_one_in_order_and_share_the_work(dp_pipe, pipe, texts):
    reference = _vectors(pipe.embed(texts, use_tqdm=False))  # one engine core (the session's Pipeline)
    pids = dp_pipe.pids
    assert len(pids["engines"]) == 2 and pids["engine"] == pids["engines"][0] and len(set(pids["engines"])) == 2

    outs = dp_pipe.embed(texts, use_tqdm=False)
    assert [o.index for o in outs] == list(range(len(texts)))
    np.testing.assert_allclose(_vectors(outs), reference, atol=TOL, rtol=0)
    stats = dp_pipe.stats()
    assert stats["requests"] == len(texts) and stats["data_parallel_size"] == 2
    per_engine = stats["per_engine"]
    assert len(per_engine) == 2 and sum(e["requests"] for e in per_engine) == len(texts)
    assert all(e["requests"] > 0 and e["batches"] > 0 and e["busy_s"] > 0 for e in per_engine), per_engine
    # The busy fraction is the mean over the engine cores.
    assert stats["engine_busy_fraction"] == pytest.approx(stats["engine_busy_s"] / (2 * stats["wall_s"]))
    assert 0 < stats["engine_busy_fraction"] <= 1

    streamed = list(dp_pipe.embed_stream(iter(texts)))
    assert [o.index for o in streamed] == list(range(len(texts)))
    np.testing.assert_allclose(_vectors(streamed), reference, atol=TOL, rtol=0)
    assert all(e["requests"] > 0 for e in dp_pipe.stats()["per_engine"])

    group = dp_pipe.stats()["group"]
    assert group["data_parallel_size"] == 2 and all(n > 0 for n in group["requests_per_engine"])
    # The CPU plan's engine threads are split between the engine cores, and each one says so.
    plan = dp_pipe.stats()["cpu_plan"]
    assert plan["data_parallel_size"] == 2 and plan["engine_threads"] >= 1
    cores = dp_pipe.stats()["engine_cores"]
    assert [c["device"] for c in cores] == ["cpu", "cpu"]
    assert all(c["torch_threads"] == plan["engine_threads"] for c in cores)


@pytest.mark.slow
def test_an_abandoned_stream_is_aborted_in_both_engines_and_the_group_goes_on(dp_pipe, pipe, texts):
    stream = dp_pipe.embed_stream(itertools.cycle(texts))
    first = [next(stream) for _ in range(5)]
    stream.close()  # aborted by external id in the engine cores that hold its requests
    assert [o.index for o in first] == list(range(5))
    outs = dp_pipe.embed(texts[:80], use_tqdm=False)
    np.testing.assert_allclose(_vectors(outs), _vectors(pipe.embed(texts[:80], use_tqdm=False)), atol=TOL, rtol=0)
    deadline = time.monotonic() + 5
    while dp_pipe.stats()["group"]["inflight_per_engine"] != [0, 0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dp_pipe.stats()["group"]["inflight_per_engine"] == [0, 0]  # every engine core's count settled


@pytest.mark.slow
def test_simulated_devices_give_exactly_the_vectors_of_one(texts):
    with Pipeline(device="sim") as one:
        reference = _vectors(one.embed(texts, use_tqdm=False))
    with Pipeline(device="sim", data_parallel_size=2) as two:
        assert [c["device"] for c in two.stats()["engine_cores"]] == ["sim", "sim"]  # one simulated device each
        outs = two.embed(texts, use_tqdm=False)
        assert [o.index for o in outs] == list(range(len(texts)))
        np.testing.assert_array_equal(_vectors(outs), reference)  # deterministic: exactly equal
        assert all(e["requests"] > 0 for e in two.stats()["per_engine"])
        streamed = list(two.embed_stream(iter(texts)))
        np.testing.assert_array_equal(_vectors(streamed), reference)

        # A RenderBatch naming no engine core of the group is malformed: the worker drops and logs it.
        group = two._group
        with group.send_lock:
            send_to(group.work[0], group.worker_ids[0], group.encoder.encode(m.RenderBatch(
                call="stray-", indices=np.array([0]),
                options=m.RenderOptions(task="embed", max_tokens=16, params=m.PoolingParams()), texts=["lost"],
                engine=7)))
        outs = two.embed(texts[:20], use_tqdm=False)  # (sent after it on the same socket: handled after it)
        np.testing.assert_array_equal(_vectors(outs), reference[:20])
        assert "RenderBatch.engine=7 is outside [0, 2)" in group.workers[0].log_tail()
        assert all(child.alive() for child in group.children)


@pytest.mark.slow
def test_killing_one_of_two_engine_cores_fails_the_call_naming_it_and_restarts_only_it(texts):
    pipe = Pipeline(device="sim", data_parallel_size=2, sim_device=(0.002, 0.0))
    try:
        survivor, victim = pipe.pids["engines"]
        workers = pipe.pids["workers"]
        took = stream_until_killed(pipe, victim, texts, EngineRestartedError, r"engine core 1 exited with code -9")
        assert took < 1.0 + 10.0
        outs = pipe.embed(texts, use_tqdm=False)  # (the survivor serves what comes while engine core 1 restarts)
        assert [o.index for o in outs] == list(range(len(texts)))
        deadline = time.monotonic() + 60
        while pipe._group.restarting_engines() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pipe._group.restarting_engines()
        outs = pipe.embed(texts, use_tqdm=False)  # both engine cores serve it: the other one and the new one
        assert [o.index for o in outs] == list(range(len(texts)))
        assert all(e["requests"] > 0 for e in pipe.stats()["per_engine"])
        engines = pipe.pids["engines"]
        assert engines[0] == survivor and engines[1] != victim and not running(victim)
        assert pipe.pids["workers"] == workers and pipe.stats()["group"]["engine_restarts"] == 1
        group_pids = _group_pids(pipe)
    finally:
        pipe.close()
    assert wait_gone(group_pids, 10.0) == []
    left = [p.pid for p in psutil.Process().children(recursive=True) if p.pid in group_pids and running(p.pid)]
    assert left == []


@pytest.mark.slow
def test_a_stopped_engine_core_among_two_is_named_after_the_heartbeat_timeout_and_restarted(texts):
    pipe = Pipeline(device="sim", data_parallel_size=2, heartbeat_timeout_s=2.0)
    try:
        survivor, victim = pipe.pids["engines"]
        os.kill(victim, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineRestartedError, match=r"engine core 1 sent no heartbeat"):
            pipe.embed(texts, use_tqdm=False)
        assert time.monotonic() - start < 2.0 + 8.0
        assert wait_gone([victim], 10.0) == []  # killed
        assert len(pipe.embed(texts, use_tqdm=False)) == len(texts)
        assert pipe.pids["engines"][0] == survivor
        group_pids = _group_pids(pipe)
    finally:
        pipe.close()
    assert wait_gone(group_pids, 10.0) == []


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError),
                                          ("2", TypeError), (None, TypeError)])
def test_bad_data_parallel_sizes_are_clear_errors_before_anything_starts(value, error):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(error, match=re.escape(f"data_parallel_size must be an int in [1, 64], got {value!r}")):
        Pipeline(data_parallel_size=value)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_engine_cores_get_a_gpu_each_and_too_few_gpus_is_a_clear_error(monkeypatch):
    import torch

    import pooling_pipeline.cpu_plan as cpu_plan

    assert engine_devices("auto", 1) == ["auto"] and engine_devices("cuda:1", 1) == ["cuda:1"]  # one: as given
    assert engine_devices("cpu", 3) == ["cpu"] * 3 and engine_devices("sim", 2) == ["sim"] * 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cpu_plan, "cuda_expected", lambda device: True)
    assert engine_devices("cuda", 2) == ["cuda:0", "cuda:1"]
    assert engine_devices("auto", 2) == ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match=r"data_parallel_size=3 needs one GPU per engine core .* 2 CUDA device"):
        engine_devices("cuda", 3)
    with pytest.raises(ValueError, match=r"cuda:1 \.\. cuda:2"):
        engine_devices("cuda:1", 2)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="needs one GPU per engine core"):
        Pipeline(device="cuda", data_parallel_size=4)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_devices("auto", 2) == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="CUDA is not available"):
        engine_devices("cuda", 2)


def test_the_cpu_plan_splits_engine_threads_between_engine_cores():
    one = plan_cpu(None, "cpu", cores=8)
    assert plan_cpu(None, "cpu", cores=8, data_parallel_size=3).engine_threads == one.engine_threads // 3
    assert plan_cpu(None, "cpu", cores=2, data_parallel_size=4).engine_threads == 1  # at least one each
    assert plan_cpu(None, "cpu", cores=8, engine_threads=3, data_parallel_size=2).engine_threads == 3  # fixed: each
    gpu = plan_cpu(None, "cuda:0", cores=16, data_parallel_size=2)
    assert gpu.engine_threads == plan_cpu(None, "cuda:0", cores=16).engine_threads and gpu.data_parallel_size == 2


def test_new_work_goes_to_the_engine_cores_not_being_restarted():
    from pooling_pipeline.frontend.ledger import Ledger

    ledger = Ledger(max_inflight=1024, num_workers=1, num_engines=3)
    ledger.engine_load[:] = [500, 0, 100]
    assert ledger.route(None, [0], 8, frozenset({1})) == (0, 2)  # engine core 1 (idle) is restarting
    assert ledger.route(None, [0], 8) == (0, 1)
    assert ledger.route(None, [0], 8, frozenset({0, 1, 2})) == (0, 1)  # all restarting: the least loaded waits for it
