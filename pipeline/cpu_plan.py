"""How the cores are shared between the render workers and the engine's torch threads.

Oversubscription is the classic way to lose 2x: N workers x M threads each on a small machine.
Render workers tokenize with one thread each (TOKENIZERS_PARALLELISM=false); thanks to prefix
truncation they are mostly idle next to a CPU forward pass, so on a CPU engine the model gets
every core and one worker suffices on small machines. A GPU engine needs few CPU threads and as
many workers as can keep it fed.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CpuPlan:
    cores: int
    render_workers: int
    engine_threads: int
    accelerator_expected: bool
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cuda_expected(device: str) -> bool:
    """Whether the engine will likely run on CUDA -- without importing torch in the caller."""
    if device.startswith("cuda") or device == "sim":  # the simulated device stands for a GPU
        return True
    if device != "auto" or os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def plan_cpu(num_render_workers: int | None, device: str, cores: int | None = None,
             engine_threads: int | None = None) -> CpuPlan:
    plan = _plan(num_render_workers, device, cores or available_cores())
    if engine_threads is None:
        return plan
    return CpuPlan(plan.cores, plan.render_workers, engine_threads, plan.accelerator_expected,
                   plan.reason + f"; engine threads fixed at {engine_threads} by the caller")


def _plan(num_render_workers: int | None, device: str, cores: int) -> CpuPlan:
    gpu = cuda_expected(device)
    if gpu:
        workers = num_render_workers or max(1, min(cores - 1, 16))
        return CpuPlan(cores, workers, 1 if cores <= 2 else 2, True,
                       "GPU engine: few CPU threads for the engine, the other cores tokenize")
    if num_render_workers is None:
        workers = 1 if cores <= 4 else max(1, cores // 8)
        threads = cores if cores <= 4 else cores - workers
        reason = "CPU engine: the forward pass dominates, so it gets the cores; a light worker shares them"
    else:
        workers = num_render_workers
        threads = max(1, cores - max(0, workers - 1))
        reason = "CPU engine with a fixed number of workers: the extra workers' cores are kept free"
    return CpuPlan(cores, workers, threads, False, reason)
