"""The step cost the scheduler weighs is learned from real steps: a noisy start-up probe is soon
replaced, one outlier step moves nothing, a lasting change is followed, and the probe is short."""

import random

import numpy as np
import pytest
from test_scheduler import Sched, _req

from pooling_pipeline import Pipeline
from pooling_pipeline.core.engine import step_cost
from pooling_pipeline.core.engine.step_cost import REFIT_EVERY, WINDOW, StepCostModel, probe_step_cost
from pooling_pipeline.core.shared.sim_device import SimDevice

A, B = 6e-3, 20e-6  # a quiet machine: 6 ms a step, 20 us per padded token (overhead worth 300 tokens)


def _steps(model: StepCostModel, count: int, a: float, b: float, rng: random.Random) -> None:
    """`count` real steps of assorted sizes on a device that costs a + b * padded (+-2% noise)."""
    for _ in range(count):
        padded = rng.choice([64, 128, 256, 512, 1024, 2048])
        model.observe(padded, (a + b * padded) * rng.uniform(0.98, 1.02))


def _batches(overhead_tokens: float) -> list[list[int]]:
    """The batches the scheduler forms for a fixed mix of lengths with this overhead."""
    sched = Sched(64, 4096, 0.05, overhead_tokens=overhead_tokens)
    rng = random.Random(1)
    for i in range(300):
        sched.add(_req(i, rng.choice([8, 12, 20, 33, 50, 70, 100])))
    return [sched.next_indices() for _ in range(12)]


def test_a_busy_probe_is_replaced_by_the_real_steps():
    """The probe said 361 ms (a loaded machine); the steps say 6 ms: a few steps later the
    estimate is 6 ms and the scheduler forms the batches a 6 ms cost gives."""
    probe_per_token = 80e-6  # a probe at a noisy moment: the tiny batch slow, the slope off
    model = StepCostModel(0.361, probe_per_token, max_overhead_tokens=1 << 16)
    _steps(model, 10, A, B, random.Random(0))
    assert abs(model.overhead_s - A) < 0.1 * A, model.overhead_s
    assert abs(model.per_token_s - B) < 0.05 * B, model.per_token_s
    assert abs(model.overhead_tokens - A / B) < 0.1 * A / B
    assert _batches(model.overhead_tokens) == _batches(A / B)
    assert _batches(A / B) != _batches(0.361 / probe_per_token)  # (the probe's figure shapes other batches)


def test_one_outlier_step_moves_the_estimate_little():
    rng = random.Random(2)
    model = StepCostModel(A, B, max_overhead_tokens=1 << 16)
    _steps(model, 3 * WINDOW, A, B, rng)
    before = model.overhead_s, model.per_token_s
    model.observe(256, 2.0)  # a page fault, a noisy neighbour: a 2 s step
    for _ in range(2 * REFIT_EVERY):  # refits that see the outlier in their window
        _steps(model, 1, A, B, rng)
        assert abs(model.overhead_s - before[0]) < 0.1 * A
        assert abs(model.per_token_s - before[1]) < 0.05 * B


def test_a_lasting_slowdown_is_followed_within_a_bounded_number_of_steps():
    rng = random.Random(3)
    model = StepCostModel(A, B, max_overhead_tokens=1 << 16)
    _steps(model, 2 * WINDOW, A, B, rng)
    _steps(model, WINDOW // 2 + REFIT_EVERY, 5 * A, 2 * B, rng)  # the machine gets slower for good
    assert abs(model.overhead_s - 5 * A) < 0.1 * 5 * A, model.overhead_s
    assert abs(model.per_token_s - 2 * B) < 0.05 * 2 * B, model.per_token_s


def test_steps_of_one_size_keep_the_overhead_in_tokens_and_follow_the_time_scale():
    """Full batches only: a fixed cost cannot be told from a cost per token, so the figure in
    tokens stays; the machine twice as slow shows as a doubled time scale."""
    model = StepCostModel(A, B, max_overhead_tokens=1 << 16)
    for _ in range(WINDOW):
        model.observe(2048, 2 * (A + B * 2048))
    assert abs(model.overhead_tokens - A / B) < 1e-6 * A / B
    assert abs(model.overhead_s - 2 * A) < 1e-9


def test_an_unconfirmed_probe_is_worth_at_most_its_largest_batch():
    model = StepCostModel(0.361, 80e-6, max_overhead_tokens=1 << 16)
    assert model.overhead_tokens == step_cost.PROBE_MAX_TOKENS


class FakeClock:
    """Each synthetic step takes `step_s` of this clock: the probe's timing without wall time."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s, self.calls = 0.0, step_s, []

    def __call__(self) -> float:
        return self.now

    def run(self, rows: int, tokens: int) -> None:
        self.calls.append(rows * tokens)
        self.now += self.step_s


def test_the_start_up_probe_is_short():
    quiet = FakeClock(0.006)  # two shapes: a warm-up and two timed runs each
    probe_step_cost(quiet.run, 2048, 256, clock=quiet)
    assert len(quiet.calls) == 6 and max(quiet.calls) <= step_cost.PROBE_MAX_TOKENS
    busy = FakeClock(0.5)  # a loaded machine, past the budget: a warm-up and one timed run per shape
    probe_step_cost(busy.run, 2048, 256, clock=busy)
    assert len(busy.calls) == 4


@pytest.mark.slow
def test_stats_show_the_cost_learned_from_steps(model_path):
    """End to end on the simulated device: the probe reports 361 ms, the steps take 2 ms + 10 us
    per padded token; stats()["engine"] follows the steps (sent with the engine's heartbeats)."""
    import time

    import corpus

    device = SimDevice(step_s=2e-3, token_s=1e-5, dim=32, probe_step_s=0.361)
    with Pipeline(device="sim", sim_device=device, max_num_seqs=32, num_render_workers=1) as pipe:
        assert pipe.stats()["engine"]["step_overhead_ms"] <= 1000 * step_cost.PROBE_MAX_TOKENS * 1e-5 + 1e-6
        texts = corpus.sentences(200, seed=5) + corpus.medium_texts(20, seed=6)
        pipe.embed(texts, use_tqdm=False)
        deadline = time.monotonic() + 10  # the next heartbeats (one a second) carry the new figure
        while pipe.stats()["engine"]["step_cost_steps"] < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        info = pipe.stats()["engine"]
    assert info["step_cost_steps"] >= 8, info
    assert abs(info["step_overhead_ms"] - 2.0) < 0.3, info
    assert abs(info["step_overhead_tokens"] - 200) < 30, info
    assert np.isfinite(info["step_overhead_tokens"])


def test_the_probe_is_remembered_per_identity_and_only_seeds(tmp_path):
    from pooling_pipeline.core.engine.step_cost import remembered_probe

    calls = []

    def probe():
        calls.append(1)
        return 0.004, 2e-6

    identity = {"model": "/m", "backend": "torch", "threads": 2}
    assert remembered_probe(identity, probe, str(tmp_path)) == (0.004, 2e-6, "measured")
    assert remembered_probe(identity, probe, str(tmp_path)) == (0.004, 2e-6, "remembered")
    assert len(calls) == 1
    assert remembered_probe({**identity, "threads": 1}, probe, str(tmp_path))[2] == "measured"  # another identity
    assert len(calls) == 2
    for stored in tmp_path.joinpath("step_cost").iterdir():  # damaged or nonsensical: probed again
        stored.write_text('{"overhead_s": -1, "per_token_s": "x"}')
    assert remembered_probe(identity, probe, str(tmp_path))[2] == "measured"
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert remembered_probe(identity, probe, str(blocked))[2] == "measured"  # a cache it cannot write: no error


@pytest.mark.parametrize("kind", ["text", "dual encoder", "static"])
def test_each_step_is_counted_once_in_the_busy_fraction_when_launching_ahead(kind, model_path, tmp_path, monkeypatch):
    """With launch-ahead (CUDA's loop, forced here on a CPU) the engine launches the next step before
    it finishes the last; a step timed on the host counts its launch and its finish only, so the
    busy fraction stays within 1 (it read 1.66-1.81 when the next step's launch was counted too) and
    the results are those of the loop without launch-ahead."""
    import corpus
    from model_zoo import build_clip, build_static

    from pooling_pipeline.core.engine.main import LAUNCH_AHEAD_ENV

    rng = np.random.default_rng(3)
    if kind == "dual encoder":
        model = build_clip(tmp_path / "clip")
        inputs = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(96)] + corpus.sentences(96, seed=8)
    else:
        model = model_path if kind == "text" else build_static(tmp_path / "static")
        inputs = corpus.sentences(200, seed=8)
    vectors = {}
    for ahead in ("1", "0"):
        monkeypatch.setenv(LAUNCH_AHEAD_ENV, ahead)
        # One engine thread: two torch threads beside other work on 2 cores wait on each other at every
        # step (this test took 72 s instead of 9 beside two CPU hogs); launch-ahead is the same with one.
        with Pipeline(model=model, backend="torch", num_render_workers=1, max_num_seqs=8, engine_threads=1) as pipe:
            assert pipe.stats()["engine"]["launch_ahead"] is (ahead == "1")
            vectors[ahead] = np.stack([o.embedding for o in pipe.embed(inputs, use_tqdm=False)])
            stats = pipe.stats()
        assert stats["batches"] >= len(inputs) // 8, stats
        assert 0 < stats["engine_busy_fraction"] <= 1, (ahead, stats["engine_busy_fraction"])
    np.testing.assert_allclose(vectors["1"], vectors["0"], rtol=0, atol=1e-6)
