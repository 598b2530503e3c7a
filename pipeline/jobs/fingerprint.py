"""Fingerprints pipeline-run records in its manifest and checks on --resume: the model directory's
(its files' content hashes: core/shared/content_hash.py, shared with the conversion cache) and each
input's (a resume only continues the same job on the same inputs)."""

from __future__ import annotations

import hashlib
import os


def sampled_fingerprints(files: dict[str, str]) -> bool:
    """Whether a per-file table is an older pipeline-run's, which hashed large files by samples."""
    return any(str(v).startswith("sampled:") for v in files.values())


def changed_model_files(then: dict[str, str], now: dict[str, str]) -> str:
    """Which model files differ between two per-file tables, in a few words."""
    changed = [n for n in sorted(set(then) & set(now)) if then[n] != now[n]]
    parts = [f"{what}: {', '.join(names[:5])}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")
             for what, names in (("changed", changed), ("added", sorted(set(now) - set(then))),
                                 ("removed", sorted(set(then) - set(now)))) if names]
    return "; ".join(parts) or "the same files, fingerprinted differently"


# An input file's fingerprint (size, modification time, a hash of SAMPLE_BLOCKS blocks of SAMPLE_BYTES:
# start, end and evenly between) is the quick check, made before anything else is read: most changes
# are refused at once, naming what changed (the size, the time). It is not the guarantee: a rewrite
# in place between the blocks, its time put back, passes it. The guarantee is the running hash of
# everything the job read (records.RecordReader.records), committed with each chunk: a resume reads
# the records done again and refuses when they hash differently.
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
    """One entry per input; a stream (stdin, a FIFO) cannot be read ahead: it has none (its bytes
    are in the running hash of what was read, as every input's are: records.RecordReader). A folder
    of images (image_records.ImageFolder) is fingerprinted by its listing."""
    return [{"path": s.path, "stream": True} if s.stream else s.fingerprint() if hasattr(s, "fingerprint")
            else file_fingerprint(s.path) for s in sources]


def grown_since(then: dict, now: dict) -> bool:
    """Whether a file looks only appended to since `then`: larger now, its first then["size"] bytes
    (their sample) the same. (Its modification time moved, so whether the bytes the job read are
    unchanged is what the resume's re-reading checks.)"""
    if then.get("stream") or now.get("stream") or now.get("size", 0) <= then.get("size", 0):
        return False
    return file_fingerprint(now["path"], then["size"])["sample_sha256"] == then.get("sample_sha256")


def changed_files(then: list[str], now: list[str]) -> str | None:
    """Why a job's list of input files (a glob's or a directory's, expanded) is not the one it began
    with, naming the files added and removed; None when it is the same."""
    if then == now:
        return None
    added, removed = [p for p in now if p not in then], [p for p in then if p not in now]
    parts = [f"{len(then)} files then, {len(now)} now"]
    parts += [f"{what}: {', '.join(names[:5])}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")
              for what, names in (("added", added), ("removed", removed)) if names]
    if not added and not removed:
        parts = [f"the same {len(now)} files, in another order"]
    return f"the input files are not the job's ({'; '.join(parts)})"


def changed_input(then: list[dict], now: list[dict]) -> str | None:
    """Why the inputs differ from the ones a job began with, or None when they are the same."""
    if len(then) != len(now):
        return f"the job began with {len(then)} inputs, now there are {len(now)}"
    for old, new in zip(then, now):
        name = new.get("path")
        if old.get("path") != name:
            return f"input {name} is not the job's input {old.get('path')} (in that position)"
        if "listing_sha256" in old or "listing_sha256" in new:  # a folder of images
            if old.get("listing_sha256") != new.get("listing_sha256"):
                return _changed_folder(name, old, new)
            continue
        if grown_since(old, new):
            continue  # the job reads the bytes it began with (records.RecordReader's snapshot)
        for key, what in [("stream", "a stream"), ("size", "size"), ("mtime_ns", "modification time"),
                          ("sample_sha256", "content")]:
            if old.get(key) != new.get(key):
                if key in ("size", "mtime_ns"):
                    return f"input {name} changed since the job began ({what} {old.get(key)} then, {new.get(key)} now)"
                return f"input {name} changed since the job began ({what} differs)"
    return None


def _changed_folder(name: str, old: dict, new: dict) -> str:
    then, now = old.get("images"), new.get("images")
    how = (f"{then} image files then, {now} now" if then != now else
           f"the same {now} image files in number, but one was added, removed, renamed or rewritten (its size or "
           "modification time)")
    return f"input folder {name} changed since the job began ({how})"
