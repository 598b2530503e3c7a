"""Staging folders of the conversion cache, each named for the process that writes it, and the
sweep that removes those whose writer is dead.

A conversion is written into a staging folder beside its final place and renamed there when whole
(core/openvino_model.save_entry). A writer killed before the rename (SIGKILL of the process group,
or its caller killed while it saves: the engine then leaves through its parent watchdog) leaves the
staging folder behind -- 87 MB for MiniLM, gigabytes for a 0.6B model -- and nothing else would
ever remove it. So a staging folder is named for its writer, `.converting-<pid>-<start>-<scope>-<random>`:

- `start`, the process's start time (field 22 of /proc/<pid>/stat, clock ticks since boot), so a
  pid the system has handed to another process since is not mistaken for the writer;
- `scope`, a digest of the boot id and the pid namespace, the only places where that pid and start
  time name one process (a cache shared by containers or machines holds folders of processes this
  one cannot see).

The sweep (`remove_stale_staging`) removes a folder whose writer is proven dead: of this scope, and
its pid gone, a zombie, or held by a process that started at another time. It never removes a folder
of a live writer (two processes may convert at once). Where no proof can be had -- another scope,
a name of another form (one written before names carried the writer), or a system without /proc
(then no name carries a writer) -- only a folder untouched for STALE_UNPROVEN_S goes.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
from typing import NamedTuple

PREFIX = ".converting-"
# A staging folder whose writer cannot be proven dead is removed only once nothing in it has changed
# for this long. A writer touches its folder all along (model.bin grows as it is written; then
# checksums.json): the quietest stretch of a save is the sha256 pass over the written weights, which
# reads 0.8 GB/s on this project's CPU -- 40 s for the 32 GB of an 8B model in float32. A day leaves
# that a wide margin, and a stopped (SIGSTOP) writer that loses its folder only fails to cache (its
# rename fails: a warning, and the conversion is served from memory).
STALE_UNPROVEN_S = 24 * 3600
_NAME = re.compile(re.escape(PREFIX) + r"(?P<pid>\d+)-(?P<start>\d+)-(?P<scope>[0-9a-f]{12})-")

# This process's staging folders not yet renamed into place: what its parent watchdog removes when
# it ends the process mid-save (core/runtime.exit_with_parent), before the sweep would have to.
_own: set[str] = set()

ALIVE, DEAD, UNKNOWN = "alive", "dead", "unknown"  # what `liveness` can tell of a writer


class Owner(NamedTuple):
    """A process, as one that outlives its pid can never match it."""

    pid: int
    start: int  # clock ticks after boot
    scope: str  # digest of the boot id and the pid namespace


def make_staging(parent: str) -> str:
    """A new, empty staging folder in `parent`, named for this process (or with no writer in its name
    where none can be proven: no /proc) and recorded as this process's own until `release`d."""
    folder = tempfile.mkdtemp(prefix=name_prefix(current_owner()), dir=parent)
    _own.add(folder)
    return folder


def release(folder: str) -> None:
    """`folder` is no longer this process's staging: renamed into place, or removed."""
    _own.discard(folder)


def remove_own_staging() -> None:
    """Removes this process's unfinished staging folders (called as it ends without finishing them)."""
    for folder in list(_own):
        shutil.rmtree(folder, ignore_errors=True)
        _own.discard(folder)


def remove_stale_staging(parent: str, now: float | None = None) -> list[str]:
    """Removes the staging folders in `parent` whose writer is dead (see the module's docstring);
    -> the names removed."""
    try:
        found = [e for e in os.scandir(parent) if e.name.startswith(PREFIX) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    me = current_owner()
    now = time.time() if now is None else now
    removed = []
    for entry in found:
        owner = owner_of(entry.name)
        state = liveness(owner) if owner is not None and me is not None and owner.scope == me.scope else UNKNOWN
        if state == DEAD or (state == UNKNOWN and now - last_change(entry.path) > STALE_UNPROVEN_S):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    return removed


def name_prefix(owner: Owner | None) -> str:
    """The start of the name of a staging folder written by `owner` (None: a writer not proven)."""
    return PREFIX if owner is None else f"{PREFIX}{owner.pid}-{owner.start}-{owner.scope}-"


def owner_of(name: str) -> Owner | None:
    """The writer a staging folder's name carries, or None (a name of another form)."""
    match = _NAME.match(name)
    return None if match is None else Owner(int(match["pid"]), int(match["start"]), match["scope"])


def liveness(owner: Owner) -> str:
    """Whether `owner` (of this scope) still runs: ALIVE (its pid is there, started when it did),
    DEAD (its pid is gone, a zombie, or another process's) or UNKNOWN (its pid is there but /proc
    does not show it: another user's process under /proc's hidepid)."""
    if owner.pid <= 0:  # (os.kill would signal a process group)
        return UNKNOWN
    found = _stat(owner.pid)
    if found is not None:
        state, start, _ = found
        return ALIVE if state not in "ZX" and start == owner.start else DEAD
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return DEAD
    except OSError:  # PermissionError: it exists
        pass
    return UNKNOWN


def current_owner() -> Owner | None:
    """This process as an Owner, or None where ownership cannot be proven: no /proc, or a /proc that
    is not this process's pid namespace's (what it says of this process disagrees with os.getpid())."""
    pid = os.getpid()
    mine = _stat("self")
    if mine is None or mine[2] != pid:
        return None
    return process_owner(pid)


def process_owner(pid: int) -> Owner | None:
    """The running process `pid` (of this process's pid namespace) as an Owner, or None."""
    found = _stat(pid)
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    if found is None or found[2] != pid:
        return None
    return Owner(pid, found[1], hashlib.sha256(f"{boot} {namespace}".encode()).hexdigest()[:12])


def last_change(folder: str) -> float:
    """The latest modification time of `folder` and of what is directly in it (a writer's files)."""
    latest = 0.0
    try:
        latest = os.stat(folder, follow_symlinks=False).st_mtime
        for entry in os.scandir(folder):
            latest = max(latest, entry.stat(follow_symlinks=False).st_mtime)
    except OSError:
        pass
    return latest


def _stat(pid: int | str) -> tuple[str, int, int] | None:
    """(state, start time in clock ticks after boot, pid) from /proc/<pid>/stat, or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
        # The command name (field 2) is in parentheses and may hold spaces and parentheses itself.
        fields = text[text.rindex(")") + 2:].split()
        return fields[0], int(fields[19]), int(text.split(" ", 1)[0])
    except (OSError, ValueError, IndexError):
        return None
