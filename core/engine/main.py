"""Engine core process: `python -m pooling_pipeline.core.engine.main <config file>` (an EngineConfig as JSON,
in a 0600 file of the group's private directory).

One thread does the work, in one loop (a heartbeat and a parent watchdog beside it only tick).
vLLM's EngineCoreProc has an input and an output thread beside its loop; here they cost more than
the socket work they would move: each step handed work between three threads that take turns on
the GIL (~17 futex calls a step, measured), and the engine's CPU per request halved without them
(docs/benchmarks.md, "Capacity planning"). Socket work does not wait on the device: the next step
is launched before the loop waits for the previous one, so the device has queued work while the
loop reads, admits and sends. Each turn of the loop:
  * reads control messages (Abort, Shutdown) -- always, even when the window is full -- and
    inputs from the render workers while the window has room for one more message (while it is
    full the input socket is not read, so back-pressure reaches the workers), without waiting
    when there is work, waiting on the sockets when there is none; decodes, validates and admits them;
  * forms a batch and launches it. On a device that runs asynchronously (CUDA, the
    simulated device) it launches the next step before it waits for the previous one, so the
    device is never idle while the host collates; a CPU step is finished as soon as launched.
    A step that raises is retried request by request, so only the culprit fails; it is dropped
    by external id and reported; the loop goes on (after a sticky CUDA error, which kills the
    device's context, the engine core exits instead: `_end_if_device_lost`). A failed chunk fails its whole document: the
    document's other chunks are dropped by external id (waiting, in the failed step, or still on
    their way), never computed for nothing;
  * packs each finished step's results, encodes and sends them without blocking; what the
    frontend cannot take yet waits in a backlog (bounded by the window), sent as it can.
The window counts a request from the moment its message is read until its result is sent.

Every message in and out carries the group's key (`core.shared.serial`); one without it is dropped.
"""

from __future__ import annotations

import os
import sys
import time
from collections import OrderedDict, deque

import msgspec
import numpy as np
import zmq

from pooling_pipeline.core.engine.columns import Requests, invalid_rows, row_checks, task_lookup
from pooling_pipeline.core.engine.device_copies import sticky_device_error
from pooling_pipeline.core.engine.scheduler import MIN_ROWS_CUT, Scheduler
from pooling_pipeline.core.engine.step_cost import StepCostModel, remembered_probe
from pooling_pipeline.core.engine.step_runner import StepRunner
from pooling_pipeline.core.engine.step_shapes import bucket_shape, scheduled_shapes
from pooling_pipeline.core.families import family_of
from pooling_pipeline.core.shared import messages as m
from pooling_pipeline.core.shared.config import EngineConfig
from pooling_pipeline.core.shared.content_hash import cache_root
from pooling_pipeline.core.shared.runtime import (
    NOBLOCK,
    BusyClock,
    DropLog,
    addressed_socket,
    exit_process,
    exit_with_parent,
    leave_owner_signals,
    recv_frames,
    release_free_memory,
    run_maybe_profiled,
    send_frames,
    setup_logging,
    socket,
    socket_dir_of,
    start_heartbeat,
    take_group_key,
)
from pooling_pipeline.core.shared.serial import Decoder, Encoder

IDLE_WAIT_S = 0.5
# At shutdown, results still held back (a frontend not reading) are sent for at most this long.
SHUTDOWN_SEND_S = 5.0
LAUNCH_AHEAD_ENV = "POOLING_PIPELINE_LAUNCH_AHEAD"
# =1 runs a CPU engine's steps as on an accelerator -- bucketed shapes, the 4-D mask, the CUDA-graph
# logic on its CPU stand-in -- so the tests drive the whole device path without a GPU; =0 turns
# them off anywhere (to measure what they are worth).
DEVICE_STEPS_ENV = "POOLING_PIPELINE_DEVICE_STEPS"
# =0: no CUDA graphs captured at start-up -- each shape is captured the first time a step takes it,
# as before the start-up plan (to measure what the plan is worth; a test on the eager CPU stand-in
# that is about something else: there each capture is four eager forwards, MiniLM's plan minutes).
GRAPH_PLAN_ENV = "POOLING_PIPELINE_GRAPH_PLAN"
# Batches of ever-changing shapes fragment the C heap: freed memory stays in the process unless it
# is handed back now and then (a soak of 1M requests grew the engine by 124 MB without this).
TRIM_EVERY_STEPS = 256
# Default batch shape by device. On a CPU the cost per padded token is flat from ~100 tokens and
# rises past ~4k (caches), and padding is paid in full; a GPU wants big batches and hides padding.
CPU_BATCH_TOKENS, GPU_BATCH_TOKENS = 2048, 16384
# (the step's sequence cap by device is decided in the caller: core.shared.config.GPU_MAX_NUM_SEQS)
CPU_MAX_PADDING, GPU_MAX_PADDING = 0.05, 0.25
# The step overhead, in padded tokens, is capped (a noisy estimate must not mean "any padding").
MAX_OVERHEAD_TOKENS = 1 << 16
# Aborted requests are remembered so a late input is dropped. Bounded: the frontend never has more
# than its window in flight, so older entries can only be strays.
MAX_REMEMBERED_ABORTS = 1 << 20
MAX_REMEMBERED_ABORTED_CALLS = 1 << 16
# The exit code of an engine core whose CUDA context a sticky error killed (see `_end_if_device_lost`).
DEVICE_LOST_EXIT = 71
# pyzmq's flags as plain ints: `getsockopt(...) & zmq.POLLIN` builds an IntFlag each time (enum's
# __call__: ~0.7 us, and the loop asks every turn). (NOBLOCK: core.shared.runtime's.)
EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class Window:
    """How many requests the engine holds, from the read of their message to the send of their
    results. A message is read only when the window has room for a whole one (`room` requests)."""

    def __init__(self, size: int, room: int) -> None:
        self.size = size
        self.room = room
        self.used = 0

    def has_room(self) -> bool:
        return self.used + self.room <= self.size

    def take(self, n: int) -> None:
        self.used += n

    def release(self, n: int) -> None:
        self.used -= n


class StageTimes:
    """Rendering time per worker (reported with the inputs) and the engine's own time decoding
    and admitting them, not yet reported: they ride on the next OutputBatch."""

    def __init__(self) -> None:
        self.render_s: dict[int, float] = {}
        self.admit_s = 0.0

    def add(self, worker: int, render_s: float, admit_s: float) -> None:
        if 0.0 < render_s < 1e6:  # a stat only: anything odd is ignored
            self.render_s[worker] = self.render_s.get(worker, 0.0) + render_s
        self.admit_s += admit_s

    def take(self) -> tuple[dict[int, float], float]:
        taken = self.render_s, self.admit_s
        self.render_s, self.admit_s = {}, 0.0
        return taken


class EngineCore:
    def __init__(self, cfg: EngineConfig, log, key: bytes) -> None:
        importing = time.perf_counter()
        import torch


        self.cfg = cfg
        self.log = log
        self.key = key
        started = time.perf_counter()
        torch.set_num_threads(cfg.torch_threads)
        self.runner: StepRunner
        if cfg.device == "sim":  # the simulated accelerator: the whole path, a modeled step
            from pooling_pipeline.core.engine.sim_runner import SimRunner

            self.runner = SimRunner(cfg.model, cfg.sim)
        else:  # what the model's family runs (core/families/)
            forced_steps = {"1": True, "0": False}.get(os.environ.get(DEVICE_STEPS_ENV, ""))
            switches = {} if forced_steps is None else {"device_steps": forced_steps, "cuda_graphs": forced_steps}
            self.runner = family_of(cfg.model).runner(cfg, **switches)
        on_cpu = str(self.runner.device) == "cpu"
        # A CPU step is done when launched; elsewhere the next one is launched before waiting.
        # LAUNCH_AHEAD_ENV=1 forces launching ahead on a CPU too (how tests run the loop of the
        # CUDA path -- failures, aborts, chunks -- without a GPU); =0 turns it off anywhere (to
        # measure what it is worth).
        forced = os.environ.get(LAUNCH_AHEAD_ENV)
        self.launch_ahead = (not on_cpu) if forced not in ("0", "1") else forced == "1"
        family = family_of(cfg.model)
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or max(
            CPU_BATCH_TOKENS if on_cpu else GPU_BATCH_TOKENS,
            family.longest_input(cfg.model) * family.longest_inputs_per_step)
        # What one step's fixed cost is worth in padded tokens: lets the scheduler fill batches
        # when a step is mostly overhead (a small model, a GPU) and keep them tight when not.
        # A short probe seeds it; every finished step refines it (`StepCostModel`).
        loaded = time.perf_counter()
        # The CUDA graphs of every step shape the scheduler can cut, captured before the probe (whose
        # steps then replay them, as served steps will) and before serving: none is captured later.
        self.graph_plan = self._capture_graphs()
        captured = time.perf_counter()
        try:
            overhead_s, per_token_s, probe = self._probe_step_cost()
        except Exception as e:  # a model that cannot run a synthetic batch still serves
            log.warning("could not measure the step cost (%s); batches stay tight until steps are seen", e)
            overhead_s, per_token_s, probe = 0.0, 1.0, "failed"

        self.step_cost = StepCostModel(overhead_s, per_token_s, MAX_OVERHEAD_TOKENS)
        # Where the start-up went (stats()["engine"]; scripts/bench_startup.py prints them).
        self.startup = {"startup_torch_import_s": round(started - importing, 3), "startup_load_s": round(loaded - started, 3),
                        "startup_graphs_s": round(captured - loaded, 3),
                        "startup_probe_s": round(time.perf_counter() - captured, 3), "startup_probe": probe}
        if self.graph_plan:  # (a shape without a graph runs eager from here)
            self.runner.end_startup()
        # Where the runner pads steps to bucketed shapes (on a device), batches are counted in them.
        cap = cfg.model.max_model_len
        shape = (lambda rows, longest: bucket_shape(rows, longest, max(cap, longest))) \
            if getattr(self.runner, "shapes_bucketed", False) else None
        self.scheduler = Scheduler(cfg.max_num_seqs, self.max_num_batched_tokens, CPU_MAX_PADDING if on_cpu
                                   else GPU_MAX_PADDING, self.step_cost.overhead_tokens, capacity=cfg.window,
                                   shape=shape)
        self.aborts = AbortMemory()
        self.encoder = Encoder(key)
        self.running = True
        self.steps = 0
        self.window = Window(cfg.window, cfg.max_message_items)
        self.times = StageTimes()
        self.reader: InputReader | None = None  # (the sockets' ends, made in serve)
        self.sender: ResultSender | None = None
        self.clock = BusyClock()
        self.sparse = cfg.model.sparse is not None
        self.aborted_requests = 0  # dropped by aborts, waiting or on their way in (a server's disconnects)
        self._graphs_off_told = False

    def _capture_graphs(self) -> dict:
        """The runner's CUDA graphs for the bucketed shapes the scheduler can cut (step_shapes.
        scheduled_shapes, with this engine's limits), captured now; their start-up facts, or {}."""
        capture = getattr(self.runner, "capture_graphs", None)
        if capture is None or not getattr(self.runner, "shapes_bucketed", False) or os.environ.get(GRAPH_PLAN_ENV) == "0":
            return {}
        shapes = scheduled_shapes(self.cfg.max_num_seqs, self.max_num_batched_tokens, self.cfg.model.max_model_len,
                                  MIN_ROWS_CUT)
        return capture(shapes)

    def _probe_step_cost(self) -> tuple[float, float, str]:
        """The step cost's seed: probed once per model, backend, precision, device and threads, then
        remembered in the project's cache (a simulated device is modeled, never remembered)."""
        import torch

        probe = lambda: self.runner.step_cost(self.max_num_batched_tokens)
        if self.cfg.device == "sim":
            return (*probe(), "measured")
        model = self.cfg.model.path
        files = sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
                       for entry in os.scandir(model) if entry.is_file())
        backend = getattr(self.runner, "backend_info", {})
        identity = {"model": os.path.realpath(model), "files": files, "backend": backend.get("backend"),
                    "precision": backend.get("precision"), "quantize": self.cfg.quantize,
                    "dtype": str(self.runner.dtype), "device": str(self.runner.device),
                    "threads": torch.get_num_threads(), "max_tokens": self.max_num_batched_tokens,
                    "torch": torch.__version__, "cpus": os.cpu_count()}
        return remembered_probe(identity, probe, cache_root())

    def ready_info(self) -> dict:
        import torch

        return {"device": str(self.runner.device), "dtype": str(self.runner.dtype).removeprefix("torch."),
                "torch_threads": torch.get_num_threads(),
                "max_num_batched_tokens": self.max_num_batched_tokens,
                **self.step_cost.info(), "launch_ahead": self.launch_ahead, **self.startup, **self.graph_plan,
                **getattr(self.runner, "backend_info", {"backend": "sim"})}

    def running_info(self) -> dict:
        """What changes as steps run, sent with each heartbeat (stats()["engine"]): the step cost,
        and the CUDA graphs' counts where the runner has them."""
        graphs = getattr(self.runner, "graph_stats", dict)()
        if "off" in graphs and not self._graphs_off_told:  # (a heartbeat carries figures only: the reason is logged)
            self.log.warning("CUDA graphs turned off: %s", graphs["off"])
            self._graphs_off_told = True
        return {**self.step_cost.info(), **{f"cuda_graphs_{k}": float(v) for k, v in graphs.items() if k != "off"},
                **({"cuda_graphs_off": 1.0} if "off" in graphs else {}),
                # counters since start: waiting requests dropped by an abort (a client that left), time in steps
                "aborted_requests": float(self.aborted_requests), "busy_total_s": self.clock.total_s}

    def serve(self, ctx: zmq.Context, to_front: zmq.Socket) -> None:
        inputs = socket(ctx, zmq.PULL, self.cfg.input_endpoint, bind=True)
        control = addressed_socket(ctx, self.cfg.control_endpoint, self.cfg.control_routing_id)
        to_front.send_multipart(self.encoder.encode(m.Ready(role="engine", index=self.cfg.index, pid=os.getpid(),
                                                                     info=self.ready_info())))
        start_heartbeat(ctx, self.cfg.output_endpoint, "engine", self.cfg.index, self.clock, self.key,
                        info=self.running_info)
        self.sender = ResultSender(self, to_front)
        self.reader = InputReader(self, inputs, control, self.sender)
        self.loop()
        self.sender.drain(SHUTDOWN_SEND_S)

    # ---- the step loop ------------------------------------------------------------------

    def loop(self) -> None:
        pending = None  # a launched step not finished yet: (batch, step, in_core)
        reader, sender = self.reader, self.sender
        while self.running:
            if sender.backlog:
                sender.flush()
            # Waits on the sockets only when there is nothing to do; otherwise takes what is there.
            reader.read(wait=pending is None and not len(self.scheduler))
            launched = self._launch() if len(self.scheduler) and self.running else None
            if pending is not None:
                self._finish(*pending)
            pending = None
            if launched is not None:
                if self.launch_ahead:
                    pending = launched  # finished after the next launch: the device stays busy
                else:
                    self._finish(*launched)
            self.steps += launched is not None
            if launched is not None and self.steps % TRIM_EVERY_STEPS == 0:
                release_free_memory()

    def _admit(self, requests: Requests, resent: bool = False) -> None:
        if self.aborts:  # inputs aborted before they arrived are dropped
            kept = self.aborts.keep(requests)
            if kept is not None:
                self.aborted_requests += len(requests) - len(kept)
                self.window.release(len(requests) - len(kept))
                requests = kept
                if not len(requests):
                    return
        # A re-sent request takes its old copy's place: one window slot is freed for each.
        self.window.release(self.scheduler.add(requests, resent))

    def _abort(self, call: str, indices: list[int] | None) -> None:
        dropped = self.scheduler.abort(call, indices)
        self.aborted_requests += dropped
        self.window.release(dropped)
        # Remember every aborted request, not only those still on their way: a chunked
        # document's other chunks may still come, and ids are never reused.
        self.aborts.add(call, indices)

    def _launch(self):
        in_core = len(self.scheduler)
        try:
            batch = self.scheduler.next_batch()
        except Exception as e:  # scheduling itself failed: fail everything waiting rather than loop on it
            self.log.exception("scheduling failed")
            self._fail(self.scheduler.take_all(), f"{type(e).__name__}: {e}")
            return None
        try:
            with self.clock:
                return batch, self.runner.launch(batch), in_core
        except Exception as e:
            self._isolate(batch, in_core, e)
            return None

    def _finish(self, batch: Requests, step, in_core: int) -> None:
        try:
            with self.clock:
                results, padded, device_s = self.runner.finish(step)
        except Exception as e:
            self._isolate(batch, in_core, e)
            return
        if self.step_cost.observe(padded, device_s):
            self.scheduler.overhead_tokens = self.step_cost.overhead_tokens
        self._send_results(batch, results, padded, device_s, in_core)

    def _isolate(self, batch: Requests, in_core: int, error: Exception) -> None:
        """A step failed. One bad input must not cost its batch: each request runs alone, so
        only the culprit fails and the others get their results (not after a sticky CUDA error)."""
        self._end_if_device_lost(error)
        if len(batch) == 1:
            self._fail_step(batch, error)
            return
        self.log.warning("step of %d requests failed (%s); isolating the culprit", len(batch), error)
        for row in range(len(batch)):
            request = batch.select([row])
            if request.chunk[0] >= 0 and self.aborts.has(request.calls[0], int(request.indices[0])):
                self.window.release(1)  # another chunk of its document failed: the document has failed
                continue
            start = time.perf_counter()
            try:
                with self.clock:
                    results, padded = self.runner.run(request)
            except Exception as e:
                self._end_if_device_lost(e)
                self._fail_step(request, e)
                continue
            self._send_results(request, results, padded, time.perf_counter() - start, in_core)

    def _end_if_device_lost(self, error: Exception) -> None:
        """Ends the engine core after a sticky CUDA error (device_copies.sticky_device_error): its
        context is dead, every later step would fail the same way, and retrying the step request by
        request failed each request in turn while the engine looked alive. The process exits with
        DEVICE_LOST_EXIT after saying why; the group handles it as an engine core that died (every
        running call: EngineDeadError with this message)."""
        phrase = sticky_device_error(error)
        if phrase is None:
            return
        self.log.critical("the device's CUDA context is lost (%s: %s): no step can run on it any more, so the engine "
                          "core exits (code %d) rather than fail every request in turn; a new engine core (a new "
                          "Pipeline, a restarted server) gets a fresh context", type(error).__name__, error,
                          DEVICE_LOST_EXIT)
        exit_process(DEVICE_LOST_EXIT)

    def _fail_step(self, batch: Requests, error: Exception) -> None:
        self.log.error("step failed for %s: %s: %s", list(zip(batch.calls.tolist(), batch.indices.tolist())),
                       type(error).__name__, error)
        self._fail(batch, f"{type(error).__name__}: {error}")
        # A document with a failed chunk has failed: its other chunks are dropped, not computed.
        chunked = np.flatnonzero(batch.chunk >= 0)
        for call, index in dict.fromkeys(zip(batch.calls[chunked].tolist(), batch.indices[chunked].tolist())):
            self._abort(call, [index])

    def _fail(self, batch: Requests, error: str) -> None:
        self.sender.send(m.StepFailed(calls=batch.calls.tolist(), indices=batch.indices.tolist(), error=error), len(batch))

    def _send_results(self, batch: Requests, results, padded: int, device_s: float, in_core: int) -> None:
        if self.aborts and (batch.chunk >= 0).any():  # chunks of a document that failed meanwhile are not sent
            keep = [i for i, (call, index, chunk) in enumerate(zip(batch.calls.tolist(), batch.indices.tolist(),
                                                                   batch.chunk.tolist()))
                    if chunk < 0 or not self.aborts.has(call, index)]
            if len(keep) < len(batch):
                self.window.release(len(batch) - len(keep))
                batch = batch.select(keep)
                results = results[keep] if isinstance(results, np.ndarray) else [results[i] for i in keep]
                if not len(batch):
                    return
        render_s, admit_s = self.times.take()
        self.sender.send(pack_outputs(batch, results, device_s, padded, in_core, render_s, admit_s, self.sparse),
                         len(batch))


class AbortMemory:
    """What was aborted, so that inputs still on their way are dropped when they arrive: whole
    calls, and single requests (with all their chunks). Bounded: the frontend never has more than
    its window in flight, so older entries can only be strays."""

    def __init__(self) -> None:
        self.calls: OrderedDict[str, None] = OrderedDict()
        self.requests: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.per_call: dict[str, int] = {}  # single requests remembered, per call

    def __bool__(self) -> bool:
        return bool(self.calls) or bool(self.requests)

    def add(self, call: str, indices: list[int] | None) -> None:
        if indices is None:
            self.calls[call] = None
            while len(self.calls) > MAX_REMEMBERED_ABORTED_CALLS:
                self.calls.popitem(last=False)
            return
        for index in indices:
            if (call, index) not in self.requests:
                self.requests[(call, index)] = None
                self.per_call[call] = self.per_call.get(call, 0) + 1
        while len(self.requests) > MAX_REMEMBERED_ABORTS:
            (old_call, _), _ = self.requests.popitem(last=False)
            self.per_call[old_call] -= 1
            if not self.per_call[old_call]:
                del self.per_call[old_call]

    def has(self, call: str, index: int) -> bool:
        return call in self.calls or (call, index) in self.requests

    def keep(self, requests: Requests) -> Requests | None:
        """The requests not aborted (None: all of them; a message is one call's)."""
        call = requests.calls[0] if len(requests) else None
        if call in self.calls:
            return requests.select([])
        if call not in self.per_call:
            return None
        keep = [i for i, index in enumerate(requests.indices.tolist()) if (call, index) not in self.requests]
        return None if len(keep) == len(requests) else requests.select(keep)


class InputReader:
    """The loop's reading: control always and inputs while the window has room; decodes,
    validates and admits them."""

    def __init__(self, engine: EngineCore, inputs: zmq.Socket, control: zmq.Socket, sender: ResultSender) -> None:
        self.engine = engine
        self.cfg = engine.cfg
        self.inputs, self.control = inputs, control
        self.sender = sender
        key = engine.key
        self.input_decoder = Decoder(m.EngineInbound, key=key)
        self.control_decoder = Decoder(m.EngineControl, key=key)
        self.dropped_control = DropLog(engine.log, "a malformed or foreign control message")
        self.dropped_input = DropLog(engine.log, "a malformed or foreign input message")
        self.runs_task = task_lookup(engine.cfg.model.tasks)
        family = family_of(engine.cfg.model)  # (its modalities, the arrays its rows carry and their rules)
        self.checks = row_checks(family.modalities, family.payloads(engine.cfg.model), family.row_rules(engine.cfg.model))
        # The waits, by (room in the window, results held back): control always, inputs with
        # room, and the frontend's socket taking more when results wait to be sent.
        self.pollers = {}
        for room in (False, True):
            for held in (False, True):
                poller = zmq.Poller()
                poller.register(control, zmq.POLLIN)
                if room:
                    poller.register(inputs, zmq.POLLIN)
                if held:
                    poller.register(sender.to_front, zmq.POLLOUT)
                self.pollers[room, held] = poller

    def read(self, wait: bool) -> None:
        """Takes what is waiting on the sockets; with `wait`, first waits (up to IDLE_WAIT_S) for
        something to take or for the frontend to take held-back results."""
        engine, inputs, window = self.engine, self.inputs, self.engine.window
        if wait:
            self.pollers[window.has_room(), bool(self.sender.backlog)].poll(IDLE_WAIT_S * 1000)
        # (EVENTS: no system call when nothing came, cheaper than a poll or a recv that raises zmq.Again)
        if self.control.getsockopt(EVENTS) & POLLIN and not self._drain_control():
            engine.running = False  # Shutdown
            return
        # Whole messages while there is room.
        while window.has_room() and inputs.getsockopt(EVENTS) & POLLIN:
            self._on_inputs(recv_frames(inputs, NOBLOCK))

    def _drain_control(self) -> bool:
        while True:
            try:
                frames = self.control.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            try:
                msg = self.control_decoder.decode(frames)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.dropped_control(e)
                continue
            if isinstance(msg, m.Shutdown):
                return False
            if isinstance(msg, m.Probe):  # the frontend checking the connection: nothing to do
                continue
            self.engine._abort(msg.call, msg.indices)

    def _on_inputs(self, frames) -> None:
        start = time.perf_counter()
        try:
            msg = self.input_decoder.decode(frames)
            msg.check()
            if len(msg.indices) > self.cfg.max_message_items:  # the window counts on it
                raise ValueError(f"an input message of {len(msg.indices)} requests (at most "
                                 f"{self.cfg.max_message_items})")
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            self.dropped_input(e)
            return
        # (A message naming one request twice is not looked for: each copy is computed and answered,
        # and the frontend takes the first answer of each request.)
        requests = Requests.from_message(msg)
        rejected = invalid_rows(requests, self.cfg.model, self.runs_task, msg.columns.keys(), self.checks)
        if rejected:  # a well-formed message with bad contents: those requests are refused, the rest kept
            self.engine.log.error("rejected %d malformed engine inputs", len(rejected))
            indices = requests.indices
            self.sender.send(m.RenderFailed(call=msg.call, indices=[int(indices[row]) for row, _ in rejected],
                                            errors=[why for _, why in rejected]), 0)
            refused = {row for row, _ in rejected}
            requests = requests.select([row for row in range(len(requests)) if row not in refused])
        if len(requests):
            self.engine.window.take(len(requests))
            self.engine._admit(requests, msg.resent)
        self.engine.times.add(msg.worker, msg.render_s, time.perf_counter() - start)


class ResultSender:
    """The loop's sending: encodes each message and sends it without waiting; while the frontend
    cannot take more, messages wait in order in `backlog` (bounded by the window: their requests
    hold it until sent). A request's window slot is freed once its results are sent."""

    def __init__(self, engine: EngineCore, to_front: zmq.Socket) -> None:
        self.window = engine.window
        self.to_front = to_front
        self.encoder = Encoder(engine.key)
        self.backlog: deque[tuple[list, int]] = deque()

    def send(self, msg: msgspec.Struct, count: int) -> None:
        """Sends `msg`, whose sending frees `count` window slots (or holds it back, in order)."""
        frames = self.encoder.encode(msg)
        if self.backlog or not self._send_now(frames):
            self.backlog.append((frames, count))
            return
        self.window.release(count)

    def flush(self) -> None:
        """Sends what was held back, while the frontend takes it."""
        backlog = self.backlog
        while backlog and self._send_now(backlog[0][0]):
            self.window.release(backlog.popleft()[1])

    def drain(self, timeout_s: float) -> None:
        """At shutdown: what is held back, sent within `timeout_s` (what is not is dropped)."""
        deadline = time.monotonic() + timeout_s
        while self.backlog and (left := deadline - time.monotonic()) > 0:
            if self.to_front.poll(left * 1000, zmq.POLLOUT):
                self.flush()

    def _send_now(self, frames: list) -> bool:
        # Copied into ZeroMQ's own message: a zero-copy send of a frame this size goes through
        # pyzmq's garbage-collector thread, which takes the GIL (4 context switches a step, measured).
        # (A multipart message is queued whole or not at all: ZeroMQ checks its limit on the first part.)
        try:
            send_frames(self.to_front, frames, NOBLOCK)
        except zmq.Again:
            return False
        return True


def pack_outputs(batch: Requests, results, busy_s: float, padded_tokens: int, in_core: int,
                 render_s: dict[int, float] | None = None, admit_s: float = 0.0, sparse: bool = False) -> m.OutputBatch:
    """The OutputBatch of a step: its columns from the batch's, and `results` -- an [n, dim]
    array, or one array per request ((token ids, weights) pairs when `sparse`)."""
    calls = batch.calls
    n = len(batch)
    # (list.count compares by identity first, and a call's id is one interned string: ~5x cheaper
    # than numpy's comparison of an object column)
    if not n or calls.tolist().count(calls[0]) == n:  # one call, as usual
        call_list, call_of = ([calls[0]] if n else []), None
    else:
        unique, call_of = np.unique(calls, return_inverse=True)
        call_list, call_of = unique.tolist(), call_of.reshape(-1).astype(np.int64)
    chunks = None
    if n and (batch.chunk >= 0).any():
        chunks = np.ascontiguousarray(np.stack([batch.chunk, batch.num_chunks], axis=1))
    data = arrays = sparse_ids = None
    if isinstance(results, np.ndarray):
        data = np.ascontiguousarray(results, dtype=np.float32)
    elif sparse:
        sparse_ids = [ids for ids, _ in results]
        arrays = [weights for _, weights in results]
    elif results and all(a.ndim == 1 for a in results) and len({a.shape for a in results}) == 1:
        data = np.stack(results).astype(np.float32, copy=False)
    else:
        arrays = list(results)
    return m.OutputBatch(calls=call_list, indices=np.ascontiguousarray(batch.indices),
                         num_prompt_tokens=np.ascontiguousarray(batch.lengths), busy_s=busy_s,
                         padded_tokens=padded_tokens, in_core=in_core, call_of=call_of, data=data, arrays=arrays,
                         sparse_ids=sparse_ids, chunks=chunks, render_s=render_s or {}, admit_s=admit_s)


def main(argv: list[str]) -> int:
    leave_owner_signals()  # Ctrl-C or a supervisor's SIGTERM to the whole group: the frontend's to handle
    with open(argv[1], "rb") as f:  # the config file the group wrote (see ProcessGroup._spawn)
        cfg = msgspec.json.decode(f.read(), type=EngineConfig)
    key = take_group_key()
    log = setup_logging(cfg.log_level, "engine")
    exit_with_parent(cfg.parent_pid, socket_dir_of(cfg.output_endpoint))
    ctx = zmq.Context(1)
    to_front = socket(ctx, zmq.PUSH, cfg.output_endpoint, bind=False)
    try:
        engine = EngineCore(cfg, log, key)
    except Exception as e:
        log.exception("engine core failed to start")
        to_front.send_multipart(Encoder(key).encode(m.Ready.failed("engine", cfg.index, os.getpid(), e)))
        # (sent before the process ends: exit_process skips the interpreter's teardown)
        ctx.destroy(linger=2000)
        return 1
    run_maybe_profiled(lambda: engine.serve(ctx, to_front), "engine")
    log.info("shutting down")
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv))
