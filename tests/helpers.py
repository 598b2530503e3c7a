"""What several test files need: waiting for processes to be gone, the repository's root."""

from __future__ import annotations

import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "pipeline" / "jobs" / "data" / "sample.jsonl"


def wait_gone(pids, timeout_s: float = 10.0) -> list[int]:
    """The pids still running (zombies count as gone) after waiting up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if running(pid)]
        if alive:
            time.sleep(0.1)
    return alive


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
