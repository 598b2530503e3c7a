"""Engine core process: `python -m pooling_pipeline.core.engine '<EngineConfig JSON>'`.

One loop owns all engine state (the scheduler's window, the set of aborted ids):
  1. read control messages (Abort, Shutdown) -- always, even when the window is full;
  2. admit inputs from the render workers while the window has room for one more message
     (while it is full the input socket is not read, so back-pressure reaches the workers);
  3. run one batch, pool, send its outputs. A step that raises is retried request by request,
     so only the culprit fails; it is dropped by external id and reported; the loop goes on.
     A failed chunk fails its whole document: the document's other chunks are dropped by
     external id (waiting, in the failed step, or still on their way), never computed for nothing.

Every message in and out carries the group's key (`core.serial`); one without it is dropped.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections import OrderedDict

import msgspec
import numpy as np
import zmq

from pooling_pipeline.core import messages as m
from pooling_pipeline.core.config import EngineConfig
from pooling_pipeline.core.runtime import (
    BusyClock,
    DropLog,
    exit_with_parent,
    run_maybe_profiled,
    setup_logging,
    socket,
    socket_dir_of,
    start_heartbeat,
    take_group_key,
)
from pooling_pipeline.core.scheduler import Scheduler
from pooling_pipeline.core.serial import Decoder, Encoder

IDLE_POLL_MS = 500
# Batches of ever-changing shapes fragment the C heap: freed memory stays in the process unless it
# is handed back now and then (a soak of 1M requests grew the engine by 124 MB without this).
TRIM_EVERY_STEPS = 256
# Default batch shape by device. On a CPU the cost per padded token is flat from ~100 tokens and
# rises past ~4k (caches), and padding is paid in full; a GPU wants big batches and hides padding.
CPU_BATCH_TOKENS, GPU_BATCH_TOKENS = 2048, 16384
CPU_MAX_PADDING, GPU_MAX_PADDING = 0.05, 0.25
# The measured step overhead, in padded tokens, is capped (a noisy probe must not mean "any padding").
MAX_OVERHEAD_TOKENS = 1 << 16
# Ids aborted before their input arrived are remembered so the late input is dropped. Bounded:
# the frontend never has more than its window in flight, so older entries can only be strays.
MAX_REMEMBERED_ABORTS = 1 << 20


class EngineCore:
    def __init__(self, cfg: EngineConfig, log, key: bytes) -> None:
        import torch

        from pooling_pipeline.core.model_runner import ModelRunner

        self.cfg = cfg
        self.log = log
        self.key = key
        torch.set_num_threads(cfg.torch_threads)
        if cfg.device == "sim":  # the simulated accelerator: the whole path, a modeled step
            from pooling_pipeline.core.sim_device import SimRunner

            self.runner = SimRunner(cfg.model, cfg.sim)
        else:
            self.runner = ModelRunner(cfg.model, cfg.device, cfg.dtype)
        on_cpu = str(self.runner.device) == "cpu"
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or max(
            CPU_BATCH_TOKENS if on_cpu else GPU_BATCH_TOKENS, cfg.model.max_model_len)
        # What one step's fixed cost is worth in padded tokens: lets the scheduler fill batches
        # when a step is mostly overhead (a small model, a GPU) and keep them tight when not.
        try:
            self.step_overhead_s, per_token_s = self.runner.step_cost(self.max_num_batched_tokens)
            overhead_tokens = min(self.step_overhead_s / per_token_s, MAX_OVERHEAD_TOKENS)
        except Exception as e:  # a model that cannot run a synthetic batch still serves
            log.warning("could not measure the step cost (%s); batches stay tight", e)
            self.step_overhead_s, overhead_tokens = 0.0, 0.0
        self.scheduler = Scheduler(cfg.max_num_seqs, self.max_num_batched_tokens,
                                   CPU_MAX_PADDING if on_cpu else GPU_MAX_PADDING, overhead_tokens)
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self.encoder = Encoder(key)
        self.input_decoder = Decoder(m.EngineInbound, key=key)
        self.control_decoder = Decoder(m.EngineControl, key=key)
        self.dropped_control = DropLog(log, "a malformed or foreign control message")
        self.dropped_input = DropLog(log, "a malformed or foreign input message")
        self.running = True
        self.steps = 0
        # Stage times not yet reported (they ride on the next OutputBatch).
        self.render_s: dict[int, float] = {}
        self.admit_s = 0.0
        self.clock = BusyClock()

    def ready_info(self) -> dict:
        import torch

        return {"device": str(self.runner.device), "dtype": str(self.runner.dtype).removeprefix("torch."),
                "torch_threads": torch.get_num_threads(),
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "step_overhead_ms": round(1000 * self.step_overhead_s, 3),
                "step_overhead_tokens": round(self.scheduler.overhead_tokens, 1)}

    def serve(self, ctx: zmq.Context, to_front: zmq.Socket) -> None:
        inputs = socket(ctx, zmq.PULL, self.cfg.input_endpoint, bind=True)
        control = socket(ctx, zmq.PULL, self.cfg.control_endpoint, bind=False)
        self.to_front = to_front
        to_front.send_multipart(self.encoder.encode(m.Ready("engine", 0, os.getpid(), info=self.ready_info())))
        start_heartbeat(ctx, self.cfg.output_endpoint, "engine", 0, self.clock, self.key)
        # While the window is full the input socket is simply not polled: back-pressure.
        control_only, both = zmq.Poller(), zmq.Poller()
        control_only.register(control, zmq.POLLIN)
        both.register(control, zmq.POLLIN)
        both.register(inputs, zmq.POLLIN)
        while self.running:
            poller = both if self._has_room() else control_only
            timeout = 0 if len(self.scheduler) else IDLE_POLL_MS
            events = dict(poller.poll(timeout))
            if control in events:
                self._drain(control, self._on_control)
            if inputs in events and self.running:
                self._drain(inputs, self._on_inputs, while_=self._has_room)
            if len(self.scheduler) and self.running:
                with self.clock:
                    self._step()
                self.steps += 1
                if self.steps % TRIM_EVERY_STEPS == 0:
                    release_free_memory()

    def _has_room(self) -> bool:
        return len(self.scheduler) + self.cfg.max_message_items <= self.cfg.window

    def _drain(self, sock: zmq.Socket, handle, while_=lambda: True) -> None:
        while while_():
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle(frames)

    def _on_control(self, frames) -> None:
        try:
            msg = self.control_decoder.decode(frames)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.dropped_control(e)
            return
        if isinstance(msg, m.Shutdown):
            self.running = False
            return
        self._abort(msg.request_ids)

    def _abort(self, request_ids: list[str]) -> None:
        self.scheduler.abort(request_ids)
        # Remember every aborted id, not only those still on their way: a chunked document's
        # other chunks may still come, and ids are never reused.
        for rid in request_ids:
            self.aborted[rid] = None
        while len(self.aborted) > MAX_REMEMBERED_ABORTS:
            self.aborted.popitem(last=False)

    def _on_inputs(self, frames) -> None:
        start = time.perf_counter()
        try:
            self._admit(frames)
        finally:
            self.admit_s += time.perf_counter() - start

    def _admit(self, frames) -> None:
        try:
            msg = self.input_decoder.decode(frames)
            items = msg.unpack()
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            self.dropped_input(e)
            return
        if 0.0 < msg.render_s < 1e6:  # a stat only: anything odd is ignored
            self.render_s[msg.worker] = self.render_s.get(msg.worker, 0.0) + msg.render_s
        if self.aborted:
            items = [r for r in items if r.request_id not in self.aborted]
        if self._all_valid(msg, items):  # the usual case: one check for the whole message
            for request in items:
                self.scheduler.add(request)
            return
        rejected: list[tuple[m.PoolingEngineInput, str]] = []
        for request in items:
            problem = self._invalid(request)
            if problem:
                rejected.append((request, problem))
            else:
                self.scheduler.add(request)
        if rejected:  # a well-formed message with bad contents: refuse those requests, keep going
            self.log.error("rejected %d malformed engine inputs", len(rejected))
            self.to_front.send_multipart(self.encoder.encode(m.RenderFailed(
                [r.request_id for r, _ in rejected], [r.index for r, _ in rejected], [e for _, e in rejected])))

    def _all_valid(self, msg: m.EngineInputBatch, items: list[m.PoolingEngineInput]) -> bool:
        """True when every input passes `_invalid`'s checks (False says "look at each one").
        The array checks run once on the message's packed ids (aborted items' included, which
        only makes it stricter); per item only what is not in the array remains."""
        model = self.cfg.model
        ids, lengths = msg.token_ids, msg.lengths
        if ids.dtype != np.int32 or (lengths.size and (int(lengths.min()) < 1 or int(lengths.max()) > model.max_model_len)):
            return False
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= model.vocab_size):
            return False
        return all(r.task in model.tasks and (r.token_type_start is None or 0 <= r.token_type_start < r.token_ids.size)
                   for r in items)

    def _invalid(self, request: m.PoolingEngineInput) -> str | None:
        ids = request.token_ids
        if request.task not in self.cfg.model.tasks:
            return f"task {request.task!r} is not one this model runs ({self.cfg.model.tasks})"
        if request.token_type_start is not None and not 0 <= request.token_type_start < ids.size:
            return f"token_type_start {request.token_type_start} is outside the prompt"
        if ids.dtype != np.int32 or ids.ndim != 1:
            return f"engine input must be a 1-D int32 array, got {ids.dtype} with shape {ids.shape}"
        if not 0 < ids.size <= self.cfg.model.max_model_len:
            return f"engine input has {ids.size} tokens; the model takes 1 to {self.cfg.model.max_model_len}"
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.model.vocab_size:
            return f"engine input has token ids outside [0, {self.cfg.model.vocab_size})"
        return None

    def _step(self) -> None:
        in_core = len(self.scheduler)
        try:
            batch = self.scheduler.next_batch()
        except Exception as e:  # scheduling itself failed: fail everything waiting rather than loop on it
            self.log.exception("scheduling failed")
            batch = self.scheduler.take_all()
            self._send(m.StepFailed([r.request_id for r in batch], [r.index for r in batch], f"{type(e).__name__}: {e}"))
            return
        self._run(batch, in_core, isolate=True)

    def _run(self, batch: list[m.PoolingEngineInput], in_core: int, isolate: bool) -> None:
        start = time.perf_counter()
        try:
            vectors, padded = self.runner.run(batch)
        except Exception as e:  # the failed requests are dropped here; the engine stays usable
            if isolate and len(batch) > 1:
                # One bad input must not cost its batch: run each request alone, so only the
                # culprit fails and the others get their results.
                self.log.warning("step of %d requests failed (%s); isolating the culprit", len(batch), e)
                for request in batch:
                    if request.chunk >= 0 and request.request_id in self.aborted:
                        continue  # another chunk of its document failed: the document has failed
                    self._run([request], in_core, isolate=False)
                return
            self.log.error("step failed for %s: %s: %s", [r.request_id for r in batch], type(e).__name__, e)
            self._send(m.StepFailed([r.request_id for r in batch], [r.index for r in batch], f"{type(e).__name__}: {e}"))
            # A document with a failed chunk has failed: its other chunks are dropped, not computed.
            failed_docs = list(dict.fromkeys(r.request_id for r in batch if r.chunk >= 0))
            if failed_docs:
                self._abort(failed_docs)
            return
        outputs = [m.PoolingOutput(r.request_id, r.index, len(r.token_ids), data=v, chunk=r.chunk,
                                   num_chunks=r.num_chunks) for r, v in zip(batch, vectors)]
        if self.cfg.model.sparse is not None:  # (token ids, weights) pairs
            for out in outputs:
                out.indices, out.data = out.data
        self._send(m.OutputBatch.pack(outputs, time.perf_counter() - start, padded, in_core, self.render_s, self.admit_s))
        self.render_s, self.admit_s = {}, 0.0

    def _send(self, msg) -> None:
        self.to_front.send_multipart(self.encoder.encode(msg), copy=False)


def release_free_memory() -> None:
    """glibc's malloc_trim: return free heap pages to the system (a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    cfg = msgspec.json.decode(argv[1], type=EngineConfig)
    key = take_group_key()
    log = setup_logging(cfg.log_level, "engine")
    exit_with_parent(cfg.parent_pid, socket_dir_of(cfg.output_endpoint))
    ctx = zmq.Context(1)
    to_front = socket(ctx, zmq.PUSH, cfg.output_endpoint, bind=False)
    try:
        engine = EngineCore(cfg, log, key)
    except Exception as e:
        log.exception("engine core failed to start")
        to_front.send_multipart(Encoder(key).encode(m.Ready("engine", 0, os.getpid(), error=f"{type(e).__name__}: {e}")))
        to_front.close(linger=2000)
        return 1
    run_maybe_profiled(lambda: engine.serve(ctx, to_front), "engine")
    log.info("shutting down")
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
