"""One call's journey through the group: bounded in-flight window, dispatch, reorder buffer.

A `Call` pulls RenderParams lazily from the request generator, never holding more than
`max_inflight` requests that are issued but not yet handed to the caller (this counts the
reorder buffer too, so memory stays bounded however long the input is). Work goes in small
batches to the least-loaded render worker; outputs come straight from the engine core and are
handed back in input order. Any failure, a stop by the caller (generator closed,
KeyboardInterrupt) or a bad input found on the way aborts everything still in flight by
external id, so the group is clean for the next call.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator

import numpy as np
import zmq

from pooling_pipeline.call_stats import CallStats
from pooling_pipeline.core import messages as m
from pooling_pipeline.core.vectors import finish_embeddings
from pooling_pipeline.errors import PipelineError, StepError
from pooling_pipeline.inputs import CallOptions, FailedRequest
from pooling_pipeline.process_group import ProcessGroup

log = logging.getLogger("pipeline")

WAIT_MS = 100
HEALTH_CHECK_INTERVAL_S = 0.5
MAX_WORKER_RESTARTS_PER_CALL = 8
# Besides the request count, the text held for requests in flight is bounded (kept for re-sending
# if a worker dies): a window of 100 MB web pages must not hold gigabytes.
MAX_INFLIGHT_CHARS = 64 * 1024 * 1024


def request_size(request: m.RenderParams) -> int:
    """Roughly the characters (or token ids) held for a request."""
    size = len(request.prompt or "") + len(request.pair or "")
    if request.token_ids is not None:
        size += request.token_ids.size
    if request.conversation is not None:
        size += sum(len(turn["content"]) for turn in request.conversation)
    return max(size, 1)


class ChunkSum:
    """Chunk mode: a document's chunk vectors pooled back into one (token-weighted mean)."""

    def __init__(self, num_chunks: int) -> None:
        self.num_chunks = num_chunks
        self.seen: set[int] = set()
        self.total: np.ndarray | None = None
        self.tokens = 0

    def add(self, out: m.PoolingOutput) -> bool:
        """Adds a chunk; False for a duplicate (a re-sent request's chunk seen before)."""
        if out.chunk in self.seen:
            return False
        self.seen.add(out.chunk)
        weighted = out.data.astype(np.float64) * out.num_prompt_tokens
        self.total = weighted if self.total is None else self.total + weighted
        self.tokens += out.num_prompt_tokens
        return True

    @property
    def complete(self) -> bool:
        return len(self.seen) == self.num_chunks

    def finish(self, out: m.PoolingOutput, params: m.PoolingParams, default_normalize: bool) -> m.PoolingOutput:
        mean = (self.total / max(self.tokens, 1)).astype(np.float32)
        normalize = params.normalize if params.normalize is not None else default_normalize
        vector = finish_embeddings(mean, params.dimensions, normalize)
        return m.PoolingOutput(out.request_id, out.index, self.tokens, data=vector, num_chunks=self.num_chunks)


class Call:
    def __init__(self, group: ProcessGroup, requests: Iterator[m.RenderParams | FailedRequest], opts: CallOptions, *,
                 max_inflight: int, batch_items: int, progress=None, default_normalize: bool = True) -> None:
        self.group = group
        self.requests = requests
        self.max_inflight = max_inflight
        self.batch_items = batch_items
        self.progress = progress
        self.chat_template = opts.chat_template
        self.default_normalize = default_normalize
        self.errors = opts.errors  # "raise": the first failure ends the call; "return": it becomes an output
        self.chunks: dict[str, ChunkSum] = {}  # chunk mode: documents with chunks still out
        self.stats = CallStats()
        self.inflight: dict[str, tuple[m.RenderParams, int]] = {}  # external id -> (request, worker)
        self.outstanding = [0] * len(group.work)  # requests per worker not yet answered
        self.backlog: deque[m.RenderParams] = deque()  # to (re)send when a worker can take them
        self.ready: dict[int, m.PoolingOutput] = {}  # reorder buffer: index -> output
        self.inflight_chars = 0
        self.issued = 0
        self.next_index = 0
        self.exhausted = False
        self.finished = False
        self.ended_by: str | None = None  # set when another call ended this one
        self.next_health_check = 0.0
        self.handlers = {m.OutputBatch: self._on_outputs, m.RenderFailed: self._on_render_failed,
                         m.StepFailed: self._on_step_failed}

    # ---- the loop ----------------------------------------------------------------------

    def outputs(self) -> Iterator[m.PoolingOutput]:
        self.group.reset_liveness()
        try:
            while True:
                if self.ended_by:
                    raise PipelineError(self.ended_by)
                started = time.perf_counter()
                self._issue()
                self.stats.frontend_busy_s += time.perf_counter() - started
                while self.next_index in self.ready:
                    out = self.ready.pop(self.next_index)
                    self.next_index += 1
                    yield out
                if self.exhausted and self.next_index == self.issued:
                    return
                self._wait()
        except BaseException:
            self.abort()
            raise
        finally:
            self.finished = True
            self.stats.wall_s = time.perf_counter() - self.stats.start
            if self.progress is not None:
                self.progress.close()

    def abort(self, reason: str | None = None) -> None:
        """Drops every request of this call still in flight, in the engine too.

        With a reason, the call's generator raises it if the caller resumes it later: results
        it would have yielded are gone, and silently stopping would look like the end of the data.
        """
        self.ended_by = reason
        if self.inflight and not self.group.closed:
            self.group.abort(list(self.inflight))
        self.inflight.clear()
        self.chunks.clear()
        self.inflight_chars = 0
        self.backlog.clear()
        self.ready.clear()
        self.exhausted = True

    # ---- sending -------------------------------------------------------------------------

    def _issue(self) -> None:
        backlog, self.backlog = list(self.backlog), deque()
        self._send(backlog)  # what cannot be sent yet goes back into self.backlog
        pending: list[m.RenderParams] = []
        while (not self.exhausted and self.issued - self.next_index < self.max_inflight
               and self.inflight_chars < MAX_INFLIGHT_CHARS):
            try:
                request = next(self.requests)  # validation errors surface here, in the caller
            except StopIteration:
                self.exhausted = True
                break
            self.issued += 1
            if isinstance(request, FailedRequest):  # refused in the caller (errors="return")
                self.ready[request.index] = m.PoolingOutput(request.request_id, request.index, 0, error=request.error)
                self.stats.errors += 1
                continue
            pending.append(request)
            self.inflight_chars += request_size(request)
            if len(pending) == self.batch_items:
                self._send(pending)
                pending = []
        self._send(pending)
        self.stats.max_inflight_seen = max(self.stats.max_inflight_seen, self.issued - self.next_index)

    def _send(self, items: list[m.RenderParams]) -> None:
        for start in range(0, len(items), self.batch_items):
            batch = items[start:start + self.batch_items]
            worker = min(range(len(self.outstanding)), key=self.outstanding.__getitem__)
            try:
                self.group.send_work(worker, batch, self.chat_template)
            except zmq.Again:  # that worker is gone or restarting: try again on the next turn
                self.backlog.extend(batch)
                continue
            for request in batch:
                self.inflight[request.request_id] = (request, worker)
            self.outstanding[worker] += len(batch)

    # ---- receiving ------------------------------------------------------------------------

    def _wait(self) -> None:
        if self.group.results.poll(WAIT_MS):
            started = time.perf_counter()
            while self.group.results.poll(0):
                msg = self.group.recv()
                if msg is not None:
                    self._handle(msg)
            self.stats.frontend_busy_s += time.perf_counter() - started
        if time.monotonic() >= self.next_health_check:
            self._check_health()

    def _handle(self, msg) -> None:
        handler = self.handlers.get(type(msg))
        if handler is not None:  # Ready and Heartbeat only concern the process group
            handler(msg)

    def _on_outputs(self, msg: m.OutputBatch) -> None:
        stats = self.stats
        stats.engine_busy_s += msg.busy_s
        stats.engine_admit_s += msg.admit_s
        for worker, seconds in msg.render_s.items():
            stats.render_busy_s[worker] = stats.render_busy_s.get(worker, 0.0) + seconds
        stats.padded_tokens += msg.padded_tokens
        stats.batches += 1
        stats.max_in_core_seen = max(stats.max_in_core_seen, msg.in_core)
        stats.depths["engine_window"].add(msg.in_core)
        stats.depths["batch_size"].add(len(msg.outputs))
        stats.depths["frontend_inflight"].add(self.issued - self.next_index)
        stats.depths["reorder_buffer"].add(len(self.ready))
        accepted = 0
        for out in msg.outputs:
            entry = self.inflight.get(out.request_id)
            if entry is None or entry[0].index != out.index:
                stats.duplicates_dropped += 1  # re-sent, aborted or from an earlier call
                continue
            if out.chunk >= 0:
                chunks = self.chunks.setdefault(out.request_id, ChunkSum(out.num_chunks))
                if not chunks.add(out):
                    stats.duplicates_dropped += 1
                if not chunks.complete:
                    continue
                out = chunks.finish(out, entry[0].params, self.default_normalize)
                del self.chunks[out.request_id]
            self._settle(out.request_id)
            self.ready[out.index] = out
            stats.requests += 1
            stats.prompt_tokens += out.num_prompt_tokens
            accepted += 1
        if self.progress is not None and accepted:
            self.progress.update(accepted)
            wall = time.perf_counter() - stats.start
            self.progress.set_postfix_str(f"{stats.prompt_tokens / max(wall, 1e-9):,.0f} tok/s", refresh=False)

    def _on_render_failed(self, msg: m.RenderFailed) -> None:
        for rid, index, error in zip(msg.request_ids, msg.indices, msg.errors):
            if self._owns(rid, index):
                if self.errors != "return":
                    raise ValueError(f"request {index}: {error}")
                self._fail(rid, index, f"request {index}: {error}")

    def _on_step_failed(self, msg: m.StepFailed) -> None:
        # One request appears once however many of its chunks the failed step held.
        mine = dict.fromkeys((rid, index) for rid, index in zip(msg.request_ids, msg.indices)
                             if self._owns(rid, index))
        if mine and self.errors != "return":
            # The call ends: `abort` (on the way out) drops these and every other request still
            # in flight by external id, other chunks of a failed document included.
            raise StepError(
                f"the engine core failed a step for requests {[i for _, i in mine]} "
                f"(ids {[r for r, _ in mine]}): {msg.error}",
                [r for r, _ in mine], [i for _, i in mine])
        for rid, index in mine:
            self._fail(rid, index, f"request {index}: the model failed on it: {msg.error}")

    def _owns(self, request_id: str, index: int) -> bool:
        entry = self.inflight.get(request_id)
        return entry is not None and entry[0].index == index

    def _settle(self, request_id: str) -> m.RenderParams:
        """The request is answered: it leaves the in-flight window."""
        request, worker = self.inflight.pop(request_id)
        self.outstanding[worker] -= 1
        self.inflight_chars -= request_size(request)
        return request

    def _fail(self, request_id: str, index: int, error: str) -> None:
        """errors="return": this request's output carries the error; the call goes on."""
        request = self._settle(request_id)
        if request.long_inputs == "chunk":  # its other chunks would be computed for nothing
            self.chunks.pop(request_id, None)
            self.group.abort([request_id])
        self.ready[index] = m.PoolingOutput(request_id, index, 0, error=error)
        self.stats.errors += 1
        if self.progress is not None:
            self.progress.update(1)

    def _check_health(self) -> None:
        self.next_health_check = time.monotonic() + HEALTH_CHECK_INTERVAL_S
        for index in self.group.check_alive():  # raises EngineDeadError
            self.stats.worker_restarts += 1
            if self.stats.worker_restarts > MAX_WORKER_RESTARTS_PER_CALL:
                tail = self.group.workers[index].log_tail()
                raise PipelineError(f"render worker {index} keeps dying; its last output:\n{tail}")
            log.warning("render worker %d died; starting a replacement and re-sending its requests", index)
            self.group.start_worker(index)
            lost = [req for req, worker in self.inflight.values() if worker == index]
            for req in lost:
                del self.inflight[req.request_id]
                self.chunks.pop(req.request_id, None)  # its windows come again from the new worker
            self.outstanding[index] = 0
            self.backlog.extend(lost)
