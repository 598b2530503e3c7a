"""What every child process of the group does the same way: logging, sockets, dying with its parent."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import zmq

PARENT_CHECK_INTERVAL_S = 0.5


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
