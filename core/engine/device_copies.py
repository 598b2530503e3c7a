"""What lets a step run on a CUDA device while the engine goes on: pinned, non-blocking copies
between the host and the device, and the events that time the step there. A runner's `launch`
queues its copies, its kernels and an end event and returns; its `finish` waits on that event
alone (the engine collates the next batch meanwhile, see core/engine/main.py's launch-ahead). On a
CPU each is a no-op: tensors stay where they are and a step is timed on the host
(`finish_step`).

Every CUDA call runs under the engine's own device: `use_device` makes it the current device when
the runner is built, before any other CUDA call, and the events name its stream."""

from __future__ import annotations

import time

import numpy as np
import torch

from pooling_pipeline.core.engine.step_runner import PendingStep, host_seconds


def use_device(device: torch.device) -> torch.device:
    """`device`, made this thread's current CUDA device where it is one (its index filled in: plain
    "cuda" is the current device); any other device as it is. Called where a runner is built,
    before any other CUDA call of the engine.

    Why: much of torch's CUDA acts on the current device, whatever tensor it serves -- an event
    recorded without a stream, a pinned host buffer (allocated in the current device's context),
    `torch.cuda.graph`'s capture (its default stream and `capture_begin`), `is_bf16_supported` --,
    and a process starts on cuda:0. Without this a data-parallel engine core on cuda:k
    (pipeline/cpu_plan.engine_devices) timed and waited for its steps on GPU 0's empty stream,
    so it read its pinned copies back before they had landed, captured its graphs on a GPU 0
    stream, and opened a context (and its memory) on GPU 0. The current device is per thread: the
    engine's steps run on the thread that builds its runner (core/engine/main.py's loop)."""
    if device.type != "cuda":
        return device
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


# What a CUDA error that leaves the process's context unusable says (torch raises RuntimeError or its
# subclass torch.AcceleratorError with "CUDA error: <this>"): after one, every later CUDA call of the
# process fails the same way, so a step retried request by request would fail each request in turn on
# a dead device while the engine looked alive. Out of memory, a shape or dtype error: not sticky.
STICKY_CUDA_ERRORS = ("device-side assert triggered", "an illegal memory access was encountered",
                      "unspecified launch failure", "an illegal instruction was encountered", "misaligned address",
                      "uncorrectable ECC error encountered", "the launch timed out and was terminated",
                      "hardware stack error")


def sticky_device_error(error: BaseException) -> str | None:
    """The sticky CUDA error `error` reports (STICKY_CUDA_ERRORS' phrase), or None for any other error."""
    if not isinstance(error, RuntimeError):
        return None
    text = str(error)
    return next((phrase for phrase in STICKY_CUDA_ERRORS if phrase in text), None)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device`; on CUDA through pinned memory, so the copy does not hold up the host."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor` (itself on a CPU), queued into pinned memory: valid once the step's
    end event has completed (`wait_for_device`)."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def start_events(device: torch.device) -> tuple[torch.cuda.Event | None, torch.cuda.Event | None]:
    """On CUDA: an event recorded now, before the step's work is queued, and one to record after it
    (its copies back included). Elsewhere (None, None)."""
    if device.type != "cuda":
        return None, None
    # blocking: the engine's wait for a step's end sleeps in the driver instead of spinning on a
    # core (a spinning wait read as "engine busy 100%" on the first GPU run, the host waiting on
    # the device counted as work, and took a core from the render workers).
    begin = torch.cuda.Event(enable_timing=True, blocking=True)
    end = torch.cuda.Event(enable_timing=True, blocking=True)
    begin.record(torch.cuda.current_stream(device))
    return begin, end


def record_end(end: torch.cuda.Event | None, device: torch.device) -> None:
    """Records a step's end event (start_events' second; None on a CPU: nothing to do) on `device`'s
    stream, once the step's work and its copies back are queued."""
    if end is not None:
        end.record(torch.cuda.current_stream(device))


def wait_for_device(step: PendingStep) -> float | None:
    """Waits until a launched step's work (its copies back included) is done on the device: the
    seconds it took there, or None for a step without events (a CPU step, done when launched)."""
    if step.end is None:
        return None
    step.end.synchronize()
    return step.begin.elapsed_time(step.end) / 1000


def finish_step(step: PendingStep) -> tuple[list, int, float]:
    """A runner's `finish`: waits for a launched step, then turns its host copies into per-request
    results -> (results, padded tokens, seconds the step took: on the device where it has events,
    else its launch and this finish on the host)."""
    finish_started = time.perf_counter()
    device_s = wait_for_device(step)
    results = step.finish([t.numpy() for t in step.host])
    return results, step.padded, host_seconds(step, finish_started) if device_s is None else device_s
