"""How the cores are shared between the render workers and the engine's torch threads.

Oversubscription is the classic way to lose 2x: N workers x M threads each on a small machine.
Render workers tokenize with one thread each (TOKENIZERS_PARALLELISM=false); thanks to prefix
truncation they are mostly idle next to a CPU forward pass, so on a CPU engine the model gets
every core and one worker suffices on small machines. A GPU engine needs few CPU threads and as
many workers as can keep it fed. With data-parallel engine cores on a CPU the planned engine
threads are split between them (at least one each); on GPUs each engine core has its own device.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from pooling_pipeline.core.shared.config import CPU_MAX_NUM_SEQS, GPU_MAX_NUM_SEQS
from pooling_pipeline.core.shared.devices import cuda_expected


@dataclass(frozen=True)
class CpuPlan:
    cores: int
    render_workers: int
    engine_threads: int
    accelerator_expected: bool
    reason: str
    data_parallel_size: int = 1  # engine cores; engine_threads is each one's torch threads

    def as_dict(self) -> dict:
        return asdict(self)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_max_num_seqs(device: str) -> int:
    """The step's sequence cap where the caller leaves it: a GPU's, where CUDA is expected (not the
    simulated device, whose figures are modeled on the CPU's default), else the CPU's (see
    core.shared.config.CPU_MAX_NUM_SEQS for why they differ)."""
    return GPU_MAX_NUM_SEQS if cuda_expected(device) and device != "sim" else CPU_MAX_NUM_SEQS


def plan_cpu(num_render_workers: int | None, device: str, cores: int | None = None,
             engine_threads: int | None = None, data_parallel_size: int = 1) -> CpuPlan:
    """`engine_threads` fixed by the caller is each engine core's; planned ones are split between
    the engine cores of a CPU engine."""
    plan = _plan(num_render_workers, device, cores or available_cores())
    if engine_threads is not None:
        return CpuPlan(plan.cores, plan.render_workers, engine_threads, plan.accelerator_expected,
                       plan.reason + f"; engine threads fixed at {engine_threads} by the caller"
                       + (f" for each of {data_parallel_size} engine cores" if data_parallel_size > 1 else ""),
                       data_parallel_size)
    if data_parallel_size == 1:
        return plan
    if plan.accelerator_expected:
        return CpuPlan(plan.cores, plan.render_workers, plan.engine_threads, True,
                       plan.reason + f"; {data_parallel_size} engine cores, one device each", data_parallel_size)
    each = max(1, plan.engine_threads // data_parallel_size)
    return CpuPlan(plan.cores, plan.render_workers, each, False,
                   plan.reason + f"; its {plan.engine_threads} threads split between {data_parallel_size} engine "
                   f"cores: {each} each", data_parallel_size)


def engine_devices(device: str, data_parallel_size: int) -> list[str]:
    """The device of each engine core. One engine core: `device` as given (resolved in the engine).
    Several: "sim" and "cpu" for each; CUDA ("cuda", "cuda:j", or "auto" where CUDA is available)
    gives engine core k the GPU j + k, and fewer visible GPUs than that is a ValueError."""
    if data_parallel_size == 1:
        return [device]
    if device in ("cpu", "sim"):
        return [device] * data_parallel_size
    if device == "auto" and not cuda_expected(device):
        return ["cpu"] * data_parallel_size
    import torch  # only here: CUDA, several engine cores (counting GPUs creates no CUDA context)

    if not torch.cuda.is_available():
        if device == "auto":
            return ["cpu"] * data_parallel_size
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    first = int(device.partition(":")[2] or 0) if device.startswith("cuda") else 0
    count = torch.cuda.device_count()
    if first + data_parallel_size > count:
        raise ValueError(
            f"data_parallel_size={data_parallel_size} needs one GPU per engine core (cuda:{first} .. "
            f"cuda:{first + data_parallel_size - 1}), but {count} CUDA device(s) are visible; use "
            f"data_parallel_size <= {max(count - first, 0)} (across machines, use Ray: pipeline-run --ray)")
    return [f"cuda:{first + k}" for k in range(data_parallel_size)]


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
