"""What every child process of the group does the same way: logging, sockets, dying with its parent."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import zmq

PARENT_CHECK_INTERVAL_S = 0.5
HEARTBEAT_INTERVAL_S = 1.0


def setup_logging(level: str, role: str) -> logging.Logger:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.WARNING),
        format=f"%(asctime)s {role}[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    return logging.getLogger(role)


def exit_with_parent(parent_pid: int) -> None:
    """Ends this process soon after the frontend's process is gone, even if it was SIGKILLed.

    Polling the parent pid works from any thread of the parent and on every POSIX system, where
    PR_SET_PDEATHSIG fires when the *thread* that spawned us exits.
    """

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(PARENT_CHECK_INTERVAL_S)

    if os.getppid() != parent_pid:
        os._exit(0)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


class BusyClock:
    """When the owning loop started its current piece of work (None when idle)."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.last_s = 0.0  # how long the last piece of work took

    def __enter__(self) -> BusyClock:
        self.since = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.last_s = time.monotonic() - self.since
        self.since = None

    def busy_s(self) -> float:
        since = self.since
        return 0.0 if since is None else time.monotonic() - since


def start_heartbeat(ctx: zmq.Context, endpoint: str, role: str, index: int, clock: BusyClock) -> None:
    """A daemon thread that sends Heartbeat every second on its own socket (sockets are not
    shared between threads). torch and the tokenizers release the GIL, so it runs during work."""
    from pooling_pipeline.core.messages import Heartbeat
    from pooling_pipeline.core.serial import Encoder

    def beat() -> None:
        sock = socket(ctx, zmq.PUSH, endpoint, bind=False)
        sock.setsockopt(zmq.SNDHWM, 16)  # never queue more than a few if the frontend is not reading
        encoder = Encoder()
        while True:
            try:
                sock.send_multipart(encoder.encode(Heartbeat(role, index, clock.busy_s())), zmq.NOBLOCK)
            except zmq.Again:
                pass
            except zmq.ZMQError:
                return  # the context is being destroyed: the process is exiting
            time.sleep(HEARTBEAT_INTERVAL_S)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


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
