"""A simulated accelerator: a measurement instrument, never a default.

`Pipeline(device="sim", sim_device=...)` runs the whole engine path for real -- admission,
validation, scheduling, collation, output encoding -- but its model step only waits: it sleeps
`a + b * padded_tokens` seconds (no CPU used, the GIL released), as a device would be busy while the
engine's CPU waits for it, and returns deterministic vectors derived from each request's token ids
(`sim_vectors`), so order and identity stay checkable. With it the CPU side of the pipeline can be
measured on a machine without the accelerator it is built for: per-request CPU cost of each
process, and whether the device would stay busy.

Presets model an H100-class GPU from first principles (see the README's "Capacity planning"): a
step's fixed cost `a` is its kernel launches (about 5 us per kernel, ~10 kernels per layer, no CUDA
graphs), and the cost per padded token `b` is 2 x (non-embedding parameters) FLOPs per token at 40%
of the H100's 989 TFLOP/s dense bf16 -- an optimistic device, so the CPU side is what is tested.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np

# Deterministic vectors: rows of a fixed random table, picked by a hash of the token ids.
TABLE_ROWS = 4096


class SimDevice(msgspec.Struct, frozen=True, kw_only=True):
    """A simulated device's step time `step_s + token_s * padded_tokens` and its output width."""

    step_s: float  # a: fixed cost of one step (kernel launches)
    token_s: float  # b: cost per padded token
    dim: int = 384  # width of the vectors it returns
    name: str = "custom"
    # What the start-up probe reports as the fixed cost (None: step_s): a probe taken at a noisy
    # moment, to see that the engine learns the real cost from its steps.
    probe_step_s: float | None = None


H100_FLOPS = 0.4 * 989e12  # 40% of dense bf16 peak
SIM_PRESETS = {
    # all-MiniLM-L6-v2 size: 6 layers, 384 wide, ~11M non-embedding parameters.
    "minilm-h100": SimDevice(step_s=6 * 10 * 5e-6, token_s=2 * 11e6 / H100_FLOPS, dim=384, name="minilm-h100"),
    # BERT-base size: 12 layers, 768 wide, ~85M non-embedding parameters.
    "base-h100": SimDevice(step_s=12 * 10 * 5e-6, token_s=2 * 85e6 / H100_FLOPS, dim=768, name="base-h100"),
}


def resolve_sim_device(value: str | SimDevice | tuple[float, float] | None) -> SimDevice:
    """A preset name, explicit (a, b) seconds, or a SimDevice."""
    if value is None:
        return SIM_PRESETS["minilm-h100"]
    if isinstance(value, SimDevice):
        return value
    if isinstance(value, str):
        if value not in SIM_PRESETS:
            raise ValueError(f"sim_device must be one of {sorted(SIM_PRESETS)} or (a, b) seconds, got {value!r}")
        return SIM_PRESETS[value]
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 10 for v in value):
        return SimDevice(step_s=float(value[0]), token_s=float(value[1]))
    raise ValueError(f"sim_device must be a preset name {sorted(SIM_PRESETS)} or (a, b) seconds, got {value!r}")


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
    """Stands in for `ModelRunner` (both are `StepRunner`s, core/step_runner.py): the same `launch` /
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
