"""What every child process of the group does the same way: logging, sockets, the group's key,
dying with its parent, leaving a signal sent to the whole process group to its owner, and clocks that
do not count time the process was stopped."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import sys
import threading
import time

import zmq

from pooling_pipeline.core.shared.staging import remove_own_staging

PARENT_CHECK_INTERVAL_S = 0.5
HEARTBEAT_INTERVAL_S = 1.0
# The group's random key reaches the children in their environment (never on a command line,
# which every user can read); each child removes it from its own environment at once.
GROUP_KEY_ENV = "POOLING_PIPELINE_GROUP_KEY"
# A RunClock advances at most this much between two of its ticks (children tick it every
# second): a longer gap is time the process did not run (SIGSTOP / Ctrl-Z, a suspended machine).
RUN_CLOCK_MAX_GAP_S = 2.0


def setup_logging(level: str, role: str) -> logging.Logger:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.WARNING),
        format=f"%(asctime)s {role}[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    return logging.getLogger(role)


def take_group_key() -> bytes:
    """The group's key, taken out of this process's environment (so nothing it starts inherits it)."""
    value = os.environ.pop(GROUP_KEY_ENV, "")
    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = b""
    if not key:
        raise SystemExit(f"{GROUP_KEY_ENV} is missing: this process is started by a Pipeline, not by hand")
    return key


def exit_with_parent(parent_pid: int, socket_dir: str | None = None) -> None:
    """Ends this process soon after the frontend's process is gone, even if it was SIGKILLed or
    SIGTERMed, removing the group's private socket directory on the way (a frontend killed that
    way never runs its own clean-up; whichever child notices first removes it), and this process's
    unfinished staging folders of the conversion cache (an engine saving a conversion then: its
    `finally` never runs; the cache's sweep of dead writers, core/shared/staging.py, is what guarantees it).

    Polling the parent pid works from any thread of the parent and on every POSIX system, where
    PR_SET_PDEATHSIG fires when the *thread* that spawned us exits.
    """

    def leave() -> None:
        if socket_dir:
            shutil.rmtree(socket_dir, ignore_errors=True)
        remove_own_staging()
        os._exit(0)

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                leave()
            time.sleep(PARENT_CHECK_INTERVAL_S)

    if os.getppid() != parent_pid:
        leave()
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


# The signals a terminal's Ctrl-C (SIGINT) and a supervisor (systemd's default KillMode=control-group,
# supervisord's stopasgroup: SIGTERM) send to every process of the group. The group's owner handles
# them -- a server drains, a caller gets its KeyboardInterrupt -- and then ends its children; children
# that died of one at once failed every request in flight (a server's 50 of 50 were answered 503). SIGKILL
# and SIGSTOP still reach every process, and a child whose owner is gone leaves (exit_with_parent).
OWNER_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def owner_signals_held():
    """Around the start of a child, in the thread that starts it: OWNER_SIGNALS blocked in this thread
    (the process still takes them in its other threads, and this one when the block ends). The child
    inherits the block across fork and exec, so a signal sent to the group while it imports (torch:
    seconds) waits there until `leave_owner_signals` drops it."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, OWNER_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def leave_owner_signals() -> None:
    """A child's first step: OWNER_SIGNALS ignored (one already waiting is dropped), then unblocked."""
    for sig in OWNER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, OWNER_SIGNALS)


class RunClock:
    """Seconds this process has run: monotonic time, except that a gap longer than
    RUN_CLOCK_MAX_GAP_S between two ticks counts as that much. Ticked by a thread that wakes up
    at least every second or so; `now()` may be read from any thread.

    Liveness is judged on it: when the whole group was stopped (Ctrl-Z, SIGSTOP of the process
    group) the watcher did not run either, and that silence is no evidence of a dead child.
    """

    def __init__(self, max_gap_s: float = RUN_CLOCK_MAX_GAP_S) -> None:
        self.max_gap_s = max_gap_s
        self._state = (0.0, time.monotonic())  # (run time at the last tick, monotonic time of it)
        self.skipped_s = 0.0  # time not counted (the process was stopped)
        self.resumed_at = float("-inf")  # run time when a gap was last skipped (the process resumed)

    def tick(self) -> float:
        run, last = self._state
        now = time.monotonic()
        gap = now - last
        if gap > self.max_gap_s:
            self.skipped_s += gap - self.max_gap_s
            gap = self.max_gap_s
            self.resumed_at = run + gap
        self._state = (run + gap, now)
        return run + gap

    def now(self) -> float:
        run, last = self._state
        return run + min(time.monotonic() - last, self.max_gap_s)


def socket_dir_of(endpoint: str) -> str | None:
    """The private directory of an ipc:// endpoint (None for other transports)."""
    return os.path.dirname(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


class DropLog:
    """Logs dropped messages without flooding the log: the first few, then every 1000th."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self.log, self.what, self.count = log, what, 0

    def __call__(self, error: Exception) -> None:
        self.count += 1
        if self.count <= 10 or self.count % 1000 == 0:
            self.log.error("dropped %s (%d so far): %s", self.what, self.count, error)


def socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


# pyzmq's multipart helpers, without their Python-level cost: `send_multipart` ORs IntFlags per
# frame (enum machinery, ~1 us each) and `recv_multipart` asks RCVMORE with a getsockopt per frame;
# the backend's own send and recv with int flags, and a frame's `more`, do the same work (~3 us less a
# message, measured). For the engine's loop, which pays them every step.
_raw_send, _raw_recv = zmq.backend.Socket.send, zmq.backend.Socket.recv
SNDMORE, NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)


def send_frames(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    """send_multipart(frames, flags), each frame copied into ZeroMQ's message. (ZeroMQ queues a
    multipart message whole or not at all: zmq.Again, with NOBLOCK, comes from the first frame.)"""
    last = len(frames) - 1
    for k, frame in enumerate(frames):
        _raw_send(sock, frame, flags | SNDMORE if k < last else flags)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """recv_multipart(flags, copy=False)."""
    frame = _raw_recv(sock, flags, False)
    frames = [frame]
    while frame.more:
        frame = _raw_recv(sock, flags, False)
        frames.append(frame)
    return frames


# The frontend's sending sockets are ROUTERs and each child connects a DEALER under a random
# routing id that only the frontend and that child know (it travels in the child's 0600 config
# file). A message goes to the one peer it is addressed to: a process that connects to the socket
# by mistake receives nothing (with a PUSH socket it would take every other message, round-robin).
def router_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """The frontend's bound sending socket: sends only to known peers (ROUTER_MANDATORY: an unknown
    or gone peer is an error, never a silent drop) and reads nothing, so a peer that writes to it
    is cut off (MAXMSGSIZE) rather than queued."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # (not 0: the peer's routing id arrives in a frame of up to 255 bytes during the handshake)
    sock.setsockopt(zmq.MAXMSGSIZE, 256)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.bind(endpoint)
    return sock


def addressed_socket(ctx: zmq.Context, endpoint: str, routing_id: bytes) -> zmq.Socket:
    """A child's receiving end of a router_socket, under the routing id the frontend gave it."""
    if not routing_id:
        raise ValueError("a child's routing id is empty (this is a bug: the process group sets one per start)")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(endpoint)
    return sock


def send_to(sock: zmq.Socket, routing_id: bytes, frames: list) -> None:
    """Sends without blocking to one peer of a router_socket; zmq.Again when it cannot take the
    message now: not connected (yet, or any more) or its queue is full."""
    try:
        sock.send_multipart([routing_id, *frames], zmq.NOBLOCK)
    except zmq.ZMQError as e:
        if e.errno == zmq.EHOSTUNREACH:
            raise zmq.Again() from e
        raise


class WorkCount:
    """A render worker's count of the work messages it took and finished, read by its heartbeat
    thread (plain ints: each is written by the worker's loop only)."""

    def __init__(self) -> None:
        self.received = 0
        self.finished = 0


class BusyClock:
    """When the owning loop started its current piece of work (None when idle), on the process's
    RunClock: a step that was stopped with the whole group does not look wedged afterwards."""

    def __init__(self, run_clock: RunClock | None = None) -> None:
        self.run_clock = run_clock or RunClock()
        self.since: float | None = None
        self.last_s = 0.0  # how long the last piece of work took (wall time, for stats)
        self.total_s = 0.0  # all pieces of work so far (a server's "engine busy" is its rate of change)
        self._started = 0.0

    def __enter__(self) -> BusyClock:
        self._started = time.perf_counter()
        self.since = self.run_clock.now()
        return self

    def __exit__(self, *exc) -> None:
        self.last_s = time.perf_counter() - self._started
        self.total_s += self.last_s
        self.since = None

    def busy_s(self) -> float:
        since = self.since
        return 0.0 if since is None else max(0.0, self.run_clock.now() - since)


def start_heartbeat(ctx: zmq.Context, endpoint: str, role: str, index: int, clock: BusyClock, key: bytes,
                    work: WorkCount | None = None, info=None) -> None:
    """A daemon thread that sends Heartbeat every second on its own socket (sockets are not
    shared between threads) and ticks the process's RunClock. torch and the tokenizers release
    the GIL, so it runs during work. `work`: a render worker's message counts, sent along;
    `info()`, when given, is sent with each beat (stats that change)."""
    from pooling_pipeline.core.shared.messages import Heartbeat
    from pooling_pipeline.core.shared.serial import Encoder

    def beat() -> None:
        sock = socket(ctx, zmq.PUSH, endpoint, bind=False)
        sock.setsockopt(zmq.SNDHWM, 16)  # never queue more than a few if the frontend is not reading
        encoder = Encoder(key)
        pid = os.getpid()
        while True:
            clock.run_clock.tick()
            # finished before received: read the other way round, a message taken in between
            # could look finished before it was counted as received.
            finished = work.finished if work is not None else 0
            received = work.received if work is not None else 0
            beat = Heartbeat(role=role, index=index, busy_s=clock.busy_s(), pid=pid, received=received,
                             finished=finished, sent_at=time.monotonic(), info=info() if info else {})
            try:
                sock.send_multipart(encoder.encode(beat), zmq.NOBLOCK)
            except zmq.Again:
                pass
            except zmq.ZMQError:
                return  # the context is being destroyed: the process is exiting
            time.sleep(HEARTBEAT_INTERVAL_S)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def release_free_memory() -> None:
    """glibc's malloc_trim: return free heap pages to the system (a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def exit_process(code: int) -> None:
    """Ends a child process after its orderly shutdown without the interpreter's teardown: its
    sockets are closed and its results sent by then, and tearing down torch and transformers'
    modules took 1.2 s of a group's close on this 2-core machine (the frontend waits for every
    child). The log is flushed first; nothing else is left to run at exit."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can reach it
            pass
    os._exit(code)


def run_maybe_profiled(fn, name: str) -> None:
    """Runs `fn()`; under cProfile when PIPELINE_PROFILE_DIR is set, writing `<dir>/<name>.prof`
    (read it with `python -m pstats`). How to see where a child process spends its time."""
    directory = os.environ.get("PIPELINE_PROFILE_DIR")
    if not directory:
        fn()
        return
    import cProfile

    profiler = cProfile.Profile()
    try:
        profiler.runcall(fn)
    finally:
        os.makedirs(directory, exist_ok=True)
        profiler.dump_stats(os.path.join(directory, f"{name}.prof"))
