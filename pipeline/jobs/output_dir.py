"""pipeline-run's output directory: checked before any work, and written by one run at a time.

The checks run before the model loads, so a wrong --output costs a second, not a job: a file in its
place, a directory that cannot be written, or one inside an input directory (its own files would
then be read as inputs by the next run). The lock is an `fcntl.flock` on `__job__/lock`, held for
the whole run; the kernel drops it when the process dies (even by SIGKILL), so a crash never leaves
a stale lock behind, and the file keeps the holder's pid for the message a second run gets.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
from collections.abc import Sequence
from pathlib import Path

from pooling_pipeline.jobs.job_errors import UsageError

# Everything that is not a data file lives in this folder: pandas, pyarrow.dataset and
# `datasets.load_dataset("parquet", data_dir=out)` read the output directory as is. pyarrow skips
# names starting with "_" or ".", but `datasets` only skips "." names and folders starting with
# "__" (it tried to read a top-level `_manifest.json` as Parquet), so the folder is `__job__`.
META_DIR = "__job__"
LOCK = "lock"


def check_output(output: str | Path, inputs: Sequence[str]) -> Path:
    """The output directory, created; a clear UsageError when it cannot be one."""
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output {str(out)!r} is a file; it must be a directory (new, or a job's to --resume)")
    resolved = out.resolve()
    for path in inputs:
        base = _input_directory(path)
        if base is not None and (resolved == base or base in resolved.parents):
            raise UsageError(f"--output {str(out)!r} is inside the input directory {str(base)!r}: the job's own "
                             "files would be read as inputs; choose an --output outside it")
    try:
        (out / META_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--output {str(out)!r} cannot be created ({e.strerror})") from None
    if not os.access(out / META_DIR, os.W_OK) or not os.access(out, os.W_OK):
        raise UsageError(f"--output {str(out)!r} is not writable")
    return out


def _input_directory(path: str) -> Path | None:
    """The directory an --input argument reads recursively: a directory, or the fixed part of a
    recursive glob (`dumps/**/*.jsonl` reads all of dumps/)."""
    if path == "-" or os.path.isfile(path):
        return None
    if os.path.isdir(path):
        return Path(path).resolve()
    if glob.has_magic(path) and "**" in path:
        fixed = path[:path.index("**")]
        return Path(fixed or ".").resolve()
    return None


class OutputLock:
    """One writer per output directory: a second run is refused, naming the holder's pid."""

    def __init__(self, out: Path) -> None:
        path = out / META_DIR / LOCK
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UsageError(f"--output {str(out)!r} is not writable ({e.strerror})") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UsageError(f"--output {str(out)!r} is in use by another pipeline-run (pid {holder}): one run "
                                 "writes to a directory at a time; wait for it, or choose another --output") from None
            raise
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None
