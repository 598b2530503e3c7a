"""What several test files need: waiting for processes to be gone, killing one mid-stream, the
repository's root."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


def examples(thorough: int) -> int:
    """A property test's example count: all of them with HYPOTHESIS_PROFILE=thorough, a fifth (at
    least 10) in the default, quick profile."""
    return thorough if THOROUGH else max(10, thorough // 5)
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


def stream_until_killed(pipe, pid: int, texts: list[str], error: type[BaseException], match: str,
                        after_s: float = 1.0) -> float:
    """Streams `texts` over and over through `pipe`, SIGKILLs `pid` `after_s` seconds in, checks
    that the stream raises `error` matching `match`, and returns the seconds it took from the start."""

    def endless():
        while True:
            yield from texts

    killer = threading.Timer(after_s, os.kill, (pid, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    try:
        with pytest.raises(error, match=match):
            for _ in pipe.embed_stream(endless()):
                pass
    finally:
        killer.join()
    return time.monotonic() - start


def engine_message(call: str, rows, worker: int = 0, task: str = "embed"):
    """One EngineInputBatch as a render worker packs it (`workers.packer`, the production packer).
    Each row is (index, ids), (index, ids, params) or (index, ids, params, {column: value}) with
    columns of `core.shared.schema`. Ids are not range-checked here (tests send bad ones on purpose)."""
    from pooling_pipeline.core.shared.messages import PoolingParams
    from pooling_pipeline.workers.packer import EngineInputPacker

    packer = EngineInputPacker()
    for index, ids, params, columns in ((*row, PoolingParams(), {})[:4] for row in rows):
        packer.add(index, ids, param_of=packer.kind(task, params), **columns)
    messages, refused = packer.messages(worker, call, max(len(packer), 1), vocab_size=1 << 62)
    if refused or len(messages) != 1:
        raise ValueError(f"rows the packer refused: {refused}")
    return messages[0]


def rewrite_in_place(path: Path, keep_mtime: bool = True) -> None:
    """Changes bytes in the middle of a file in place -- the same inode and size, and (by default)
    its modification time put back --, as a copy tool or a checkout can leave a file."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(before.st_size // 2)
        chunk = f.read(4096)
        f.seek(before.st_size // 2)
        f.write(bytes(b ^ 0x21 for b in chunk))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)
    assert not keep_mtime or after.st_mtime_ns == before.st_mtime_ns


class FakePipelineBase:
    """What `pipeline-run` needs of a Pipeline, without a model: tests of the job runner's own logic
    subclass it with an `encode_stream` that yields stand-in outputs."""

    def __init__(self, **kw):
        self.pids = {"engine": os.getpid(), "workers": []}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def stats(self):
        return {"requests": 0, "prompt_tokens": 0, "engine_busy_fraction": 0, "padding_fraction": 0,
                "padding_efficiency": 1, "batches": 0, "errors": 0, "cpu_plan": {}, "stages": {}, "queue_depths": {}}


def synthetic_batch(lengths, task: str = "embed", vocab: int = 1000, seed: int = 0, pair_start=None, ids=None,
                    pool_start=None):
    """A step's Requests of these lengths, as the engine's table gives them: ids from a seeded
    generator past the special tokens (or `ids`); `pair_start`: per row, where a pair's second text
    starts (-1: none); `pool_start`: per row, the first token pooled (a prompt left out)."""
    import numpy as np

    from pooling_pipeline.core.engine.columns import COL, TASK_CODE, Requests
    from pooling_pipeline.core.shared.schema import blank_table

    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    cols = blank_table(len(lengths))
    cols[:, COL["indices"]] = np.arange(len(lengths))
    cols[:, COL["lengths"]] = lengths
    cols[:, COL["task"]] = TASK_CODE[task]
    if pair_start is not None:
        cols[:, COL["token_type_start"]] = pair_start
    if pool_start is not None:
        cols[:, COL["pool_start"]] = pool_start
    calls = np.empty(len(lengths), dtype=object)
    calls[:] = "c"
    token_ids = rng.integers(5, vocab, int(lengths.sum())) if ids is None else np.asarray(ids)
    return Requests(calls, cols, token_ids.astype(np.int32))
