"""Starting `pipeline-serve` for a test module: a real server process on a free port, reached with
real clients; stopped with SIGTERM (its drain) and checked to leave no process behind.

    @pytest.fixture(scope="module")
    def server():
        with started_server("--max-num-seqs", "16") as srv:
            yield srv          # srv.url, srv.proc, srv.log()
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
from helpers import running, wait_gone

# Time a server may take to start on a loaded 2-core machine (the model's load, OpenVINO's compile
# when its cache is cold, the probes): the bound is for a hung start, not a timing.
START_TIMEOUT_S = 300.0
READY = re.compile(r"pipeline-serve: ready on (http://\S+)")


@dataclass
class RunningServer:
    url: str
    proc: subprocess.Popen
    log_path: str
    lines: list[str] = field(default_factory=list)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def children(self) -> list[int]:
        try:
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


def start_server(*args: str, env: dict | None = None, new_session: bool = False) -> RunningServer:
    """Starts `pipeline-serve --port 0 ARGS` (the bundled model unless ARGS name one) and waits until it
    prints its address; raises with its log when it exits or does not start in time. `new_session`: the
    server leads a process group of its own (a test may then signal that whole group, as systemd does)."""
    log = tempfile.NamedTemporaryFile("w", prefix="pipeline-serve-", suffix=".log", delete=False)
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "pooling_pipeline.serve.cli", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=environment,
                            start_new_session=new_session)
    found: list[str] = []

    def read() -> None:  # the ready line (stdout); anything after it is drained so the pipe never fills
        for line in proc.stdout:
            match = READY.search(line)
            if match and not found:
                found.append(match.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not found:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            with open(log.name, errors="replace") as f:
                raise RuntimeError(f"pipeline-serve did not start (exit {proc.returncode}):\n{f.read()[-4000:]}")
        time.sleep(0.05)
    return RunningServer(found[0], proc, log.name)


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> int | None:
    """SIGTERM (the server drains and closes its group), then SIGKILL if it hangs; its children must
    be gone after."""
    try:
        children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        children = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    left = wait_gone(children, 30.0)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if left:
        raise AssertionError(f"pipeline-serve left processes behind: {left}")
    return proc.returncode


@contextlib.contextmanager
def started_server(*args: str, env: dict | None = None) -> Iterator[RunningServer]:
    server = start_server(*args, env=env)
    try:
        yield server
    finally:
        stop_server(server.proc)


__all__ = ["RunningServer", "running", "start_server", "started_server", "stop_server"]
