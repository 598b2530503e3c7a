"""Spawns, watches and tears down the engine core and the render workers.

Transport: ipc:// endpoints in a fresh private directory (mode 0700) per group, removed on close.
The frontend binds its sockets; the children connect (and the engine binds its input socket).
Children start as module entry points with `python -m`, never forked from the caller, so a
process holding torch threads is never forked and no `__main__` guard is needed.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from pooling_pipeline.core import messages as m
from pooling_pipeline.core.config import EngineConfig, ModelSpec, WorkerConfig
from pooling_pipeline.core.runtime import socket
from pooling_pipeline.core.serial import Decoder, Encoder
from pooling_pipeline.errors import EngineDeadError, WorkerStartError

log = logging.getLogger("pipeline")

SHUTDOWN_GRACE_S = 5.0  # a child exits in about a second; under load torch teardown takes longer
LOG_TAIL_CHARS = 3000


class Child:
    def __init__(self, role: str, index: int, proc: subprocess.Popen, log_path: Path) -> None:
        self.role, self.index, self.proc, self.log_path = role, index, proc, log_path

    @property
    def name(self) -> str:
        return "engine core" if self.role == "engine" else f"render worker {self.index}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-LOG_TAIL_CHARS:].strip()


class ProcessGroup:
    def __init__(self, spec: ModelSpec, *, num_workers: int, engine_threads: int, device: str, dtype: str,
                 max_num_seqs: int, max_num_batched_tokens: int | None, window: int, max_message_items: int,
                 io_processor: str | None = None, log_level: str = "WARNING",
                 heartbeat_timeout_s: float = 30.0, step_timeout_s: float = 600.0) -> None:
        self.spec = spec
        self.dir = Path(tempfile.mkdtemp(prefix="pooling-pipeline-"))  # mode 0700
        os.chmod(self.dir, 0o700)
        self.ctx = zmq.Context(1)
        self.encoder = Encoder()
        self.decoder = Decoder(m.FrontendInbound, writable_arrays=True)
        self.closed = False
        self.children: list[Child] = []
        self.workers: list[Child | None] = [None] * num_workers
        self.worker_info: dict = {}
        self.engine_info: dict = {}
        ep = lambda name: f"ipc://{self.dir}/{name}"  # noqa: E731
        self.endpoints = {"results": ep("results"), "control": ep("control"), "engine_in": ep("engine-in")}
        self.results = socket(self.ctx, zmq.PULL, self.endpoints["results"], bind=True)
        self.control = socket(self.ctx, zmq.PUSH, self.endpoints["control"], bind=True)
        self.work = [socket(self.ctx, zmq.PUSH, ep(f"work-{i}"), bind=True) for i in range(num_workers)]
        self.log_level = log_level
        self.io_processor = io_processor
        # Liveness: a child that sends nothing for heartbeat_timeout_s (stopped, wedged) or stays
        # inside one piece of work for step_timeout_s is treated as dead. Nothing waits forever.
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.step_timeout_s = step_timeout_s
        self.last_seen: dict[tuple[str, int], float] = {}
        self.busy_s: dict[tuple[str, int], float] = {}
        self.ready: set[tuple[str, int]] = set()  # heartbeats are expected only once a child is ready
        self.startup_timeout_s = 300.0
        self.engine_cfg = EngineConfig(
            model=spec, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, window=window, max_message_items=max_message_items,
            torch_threads=engine_threads, input_endpoint=self.endpoints["engine_in"],
            control_endpoint=self.endpoints["control"], output_endpoint=self.endpoints["results"],
            parent_pid=os.getpid(), log_level=log_level)
        try:
            self.engine = self._spawn("engine", 0, "pooling_pipeline.core.engine", self.engine_cfg, {
                "OMP_NUM_THREADS": str(engine_threads), "MKL_NUM_THREADS": str(engine_threads),
                # oneDNN caches a compiled kernel per batch shape (1024 by default): with shapes that
                # change every step that cache grew the engine by 124 MB over a 1M-request soak.
                # A small cache keeps memory flat and costs nothing measurable.
                "ONEDNN_PRIMITIVE_CACHE_CAPACITY": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")})
            for i in range(num_workers):
                self.start_worker(i)
        except BaseException:
            self.close()  # what did start must not outlive a failed start
            raise

    def _spawn(self, role: str, index: int, module: str, cfg: msgspec.Struct, extra_env: dict) -> Child:
        env = dict(os.environ)
        env.update(extra_env)
        if self.io_processor is not None:
            # A plugin module next to the caller's script or notebook must import in the workers
            # too: they get the caller's import path (the project itself is installed).
            paths = [os.path.abspath(p or ".") for p in sys.path if os.path.isdir(p or ".")]
            env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["TOKENIZERS_PARALLELISM"] = "false"
        env.setdefault("HF_HUB_OFFLINE", "1")  # models load from local paths only
        log_path = self.dir / f"{role}{index}.log"
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, msgspec.json.encode(cfg).decode()],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                # The private directory as working directory: nothing in the caller's (a local
                # `core/` or `pipeline.py`) can shadow a module the children import.
                env=env, cwd=self.dir, close_fds=True)
        child = Child(role, index, proc, log_path)
        self.children.append(child)
        self.last_seen[(role, index)] = time.monotonic()
        self.busy_s[(role, index)] = 0.0
        self.ready.discard((role, index))
        return child

    def start_worker(self, index: int) -> Child:
        cfg = WorkerConfig(index=index, model=self.spec, work_endpoint=self.work[index].getsockopt_string(zmq.LAST_ENDPOINT),
                           engine_endpoint=self.endpoints["engine_in"], output_endpoint=self.endpoints["results"],
                           parent_pid=os.getpid(), io_processor=self.io_processor,
                           max_message_items=self.engine_cfg.max_message_items, log_level=self.log_level)
        child = self._spawn("worker", index, "pooling_pipeline.workers.main", cfg,
                            {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        self.workers[index] = child
        return child

    @property
    def pids(self) -> dict:
        return {"engine": self.engine.proc.pid, "workers": [w.proc.pid for w in self.workers if w is not None]}

    # ---- start-up --------------------------------------------------------------------

    def wait_ready(self, timeout_s: float) -> None:
        """Waits for a Ready from every child; raises with the child's own log if one fails."""
        self.startup_timeout_s = timeout_s
        pending = {("engine", 0)} | {("worker", i) for i in range(len(self.workers))}
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise EngineDeadError(f"process group not ready after {timeout_s:.0f} s; waiting for {sorted(pending)}")
            self.check_alive()
            if not self.results.poll(200):
                continue
            msg = self.recv()
            if not isinstance(msg, m.Ready):
                continue
            if msg.error:
                child = self.engine if msg.role == "engine" else self.workers[msg.index]
                kind = EngineDeadError if msg.role == "engine" else WorkerStartError
                raise kind(f"{child.name} failed to start: {msg.error}")
            (self.engine_info if msg.role == "engine" else self.worker_info).update(msg.info)
            pending.discard((msg.role, msg.index))

    # ---- messages ----------------------------------------------------------------------

    def recv(self):
        """The next decodable message on the results socket (malformed ones are logged and dropped)."""
        while True:
            frames = self.results.recv_multipart(copy=False)
            try:
                msg = self.decoder.decode(frames)
                if isinstance(msg, m.OutputBatch):
                    msg.unpack()  # each output gets its row of the packed data
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                log.error("dropped a malformed message from a child: %s", e)
                if not self.results.poll(0):
                    return None
                continue
            self._note(msg)
            return msg

    def _note(self, msg) -> None:
        now = time.monotonic()
        if isinstance(msg, m.Heartbeat):
            self.last_seen[(msg.role, msg.index)] = now
            self.busy_s[(msg.role, msg.index)] = msg.busy_s
        elif isinstance(msg, (m.OutputBatch, m.StepFailed)):
            self.last_seen[("engine", 0)] = now
        elif isinstance(msg, m.Ready):
            self.last_seen[(msg.role, msg.index)] = now
            if msg.error is None:
                self.ready.add((msg.role, msg.index))

    def reset_liveness(self) -> None:
        """Between calls nobody reads the heartbeats: a new call starts every clock afresh."""
        now = time.monotonic()
        for key in self.last_seen:
            self.last_seen[key] = now

    def send_work(self, worker: int, items: list[m.RenderParams], chat_template: str | None = None) -> None:
        # NOBLOCK: a worker that died (no peer on its socket) raises zmq.Again instead of blocking.
        frames = self.encoder.encode(m.RenderBatch(items, chat_template))
        self.work[worker].send_multipart(frames, zmq.NOBLOCK, copy=False)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and not self.closed:
            try:  # never block on an engine that is gone: its requests went with it
                self.control.send_multipart(self.encoder.encode(m.Abort(request_ids)), zmq.NOBLOCK)
            except zmq.Again:
                log.warning("could not send an abort for %d requests: the engine core is not reachable",
                            len(request_ids))

    # ---- health ------------------------------------------------------------------------

    def check_alive(self) -> list[int]:
        """Raises EngineDeadError if the engine is gone or wedged; returns the indices of dead
        workers (a wedged worker is killed first, so it is dead too)."""
        if not self.engine.alive():
            tail = self.engine.log_tail()
            raise EngineDeadError(f"engine core exited with code {self.engine.proc.returncode}"
                                  + (f"; its last output:\n{tail}" if tail else ""))
        wedged = self._wedged("engine", 0)
        if wedged:
            self.engine.proc.kill()
            raise EngineDeadError(f"engine core {wedged}; it was killed")
        dead = []
        for i, worker in enumerate(self.workers):
            if worker is None:
                continue
            wedged = self._wedged("worker", i) if worker.alive() else None
            if wedged:
                log.warning("render worker %d %s; killing it", i, wedged)
                worker.proc.kill()
                worker.proc.wait()
            if not worker.alive():
                dead.append(i)
        return dead

    def _wedged(self, role: str, index: int) -> str | None:
        if (role, index) not in self.ready:  # still loading its model or tokenizer
            starting = time.monotonic() - self.last_seen.get((role, index), time.monotonic())
            return f"did not become ready in {starting:.0f} s" if starting > self.startup_timeout_s else None
        silent = time.monotonic() - self.last_seen.get((role, index), time.monotonic())
        if silent > self.heartbeat_timeout_s:
            return f"sent no heartbeat for {silent:.0f} s (stopped or wedged)"
        busy = self.busy_s.get((role, index), 0.0)
        if busy > self.step_timeout_s:
            return f"has been stuck in one piece of work for {busy:.0f} s"
        return None

    # ---- tear-down -----------------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # Every live child is asked on its own: one that cannot be reached must not keep the
        # others from their orderly exit (the rest are killed after the grace period).
        asks = [(sock, self.workers[i]) for i, sock in enumerate(self.work)]
        asks.append((self.control, getattr(self, "engine", None)))
        shutdown = self.encoder.encode(m.Shutdown())
        for sock, child in asks:
            if child is not None and child.alive():
                try:
                    sock.send_multipart(shutdown, zmq.NOBLOCK)
                except zmq.ZMQError as e:
                    log.debug("could not ask %s to shut down: %s", child.name, e)
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.send_signal(signal.SIGKILL)
                child.proc.wait()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)
