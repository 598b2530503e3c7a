"""Spawns, watches and tears down the engine core(s) and the render workers.

Transport: ipc:// endpoints in a fresh private directory (mode 0700) per group, removed on close
(and by the children when the frontend's process dies without closing: SIGTERM, SIGKILL). The
frontend binds its sockets; the children connect (and the engine binds its input socket).
Every message carries the group's random key (`core.shared.serial`); frames without it are dropped.
What the frontend sends (work, control) is addressed to one child's random routing id
(`runtime.router_socket`), so a process that connects to a socket receives nothing, and each
worker's heartbeat counts the messages it took: a batch that never reached its worker is
noticed (`_lost_work`) and re-sent with the rest of that worker's work.
Children start as module entry points with `python -m`, never forked from the caller, so a
process holding torch threads is never forked and no `__main__` guard is needed.

Data parallel (`data_parallel_size` N > 1): N engine cores, each with its own input endpoint
("engine-in-k", which it binds), its own control socket ("control-k": a PUSH socket bound to N
peers would round-robin, and an Abort or Shutdown must reach a given engine) and its own device;
every render worker connects to all of them and sends each RenderBatch's inputs to the engine the
frontend named in it.

An engine core that dies (a crash, SIGKILL, DEVICE_LOST_EXIT after a sticky CUDA error) or wedges
(killed first) is restarted in its slot -- same device, config and endpoints; a new control routing
id -- with the workers' back-off. Its input socket is bound again and the workers' PUSH sockets
reconnect by themselves; what they had queued towards the dead process (ZeroMQ keeps a connecting
socket's queue across a reconnect) reaches the new one and is computed or aborted there, but only
for calls that failed: the slot's generation (`engine_gen`) tells each call which of its requests
went towards the dead process, and a call that had any fails as a whole (frontend.receiver.LostEngine),
its outputs dropped from then on. The aborts of those calls are held until the new process's control
socket connects. More than MAX_ENGINE_RESTARTS_PER_MINUTE restarts of one engine core within a
minute, or a restarted one that cannot start, fails the group as before.

The group belongs to the process that created it: in an `os.fork()`ed child, `close()` (the exit
handler too) leaves the parent's sockets, children and directory alone.

Liveness is measured on a RunClock (`core.shared.runtime`): a heartbeat gap during which the frontend
itself did not run (the whole job stopped with Ctrl-Z) is not taken for a dead child. A render
worker that dies is restarted with back-off; more than MAX_WORKER_RESTARTS_PER_MINUTE restarts of
one worker within a minute is an error for the calls running (the restarts go on).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from pooling_pipeline.core.families import family_of
from pooling_pipeline.core.shared import messages as m
from pooling_pipeline.core.shared.config import EngineConfig, ModelSpec, WorkerConfig
from pooling_pipeline.core.shared.runtime import (
    GROUP_KEY_ENV,
    HEARTBEAT_INTERVAL_S,
    OWNER_SIGNALS,
    DropLog,
    RunClock,
    owner_signals_held,
    router_socket,
    send_to,
    socket,
)
from pooling_pipeline.core.shared.serial import KEY_BYTES, Decoder, Encoder
from pooling_pipeline.core.shared.sim_device import SimDevice
from pooling_pipeline.errors import EngineDeadError, PipelineError, WorkerStartError
from pooling_pipeline.group_dir import DIR_PREFIX, make_group_dir
from pooling_pipeline.options import PipelineOptions

log = logging.getLogger("pipeline")

SHUTDOWN_SEND_RETRY_S = 1.0  # how long close() keeps asking a child whose connection is not attached yet
SHUTDOWN_GRACE_S = 5.0  # a child exits in about a second; under load torch teardown takes longer
LOG_TAIL_CHARS = 3000
# sun_path holds 108 bytes on Linux (104 on macOS), the terminating NUL included.
IPC_PATH_MAX = 103 if sys.platform == "darwin" else 107
# File descriptors the frontend's process opens for a group: the ZeroMQ context, one mailbox per
# socket, a listening socket per endpoint and one connection per peer (the results socket has two
# per child: its main socket and its heartbeat), the receiver's wake-up pipe. Measured: 19 with 1
# render worker, 24 with 2, 29 with 3; the margin covers a restart in progress (the log file, the
# exec status pipe, new connections). Under `ulimit -n 24` libzmq otherwise aborts the process.
FDS_BASE, FDS_PER_WORKER, FDS_MARGIN = 14, 5, 8
# Each engine core past the first: its control socket (mailbox, listener, connection) and its
# two connections to the results socket (main socket and heartbeat).
FDS_PER_ENGINE = 5
# Worker restarts: back-off before the n-th restart of one worker within a minute, and how many
# are tolerated in that minute before the calls running fail (a crash loop, not a bad moment).
MAX_WORKER_RESTARTS_PER_MINUTE = 6
RESTART_BACKOFF_S = 0.5  # doubles with each restart of the same worker within the minute
MAX_RESTART_BACKOFF_S = 8.0
RESTART_WINDOW_S = 60.0
# Engine core restarts, with the same back-off: fewer are tolerated (each loads the model again; a
# device that keeps failing is not a bad moment).
MAX_ENGINE_RESTARTS_PER_MINUTE = 3
# Aborts held for an engine core being restarted (sent once its control socket connects, so that the
# inputs the workers had queued towards the dead process are dropped, not computed): at most this many.
MAX_HELD_ABORTS = 4096
# The frontend's RunClock is ticked every 0.1 s by the receiver thread: a gap longer than this is
# time the frontend did not run. After such a gap the children (stopped with it) get a moment to
# send their next heartbeat before any silence counts.
FRONTEND_CLOCK_MAX_GAP_S = 0.5
RESUME_GRACE_S = 2 * HEARTBEAT_INTERVAL_S + 0.5
WORKER_POLL_INTERVAL_S = 0.02
# A child's address on a frontend socket (runtime.router_socket): random, so no other peer can
# claim it.
ROUTING_ID_BYTES = 16
# A batch sent to a worker that then reports, in two heartbeats made at least this long after
# the send, that it is idle and took fewer messages than were sent to it, was lost on the way:
# the worker is handled as wedged (killed, its batches re-sent). Delivery over ipc takes
# microseconds; two heartbeats keep a worker that was stopped with the message in its queue (and
# whose heartbeat thread woke first) from being taken for one that lost it.
LOST_WORK_GRACE_S = 2.0
REFUSALS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}  # (m.Refusal)


def endpoint_names(num_workers: int, num_engines: int = 1) -> list[str]:
    """The socket file names of a group, in its private directory (the path-length check covers
    the longest: the last engine core's input or a high-numbered worker's)."""
    return (["results"] + [f"control-{k}" for k in range(num_engines)] + [f"engine-in-{k}" for k in range(num_engines)]
            + [f"work-{i}" for i in range(num_workers)])


def check_resources(num_workers: int, num_engines: int = 1) -> None:
    """Fails with a clear message, before anything is created, when the ipc paths would be too
    long for a Unix socket or the process may not open enough files (raising the soft limit up
    to the hard one first, as far as that is allowed)."""
    base = tempfile.gettempdir()
    longest = max(endpoint_names(num_workers, num_engines), key=len)
    path = os.path.join(base, DIR_PREFIX + "x" * 8, longest)
    if len(os.fsencode(path)) > IPC_PATH_MAX:
        raise PipelineError(
            f"the socket path {path!r} would be {len(os.fsencode(path))} bytes, more than the {IPC_PATH_MAX} a Unix "
            f"socket path may have: the temporary directory {base!r} (TMPDIR) is too long; point TMPDIR at a "
            "shorter directory, e.g. TMPDIR=/tmp")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        open_now = len(os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"))
    except OSError:
        open_now = 0
    needed = open_now + FDS_BASE + FDS_PER_WORKER * num_workers + FDS_PER_ENGINE * (num_engines - 1) + FDS_MARGIN
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard == resource.RLIM_INFINITY or needed <= hard:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, max(needed, 1024))
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return
        except (ValueError, OSError):
            pass
    raise PipelineError(
        f"too few file descriptors: this process may open {soft} files (ulimit -n) and has {open_now} open; a "
        f"process group with {num_workers} render worker(s) and {num_engines} engine core(s) needs about "
        f"{needed - open_now} more. Raise the limit (e.g. `ulimit -n 4096`) or use fewer render workers")


@contextlib.contextmanager
def _owner_signals_deferred():
    """In the main thread, OWNER_SIGNALS' Python handlers are run at the end of the block instead of inside
    it. owner_signals_held blocks them in this thread only: another thread takes one, and Python runs its
    handler in the main thread at the next bytecode -- a KeyboardInterrupt raised inside Popen after the
    fork lost the Popen object, and its child (which ignores both signals) lived on, unknown to close(),
    until this process exited. (Another thread's spawn cannot be interrupted so: nothing to do there.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken: list[int] = []
    handlers = {sig: signal.getsignal(sig) for sig in OWNER_SIGNALS}
    for sig, handler in handlers.items():
        if handler not in (signal.SIG_IGN, None):  # (None: a handler not set from Python; left alone)
            signal.signal(sig, lambda signum, frame: taken.append(signum))
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            if handler not in (signal.SIG_IGN, None):
                signal.signal(sig, handler)
        for sig in taken:  # (now: the child is in self.children, for the close() the interrupt leads to)
            handler = handlers[sig]
            if callable(handler):
                handler(sig, None)
            else:  # (SIG_DFL: what it does)
                signal.raise_signal(sig)


class Child:
    def __init__(self, role: str, index: int, proc: subprocess.Popen, log_path: Path, numbered: bool = False,
                 log_start: int = 0) -> None:
        self.role, self.index, self.proc, self.log_path = role, index, proc, log_path
        self.numbered = numbered  # an engine core among several is named with its index
        self.log_start = log_start  # where this process's output begins in its slot's log (restarts append)

    @property
    def name(self) -> str:
        if self.role == "engine":
            return f"engine core {self.index}" if self.numbered else "engine core"
        return f"render worker {self.index}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(self.log_start, f.seek(0, os.SEEK_END) - 4 * LOG_TAIL_CHARS))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return text[-LOG_TAIL_CHARS:].strip()


@dataclass(frozen=True)
class GroupPlan:
    """What a process group is started with: the caller's options as they are declared
    (`PipelineOptions`, one object from the caller to each child's config) and what the Pipeline
    derived from them and the model."""

    options: PipelineOptions
    render_workers: int
    engine_threads: int  # torch threads of each engine core
    engine_devices: list[str]  # one per engine core (cuda:k, or the option's device)
    dtype: str  # the option's, its alias resolved
    max_num_seqs: int  # the option's, or the device's default
    engine_window: int  # requests admitted in each engine core
    message_items: int  # requests per message to a worker and from it to the engine
    backend: str  # what the model's family asks the engine cores for (core/families/)
    sim: SimDevice | None = None  # device "sim": the simulated accelerator


class ProcessGroup:
    def __init__(self, spec: ModelSpec, plan: GroupPlan) -> None:
        """The engine core(s) and render workers of `spec`, started as `plan` says."""
        opts = plan.options
        num_workers, data_parallel_size, engine_devices = plan.render_workers, opts.data_parallel_size, plan.engine_devices
        if len(engine_devices) != data_parallel_size:
            raise ValueError(f"{len(engine_devices)} engine devices for data_parallel_size={data_parallel_size}")
        self.plan = plan
        check_resources(num_workers, data_parallel_size)
        self.owner_pid = os.getpid()  # the group is this process's, not a forked child's
        self.spec = spec
        self.closed = False
        self._close_lock = threading.Lock()
        self.children: list[Child] = []
        self.dir = make_group_dir()  # mode 0700, naming its owner; dead groups' directories are removed first
        try:
            self.ctx = zmq.Context(1)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        # Every message carries this key; the children get it in their environment.
        self.key = secrets.token_bytes(KEY_BYTES)
        self.encoder = Encoder(self.key)
        # Arrays come as views of the received frames; the calls copy what they keep.
        self.decoder = Decoder(m.FrontendInbound, key=self.key)
        self.dropped = DropLog(log, "a malformed or foreign message from the results socket")
        # ZeroMQ sockets are not thread-safe: every send on the work and control sockets (and the
        # shared encoder) is under this lock; the results socket has one reader (the frontend's
        # receiver thread, or the constructor while it waits for the children to be ready).
        self.send_lock = threading.Lock()
        self.workers: list[Child | None] = [None] * num_workers
        self.worker_gen = [0] * num_workers  # bumped when a worker slot loses its process
        self._polled = [0.0] * num_workers  # when worker_up last looked at each worker's process
        self.connected: set[int] = set()  # ready workers whose work socket took a Probe (see m.Probe)
        self.ready_at = [0.0] * num_workers  # when each worker's Ready came (RunClock): it must connect in time
        self.down: dict[int, float] = {}  # worker slots waiting to be restarted: slot -> when (monotonic)
        self.restarts: list[deque[float]] = [deque() for _ in range(num_workers)]  # monotonic times, last minute
        self.total_restarts = 0
        self.worker_info: dict = {}
        self.num_engines = data_parallel_size
        self.engine_infos: list[dict] = [{} for _ in range(data_parallel_size)]  # each engine core's Ready info
        self.engine_info: dict = self.engine_infos[0]
        # Engine core restarts (module docstring): each slot's generation, bumped when it loses its
        # process (requests sent towards it before are lost); slots waiting for their back-off
        # (k -> when, monotonic); aborts held for a restarted slot until its control socket connects
        # (its presence: not connected since the loss); restart times within the last minute.
        self.engine_gen = [0] * data_parallel_size
        self.engines_down: dict[int, float] = {}
        self.held_aborts: dict[int, deque[m.Abort]] = {}
        self.engine_restarts: list[deque[float]] = [deque() for _ in range(data_parallel_size)]
        self.total_engine_restarts = 0
        ep = lambda name: f"ipc://{self.dir}/{name}"  # noqa: E731
        # "engine_in" / "control": the first engine core's (as with one engine); "engine_in_k" /
        # "control_k": engine core k's.
        self.endpoints = {"results": ep("results"), "control": ep("control-0"), "engine_in": ep("engine-in-0")}
        for k in range(data_parallel_size):
            self.endpoints[f"engine_in_{k}"] = ep(f"engine-in-{k}")
            self.endpoints[f"control_{k}"] = ep(f"control-{k}")
        self.engine_inputs = [self.endpoints[f"engine_in_{k}"] for k in range(data_parallel_size)]
        self.log_level = opts.log_level
        self.io_processor = opts.io_processor
        # Liveness: a child that sends nothing for heartbeat_timeout_s (stopped, wedged) or stays
        # inside one piece of work for step_timeout_s is treated as dead. Nothing waits forever.
        # Silence is measured on the RunClock, so time this process was stopped does not count.
        self.clock = RunClock(FRONTEND_CLOCK_MAX_GAP_S)
        self.heartbeat_timeout_s = opts.heartbeat_timeout_s
        self.step_timeout_s = opts.step_timeout_s
        self.last_seen: dict[tuple[str, int], float] = {}
        self.busy_s: dict[tuple[str, int], float] = {}
        self.ready: set[tuple[str, int]] = set()  # heartbeats are expected only once a child is ready
        self.startup_timeout_s = opts.startup_timeout_s  # a child (a restarted worker too) may take this long to be ready
        self.engines: list[Child] = []
        self.controls: list[zmq.Socket] = []
        self.control_ids = [secrets.token_bytes(ROUTING_ID_BYTES) for _ in range(data_parallel_size)]
        # Each worker process's routing id (new per start) and what was sent to it: the number of
        # messages, and (number, time.monotonic()) of those it has not yet said it received.
        self.worker_ids = [b""] * num_workers
        self.work_sent = [0] * num_workers
        self.unreceived: list[deque[tuple[int, float]]] = [deque() for _ in range(num_workers)]
        self.caught_up: list[tuple[int, float] | None] = [None] * num_workers  # (received, heartbeat time)
        self.lost_work: list[str | None] = [None] * num_workers
        try:
            self.results = socket(self.ctx, zmq.PULL, self.endpoints["results"], bind=True)
            # One control socket per engine core: an Abort or Shutdown goes to the engine it is for.
            self.controls = [router_socket(self.ctx, self.endpoints[f"control_{k}"]) for k in range(data_parallel_size)]
            self.control = self.controls[0]
            self.work = [router_socket(self.ctx, ep(f"work-{i}")) for i in range(num_workers)]
            self.engine_cfgs = [EngineConfig(
                model=spec, device=engine_devices[k], dtype=plan.dtype, max_num_seqs=plan.max_num_seqs,
                max_num_batched_tokens=opts.max_num_batched_tokens, window=plan.engine_window,
                max_message_items=plan.message_items, torch_threads=plan.engine_threads,
                input_endpoint=self.endpoints[f"engine_in_{k}"], control_endpoint=self.endpoints[f"control_{k}"],
                control_routing_id=self.control_ids[k], output_endpoint=self.endpoints["results"],
                parent_pid=os.getpid(), log_level=opts.log_level, index=k, backend=plan.backend,
                quantize=opts.quantize, **({"sim": plan.sim} if plan.sim is not None else {}))
                for k in range(data_parallel_size)]
            self.engine_cfg = self.engine_cfgs[0]
            for k in range(data_parallel_size):
                self.engines.append(self._start_engine(k))
            self.engine = self.engines[0]
            for i in range(num_workers):
                self.start_worker(i)
        except BaseException:
            self.close()  # what did start must not outlive a failed start
            raise

    def _start_engine(self, k: int) -> Child:
        """Starts engine core `k`'s process with its config (at start-up, and again after a restart)."""
        plan, spec = self.plan, self.spec
        env = {
            "OMP_NUM_THREADS": str(plan.engine_threads), "MKL_NUM_THREADS": str(plan.engine_threads),
            # oneDNN caches a compiled kernel per batch shape (1024 by default): with shapes that
            # change every step that cache grew the engine by 124 MB over a 1M-request soak.
            # A small cache keeps memory flat and costs nothing measurable.
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16"),
            # what the model's family starts its engine with (the transformer family: OpenMP's
            # threads sleep after a loop where OpenVINO runs the forward; it says why)
            **family_of(spec).engine_environment(plan.backend, plan.engine_devices[k], spec, os.environ)}
        profile_dir = os.environ.get("PIPELINE_PROFILE_DIR")
        if profile_dir and k > 0:  # every engine core writes engine.prof: each in its own folder
            env["PIPELINE_PROFILE_DIR"] = os.path.join(profile_dir, f"engine{k}")
        return self._spawn("engine", k, "pooling_pipeline.core.engine.main", self.engine_cfgs[k], env)

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
        env[GROUP_KEY_ENV] = self.key.hex()
        log_path = self.dir / f"{role}{index}.log"
        # The config goes in a file of the private directory, its path on the command line: a
        # model's description (its prompts, say) can be larger than an argument may be.
        config_path = self.dir / f"{role}{index}.json"
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.encode(cfg))
        # The child leaves SIGINT / SIGTERM sent to the whole process group to this process (Ctrl-C, a
        # supervisor's stop: see runtime.OWNER_SIGNALS); held from its first instruction, imports included.
        # And a KeyboardInterrupt waits until the child is one close() knows (_owner_signals_deferred).
        with _owner_signals_deferred():
            with open(log_path, "ab") as log_file, owner_signals_held():
                log_start = log_file.tell()
                proc = subprocess.Popen(
                    [sys.executable, "-m", module, str(config_path)],
                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                    # The private directory as working directory: nothing in the caller's (a local
                    # `core/` or `pipeline.py`) can shadow a module the children import.
                    env=env, cwd=self.dir, close_fds=True)
            child = Child(role, index, proc, log_path, numbered=role == "engine" and self.num_engines > 1,
                          log_start=log_start)
            # Children of this slot that are gone and reaped are forgotten (a long job restarts many).
            self.children = [c for c in self.children if c.role != role or c.index != index or c.proc.returncode is None]
            self.children.append(child)
        self.last_seen[(role, index)] = self.clock.now()
        self.busy_s[(role, index)] = 0.0
        self.ready.discard((role, index))
        return child

    def start_worker(self, index: int) -> Child:
        with self.send_lock:  # a new process: a new address, nothing sent to it yet
            self.worker_ids[index] = secrets.token_bytes(ROUTING_ID_BYTES)
            self.work_sent[index] = 0
            self.unreceived[index].clear()
            self.caught_up[index] = None
            self.lost_work[index] = None
            self.connected.discard(index)
        cfg = WorkerConfig(index=index, model=self.spec, work_endpoint=self.work[index].getsockopt_string(zmq.LAST_ENDPOINT),
                           routing_id=self.worker_ids[index], engine_endpoints=self.engine_inputs,
                           output_endpoint=self.endpoints["results"],
                           parent_pid=os.getpid(), io_processor=self.io_processor,
                           max_message_items=self.engine_cfg.max_message_items, log_level=self.log_level,
                           image_draft=self.plan.options.image_decode == "draft",
                           max_image_pixels=self.plan.options.max_image_pixels)
        child = self._spawn("worker", index, "pooling_pipeline.workers.main", cfg,
                            {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        self.workers[index] = child
        return child

    @property
    def pids(self) -> dict:
        engines = [e.proc.pid for e in self.engines]
        return {"engine": engines[0], "engines": engines,
                "workers": [w.proc.pid for w in self.workers if w is not None]}

    def worker_up(self, index: int) -> bool:
        """Whether a worker can take work now: started, ready, connected, alive (a restarting one
        cannot). Its process is looked at every WORKER_POLL_INTERVAL_S at most (waitpid cost ~90 us
        here: per batch it was 1.5 us per request); the health check and a refused send cover the rest."""
        worker = self.workers[index]
        if index in self.down or ("worker", index) not in self.ready or worker is None:
            return False
        if worker.proc.returncode is not None:
            return False
        if index not in self.connected and not self._probe(index):
            return False
        now = time.monotonic()
        if now - self._polled[index] >= WORKER_POLL_INTERVAL_S:
            self._polled[index] = now
            return worker.proc.poll() is None
        return True

    def _probe(self, index: int) -> bool:
        """Sends a ready worker a Probe: True (and the worker counts as connected) when it went
        through, False when its work socket cannot take a message yet (see m.Probe)."""
        try:
            self.send_work(index, m.Probe())
        except zmq.Again:
            return False
        self.connected.add(index)
        return True

    def _probe_engine(self, k: int) -> bool:
        """Sends engine core `k` a Probe on its control socket: True when it went through."""
        with self.send_lock:
            try:
                send_to(self.controls[k], self.control_ids[k], self.encoder.encode(m.Probe()))
            except zmq.Again:
                return False
            return True

    def refused(self, index: int) -> None:
        """A send to a worker was refused (gone, or its queue full): it takes no more work until
        a probe goes through again (a dead one is found by worker_up's next look at its process)."""
        with self.send_lock:
            self.connected.discard(index)
        self._polled[index] = 0.0

    def unconnected_workers(self) -> list[int]:
        """The ready workers whose work socket has not taken a probe yet."""
        return [i for i in range(len(self.workers)) if ("worker", i) in self.ready and i not in self.connected]

    def connect_ready_workers(self) -> bool:
        """Probes every ready worker not connected yet; True when one connected now (calls with
        work held back can send it)."""
        return any([self.worker_up(i) for i in self.unconnected_workers()])

    # ---- restarts ----------------------------------------------------------------------

    def worker_lost(self, index: int) -> tuple[int, str | None]:
        """A worker's process is gone: its slot is restarted after a back-off. Returns the slot's
        generation that was lost (requests sent to it then must be re-sent) and, when the worker
        died more than MAX_WORKER_RESTARTS_PER_MINUTE times within a minute, an error message."""
        now = time.monotonic()
        times = self.restarts[index]
        while times and now - times[0] > RESTART_WINDOW_S:
            times.popleft()
        times.append(now)
        self.total_restarts += 1
        backoff = 0.0 if len(times) == 1 else min(MAX_RESTART_BACKOFF_S, RESTART_BACKOFF_S * 2 ** (len(times) - 2))
        self.down[index] = now + backoff
        self.ready.discard(("worker", index))
        lost_gen = self.worker_gen[index]
        self.worker_gen[index] += 1
        error = None
        if len(times) > MAX_WORKER_RESTARTS_PER_MINUTE:
            worker = self.workers[index]
            tail = worker.log_tail() if worker is not None else ""
            error = (f"render worker {index} keeps dying: {len(times)} restarts within a minute"
                     + (f"; its last output:\n{tail}" if tail else ""))
        log.warning("render worker %d died; restarting it in %.1f s (restart %d within a minute)", index, backoff,
                    len(times))
        return lost_gen, error

    def engine_lost(self, k: int, death: str) -> tuple[int, str]:
        """Engine core `k`'s process is gone (`death`: what `lost_engines` said): its slot is
        restarted after a back-off. Returns the slot's generation that was lost (requests sent
        towards it then are gone) and the error for the calls that had any. Raises EngineDeadError
        (the group cannot serve) when it died more than MAX_ENGINE_RESTARTS_PER_MINUTE times within
        a minute, or was a restarted process that never became ready (its start failed)."""
        if ("engine", k) not in self.ready:
            raise EngineDeadError(f"{death}\n(it was being restarted and did not start again)")
        now = time.monotonic()
        times = self.engine_restarts[k]
        while times and now - times[0] > RESTART_WINDOW_S:
            times.popleft()
        times.append(now)
        if len(times) > MAX_ENGINE_RESTARTS_PER_MINUTE:
            raise EngineDeadError(f"{self.engines[k].name} keeps dying: {len(times)} restarts within a minute "
                                  f"(at most {MAX_ENGINE_RESTARTS_PER_MINUTE}); the last one: {death}")
        backoff = 0.0 if len(times) == 1 else min(MAX_RESTART_BACKOFF_S, RESTART_BACKOFF_S * 2 ** (len(times) - 2))
        with self.send_lock:
            self.engines_down[k] = now + backoff
            self.held_aborts[k] = deque(maxlen=MAX_HELD_ABORTS)
            self.ready.discard(("engine", k))
            lost_gen = self.engine_gen[k]
            self.engine_gen[k] += 1
        self.total_engine_restarts += 1
        log.warning("%s; restarting it in %.1f s (restart %d within a minute)", death, backoff, len(times))
        return lost_gen, (f"{death}\nThe engine core was restarted; this call's requests that were in it or on "
                          "their way to it are lost, so the call fails as a whole (calls started from now on are "
                          "served by the new engine core)")

    def restarting_engines(self) -> frozenset[int]:
        """The engine cores being restarted (lost, not connected again yet): new work goes to the
        others while there are any."""
        if not self.held_aborts:  # (the usual case: no lock taken)
            return frozenset()
        with self.send_lock:
            return frozenset(self.held_aborts)

    def start_due_engines(self) -> list[int]:
        """Starts the lost engine cores whose back-off is over; returns their slots. Each gets a new
        control routing id (the dead process's is forgotten); nothing else of its config changes."""
        now = time.monotonic()
        due = [k for k, at in self.engines_down.items() if at <= now]
        for k in due:
            del self.engines_down[k]
            with self.send_lock:
                self.control_ids[k] = secrets.token_bytes(ROUTING_ID_BYTES)
                self.engine_cfgs[k] = msgspec.structs.replace(self.engine_cfgs[k], control_routing_id=self.control_ids[k])
            self.engines[k] = self._start_engine(k)
            self.engine, self.engine_cfg = self.engines[0], self.engine_cfgs[0]
        return due

    def engine_started(self, msg: m.Ready) -> None:
        """A restarted engine core's Ready: its facts are kept; one that failed to start fails the group."""
        if msg.error is not None:
            raise EngineDeadError(f"{self.engines[msg.index].name} failed to start again after a restart: "
                                  f"{msg.error_type}: {msg.error}")
        self.engine_infos[msg.index].update(msg.info)

    def connect_restarted_engines(self) -> bool:
        """Probes each restarted engine core that is ready and not connected yet; sends the aborts
        held for it once its control socket takes the probe. True when one connected now."""
        connected = False
        for k in [k for k in self.held_aborts if ("engine", k) in self.ready]:
            if not self._probe_engine(k):
                continue
            with self.send_lock:
                held = self.held_aborts.pop(k)
                for abort in held:
                    try:
                        send_to(self.controls[k], self.control_ids[k], self.encoder.encode(abort))
                    except zmq.Again:  # (its queue is full, or it died again: only work is lost)
                        break
            connected = True
        return connected

    def start_due_workers(self) -> list[int]:
        """Starts the lost workers whose back-off is over; returns their slots."""
        now = time.monotonic()
        due = [i for i, at in self.down.items() if at <= now]
        for i in due:
            del self.down[i]
            self.start_worker(i)
        return due

    # ---- start-up --------------------------------------------------------------------

    def wait_ready(self) -> None:
        """Waits (up to startup_timeout_s) for a Ready from every child. A child that refused the
        model or an option at start-up raises its ValueError / TypeError here, with its message;
        one that failed otherwise is an EngineDeadError / WorkerStartError naming it and its error.
        (The caller closes the group.)"""
        timeout_s = self.startup_timeout_s
        pending = {("engine", k) for k in range(self.num_engines)} | {("worker", i) for i in range(len(self.workers))}
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise EngineDeadError(f"process group not ready after {timeout_s:.0f} s; waiting for {sorted(pending)}")
            self.clock.tick()
            try:
                self.check_alive()
            except EngineDeadError:
                # An engine core that reported why it could not start exits right after: its report,
                # already here, says more than its exit code.
                while (msg := self.recv(zmq.NOBLOCK)) is not None:
                    self._started(msg, pending)
                raise
            if self.results.poll(200):
                self._started(self.recv(), pending)
        # Every child said Ready: wait for the sockets the frontend sends on to connect too (a
        # moment), so the first call's batches and aborts are not refused (see m.Probe).
        engines = set(range(self.num_engines))
        while True:
            engines -= {k for k in engines if self._probe_engine(k)}
            self.connect_ready_workers()
            workers = self.unconnected_workers()
            if not engines and not workers:
                return
            if time.monotonic() > deadline:
                waiting = [f"render worker {i}" for i in workers] + [self.engines[k].name for k in sorted(engines)]
                raise EngineDeadError(f"process group not ready after {timeout_s:.0f} s: {', '.join(waiting)} said "
                                      "Ready but the socket the frontend sends on did not connect")
            self.check_alive()
            time.sleep(0.002)

    def _started(self, msg, pending: set[tuple[str, int]]) -> None:
        """A message during start-up: a pending child's Ready takes it off `pending`, or raises its failure."""
        if not isinstance(msg, m.Ready) or (msg.role, msg.index) not in pending:
            return
        if msg.error is not None:
            child = self.engines[msg.index] if msg.role == "engine" else self.workers[msg.index]
            if msg.refusal is not None:  # the model or an option refused: raised as the error it is
                refusal = REFUSALS[msg.refusal](msg.error)
                refusal.add_note(f"(raised by the {child.name} at start-up)")
                raise refusal
            kind = EngineDeadError if msg.role == "engine" else WorkerStartError
            raise kind(f"{child.name} failed to start: {msg.error_type}: {msg.error}")
        (self.engine_infos[msg.index] if msg.role == "engine" else self.worker_info).update(msg.info)
        pending.discard((msg.role, msg.index))

    # ---- messages ----------------------------------------------------------------------

    def recv(self, flags: int = 0):
        """The next decodable message on the results socket (malformed or foreign ones are logged
        and dropped); None when there is none (with zmq.NOBLOCK) or only dropped ones were there."""
        while True:
            try:
                frames = self.results.recv_multipart(flags, copy=False)
            except zmq.Again:
                return None
            try:
                msg = self.decoder.decode(frames)
                if isinstance(msg, m.OutputBatch):
                    msg.check()
                    msg.own_arrays()  # (its vectors are copied where the call keeps them)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                self.dropped(e)
                if not self.results.poll(0):
                    return None
                continue
            self._note(msg)
            return msg

    def _note(self, msg) -> None:
        now = self.clock.now()
        if isinstance(msg, m.Heartbeat):
            if msg.role == "worker":
                worker = self.workers[msg.index] if 0 <= msg.index < len(self.workers) else None
                if worker is None or msg.pid != worker.proc.pid:
                    return  # a late heartbeat of a worker process that was replaced
                self._note_work(msg)
            self.last_seen[(msg.role, msg.index)] = now
            self.busy_s[(msg.role, msg.index)] = msg.busy_s
            if msg.info and msg.role == "engine" and 0 <= msg.index < len(self.engine_infos):
                self.engine_infos[msg.index].update(msg.info)  # (the step cost as learned since Ready)
        elif isinstance(msg, (m.OutputBatch, m.StepFailed)) and self.num_engines == 1:
            self.last_seen[("engine", 0)] = now  # (with several, which one sent it is in their heartbeats)
        elif isinstance(msg, m.Ready):
            self.last_seen[(msg.role, msg.index)] = now
            if msg.error is None:
                self.ready.add((msg.role, msg.index))
                if msg.role == "worker" and 0 <= msg.index < len(self.workers):
                    self.ready_at[msg.index] = now

    def send_work(self, worker: int, batch: m.RenderBatch | m.Probe) -> None:
        """A batch to a render worker, whose inputs it sends on to the engine core it names (or a
        Probe: counted as work on both sides)."""
        # A worker that is gone (or not connected yet) raises zmq.Again instead of blocking.
        with self.send_lock:
            if self.closed:
                raise zmq.Again()
            send_to(self.work[worker], self.worker_ids[worker], self.encoder.encode(batch))
            self.work_sent[worker] += 1
            self.unreceived[worker].append((self.work_sent[worker], time.monotonic()))

    def _note_work(self, beat: m.Heartbeat) -> None:
        """A worker's heartbeat: forgets the sends it has received, and records a loss when it is
        idle (every message it took is finished) without a message sent LOST_WORK_GRACE_S before
        both this heartbeat and an earlier one with the same count (module docstring)."""
        i = beat.index
        with self.send_lock:
            unreceived = self.unreceived[i]
            while unreceived and unreceived[0][0] <= beat.received:
                unreceived.popleft()
            if beat.finished != beat.received or not unreceived:
                self.caught_up[i] = None
                return
            previous, self.caught_up[i] = self.caught_up[i], (beat.received, beat.sent_at)
            if previous is None or previous[0] != beat.received:
                return
            previous_beat_at, sent_at = previous[1], unreceived[0][1]
            if previous_beat_at - sent_at >= LOST_WORK_GRACE_S and beat.sent_at > previous_beat_at:
                self.lost_work[i] = (f"never received {len(unreceived)} batch(es) sent to it (the first "
                                     f"{beat.sent_at - sent_at:.1f} s ago) although it was idle")

    def abort(self, call: str, indices: list[int] | None = None, engine: int | None = None) -> None:
        """Drops these requests of a call (all of them when `indices` is None) in engine core
        `engine` (None: in every engine core). For an engine core being restarted the abort is held
        until it connects: inputs the workers had queued towards the dead process reach it."""
        with self.send_lock:
            if self.closed or indices is not None and not indices:
                return
            abort = m.Abort(call=call, indices=indices)
            frames = self.encoder.encode(abort)
            for k in range(self.num_engines) if engine is None else (engine,):
                held = self.held_aborts.get(k)
                if held is not None:
                    held.append(abort)
                    continue
                try:  # never block on an engine that is gone: its requests went with it
                    send_to(self.controls[k], self.control_ids[k], frames)
                except zmq.Again:
                    log.warning("could not send an abort for call %s: %s is not reachable", call, self.engines[k].name)

    # ---- health ------------------------------------------------------------------------

    def check_alive(self) -> list[int]:
        """Raises EngineDeadError if an engine core is gone or wedged, naming it (at start-up: the
        receiver restarts them instead, `lost_engines`); returns the indices of dead workers."""
        for _, death in self.lost_engines():
            raise EngineDeadError(death)
        return self.dead_workers()

    def lost_engines(self) -> list[tuple[int, str]]:
        """The engine cores that are gone or wedged (a wedged one is killed first), each with what
        happened to it: its name, exit code or silence, and its last output."""
        lost = []
        for engine in self.engines:
            k = engine.index
            if k in self.engines_down:  # gone already, waiting for its restart
                continue
            if engine.alive():
                wedged = self._wedged("engine", k)
                if not wedged:
                    continue
                engine.proc.kill()
                engine.proc.wait()
                what = f"{wedged}; it was killed (exit code {engine.proc.returncode})"
            else:
                what = f"exited with code {engine.proc.returncode}"
            tail = engine.log_tail()
            lost.append((k, f"{engine.name} {what}" + (f"; its last output:\n{tail}" if tail else "")))
        return lost

    def dead_workers(self) -> list[int]:
        """The indices of dead workers (a wedged worker is killed first, so it is dead too)."""
        dead = []
        for i, worker in enumerate(self.workers):
            if worker is None or i in self.down:
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
        now = self.clock.now()
        if now - self.clock.resumed_at < RESUME_GRACE_S:
            return None  # this process was just stopped, its children too: their heartbeats are due
        if (role, index) not in self.ready:  # still loading its model or tokenizer
            starting = now - self.last_seen.get((role, index), now)
            return f"did not become ready in {starting:.0f} s" if starting > self.startup_timeout_s else None
        silent = now - self.last_seen.get((role, index), now)
        if silent > self.heartbeat_timeout_s:
            return f"sent no heartbeat for {silent:.0f} s (stopped or wedged)"
        busy = self.busy_s.get((role, index), 0.0)
        if busy > self.step_timeout_s:
            return f"has been stuck in one piece of work for {busy:.0f} s"
        if role == "worker":
            connecting = now - self.ready_at[index] if index not in self.connected else 0.0
            if connecting > self.startup_timeout_s:
                return f"said Ready but its work socket did not connect in {connecting:.0f} s"
            return self.lost_work[index]
        return None

    # ---- tear-down -----------------------------------------------------------------------

    def close(self) -> None:
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        if os.getpid() != self.owner_pid:
            return  # a forked child: the sockets, children and directory are its parent's
        # The children are ended and the sockets closed whatever the asking raised: a context
        # left open would hang the process that collects it (its sockets' messages never leave).
        try:
            self._kill_unready_children()
            self._ask_children_to_exit()
        finally:
            self._end_children()
            self.ctx.destroy(linger=0)
            shutil.rmtree(self.dir, ignore_errors=True)

    def _kill_unready_children(self) -> None:
        """Kills at once the children that have not said Ready: a start cut short (Ctrl-C while the model
        loads), a worker restarting. They hold no work and cannot be asked yet, and they leave a signal
        sent to the process group to this process (runtime.OWNER_SIGNALS): waiting out SHUTDOWN_GRACE_S
        for them made a Ctrl-C during start-up take 6 s. (A conversion an engine leaves unfinished is
        swept by the cache's next writer: core/shared/staging.py.)"""
        for child in self.children:
            if (child.role, child.index) not in self.ready and child.alive():
                child.proc.send_signal(signal.SIGKILL)

    def _ask_children_to_exit(self) -> None:
        """Sends each live child a Shutdown."""
        # Every live child is asked on its own: one that cannot be reached must not keep the
        # others from their orderly exit (the rest are killed after the grace period).
        asks = [(sock, self.worker_ids[i], self.workers[i]) for i, sock in enumerate(getattr(self, "work", []))]
        engines = getattr(self, "engines", [])
        asks += [(sock, self.control_ids[k], engines[k] if k < len(engines) else None)
                 for k, sock in enumerate(getattr(self, "controls", []))]
        with self.send_lock:
            shutdown = self.encoder.encode(m.Shutdown())
            # A child's connection to a socket we bound may not be attached yet (a group closed
            # right after it started: the child's Ready can arrive first), and then a send finds
            # no peer (EAGAIN): those are asked again for a short while, never blocking on one.
            retry_until = time.monotonic() + SHUTDOWN_SEND_RETRY_S
            while asks:
                unreached = []
                for sock, routing_id, child in asks:
                    if child is None or not child.alive():
                        continue
                    try:
                        send_to(sock, routing_id, shutdown)
                    except zmq.Again:
                        unreached.append((sock, routing_id, child))
                    except zmq.ZMQError as e:
                        log.debug("could not ask %s to shut down: %s", child.name, e)
                asks = unreached
                if asks and time.monotonic() >= retry_until:
                    log.debug("could not ask %s to shut down: no connection", ", ".join(c.name for _, _, c in asks))
                    break
                if asks:
                    time.sleep(0.01)

    def _end_children(self) -> None:
        """Waits for the children to exit (SHUTDOWN_GRACE_S in all), then kills those left."""
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.send_signal(signal.SIGKILL)
                child.proc.wait()
