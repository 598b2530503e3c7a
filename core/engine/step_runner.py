"""The interface the engine core drives a model through, whatever runs it: `ModelRunner`
(core/engine/model_runner.py: torch on CUDA or a CPU, or the transformer compiled by OpenVINO, see
core/engine/openvino_model.py) and the simulated accelerator's `SimRunner` (core/engine/sim_runner.py).

A step is launched, then finished: on CUDA `launch` returns while the device works, so the engine
collates the next batch meanwhile; on a CPU (and OpenVINO) it returns when the work is done.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from pooling_pipeline.core.engine.columns import Requests


class StepRunner(Protocol):
    device: Any  # where steps run: a torch.device (its .type "cpu" / "cuda"), or the simulated one
    dtype: Any  # the model's dtype, as reported in the engine's start-up info

    def step_cost(self, max_tokens: int) -> tuple[float, float]:
        """The start-up probe of one step: (fixed cost in seconds, cost per padded token)."""

    def launch(self, batch: Requests) -> Any:
        """Starts a step on `batch`; -> a handle for `finish`."""

    def finish(self, step: Any) -> tuple[list | np.ndarray, int, float]:
        """Waits for a launched step: (one result per request, padded tokens, device seconds)."""

    def run(self, batch: Requests) -> tuple[list | np.ndarray, int]:
        """launch + finish (an isolated retry of one request): (results, padded tokens)."""


class PendingStep:
    """A launched step: the host copies of its results (filled when the device is done), what
    turns them into per-request results, and (on CUDA) events timing it on the device. It is made
    at the end of `launch`: `launched` is when that returned."""

    __slots__ = ("padded", "host", "finish", "started", "launched", "begin", "end")

    def __init__(self, padded: int, host: list, finish, started: float, begin, end) -> None:
        self.padded, self.host, self.finish = padded, host, finish
        self.started, self.launched, self.begin, self.end = started, time.perf_counter(), begin, end


def host_seconds(step: PendingStep, finish_started: float) -> float:
    """How long a step without device events (a CPU step, done when launched) kept the engine: its
    launch and its finish, not the time between them -- where the engine launches the next step
    first (launch-ahead), that step's work is its own, and counting it twice would put the engine's
    busy fraction over 1."""
    return (step.launched - step.started) + (time.perf_counter() - finish_started)
