"""Content hashes of model files, and where the project keeps what it computes once per model:
what the OpenVINO conversion cache (the engine's) and pipeline-run's model fingerprint (the job
runner's) share, so it sits below both."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading

CACHE_ENV = "POOLING_PIPELINE_CACHE"  # the project's cache (default ~/.cache/pooling_pipeline)


def cache_root() -> str:
    """Where the project keeps what it computes once per model: OpenVINO conversions, content hashes."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "pooling_pipeline")


# Every file under the model directory can shape the output (ST module folders such as 2_Dense/ or a
# Router's routes, tokenizer files of any name, configs, weights, remote code), so all of them are
# fingerprinted, except what clearly cannot: hidden entries (.git, .cache, .gitattributes),
# Python's byte-code caches, documentation and images. When in doubt a file is included.
IGNORED_MODEL_DIRS = ("__pycache__",)
IGNORED_MODEL_SUFFIXES = (".md", ".pyc", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp", ".lock")
# Model files are hashed whole, every byte (a sample of a large file let a rewrite in place with the
# size and modification time kept pass as the same model). A file's hash is remembered by its
# identity on disk -- device, inode, size, modification and change times -- in the cache
# (`content-hashes.json`), so the gigabytes are read once: any write to the file, and any
# os.utime() that would put its modification time back, moves its change time, which no user
# process can set, so a changed file is always hashed anew. Files below this size are not
# remembered (hashing them costs less than the bookkeeping).
REMEMBERED_HASH_BYTES = 1 << 20
MAX_REMEMBERED_HASHES = 4096


def model_files(model_dir: str, recursive: bool = True) -> dict[str, str]:
    """{path relative to the model directory: fingerprint} for every file that can shape the output
    (with `recursive=False`, the directory's own files only: its subfolders are not read at all).

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
        dirs[:] = sorted(d for d in dirs if recursive and not d.startswith(".") and d not in IGNORED_MODEL_DIRS)
        for name in names:
            path = os.path.join(top, name)
            if _shapes_output(name) and os.path.isfile(path):
                files[os.path.relpath(path, root).replace(os.sep, "/")] = model_file_fingerprint(path)
    return dict(sorted(files.items()))


def _shapes_output(name: str) -> bool:
    lower = name.lower()
    return not (lower.startswith(".") or lower.endswith(IGNORED_MODEL_SUFFIXES) or lower.startswith("readme"))


def model_file_fingerprint(path: str) -> str:
    """sha256 of a model file's bytes (`content_sha256`)."""
    return content_sha256(path)


def content_sha256(path: str) -> str:
    """sha256 of a file's whole content, remembered by the file's identity on disk (see
    REMEMBERED_HASH_BYTES): computed once per version of the file, never trusted past a change."""
    real = os.path.realpath(path)
    before = os.stat(real)
    if before.st_size < REMEMBERED_HASH_BYTES:
        return file_sha256(real)
    identity = _identity(before)
    with _memo_lock:
        memo = _memo()
        remembered = memo.get(real)
        if isinstance(remembered, list) and len(remembered) == 2 and remembered[0] == identity:
            return str(remembered[1])
    digest = file_sha256(real)
    if _identity(os.stat(real)) == identity:  # not written to while it was read
        with _memo_lock:
            memo = _memo()
            memo[real] = [identity, digest]
            while len(memo) > MAX_REMEMBERED_HASHES:
                memo.pop(next(iter(memo)))
            _save_memo(memo)
    return digest


def _identity(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_memo_lock = threading.Lock()
_memo_state: dict = {}  # {"path": the memo file, "hashes": {real path: [identity, sha256]}}


def _memo_path() -> str:
    return os.path.join(cache_root(), "content-hashes.json")


def _memo() -> dict:
    """The remembered hashes (read once per process and cache location; unreadable: none)."""
    path = _memo_path()
    if _memo_state.get("path") != path:
        try:
            with open(path, encoding="utf-8") as f:
                hashes = json.load(f)
        except (OSError, ValueError):
            hashes = {}
        _memo_state.update(path=path, hashes=hashes if isinstance(hashes, dict) else {})
    return _memo_state["hashes"]


def _save_memo(memo: dict) -> None:
    """Writes the memo whole beside its place and renames it there. A cache that cannot be written
    only means hashing again next time."""
    path = _memo_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=".content-hashes-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(memo, f)
        os.replace(staging, path)
    except (OSError, ValueError):
        pass


def model_hash(files: dict[str, str]) -> str:
    """The model's fingerprint (the manifest's `model_sha256`): one sha256 over the per-file table."""
    digest = hashlib.sha256()
    for name, fingerprint in sorted(files.items()):
        digest.update(f"{name}\0{fingerprint}\n".encode())
    return digest.hexdigest()
