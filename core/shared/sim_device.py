"""A simulated accelerator: a measurement instrument, never a default.

`Pipeline(device="sim", sim_device=...)` runs the whole engine path for real -- admission,
validation, scheduling, collation, output encoding -- but its model step only waits: it sleeps
`a + b * padded_tokens` seconds (no CPU used, the GIL released), as a device would be busy while the
engine's CPU waits for it, and returns deterministic vectors derived from each request's token ids
(core/engine/sim_runner.py's `sim_vectors`), so order and identity stay checkable. With it the CPU side of the pipeline can be
measured on a machine without the accelerator it is built for: per-request CPU cost of each
process, and whether the device would stay busy.

Presets model an H100-class GPU from first principles (see the README's "Capacity planning"): a
step's fixed cost `a` is its kernel launches (about 5 us per kernel, ~10 kernels per layer, no CUDA
graphs), and the cost per padded token `b` is 2 x (non-embedding parameters) FLOPs per token at 40%
of the H100's 989 TFLOP/s dense bf16 -- an optimistic device, so the CPU side is what is tested.
"""

from __future__ import annotations

import msgspec


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
