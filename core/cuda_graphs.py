"""A step's transformer forward replayed from CUDA graphs: one graph per step shape, captured the
first time the shape is seen, replayed after.

Why: an eager MiniLM forward launches ~180 kernels through ~2,000 Python calls, 2-4 ms of host time
a step before the device does anything, while its arithmetic at a 2,400-token step is well under
0.1 ms on an H200. A graph replays the recorded kernels in one call. It needs fixed shapes (the
step shapes are bucketed: core/step_shapes.py), no read of the device inside the forward (the 4-D
mask: core/attention_mask.py) and static input and output buffers: a step's inputs are copied into
its graph's buffers, the graph replays, the output buffer is the forward's output (read before the
next replay: the copies back are queued on the same stream).

Every capture is checked against the eager forward on the step that triggered it (cosine >= 0.9999
in half precision, max |diff| <= 1e-5 in float32, relative above 1); a capture that fails or
differs turns graphs off for the runner, said in its start-up facts and `stats()`. Shapes past
MAX_GRAPHS run eager. Tests drive this on a CPU through `EagerStandIn`, which records a "graph"
as the function and its static buffers and replays it eagerly (a runner that forgot to copy its
inputs into the buffers, or read the output elsewhere, gives wrong vectors there too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Graphs kept at most (each holds its static buffers; the memory of its activations is shared with
# the others through one pool). The bucketed shapes of a real corpus stay well under it.
MAX_GRAPHS = 64
WARMUP_RUNS = 2  # eager runs on a side stream before a capture (as torch's docs ask)
MIN_COSINE = 0.9999
MAX_DIFF_FLOAT32 = 1e-5

Forward = Callable[[dict[str, torch.Tensor]], torch.Tensor]


class CudaGraphs:
    """Captures with torch.cuda.CUDAGraph, every graph in one memory pool."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None
        # The capture stream is named on the engine's device: torch.cuda.graph's default one is made
        # once per process, on whichever device is current the first time.
        self.capture_stream = torch.cuda.Stream(device)

    def capture(self, forward: Forward, static: dict[str, torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        # Under the engine's device whatever the thread's current one: CUDAGraph.capture_begin
        # captures on the current device, and torch.cuda.graph synchronizes it first.
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    forward(static)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                output = forward(static)
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, output


class EagerStandIn:
    """A CPU stand-in for the tests: a "graph" is the forward on its static inputs, its output a
    static buffer that each replay overwrites."""

    name = "stand-in"

    def capture(self, forward: Forward, static: dict[str, torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        output = forward(static).clone()

        def replay() -> None:
            output.copy_(forward(static))

        return replay, output


class GraphedForward:
    """`forward` (step inputs by name -> the transformer's output tensor) through graphs, per the
    module's docstring. `graphs`: CudaGraphs or EagerStandIn; `half`: the model runs in float16 or
    bfloat16 (the check is a cosine then)."""

    def __init__(self, forward: Forward, graphs, half: bool, max_graphs: int = MAX_GRAPHS) -> None:
        self.forward, self.backend, self.half, self.max_graphs = forward, graphs, half, max_graphs
        self.graphs: dict[tuple, tuple[dict[str, torch.Tensor], Callable[[], None], torch.Tensor]] = {}
        self.off: str | None = None  # why graphs were turned off
        self.replays = self.eager_steps = 0

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in inputs.items())
        graph = self.graphs.get(key)
        if graph is None and self.off is None and len(self.graphs) < self.max_graphs:
            graph = self._capture(key, inputs)
        if graph is None:
            self.eager_steps += 1
            return self.forward(inputs)
        static, replay, output = graph
        for name, tensor in inputs.items():
            static[name].copy_(tensor, non_blocking=True)
        replay()
        self.replays += 1
        return output

    def stats(self) -> dict:
        return {"captured": len(self.graphs), "replays": self.replays, "eager_steps": self.eager_steps,
                **({"off": self.off} if self.off else {})}

    def _capture(self, key: tuple, inputs: dict[str, torch.Tensor]):
        """The graph of this shape, checked against the eager forward on these inputs (a read of
        the device, once per shape); None with graphs turned off when it fails or differs."""
        static = {name: tensor.clone() for name, tensor in inputs.items()}
        try:
            replay, output = self.backend.capture(self.forward, static)
        except Exception as e:  # something in the forward that a graph cannot hold
            self.off = f"capture failed: {type(e).__name__}: {str(e)[:200]}"
            return None
        replay()
        eager = self.forward(inputs)
        problem = self._differs(output, eager)
        if problem is not None:
            self.off = problem
            return None
        self.graphs[key] = (static, replay, output)
        return self.graphs[key]

    def _differs(self, replayed: torch.Tensor, eager: torch.Tensor) -> str | None:
        if replayed.shape != eager.shape:
            return f"a replay's output is {tuple(replayed.shape)}, the eager one's {tuple(eager.shape)}"
        a, b = replayed.float().reshape(len(replayed), -1), eager.float().reshape(len(eager), -1)
        if self.half:
            cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=1).min())
            return None if cosine >= MIN_COSINE else f"a replay differs from eager: min cosine {cosine:.6f}"
        diff = float((a - b).abs().max())
        bound = MAX_DIFF_FLOAT32 * max(1.0, float(b.abs().max()))
        return None if diff <= bound else f"a replay differs from eager by {diff:.1e}"
