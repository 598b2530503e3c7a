"""A process group's private directory: made with its owner's identity in it, and the directories
of groups whose owner is gone removed when a new group starts.

A group's directory is removed by `ProcessGroup.close` or, when the frontend's process dies without
closing (SIGTERM, SIGKILL), by its children as they exit. When the whole group is killed at once
(SIGKILL of a process group, an OOM kill, a power cut of a container) nobody is left to remove it:
the next group removes it instead. Only a directory that is certainly dead goes:

* it is in the temporary directory, named `pooling-pipeline-*`, a real directory (not a link)
  owned by this user;
* its owner is gone: the `owner` file names a pid that is not running, or that is running but
  started at another time (pids are reused); without an `owner` file (a group of an older version,
  or one killed between making its directory and writing the file), it is older than
  STALE_UNOWNED_AGE_S;
* nobody listens on its results socket (a live frontend binds it at once: this also keeps the
  directory of a group whose owner runs in another pid namespace sharing this temporary directory).

Two groups starting at once may both remove the same dead directory: a removal that finds it gone
is fine, and neither ever removes a directory with a live owner.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

log = logging.getLogger("pipeline")

DIR_PREFIX = "pooling-pipeline-"
OWNER_FILE = "owner"
RESULTS_SOCKET = "results"
STALE_UNOWNED_AGE_S = 600.0


def make_group_dir() -> Path:
    """A fresh 0700 directory for a group, with its owner's pid and start time in `owner`; the
    dead groups' directories are removed first."""
    remove_stale_dirs()
    path = Path(tempfile.mkdtemp(prefix=DIR_PREFIX))  # mode 0700
    try:
        os.chmod(path, 0o700)
        pid = os.getpid()
        fd = os.open(path / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": pid, "start": process_start(pid)}, f)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def process_start(pid: int) -> str | None:
    """When process `pid` started, as the kernel says (clock ticks since boot, field 22 of
    /proc/<pid>/stat); None where there is no /proc or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    fields = stat_line[stat_line.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None  # field 22 is the 20th after the name


def remove_stale_dirs(base: str | None = None) -> list[str]:
    """Removes the directories of dead groups in `base` (the temporary directory); returns them."""
    base = base or tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(base) if n.startswith(DIR_PREFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(base, name)
        try:
            if _is_stale(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        except OSError as e:  # another user's, vanished meanwhile, unreadable: left alone
            log.debug("left %s alone: %s", path, e)
    if removed:
        log.debug("removed %d directories of process groups whose owner is gone: %s", len(removed), removed)
    return removed


def _is_stale(path: str) -> bool:
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False
    return _owner_gone(path, info.st_mtime) and not _listening(os.path.join(path, RESULTS_SOCKET))


def _owner_gone(path: str, mtime: float) -> bool:
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            owner = json.load(f)
        pid, start = int(owner["pid"]), owner.get("start")
    except FileNotFoundError:
        return time.time() - mtime > STALE_UNOWNED_AGE_S
    except (OSError, ValueError, KeyError, TypeError):
        return time.time() - mtime > STALE_UNOWNED_AGE_S  # being written now, or not ours to read
    if not _running(pid):
        return True
    return start is not None and process_start(pid) not in (None, start)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process has this pid
    return True


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket at `path`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(1.0)
        sock.connect(path)
    except OSError as e:
        return e.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK)
    finally:
        sock.close()
    return True
