"""A step's transformer forward replayed from CUDA graphs: one graph per step shape, captured at the
engine's start for every bucketed shape its scheduler can cut (`capture_plan`), replayed after; a
shape outside them runs eager, counted. (Without a plan -- a runner used on its own -- a shape is
captured the first time it is seen.)

Why: an eager MiniLM forward launches ~180 kernels through ~2,000 Python calls, 2-4 ms of host time
a step before the device does anything, while its arithmetic at a 2,400-token step is well under
0.1 ms on an H200. A graph replays the recorded kernels in one call. It needs fixed shapes (the
step shapes are bucketed: core/engine/step_shapes.py), no read of the device inside the forward (the 4-D
mask: core/engine/attention_mask.py) and static input and output buffers: a step's inputs are copied into
its graph's buffers, the graph replays, the output buffer is the forward's output (read before the
next replay: the copies back are queued on the same stream).

Every capture is checked against the eager forward on the step that triggered it (cosine >= 0.9999
in half precision, max |diff| <= 1e-5 in float32, relative above 1); a capture that fails or
differs turns graphs off for the runner, said in its start-up facts and `stats()`. Shapes past
MAX_GRAPHS run eager. Tests drive this on a CPU through `EagerStandIn`, which records a "graph"
as the function and its static buffers and replays it eagerly (a runner that forgot to copy its
inputs into the buffers, or read the output elsewhere, gives wrong vectors there too).

Why at the start: a capture costs a device sync, two eager warm-ups, the capture and a check
against eager (a device read); captured lazily, each new shape paid that in the middle of serving
(a load test's timed window, a caller's first calls). The plan is bounded: at most MAX_GRAPHS
graphs, their held buffers (static inputs and output: the memory a graph keeps; activations are
shared through one pool) within GRAPH_MEMORY_FRACTION of the device, the capture within
CAPTURE_BUDGET_S. Where the plan is cut, it keeps the shapes of the fewest padded tokens -- a
step's host launch cost matters most against a small step's device time; a large step keeps the
device busy while the next one is launched (launch-ahead) -- and the rest run eager, counted.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from unittest import mock

import torch

# Graphs kept at most (each holds its static buffers; the memory of its activations is shared with
# the others through one pool). The scheduler's plan for all-MiniLM-L6-v2 on a GPU (1,024 rows,
# 16,384 tokens, 256-token texts) is 197 shapes; a BERT-base at 512 tokens 264.
MAX_GRAPHS = 320
# The held buffers of the plan's graphs, at most this fraction of the device's memory (MiniLM's 197
# in float16: ~0.65 GB; a SPLADE model's logits over a 30k vocabulary are ~1 GB for one large shape).
GRAPH_MEMORY_FRACTION = 0.05
# The start-up capture stops after this long (the shapes left run eager, counted).
CAPTURE_BUDGET_S = 90.0
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

    def memory(self) -> tuple[int | None, int | None]:
        """(bytes the caching allocator holds on the device now, the device's total bytes)."""
        return torch.cuda.memory_reserved(self.device), torch.cuda.mem_get_info(self.device)[1]

    def planning(self):
        """Around the start-up captures: torch.cuda.graph's per-capture gc.collect() and empty_cache()
        skipped (tens of ms each in a process holding torch and transformers; vLLM skips them too).
        Only the engine's thread runs then, and both are restored after."""
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch("gc.collect", lambda *args: 0))
        stack.enter_context(mock.patch.object(torch.cuda, "empty_cache", lambda: None))
        return stack


class EagerStandIn:
    """A CPU stand-in for the tests: a "graph" is the forward on its static inputs, its output a
    static buffer that each replay overwrites."""

    name = "stand-in"

    def capture(self, forward: Forward, static: dict[str, torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        output = forward(static).clone()

        def replay() -> None:
            output.copy_(forward(static))

        return replay, output

    def memory(self) -> tuple[int | None, int | None]:
        return None, None  # (no device: the held buffers are counted)

    def planning(self):
        return contextlib.nullcontext()


class GraphedForward:
    """`forward` (step inputs by name -> the transformer's output tensor) through graphs, per the
    module's docstring. `graphs`: CudaGraphs or EagerStandIn; `half`: the model runs in float16 or
    bfloat16 (the check is a cosine then)."""

    def __init__(self, forward: Forward, graphs, half: bool, max_graphs: int = MAX_GRAPHS) -> None:
        self.forward, self.backend, self.half, self.max_graphs = forward, graphs, half, max_graphs
        self.graphs: dict[tuple, tuple[dict[str, torch.Tensor], Callable[[], None], torch.Tensor]] = {}
        self.off: str | None = None  # why graphs were turned off
        self.replays = self.eager_steps = 0
        # Set by `seal` when the start-up plan is done: no capture after it (a new shape runs eager),
        # and the counts of the run start from there.
        self.sealed_at: int | None = None

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in inputs.items())
        graph = self.graphs.get(key)
        if graph is None and self.off is None and self.sealed_at is None and len(self.graphs) < self.max_graphs:
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
        """The graphs held, and since `seal` (the run; since the start without one): replays, steps run
        eager (a shape outside the plan, graphs off, past the bound) and captures (0 once sealed)."""
        run_captures = {} if self.sealed_at is None else {"captured_in_run": len(self.graphs) - self.sealed_at}
        return {"captured": len(self.graphs), "replays": self.replays, "eager_steps": self.eager_steps,
                **run_captures, **({"off": self.off} if self.off else {})}

    def seal(self) -> None:
        """The start-up is over: from now on a shape without a graph runs eager, and the counts of
        replays and eager steps are the run's."""
        self.sealed_at = len(self.graphs)
        self.replays = self.eager_steps = 0

    def held_bytes(self) -> int:
        """The bytes the graphs keep for themselves: their static inputs and outputs."""
        return sum(t.nbytes for static, _, output in self.graphs.values() for t in (*static.values(), output))

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


def capture_plan(graphed: GraphedForward, shapes: list[tuple[int, int]], run_step: Callable[[int, int], object],
                 memory_budget: int | None = None, time_budget_s: float = CAPTURE_BUDGET_S) -> dict:
    """Captures the graphs of the step shapes `shapes` ((rows, length), each a bucket) before serving:
    `run_step(rows, length)` runs a synthetic step of that shape through the runner (so each graph
    is keyed, captured and checked exactly as a served step's would be). Bounded as the module's
    docstring says; `memory_budget` in bytes (None: GRAPH_MEMORY_FRACTION of the device's memory;
    no bound without a device). Returns the start-up facts (stats()["engine"]: cuda_graphs_*)."""
    started = time.perf_counter()
    reserved_before, total = graphed.backend.memory()
    budget = memory_budget if memory_budget is not None else (int(total * GRAPH_MEMORY_FRACTION) if total else None)
    by_tokens = sorted(set(shapes), key=lambda shape: (shape[0] * shape[1], shape))
    chosen, out_of_time = by_tokens[:1], False
    with graphed.backend.planning():
        if by_tokens:  # the smallest first: what a graph holds per padded token, for the bound below
            run_step(*by_tokens[0])
        per_token = graphed.held_bytes() / (by_tokens[0][0] * by_tokens[0][1]) if graphed.graphs else 0.0
        held = graphed.held_bytes()
        for rows, length in by_tokens[1:]:
            cost = per_token * rows * length  # (an upper bound for an output per row: length >= 1 token)
            if len(chosen) >= min(graphed.max_graphs, MAX_GRAPHS) or (budget is not None and held + cost > budget):
                break
            chosen.append((rows, length))
            held += cost
        # The largest first: each smaller capture reuses the pool's blocks (vLLM captures so too).
        for shape in sorted(chosen[1:], key=lambda shape: -shape[0] * shape[1]):
            out_of_time = time.perf_counter() - started > time_budget_s
            if graphed.off is not None or out_of_time:
                break
            run_step(*shape)
    reserved_after, _ = graphed.backend.memory()
    captured = len(graphed.graphs)
    facts = {"cuda_graphs_planned": len(by_tokens), "cuda_graphs_startup_captured": captured,
             "cuda_graphs_capture_s": round(time.perf_counter() - started, 3),
             "cuda_graphs_buffers_mb": round(graphed.held_bytes() / 2**20, 1)}
    if reserved_after is not None:
        facts["cuda_graphs_pool_mb"] = round((reserved_after - reserved_before) / 2**20, 1)
    if captured < len(by_tokens):
        bound = (f"at most {min(graphed.max_graphs, MAX_GRAPHS)} graphs and "
                 f"{'no memory bound' if budget is None else f'{budget / 2**20:.0f} MB of buffers'}: the smallest "
                 "steps kept")
        why = (f"graphs off ({graphed.off})" if graphed.off else
               f"the capture took its {time_budget_s:.0f} s" if out_of_time else bound)
        facts["cuda_graphs_left_eager"] = f"{len(by_tokens) - captured} of {len(by_tokens)} planned shapes run eager: {why}"
    return facts
