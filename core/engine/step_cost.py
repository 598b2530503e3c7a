"""What one engine step costs -- a fixed part `a` plus `b` per padded token -- learned from the
steps the engine runs.

The scheduler weighs padding against a step's fixed cost, in padded tokens (`overhead_tokens` =
a / b). That figure used to come from a start-up probe of two synthetic batches, kept for the
engine's whole life: on a loaded machine the probe once measured a 361 ms fixed cost where a quiet
one gives ~6 ms, and every later batch was shaped by it (batches filled up with padding: 0.45x
sentence-transformers' speed). Now the probe is short and only seeds the estimate; each finished
step is an observation (padded tokens, seconds), and the estimate is a robust fit over the last
`WINDOW` of them, so one noisy moment moves nothing and a lasting change is followed within about
WINDOW / 2 + REFIT_EVERY steps.

The fit (`StepCostModel._refit`) is Theil-Sen: the slope `b` is the median of the slopes between
pairs of steps of clearly different sizes, and `a` the median of each step's own fixed-cost
estimate (seconds - b * padded). Medians ignore a few outliers (a page fault, a noisy neighbour)
where a least-squares line would tilt. When the window's steps are all about one size (full
batches), the data cannot tell a fixed cost from a cost per token: the step time's scale is
followed (a and b together), `overhead_tokens` is left as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable

import numpy as np

# Steps remembered for the fit: bounded memory; a refit over them costs O(WINDOW^2), a few tens of us.
WINDOW = 32
# Refit after every step until the window is full (so the seed is replaced quickly), then every
# REFIT_EVERY steps that took REFIT_MIN_S of step time together (a refit costs ~120 us: ~8 us a step
# every 16 steps, 2-3% of a fast device's engine CPU; at most one per 50 ms of steps on a fast device,
# the same every 16 steps on a CPU, where a step takes milliseconds).
REFIT_EVERY = 16
REFIT_MIN_S = 0.05
# Fewer steps than this in the window: only the time scale is followed (a fit of a line through
# two or three points would follow their noise).
MIN_STEPS_FOR_SLOPE = 8
# Two steps count for the slope when one is at least this much bigger; the window's sizes must
# spread that much between its lower and upper quartile for the slope to be fitted at all.
MIN_SIZE_RATIO = 1.25
# The seed is a probe's extrapolation: until real steps of several sizes confirm it, the fixed
# cost counts as at most the probe's largest batch (in tokens).
PROBE_MAX_TOKENS = 512
# The start-up probe: each shape runs once to warm up (kernels are built for it), then is timed
# while the probe's total time stays under this budget -- at most PROBE_TIMED_RUNS times, and at
# least once.
PROBE_BUDGET_S = 1.0
PROBE_TIMED_RUNS = 2
MIN_PER_TOKEN_S = 1e-12  # a slope that is not positive: the steps cost the same at any size


class StepCostModel:
    """A running estimate of one step's fixed cost `overhead_s` and cost per padded token
    `per_token_s`, seeded by the start-up probe and refitted from observed steps."""

    def __init__(self, overhead_s: float, per_token_s: float, max_overhead_tokens: float,
                 seed_max_tokens: float = PROBE_MAX_TOKENS) -> None:
        self.max_overhead_tokens = max_overhead_tokens
        self.per_token_s = max(per_token_s, MIN_PER_TOKEN_S)
        # An unconfirmed seed: worth at most `seed_max_tokens` (a probe cannot see past its batches).
        self.overhead_s = min(max(overhead_s, 0.0), self.per_token_s * seed_max_tokens)
        self.steps = 0  # observed, in all
        self._since_refit_s = 0.0  # step time observed since the last refit
        self._padded = np.zeros(WINDOW)
        self._seconds = np.zeros(WINDOW)

    @property
    def overhead_tokens(self) -> float:
        """What a step's fixed cost is worth in padded tokens (what the scheduler weighs)."""
        return min(self.overhead_s / self.per_token_s, self.max_overhead_tokens)

    def observe(self, padded_tokens: int, seconds: float) -> bool:
        """Adds a finished step; returns whether the estimate was refitted."""
        if padded_tokens <= 0 or not 0.0 < seconds < 1e6:
            return False  # nothing to learn from (an empty step, a clock gone wrong)
        slot = self.steps % WINDOW
        self._padded[slot], self._seconds[slot] = padded_tokens, seconds
        self.steps += 1
        self._since_refit_s += seconds
        if self.steps <= WINDOW or (self.steps % REFIT_EVERY == 0 and self._since_refit_s >= REFIT_MIN_S):
            self._refit()
            self._since_refit_s = 0.0
            return True
        return False

    def _refit(self) -> None:
        n = min(self.steps, WINDOW)
        x, s = self._padded[:n], self._seconds[:n]
        if n >= MIN_STEPS_FOR_SLOPE and _spread(x):
            slope = _pairwise_median_slope(x, s)
            if slope is not None:
                b = max(slope, MIN_PER_TOKEN_S)
                self.per_token_s, self.overhead_s = b, max(float(np.median(s - b * x)), 0.0)
                return
        # Sizes too alike (or too few steps): only the time scale is known. Scaling a and b
        # together keeps overhead_tokens, which these steps say nothing about.
        scale = float(np.median(s / (self.overhead_s + self.per_token_s * x)))
        self.overhead_s *= scale
        self.per_token_s = max(self.per_token_s * scale, MIN_PER_TOKEN_S)

    def info(self) -> dict[str, float]:
        """The current figures, as the engine reports them (stats()["engine"])."""
        return {"step_overhead_ms": round(1000 * self.overhead_s, 3),
                "step_overhead_tokens": round(self.overhead_tokens, 1),
                "step_cost_steps": self.steps}


def _spread(x: np.ndarray) -> bool:
    """Whether the steps' sizes differ enough (quartile to quartile) for a slope to be fitted."""
    low, high = np.percentile(x, [25, 75])
    return high >= MIN_SIZE_RATIO * low


def _pairwise_median_slope(x: np.ndarray, s: np.ndarray) -> float | None:
    """The median slope between pairs of steps whose sizes differ by MIN_SIZE_RATIO (None: no pair)."""
    i, j = np.triu_indices(len(x), 1)
    low, high = np.minimum(x[i], x[j]), np.maximum(x[i], x[j])
    apart = high >= MIN_SIZE_RATIO * low
    if not apart.any():
        return None
    i, j = i[apart], j[apart]
    return float(np.median((s[j] - s[i]) / (x[j] - x[i])))


def probe_step_cost(run: Callable[[int, int], object], max_tokens: int, max_model_len: int,
                    clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """The start-up probe: (overhead_s, per_token_s) from a tiny batch and one of up to
    PROBE_MAX_TOKENS tokens, `run(num_rows, num_tokens)` running a synthetic batch.

    Each shape is run once to warm up, then timed (best of at most PROBE_TIMED_RUNS) while the
    probe has spent less than PROBE_BUDGET_S -- on a loaded machine a probe of six runs took
    seconds. Its figures only seed `StepCostModel`; the real steps replace them."""
    length = max(1, min(128, max_model_len))
    rows = max(1, min(max_tokens, PROBE_MAX_TOKENS) // length)
    started = clock()

    def timed(num_rows: int, num_tokens: int) -> float:
        run(num_rows, num_tokens)  # warm-up
        best = float("inf")
        for attempt in range(PROBE_TIMED_RUNS):
            if attempt and clock() - started >= PROBE_BUDGET_S:
                break
            start = clock()
            run(num_rows, num_tokens)
            best = min(best, clock() - start)
        return best

    small_tokens, large_tokens = min(8, length), rows * length
    small, large = timed(1, small_tokens), timed(rows, length)
    per_token = max((large - small) / max(large_tokens - small_tokens, 1), MIN_PER_TOKEN_S)
    return max(small - per_token * small_tokens, 0.0), per_token


def remembered_probe(identity: dict, probe: Callable[[], tuple[float, float]], root: str) -> tuple[float, float, str]:
    """The start-up probe's seed, measured once per engine identity (model files, backend,
    precision, device, threads, library versions) and remembered under `root`: a later start with
    the same identity skips the probe (its runs took 0.3-1.5 s of a start on this 2-core machine).
    A seed only seeds -- the real steps replace it within a few dozen steps --, so a remembered one
    that no longer fits costs a few badly shaped batches at worst, never a wrong result. ->
    (overhead_s, per_token_s, "remembered" | "measured"). The memory is best effort: a folder that
    cannot be read or written means the probe runs."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:32]
    path = os.path.join(root, "step_cost", f"{digest}.json")
    try:
        with open(path, encoding="utf-8") as f:
            seed = json.load(f)
        overhead_s, per_token_s = float(seed["overhead_s"]), float(seed["per_token_s"])
        if np.isfinite(overhead_s) and np.isfinite(per_token_s) and overhead_s >= 0 and per_token_s > 0:
            return overhead_s, per_token_s, "remembered"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: measure
    overhead_s, per_token_s = probe()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        staging = f"{path}.{os.getpid()}.tmp"
        with open(staging, "w", encoding="utf-8") as f:
            json.dump({"overhead_s": overhead_s, "per_token_s": per_token_s, "identity": identity}, f, default=str)
        os.replace(staging, path)  # whole or not at all, for a start running beside this one
    except OSError:
        pass  # a read-only or full cache: the next start probes again
    return overhead_s, per_token_s, "measured"
