"""The simulated accelerator's runner in the engine core (the device itself, a `SimDevice`, is
declared in core/shared/sim_device.py, which the caller and the engine's config read)."""

from __future__ import annotations

import time

import numpy as np

from pooling_pipeline.core.shared.sim_device import SimDevice

# Deterministic vectors: rows of a fixed random table, picked by a hash of the token ids.
TABLE_ROWS = 4096


def _table(dim: int) -> np.ndarray:
    rows = np.random.default_rng(1234).standard_normal((TABLE_ROWS, dim)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


_ID_WEIGHTS = np.array([7919, 104_729, 1], dtype=np.int64)  # (sim_keys': the first, middle and last id's)


def sim_keys(token_ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The table row of each request: a hash of its length, first, middle and last token ids
    (packed ids, as a batch holds them; computed for the whole batch at once)."""
    # (the three ids of each request picked with one gather, then widened and weighed with one
    # product: the simulated device's lookup should cost the host little, as a device's does)
    picked = token_ids.take(np.concatenate((starts, starts + lengths // 2, starts + lengths - 1)))
    keys = lengths * 1_000_003 + _ID_WEIGHTS.dot(picked.reshape(3, -1).astype(np.int64))
    return keys % TABLE_ROWS



def sim_vectors(token_ids: list[np.ndarray], dim: int) -> np.ndarray:
    """[n, dim] unit vectors: what the simulated device returns for these requests' token ids."""
    lengths = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
    return _table(dim)[sim_keys(np.concatenate(token_ids), np.cumsum(lengths) - lengths, lengths)]


class SimRunner:
    """Stands in for `ModelRunner` (both are `StepRunner`s, core/engine/step_runner.py): the same `launch` /
    `finish` / `run` and `step_cost`, a modeled step time. Steps queue on the simulated device as
    kernels queue on a CUDA stream: a launched step starts when the one before it ends, and
    `finish` sleeps until it is done."""

    def __init__(self, spec, device: SimDevice) -> None:
        self.spec = spec
        self.sim = device
        self.device = "sim"
        self.dtype = "float32"
        self.table = _table(device.dim)
        self.free_at = 0.0  # when the device finishes the work queued on it (perf_counter time)

    def step_cost(self, max_tokens: int) -> tuple[float, float]:
        probe = self.sim.step_s if self.sim.probe_step_s is None else self.sim.probe_step_s
        return probe, self.sim.token_s

    def launch(self, batch) -> tuple[np.ndarray, int, float, float]:
        # The host's part of a step, as on CUDA: the padded ids matrix the device would be given
        # (ModelRunner.launch collates the same way); the device's part is a table lookup.
        ids, _ = batch.padded(0)
        padded = ids.size
        device_s = self.sim.step_s + self.sim.token_s * padded
        self.free_at = max(time.perf_counter(), self.free_at) + device_s
        rows = self.table.take(sim_keys(batch.token_ids, batch.starts, batch.lengths), axis=0)
        return rows, padded, device_s, self.free_at

    def finish(self, step) -> tuple[np.ndarray, int, float]:
        rows, padded, device_s, done_at = step
        wait = done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # the device is busy; the CPU is not
        return rows, padded, device_s

    def run(self, batch) -> tuple[np.ndarray, int]:
        rows, padded, _ = self.finish(self.launch(batch))
        return rows, padded
