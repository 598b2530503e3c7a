"""Fingerprints pipeline-run records in its manifest and checks on --resume: the model directory's
and each input's (a resume only continues the same job on the same inputs)."""

from __future__ import annotations

import hashlib
import os

# Every file under the model directory can shape the output (ST module folders such as 2_Dense/ or a
# Router's routes, tokenizer files of any name, configs, weights, remote code), so all of them are
# fingerprinted, except what clearly cannot: hidden entries (.git, .cache, .gitattributes),
# Python's byte-code caches, documentation and images. When in doubt a file is included.
IGNORED_MODEL_DIRS = ("__pycache__",)
IGNORED_MODEL_SUFFIXES = (".md", ".pyc", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp", ".lock")
# Files up to this size are hashed whole (configs, tokenizer files, small Dense weights: any byte of
# them changed is seen); larger ones (the transformer's weights) by their size and a bounded sample,
# so a start or a resume does not read gigabytes.
MODEL_FULL_HASH_BYTES = 16 * 2**20
MODEL_SAMPLE_BLOCKS = 64  # of SAMPLE_BYTES each: 4 MiB read per large file


def model_files(model_dir: str) -> dict[str, str]:
    """{path relative to the model directory: fingerprint} for every file that can shape the output.

    Symlinks are followed (a Hugging Face cache snapshot is links into blobs/): what counts is the
    content under its name in the model, never the link or the blob's name."""
    root = os.path.realpath(model_dir)
    files: dict[str, str] = {}
    seen_dirs: set[str] = set()
    for top, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(top)
        if real in seen_dirs:  # a linked folder met twice (or a loop of links): once is enough
            dirs[:] = []
            continue
        seen_dirs.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in IGNORED_MODEL_DIRS)
        for name in names:
            path = os.path.join(top, name)
            if _shapes_output(name) and os.path.isfile(path):
                files[os.path.relpath(path, root).replace(os.sep, "/")] = model_file_fingerprint(path)
    return dict(sorted(files.items()))


def _shapes_output(name: str) -> bool:
    lower = name.lower()
    return not (lower.startswith(".") or lower.endswith(IGNORED_MODEL_SUFFIXES) or lower.startswith("readme"))


def model_file_fingerprint(path: str) -> str:
    """sha256 of a model file's bytes; of its size and MODEL_SAMPLE_BLOCKS evenly spaced blocks when larger
    than MODEL_FULL_HASH_BYTES (then prefixed "sampled:", so the two kinds never compare equal)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= MODEL_FULL_HASH_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
            return digest.hexdigest()
        digest.update(str(size).encode())
        _hash_sample(f, size, MODEL_SAMPLE_BLOCKS, digest)
    return "sampled:" + digest.hexdigest()


def model_hash(files: dict[str, str]) -> str:
    """The model's fingerprint (the manifest's `model_sha256`): one sha256 over the per-file table."""
    digest = hashlib.sha256()
    for name, fingerprint in sorted(files.items()):
        digest.update(f"{name}\0{fingerprint}\n".encode())
    return digest.hexdigest()


def changed_model_files(then: dict[str, str], now: dict[str, str]) -> str:
    """Which model files differ between two per-file tables, in a few words."""
    changed = [n for n in sorted(set(then) & set(now)) if then[n] != now[n]]
    parts = [f"{what}: {', '.join(names[:5])}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")
             for what, names in (("changed", changed), ("added", sorted(set(now) - set(then))),
                                 ("removed", sorted(set(then) - set(now)))) if names]
    return "; ".join(parts) or "the same files, fingerprinted differently"


# A file's fingerprint reads at most SAMPLE_BLOCKS blocks of SAMPLE_BYTES (start, end and evenly
# between), so checking a 100 GB input on --resume costs ~320 KiB of reading, not the whole file.
SAMPLE_BYTES = 64 * 1024
SAMPLE_BLOCKS = 5


def file_fingerprint(path: str, size: int | None = None) -> dict:
    """Size, modification time and a hash of a bounded sample of one input file; with `size`, of its
    first `size` bytes only (is that part of the file still what it was?)."""
    st = os.stat(path)
    size = st.st_size if size is None else size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        _hash_sample(f, size, SAMPLE_BLOCKS, digest)
    return {"path": os.path.abspath(path), "size": size, "mtime_ns": st.st_mtime_ns,
            "sample_sha256": digest.hexdigest()}


def _hash_sample(f, size: int, blocks: int, digest) -> None:
    """`blocks` blocks of SAMPLE_BYTES of [0, size): the start, the end and evenly between. Never a
    byte past `size`, even when the file has grown since its size was taken."""
    last = max(size - SAMPLE_BYTES, 0)
    for k in range(blocks):
        start = last * k // (blocks - 1)
        f.seek(start)
        digest.update(f.read(min(SAMPLE_BYTES, size - start)))


def input_fingerprints(sources) -> list[dict]:
    """One entry per input; a stream (stdin, a FIFO) cannot be read ahead: its bytes are hashed as
    they are read instead (records.RecordReader), and the manifest keeps that hash per chunk."""
    return [{"path": s.path, "stream": True} if s.stream else file_fingerprint(s.path) for s in sources]


def grown_since(then: dict, now: dict) -> bool:
    """Whether a file was only appended to since `then`: larger now, its first then["size"] bytes
    (their sample) the same."""
    if then.get("stream") or now.get("stream") or now.get("size", 0) <= then.get("size", 0):
        return False
    return file_fingerprint(now["path"], then["size"])["sample_sha256"] == then.get("sample_sha256")


def changed_input(then: list[dict], now: list[dict]) -> str | None:
    """Why the inputs differ from the ones a job began with, or None when they are the same."""
    if len(then) != len(now):
        return f"the job began with {len(then)} inputs, now there are {len(now)}"
    for old, new in zip(then, now):
        name = new.get("path")
        if old.get("path") != name:
            return f"input {name} is not the job's input {old.get('path')} (in that position)"
        if grown_since(old, new):
            continue  # the job reads the bytes it began with (records.RecordReader's snapshot)
        for key, what in [("stream", "a stream"), ("size", "size"), ("mtime_ns", "modification time"),
                          ("sample_sha256", "content")]:
            if old.get(key) != new.get(key):
                if key in ("size", "mtime_ns"):
                    return f"input {name} changed since the job began ({what} {old.get(key)} then, {new.get(key)} now)"
                return f"input {name} changed since the job began ({what} differs)"
    return None

