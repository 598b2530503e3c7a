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

from core import messages as m
from pipeline.call_stats import CallStats
from pipeline.errors import PipelineError, StepError
from pipeline.inputs import FailedRequest
from pipeline.process_group import ProcessGroup

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
    """Chunk mode: a document's window vectors pooled back into one (token-weighted mean)."""

    def __init__(self, num_windows: int) -> None:
        self.num_windows = num_windows
        self.seen: set[int] = set()
        self.total: np.ndarray | None = None
        self.tokens = 0

    def add(self, out: m.PoolingOutput) -> bool:
        """Adds a window; False for a duplicate (a re-sent request's window seen before)."""
        if out.window in self.seen:
            return False
        self.seen.add(out.window)
        weighted = out.data.astype(np.float64) * out.num_prompt_tokens
        self.total = weighted if self.total is None else self.total + weighted
        self.tokens += out.num_prompt_tokens
        return True

    @property
    def complete(self) -> bool:
        return len(self.seen) == self.num_windows

    def finish(self, out: m.PoolingOutput, params: m.PoolingParams, default_normalize: bool) -> m.PoolingOutput:
        vector = (self.total / max(self.tokens, 1)).astype(np.float32)
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        if (params.normalize if params.normalize is not None else default_normalize):
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return m.PoolingOutput(out.request_id, out.seq, self.tokens, data=vector, num_windows=self.num_windows)


class Call:
    def __init__(self, group: ProcessGroup, requests: Iterator[m.RenderParams], *, max_inflight: int,
                 batch_items: int, progress=None, chat_template: str | None = None,
                 default_normalize: bool = True, errors: str = "raise") -> None:
        self.group = group
        self.requests = requests
        self.max_inflight = max_inflight
        self.batch_items = batch_items
        self.progress = progress
        self.chat_template = chat_template
        self.default_normalize = default_normalize
        self.errors = errors  # "raise": the first failure ends the call; "return": it becomes an output
        self.chunks: dict[str, ChunkSum] = {}  # chunk mode: documents with windows still out
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
                self.ready[request.seq] = m.PoolingOutput(request.request_id, request.seq, 0, error=request.error)
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
            chunk = items[start:start + self.batch_items]
            worker = min(range(len(self.outstanding)), key=self.outstanding.__getitem__)
            try:
                self.group.send_work(worker, chunk, self.chat_template)
            except zmq.Again:  # that worker is gone or restarting: try again on the next turn
                self.backlog.extend(chunk)
                continue
            for request in chunk:
                self.inflight[request.request_id] = (request, worker)
            self.outstanding[worker] += len(chunk)

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
        if isinstance(msg, m.OutputBatch):
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
                if entry is None or entry[0].seq != out.seq:
                    self.stats.duplicates_dropped += 1  # re-sent, aborted or from an earlier call
                    continue
                if out.window >= 0:
                    chunks = self.chunks.setdefault(out.request_id, ChunkSum(out.num_windows))
                    if not chunks.add(out):
                        self.stats.duplicates_dropped += 1
                    if not chunks.complete:
                        continue
                    out = chunks.finish(out, entry[0].params, self.default_normalize)
                    del self.chunks[out.request_id]
                del self.inflight[out.request_id]
                self.outstanding[entry[1]] -= 1
                self.inflight_chars -= request_size(entry[0])
                self.ready[out.seq] = out
                self.stats.requests += 1
                self.stats.prompt_tokens += out.num_prompt_tokens
                accepted += 1
            if self.progress is not None and accepted:
                self.progress.update(accepted)
                wall = time.perf_counter() - self.stats.start
                self.progress.set_postfix_str(f"{self.stats.prompt_tokens / max(wall, 1e-9):,.0f} tok/s", refresh=False)
        elif isinstance(msg, m.RenderFailed):
            for rid, seq, error in zip(msg.request_ids, msg.seqs, msg.errors):
                if self._owns(rid, seq):
                    if self.errors != "return":
                        raise ValueError(f"request {seq}: {error}")
                    self._fail(rid, seq, f"request {seq}: {error}")
        elif isinstance(msg, m.StepFailed):
            mine = [(rid, seq) for rid, seq in zip(msg.request_ids, msg.seqs) if self._owns(rid, seq)]
            if mine and self.errors != "return":
                for rid, _ in mine:
                    del self.inflight[rid]  # already dropped in the engine
                raise StepError(
                    f"the engine core failed a step for requests {[s for _, s in mine]} "
                    f"(ids {[r for r, _ in mine]}): {msg.error}",
                    [r for r, _ in mine], [s for _, s in mine])
            for rid, seq in mine:
                self._fail(rid, seq, f"request {seq}: the model failed on it: {msg.error}")

    def _owns(self, request_id: str, seq: int) -> bool:
        entry = self.inflight.get(request_id)
        return entry is not None and entry[0].seq == seq

    def _fail(self, request_id: str, seq: int, error: str) -> None:
        """errors="return": this request's output carries the error; the call goes on."""
        request, worker = self.inflight.pop(request_id)
        self.outstanding[worker] -= 1
        self.inflight_chars -= request_size(request)
        self.chunks.pop(request_id, None)
        self.ready[seq] = m.PoolingOutput(request_id, seq, 0, error=error)
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
