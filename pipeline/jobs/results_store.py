"""pipeline-run's output directory: chunks written atomically with checksums, each committed by one
line of an append-only log, read back in order by `load_results`, which never returns a partial or
mixed result silently.

Layout (the README's "Output schema" says what each column holds):

    data-NNNNN.parquet            id, index, the vectors (fixed-size lists), --keep-fields columns
    data-NNNNN.npy + ids-NNNNN.json   (--format npy) the vectors; {"index": [...], "id": [...]}
    __job__/manifest.json         the job, its chunks up to the last compaction (a sha256 per file), int8 calibration
    __job__/commits.jsonl         the chunks committed since: one line each, "<sha256 of the JSON> <JSON>"
    __job__/errors.jsonl          every record that failed under --errors return, in input order
    __job__/errors-NNNNN.jsonl    the same, per chunk (what a resume relies on)
    __job__/lock                  held by the run writing here (output_dir.py)

Everything that is not data sits in `__job__/`, so pandas, pyarrow.dataset and `datasets` read the
directory as it is. A chunk's files are written to a temporary name (starting with ".") and renamed;
then one line is appended to the commit log and fsynced: that line is the commit. Rewriting the
whole manifest per chunk instead made --chunk-rows 1 quadratic (264 s for 3,000 records, against
21 s at 1,000 rows a chunk). The log is folded into the manifest (written atomically, then the log
removed) at the end of every run, and whenever it holds as many chunks as the manifest (so the
folding stays amortized O(1) per chunk). After a crash -- even a SIGKILL -- the manifest and the
log's complete lines list exactly the committed chunks: a last line cut short (no newline, or a
checksum that does not match) is a commit that did not happen, and --resume continues from there.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np

from pooling_pipeline.core.shared.options import TOKEN_TASKS
from pooling_pipeline.jobs.fingerprint import changed_files, changed_input, changed_model_files, sampled_fingerprints
from pooling_pipeline.jobs.job_errors import InputError, UsageError
from pooling_pipeline.jobs.kept_fields import KeptColumns
from pooling_pipeline.jobs.output_dir import META_DIR

PRECISIONS = ("float32", "float16", "int8", "binary")
FORMATS = ("npy", "parquet")
# 1: manifest.json and errors files at the top (they broke the Parquet readers). 2: the manifest,
# rewritten per chunk. 3: the manifest and the commit log (a layout-2 directory loads and resumes).
LAYOUT = 3
MANIFEST = f"{META_DIR}/manifest.json"
COMMITS = f"{META_DIR}/commits.jsonl"
# The log is folded into the manifest once it holds max(COMPACT_MIN, chunks in the manifest) lines.
COMPACT_MIN = 1000
# What a commit line may change in the manifest besides its chunk and the counts. `read_sha256`: the
# hash of all the job read up to the chunk's last record, which a resume checks its inputs against
# (records.RecordReader.records); `stream_sha256` is an older run's (it hashed the bytes of streams only).
COMMIT_STATE_KEYS = ("read_sha256", "stream_sha256", "int8", "dim")
ERRORS = f"{META_DIR}/errors.jsonl"
# int8 ranges come from this many vector rows (or the whole input, when shorter): calibrating on the
# first chunk made --chunk-rows 1 give 499/500 rows a cosine < 0.9 to float32.
CALIBRATION_ROWS = 1000
# The vector column of the Parquet chunks, by task (the names PoolingBatches uses for Ray Data).
VECTOR_COLUMNS = {"embed": "embedding", "classify": "probs", "token_embed": "token_embeddings",
                  "token_classify": "token_probs", "sparse_embed": "sparse_terms"}
# Tasks with a variable number of rows per record: token tasks (one row per token) and sparse_embed
# (one [token id, weight] row per non-zero term, token ids ascending, float32 -- exact below 2**24).
VARIABLE_ROW_TASKS = (*TOKEN_TASKS, "sparse_embed")
# What load_results needs from a manifest, to fail naming the file rather than with a KeyError.
MANIFEST_KEYS = ("task", "model_sha256", "inputs", "shard", "params", "chunks", "complete", "records_done", "rows")
# Shards of one job differ in these only; everything else in the manifest's job must match.
PER_SHARD_PARAMS = ("chunk_rows", "format")


def _atomic_write(path: Path, data: bytes) -> str:
    """Writes through a hidden temporary file and a rename; returns the data's sha256."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


class Quantizer:
    """float32 rows -> the stored precision. int8 uses per-dimension ranges (as sentence-transformers'
    quantize_embeddings does) calibrated once per job on a sample of CALIBRATION_ROWS rows, recorded
    in the manifest; values outside the ranges are clipped."""

    def __init__(self, precision: str, calibration: dict | None = None) -> None:
        self.precision = precision
        self.calibration = calibration

    @property
    def needs_calibration(self) -> bool:
        return self.precision == "int8" and self.calibration is None

    def calibrate(self, rows: np.ndarray) -> None:
        low, high = rows.min(axis=0), rows.max(axis=0)
        self.calibration = {"starts": low.tolist(), "steps": np.maximum((high - low) / 255, 1e-12).tolist(),
                            "sample_rows": int(len(rows))}

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        if self.precision == "float32":
            return rows.astype(np.float32, copy=False)
        if self.precision == "float16":
            return rows.astype(np.float16)
        if self.precision == "binary":
            return np.packbits(rows > 0, axis=-1)
        if self.calibration is None:
            raise RuntimeError("int8 rows before calibration: this is a bug")
        starts = np.asarray(self.calibration["starts"], dtype=np.float32)
        steps = np.asarray(self.calibration["steps"], dtype=np.float32)
        return np.clip(np.round((rows - starts) / steps) - 128, -128, 127).astype(np.int8)


def dequantize(data: np.ndarray, manifest: dict) -> np.ndarray:
    if manifest["params"]["precision"] != "int8":
        return data
    cal = manifest["int8"]
    return (data.astype(np.float32) + 128) * np.asarray(cal["steps"], np.float32) + np.asarray(cal["starts"], np.float32)


class ResultWriter:
    """Collects a run's results in input order and commits them as chunks of `chunk_rows` records.

    int8 waits until CALIBRATION_ROWS vector rows (or the end of the input) are in before the first
    chunk with vectors is written; a run that stops before that keeps nothing of them (see finish).
    """

    def __init__(self, out_dir: str | Path, job: dict, resume: bool, fingerprints: list[dict] | None = None,
                 calibration_rows: int = CALIBRATION_ROWS, field_types: dict | None = None) -> None:
        self.dir = Path(out_dir)
        (self.dir / META_DIR).mkdir(parents=True, exist_ok=True)
        self.job = job  # what must match for a resume: task, model hash, params, inputs, shard
        self.chunk_rows = job["params"]["chunk_rows"]
        self.calibration_rows = calibration_rows
        if (self.dir / MANIFEST).exists():
            if not resume:
                raise UsageError(f"{self.dir} already holds results ({MANIFEST}): pass --resume to continue that job, "
                                 "or choose another --output")
            self.manifest, self.folded, self.logged, log_bytes = _read_state(self.dir)
            _check_same_model(self.dir, self.manifest, job)
            for key, value in job.items():
                # (the input files are compared below, with their fingerprints: a glob that now matches
                # other files is an input changed since the job began, not another job)
                if key != "inputs" and self.manifest.get(key) != value:
                    raise UsageError(f"--resume: the existing job in {self.dir} has a different {key!r} "
                                     f"({self.manifest.get(key)!r} there, {value!r} now)")
            reason = changed_files(self.manifest.get("inputs") or [], job["inputs"]) or \
                changed_input(self.manifest.get("input_fingerprints", []), fingerprints or [])
            if reason:
                raise InputError(f"--resume: {reason}; the results in {self.dir} would mix two inputs. Start a new "
                                 "job in another --output")
        elif (self.dir / "manifest.json").exists():
            raise UsageError(f"{self.dir} holds the output of an older pipeline-run (manifest.json at the top); "
                             "choose another --output")
        else:
            self.manifest = {"layout": LAYOUT, **job, "input_fingerprints": fingerprints or [], "records_done": 0,
                             "rows": 0, "errors": 0, "chunks": [], "complete": False}
            self.folded = None  # no manifest written yet: the first commit writes it
            self.logged = log_bytes = 0
        self.manifest["layout"] = LAYOUT  # a layout-2 job resumed goes on with the commit log
        self.log = CommitLog(self.dir, log_bytes)
        self.quantize = Quantizer(job["params"]["precision"], self.manifest.get("int8"))
        keep = job["params"].get("keep_fields") or []
        # Parquet: later chunks keep the first chunk's column types (kept_fields.py)
        self.kept = KeptColumns(keep, field_types, _first_schema(self.dir, self.manifest)) if keep else None
        # Records handed in but not committed: (index, id, data, error entry, kept fields, read hash, where).
        self.pending: list[tuple] = []
        self.pending_rows = 0  # vector rows among them (a token task has one per token)

    @property
    def records_done(self) -> int:
        return self.manifest["records_done"]

    def add(self, record, data: np.ndarray | None, error: str | None) -> None:
        """One record's result (or its error), in input order."""
        entry = None
        if error is not None:
            entry = {"index": record.index, "id": record.id, "file": record.file, record.unit: record.line,
                     "error": error}
            data = None
        else:
            if self.kept is not None:  # refused before it is added: the records before it are kept
                self.kept.check(record.fields or {}, record.where)
            self.pending_rows += len(data) if data.ndim == 2 else 1
        self.pending.append((record.index, record.id, data, entry, record.fields, record.read_sha256, record.where))
        if len(self.pending) >= self.chunk_rows:
            self._write_ready(end_of_input=False, final=False)

    def finish(self, stats: dict | None, complete: bool) -> int:
        """Commits what is pending and writes the manifest, marked complete only when the whole
        input is done. Returns how many records were not kept: int8 rows still waiting for their
        calibration sample when the run stops early (a resume computes them again)."""
        self._write_ready(end_of_input=complete, final=True)
        dropped = len(self.pending)
        self.pending, self.pending_rows = [], 0
        write_errors_file(self.dir, self.manifest["chunks"])
        self.manifest["complete"] = bool(complete and not dropped)
        if stats is not None:
            self.manifest["stats"] = stats
        self._compact()
        self.log.close()
        return dropped

    def _write_ready(self, end_of_input: bool, final: bool) -> None:
        while self.pending and (final or len(self.pending) >= self.chunk_rows):
            group = self.pending[:self.chunk_rows]
            if self.quantize.needs_calibration and any(e[2] is not None for e in group):
                if self.pending_rows < self.calibration_rows and not end_of_input:
                    return  # wait for the sample (bounded: calibration_rows rows)
                self.quantize.calibrate(np.concatenate([_as_rows(e[2]) for e in self.pending if e[2] is not None]))
            self._commit(group)
            del self.pending[:len(group)]
            self.pending_rows -= sum(len(_as_rows(e[2])) for e in group if e[2] is not None)

    def _commit(self, group: list[tuple]) -> None:
        ok = [e for e in group if e[2] is not None]
        kept = None
        if ok and self.kept is not None:
            kept = self.kept.arrays({k: [(e[4] or {}).get(k) for e in ok] for k in self.kept.names}, [e[6] for e in ok])
        chunk = write_chunk(self.dir, f"{len(self.manifest['chunks']):05d}", [e[2] for e in ok], [e[0] for e in ok],
                            [e[1] for e in ok], [e[3] for e in group if e[3] is not None], self.job["task"],
                            self.job["params"]["format"], self.quantize, kept)
        chunk["records"] = len(group)
        state = {}
        if ok and "dim" not in self.manifest:
            state["dim"] = int(ok[0][2].shape[-1])
        if self.quantize.calibration is not None and "int8" not in self.manifest:
            state["int8"] = self.quantize.calibration
        if group[-1][5] is not None:  # the hash of all read up to here: a resume checks its inputs against it
            state["read_sha256"] = group[-1][5]
        commit = {"seq": len(self.manifest["chunks"]), "chunk": chunk, "state": state}
        _apply_commit(self.manifest, commit)
        if self.folded is None or self.logged >= max(COMPACT_MIN, self.folded):
            self._compact()  # the first commit writes the manifest; later ones fold the log now and then
        else:
            self.log.append(commit)
            self.logged += 1

    def _compact(self) -> None:
        """Folds the log into the manifest: the manifest (every chunk) is replaced atomically, then
        the log is removed. A crash in between leaves log lines the manifest holds too; reading
        skips them by their `seq`."""
        write_manifest(self.dir, self.manifest)
        self.log.remove()
        self.folded, self.logged = len(self.manifest["chunks"]), 0


class CommitLog:
    """`__job__/commits.jsonl`: one line per committed chunk, "<sha256 of the JSON> <JSON>\\n",
    appended and fsynced (the commit); O(1) per chunk, where rewriting the manifest grew with it."""

    def __init__(self, directory: Path, valid_bytes: int) -> None:
        self.path = directory / COMMITS
        self.valid_bytes = valid_bytes  # what follows is a line a crash cut short: cut off before appending
        self.file = None

    def append(self, commit: dict) -> None:
        if self.file is None:
            self.file = open(self.path, "ab")
            if os.fstat(self.file.fileno()).st_size != self.valid_bytes:
                self.file.truncate(self.valid_bytes)
        line = commit_line(commit)
        self.file.write(line)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.valid_bytes += len(line)

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
        self.valid_bytes = 0

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def commit_line(commit: dict) -> bytes:
    text = json.dumps(commit, separators=(",", ":")).encode()
    return hashlib.sha256(text).hexdigest().encode() + b" " + text + b"\n"


def _parse_commit_line(line: bytes) -> dict | None:
    """A commit line's commit, or None when the line is not whole (its checksum does not match)."""
    digest, _, text = line.partition(b" ")
    if hashlib.sha256(text).hexdigest().encode() != digest:
        return None
    try:
        commit = json.loads(text)
    except ValueError:
        return None
    return commit if isinstance(commit, dict) else None


def _apply_commit(manifest: dict, commit: dict) -> None:
    """One commit on the manifest: its chunk, the counts, what else it changed (COMMIT_STATE_KEYS)."""
    chunk = commit["chunk"]
    manifest.update(commit.get("state", {}))
    manifest["chunks"].append(chunk)
    manifest["records_done"] += chunk["records"]
    manifest["rows"] += chunk["rows"]
    manifest["errors"] += chunk["records"] - chunk["rows"]


def _read_log(directory: Path) -> bytes:
    try:
        return (directory / COMMITS).read_bytes()
    except FileNotFoundError:
        return b""


def _read_commits(path: Path, data: bytes, folded: int) -> tuple[list[dict], int]:
    """The log's commits after the manifest's first `folded` chunks, and the bytes of the log's
    complete lines. The last line, when not whole (no newline, a checksum that does not match), is
    a commit a crash cut short: not a chunk. Any other bad line is a corrupted log."""
    commits: list[dict] = []
    pos = line_no = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end == -1:
            break  # cut short by a crash
        line_no += 1
        commit = _parse_commit_line(data[pos:end])
        if commit is None:
            if end + 1 == len(data):
                break
            raise ValueError(f"{path}: line {line_no} is corrupted (its checksum does not match, and lines follow "
                             "it, so no crash cut it short)")
        pos = end + 1
        seq, expected = commit.get("seq"), folded + len(commits)
        chunk = commit.get("chunk")
        counts = isinstance(chunk, dict) and all(type(chunk.get(k)) is int for k in ("records", "rows"))
        if not isinstance(seq, int) or not counts or seq > expected:
            raise ValueError(f"{path}: line {line_no} is not the commit of chunk {expected} (seq {seq!r}); the log "
                             "is corrupted or not pipeline-run's")
        if seq < folded:
            continue  # the manifest holds it already: a crash came between folding the log and removing it
        if seq < expected:
            raise ValueError(f"{path}: line {line_no} commits chunk {seq} a second time; the log is corrupted")
        commits.append(commit)
    return commits, pos


def _check_same_model(directory: Path, manifest: dict, job: dict) -> None:
    """A resume computes the rest of the job with the model it began with, or not at all: the model's
    per-file table names what changed."""
    if manifest.get("model_sha256") == job["model_sha256"]:
        return
    then = manifest.get("model_files")
    if then is None:  # an older pipeline-run's manifest: its fingerprint covered top-level files only
        raise UsageError(f"--resume: the job in {directory} was begun by an older pipeline-run whose model fingerprint "
                         "covered only the model directory's top-level files, so whether the model changed since "
                         "cannot be told; start a new job in another --output")
    if sampled_fingerprints(then):  # an older pipeline-run's manifest: large files fingerprinted by samples
        raise UsageError(f"--resume: the job in {directory} was begun by an older pipeline-run that fingerprinted "
                         "large model files by samples (which a rewrite in place can pass), so whether the model "
                         "changed since cannot be told; start a new job in another --output")
    raise UsageError(f"--resume: the model changed since the job began ({changed_model_files(then, job['model_files'])});"
                     f" the results in {directory} would mix two models. Start a new job in "
                     "another --output")


def _as_rows(data: np.ndarray) -> np.ndarray:
    return data if data.ndim == 2 else data[None, :]


def _first_schema(directory: Path, manifest: dict):
    for chunk in manifest["chunks"]:
        if chunk.get("data", "").endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.read_schema(directory / chunk["data"])
    return None


def write_errors_file(directory: Path, chunks: list[dict]) -> None:
    """One errors.jsonl for the whole job, in input order, from the chunks' own errors files,
    streamed (a job may have millions). Indices become positions in the whole input: a chunk
    written by a Ray task holds chunk-local ones, placed by its `index_offset`."""
    path = directory / ERRORS
    tmp = path.with_name(f".{path.name}.tmp")
    wrote = False
    with open(tmp, "w", encoding="utf-8") as out:
        for chunk in chunks:
            if chunk.get("errors"):
                offset = chunk.get("index_offset", 0)
                with open(directory / chunk["errors"], encoding="utf-8") as f:
                    for line in f:
                        error = json.loads(line)
                        error["index"] += offset
                        out.write(json.dumps(error) + "\n")
                        wrote = True
    if wrote:
        os.replace(tmp, path)
    else:
        tmp.unlink()


def write_manifest(directory: Path, manifest: dict) -> None:
    _atomic_write(Path(directory) / MANIFEST, json.dumps(manifest, indent=2).encode())


def write_chunk(directory: Path, name: str, rows: list[np.ndarray], indices: list[int], ids: list[str],
                errors: list[dict], task: str, fmt: str, quantize: Quantizer, kept: list[tuple] | None = None) -> dict:
    """Writes one chunk's files atomically -- data-NAME.(npy|parquet) (with ids-NAME.json beside a
    .npy), __job__/errors-NAME.jsonl when some records failed -- and returns its manifest entry, with
    each file's sha256. Writing the same name again replaces the chunk (a retried task never
    duplicates rows)."""
    directory = Path(directory)
    (directory / META_DIR).mkdir(parents=True, exist_ok=True)
    chunk: dict = {"name": name, "rows": len(rows), "records": len(rows) + len(errors), "sha256": {}}
    if rows:
        chunk.update(_write_data(directory, name, rows, indices, ids, task, fmt, quantize, kept, chunk["sha256"]))
    if errors:
        errors_name = f"{META_DIR}/errors-{name}.jsonl"
        data = "".join(json.dumps(e) + "\n" for e in errors).encode()
        chunk["sha256"][errors_name] = _atomic_write(directory / errors_name, data)
        chunk["errors"] = errors_name
    return chunk


def _write_data(directory: Path, name: str, rows: list[np.ndarray], indices: list[int], ids: list[str], task: str,
                fmt: str, quantize: Quantizer, kept: list[tuple] | None, sha256: dict) -> dict:
    token_task = task in VARIABLE_ROW_TASKS
    if token_task:  # variable rows per record: concatenated, with offsets
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
        data = quantize(np.concatenate(rows))
    else:
        offsets = None
        data = quantize(np.stack(rows))
    if fmt == "parquet":
        file_name = f"data-{name}.parquet"
        column = VECTOR_COLUMNS[task]
        sha256[file_name] = _atomic_write(directory / file_name,
                                          _parquet_bytes(data, offsets, indices, ids, column, kept))
        return {"data": file_name, "column": column}
    file_name, ids_name = f"data-{name}.npy", f"ids-{name}.json"
    sha256[file_name] = _atomic_write(directory / file_name, _npy_bytes(data))
    sha256[ids_name] = _atomic_write(directory / ids_name, json.dumps({"index": indices, "id": ids}).encode())
    return {"data": file_name, "ids": ids_name, **({"offsets": offsets.tolist()} if token_task else {})}


def _parquet_bytes(data: np.ndarray, offsets: np.ndarray | None, indices: list[int], ids: list[str], column: str,
                   kept: list[tuple] | None) -> bytes:
    """One chunk as a Parquet table: `id`, `index`, the vectors as a fixed-size list of the stored
    precision (token tasks: a list of them per record), then the kept input fields ((field, array)
    pairs, from kept_fields.py)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    vectors = pa.FixedSizeListArray.from_arrays(pa.array(data.reshape(-1)), data.shape[-1])
    if offsets is not None:
        vectors = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), vectors)
    table = pa.table({"id": pa.array(ids, pa.string()), "index": pa.array(indices, pa.int64()), column: vectors})
    for field, array in kept or []:
        table = table.append_column(field, array)
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


# -- reading back ---------------------------------------------------------------------------------

def load_manifest(directory: str | Path) -> dict | None:
    """The manifest of an output directory, or None when there is none."""
    return read_manifest(directory) if (Path(directory) / MANIFEST).exists() else None


def read_manifest(directory: str | Path) -> dict:
    """The manifest with the commit log's chunks applied, checked: a missing file, invalid JSON, a
    missing key or a corrupted log is a ValueError naming it."""
    return _read_state(directory)[0]


def _read_state(directory: str | Path) -> tuple[dict, int, int, int]:
    """(manifest with the log applied, chunks in manifest.json, commits in the log, bytes of the log's
    complete lines)."""
    path = Path(directory) / MANIFEST
    # The log first: a run folding it meanwhile then leaves a newer manifest, whose chunks the log's
    # lines repeat (skipped by seq); the other order could miss the chunks just folded.
    log = _read_log(Path(directory))
    if not path.exists():
        old = " (it holds manifest.json at the top: an older pipeline-run's layout)" if \
            (Path(directory) / "manifest.json").exists() else ""
        raise ValueError(f"{directory}: no {MANIFEST}: not a pipeline-run output directory{old}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the manifest is corrupted") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: a JSON object is expected, got {type(manifest).__name__}")
    if isinstance(manifest.get("layout"), int) and manifest["layout"] > LAYOUT:
        raise ValueError(f"{path}: layout {manifest['layout']}, written by a newer pipeline-run (this one reads "
                         f"layouts up to {LAYOUT}); read it with that version")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise ValueError(f"{path}: the manifest lacks {missing}; it is corrupted or not pipeline-run's")
    folded = len(manifest["chunks"])
    commits, log_bytes = _read_commits(Path(directory) / COMMITS, log, folded)
    for commit in commits:
        _apply_commit(manifest, commit)
    missing += [f"params.{k}" for k in ("precision", "format") if k not in (manifest.get("params") or {})]
    if manifest.get("params", {}).get("precision") == "int8" and manifest.get("rows") and "int8" not in manifest:
        missing.append("int8")
    if missing:
        raise ValueError(f"{path}: the manifest lacks {missing}; it is corrupted or not pipeline-run's")
    for i, chunk in enumerate(manifest["chunks"]):
        need = ["records", "rows", "sha256"] + (["data"] if chunk.get("rows") else [])
        need += ["ids"] if chunk.get("rows") and not str(chunk.get("data", "")).endswith(".parquet") else []
        lacking = [k for k in need if k not in chunk]
        if lacking:
            where = path if i < folded else Path(directory) / COMMITS
            raise ValueError(f"{where}: chunk {i} lacks {lacking}; the manifest is corrupted")
    return manifest, folded, len(commits), log_bytes


def load_results(*directories: str | Path, allow_partial: bool = False) -> tuple[list[str], np.ndarray | list[np.ndarray]]:
    """Reads pipeline-run output back in input order: (ids, array [rows, dim]).

    Several directories (the shards of one job) are merged by record index. int8 is dequantized to
    float32; binary stays packed (uint8, as sentence-transformers' ubinary). Token tasks give a list
    of [num_tokens, dim] arrays instead of one array. Records that failed (--errors return) are not
    included; their errors are in __job__/errors.jsonl.

    Never a partial or mixed result in silence: a job that did not finish raises (unless
    `allow_partial=True`), so do a directory given twice and directories of different jobs; every
    file is checked against the sha256 the manifest recorded, and a corrupted one is named.
    """
    if not directories:
        raise ValueError("load_results needs at least one output directory")
    manifests = []
    seen: dict[Path, str] = {}
    for directory in directories:
        key = Path(directory).resolve()
        if key in seen:
            raise ValueError(f"{directory} is given twice (as {seen[key]!r}): its rows would be counted twice")
        seen[key] = str(directory)
        manifest = read_manifest(directory)
        if not manifest["complete"] and not allow_partial:
            raise ValueError(f"{directory} holds an unfinished job ({manifest['records_done']} records done; it was "
                             "interrupted, stopped at --limit, or is still running): finish it with --resume, or pass "
                             "allow_partial=True to read what is there")
        manifests.append((Path(directory), manifest))
    _check_one_job(manifests)
    parts: list[tuple[int, str, np.ndarray]] = []
    token_task = manifests[0][1]["task"] in VARIABLE_ROW_TASKS
    for directory, manifest in manifests:
        for chunk in manifest["chunks"]:
            if chunk["rows"]:
                parts.extend(_read_chunk(directory, manifest, chunk, token_task))
    parts.sort(key=lambda p: p[0])
    ids_out = [p[1] for p in parts]
    rows_out = [p[2] for p in parts]
    if token_task:
        return ids_out, rows_out
    if not rows_out:
        return ids_out, np.zeros((0, 0), dtype=np.float32)
    return ids_out, np.stack(rows_out)


def _job_identity(manifest: dict) -> dict:
    params = {k: v for k, v in manifest["params"].items() if k not in PER_SHARD_PARAMS}
    return {"task": manifest["task"], "model_sha256": manifest["model_sha256"], "inputs": manifest["inputs"],
            "params": params, "shards": manifest["shard"][1]}


def _check_one_job(manifests: list[tuple[Path, dict]]) -> None:
    """Directories read together must be distinct shards of one job."""
    first_dir, first = manifests[0]
    want = _job_identity(first)
    shards: dict[int, Path] = {}
    for directory, manifest in manifests:
        got = _job_identity(manifest)
        for key in want:
            if got[key] != want[key]:
                what = {k: (want[key].get(k), got[key].get(k)) for k in set(want[key]) | set(got[key])
                        if want[key].get(k) != got[key].get(k)} if isinstance(want[key], dict) else (want[key], got[key])
                raise ValueError(f"{first_dir} and {directory} hold different jobs (their {key!r} differ: {what}); "
                                 "read them apart")
        shard = manifest["shard"][0]
        if shard in shards:
            raise ValueError(f"{shards[shard]} and {directory} both hold shard {shard}/{manifest['shard'][1]} of "
                             "the job: its rows would be counted twice")
        shards[shard] = directory


def _read_verified(directory: Path, chunk: dict, name: str) -> bytes:
    path = directory / name
    expected = chunk["sha256"].get(name)
    if expected is None:
        raise ValueError(f"{directory / MANIFEST}: no checksum for {name}; the manifest is corrupted")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror}); the output is incomplete") from None
    if hashlib.sha256(data).hexdigest() != expected:
        raise ValueError(f"{path}: its sha256 differs from the manifest's: the file is truncated or corrupted")
    return data


def _read_chunk(directory: Path, manifest: dict, chunk: dict, token_task: bool) -> list[tuple[int, str, np.ndarray]]:
    data_bytes = _read_verified(directory, chunk, chunk["data"])
    where = directory / chunk["data"]
    if chunk["data"].endswith(".parquet"):
        indices, ids, rows = _parquet_rows(data_bytes, chunk, token_task, where)
    else:
        meta = json.loads(_read_verified(directory, chunk, chunk["ids"]))
        indices, ids = meta["index"], meta["id"]
        try:
            data = np.load(io.BytesIO(data_bytes), allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"{where}: not a readable .npy file ({e})") from None
        offsets = chunk.get("offsets")
        rows = [data[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)] if token_task else list(data)
    if not len(ids) == len(indices) == len(rows) == chunk["rows"]:
        raise ValueError(f"{where}: {len(rows)} rows, {len(ids)} ids and {len(indices)} indices, but the manifest "
                         f"says {chunk['rows']}: the chunk is corrupted")
    offset = chunk.get("index_offset", 0)  # Ray jobs: chunk-local indices
    return [(offset + i, str(rid), dequantize(r, manifest)) for i, rid, r in zip(indices, ids, rows)]


def _parquet_rows(data: bytes, chunk: dict, token_task: bool, where: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(data))
        vectors = table.column(chunk.get("column", "data")).combine_chunks()
    except (pa.ArrowException, KeyError) as e:
        raise ValueError(f"{where}: not a readable chunk ({e})") from None
    if token_task:
        offsets = vectors.offsets.to_numpy()
        offsets = offsets - offsets[0]  # flatten() starts at the first record's rows
        values = vectors.flatten()
    else:
        offsets, values = None, vectors
    width = values.type.list_size
    flat = values.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
    rows = [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)] if token_task else list(flat)
    return table.column("index").to_pylist(), table.column("id").to_pylist(), rows
