"""Fingerprints pipeline-run records in its manifest and checks on --resume: the model directory's
and each input's (a resume only continues the same job on the same inputs)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def model_hash(model_dir: str) -> str:
    """sha256 over the names and bytes of the model's config, tokenizer and weight files."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file() and path.suffix in (".json", ".safetensors", ".bin", ".txt", ".model", ".py"):
            digest.update(path.name.encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


# A file's fingerprint reads at most SAMPLE_BLOCKS blocks of SAMPLE_BYTES (start, end and evenly
# between), so checking a 100 GB input on --resume costs ~320 KiB of reading, not the whole file.
SAMPLE_BYTES = 64 * 1024
SAMPLE_BLOCKS = 5


def file_fingerprint(path: str) -> dict:
    """Size, modification time and a hash of a bounded sample of one input file."""
    st = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        last = max(st.st_size - SAMPLE_BYTES, 0)
        for k in range(SAMPLE_BLOCKS):
            f.seek(last * k // (SAMPLE_BLOCKS - 1))
            digest.update(f.read(SAMPLE_BYTES))
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sample_sha256": digest.hexdigest()}


def input_fingerprints(sources) -> list[dict]:
    """One entry per input; a stream (stdin, a FIFO) cannot be read ahead: its bytes are hashed as
    they are read instead (records.RecordReader), and the manifest keeps that hash per chunk."""
    return [{"path": s.path, "stream": True} if s.stream else file_fingerprint(s.path) for s in sources]


def changed_input(then: list[dict], now: list[dict]) -> str | None:
    """Why the inputs differ from the ones a job began with, or None when they are the same."""
    if len(then) != len(now):
        return f"the job began with {len(then)} inputs, now there are {len(now)}"
    for old, new in zip(then, now):
        name = new.get("path")
        if old.get("path") != name:
            return f"input {name} is not the job's input {old.get('path')} (in that position)"
        for key, what in [("stream", "a stream"), ("size", "size"), ("mtime_ns", "modification time"),
                          ("sample_sha256", "content")]:
            if old.get(key) != new.get(key):
                if key in ("size", "mtime_ns"):
                    return f"input {name} changed since the job began ({what} {old.get(key)} then, {new.get(key)} now)"
                return f"input {name} changed since the job began ({what} differs)"
    return None

