"""pipeline-run's output directory: chunks written atomically, a manifest written last, read back in order.

Layout: data-NNNNN.npy (or .parquet) with ids-NNNNN.json beside it ({"index": [...], "id": [...]}),
errors-NNNNN.jsonl for records that failed with --errors return, and manifest.json. A chunk's files
are written to a temporary name and renamed, and the manifest is rewritten (the same way) after
every chunk, so after a crash -- even a SIGKILL -- the manifest lists exactly the chunks that are
complete, and --resume continues from there with identical output.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
from pooling_pipeline.core.options import TOKEN_TASKS

PRECISIONS = ("float32", "float16", "int8", "binary")
FORMATS = ("npy", "parquet")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


class Quantizer:
    """float32 rows -> the stored precision. int8 uses per-dimension ranges calibrated on the first
    chunk (as sentence-transformers' quantize_embeddings does), recorded in the manifest."""

    def __init__(self, precision: str, calibration: dict | None = None) -> None:
        self.precision = precision
        self.calibration = calibration

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        if self.precision == "float32":
            return rows.astype(np.float32, copy=False)
        if self.precision == "float16":
            return rows.astype(np.float16)
        if self.precision == "binary":
            return np.packbits(rows > 0, axis=-1)
        if self.calibration is None:
            low, high = rows.min(axis=0), rows.max(axis=0)
            self.calibration = {"starts": low.tolist(), "steps": np.maximum((high - low) / 255, 1e-12).tolist()}
        starts = np.asarray(self.calibration["starts"], dtype=np.float32)
        steps = np.asarray(self.calibration["steps"], dtype=np.float32)
        return np.clip(np.round((rows - starts) / steps) - 128, -128, 127).astype(np.int8)


def dequantize(data: np.ndarray, manifest: dict) -> np.ndarray:
    if manifest["params"]["precision"] != "int8":
        return data
    cal = manifest["int8"]
    return (data.astype(np.float32) + 128) * np.asarray(cal["steps"], np.float32) + np.asarray(cal["starts"], np.float32)


class ResultWriter:
    def __init__(self, out_dir: str | Path, job: dict, resume: bool) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.job = job  # what must match for a resume: task, model hash, params, inputs, shard
        manifest_path = self.dir / "manifest.json"
        if manifest_path.exists():
            if not resume:
                raise ValueError(f"{self.dir} already holds results (manifest.json): pass --resume to continue "
                                 "that job, or choose another --output")
            self.manifest = json.loads(manifest_path.read_text())
            for key, value in job.items():
                if self.manifest.get(key) != value:
                    raise ValueError(f"--resume: the existing job in {self.dir} has a different {key!r} "
                                     f"({self.manifest.get(key)!r} there, {value!r} now)")
        else:
            self.manifest = {**job, "records_done": 0, "rows": 0, "errors": 0, "chunks": [], "complete": False}
        self.quantize = Quantizer(job["params"]["precision"], self.manifest.get("int8"))
        self.rows: list[np.ndarray] = []
        self.indices: list[int] = []
        self.ids: list[str] = []
        self.errors: list[dict] = []
        self.pending_records = 0

    @property
    def records_done(self) -> int:
        return self.manifest["records_done"]

    def add(self, index: int, rid: str, data: np.ndarray | None, error: str | None) -> None:
        self.pending_records += 1
        if error is not None:
            self.errors.append({"index": index, "id": rid, "error": error})
            return
        self.rows.append(data)
        self.indices.append(index)
        self.ids.append(rid)

    def flush(self, stats: dict | None = None) -> None:
        """Commits what was added as one chunk: data, ids and errors files first, the manifest last."""
        if not self.pending_records:
            return
        chunk = write_chunk(self.dir, f"{len(self.manifest['chunks']):05d}", self.rows, self.indices, self.ids,
                            self.errors, self.job["task"], self.job["params"]["format"], self.quantize)
        chunk["records"] = self.pending_records
        if self.rows:
            self.manifest.setdefault("dim", int(self.rows[0].shape[-1]))
        self.manifest["chunks"].append(chunk)
        self.manifest["records_done"] += self.pending_records
        self.manifest["rows"] += len(self.rows)
        self.manifest["errors"] += len(self.errors)
        if self.quantize.calibration is not None:
            self.manifest["int8"] = self.quantize.calibration
        if stats:
            self.manifest["stats"] = stats
        self._write_manifest()
        self.rows, self.indices, self.ids, self.errors, self.pending_records = [], [], [], [], 0

    def close(self, stats: dict) -> None:
        self.flush(stats)
        write_errors_file(self.dir, self.manifest["chunks"])
        self.manifest["complete"] = True
        self.manifest["stats"] = stats
        self._write_manifest()

    def _write_manifest(self) -> None:
        write_manifest(self.dir, self.manifest)


def write_errors_file(directory: Path, chunks: list[dict]) -> None:
    """One errors.jsonl for the whole job, in input order, from the chunks' own errors files (the
    per-chunk files are what a resume relies on). Indices become positions in the whole input:
    a chunk written by a Ray task holds chunk-local ones, placed by its `index_offset`."""
    lines = []
    for chunk in chunks:
        if chunk.get("errors"):
            offset = chunk.get("index_offset", 0)
            for line in (directory / chunk["errors"]).read_text(encoding="utf-8").splitlines():
                error = json.loads(line)
                error["index"] += offset
                lines.append(json.dumps(error) + "\n")
    if lines:
        _atomic_write(directory / "errors.jsonl", "".join(lines).encode())


def write_manifest(directory: Path, manifest: dict) -> None:
    _atomic_write(directory / "manifest.json", json.dumps(manifest, indent=2).encode())


def write_chunk(directory: Path, name: str, rows: list[np.ndarray], indices: list[int], ids: list[str],
                errors: list[dict], task: str, fmt: str, quantize: Quantizer) -> dict:
    """Writes one chunk's files atomically -- data-NAME.(npy|parquet) with ids-NAME.json beside it,
    errors-NAME.jsonl when some records failed -- and returns its manifest entry. Writing the same
    name again replaces the chunk (a retried task never duplicates rows)."""
    chunk: dict = {"rows": len(rows), "records": len(rows) + len(errors)}
    if rows:
        chunk.update(_write_data(directory, name, rows, indices, ids, task, fmt, quantize))
        ids_name = f"ids-{name}.json"
        _atomic_write(directory / ids_name, json.dumps({"index": indices, "id": ids}).encode())
        chunk["ids"] = ids_name
    if errors:
        errors_name = f"errors-{name}.jsonl"
        _atomic_write(directory / errors_name, "".join(json.dumps(e) + "\n" for e in errors).encode())
        chunk["errors"] = errors_name
    return chunk


def _write_data(directory: Path, name: str, rows: list[np.ndarray], indices: list[int], ids: list[str],
                task: str, fmt: str, quantize: Quantizer) -> dict:
    if task in TOKEN_TASKS:  # variable rows per record: concatenated, with offsets
        lengths = [len(r) for r in rows]
        data = quantize(np.concatenate(rows))
        extra = {"offsets": np.concatenate([[0], np.cumsum(lengths)]).tolist()}
    else:
        data = quantize(np.stack(rows))
        extra = {}
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        file_name = f"data-{name}.parquet"
        table = pa.table({"index": indices, "id": ids,
                          "data": [row.tobytes() for row in _split(data, extra.get("offsets"))]})
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        _atomic_write(directory / file_name, buffer.getvalue())
        return {"data": file_name, "dtype": str(data.dtype), "shape": list(data.shape[1:]), **extra}
    file_name = f"data-{name}.npy"
    _atomic_write(directory / file_name, _npy_bytes(data))
    return {"data": file_name, **extra}


def _split(data: np.ndarray, offsets: list[int] | None) -> list[np.ndarray]:
    if offsets is None:
        return list(data)
    return [data[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def load_manifest(directory: str | Path) -> dict | None:
    """The manifest of an output directory, or None when there is none."""
    path = Path(directory) / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else None


def load_results(*directories: str | Path) -> tuple[list[str], np.ndarray | list[np.ndarray]]:
    """Reads pipeline-run output back in input order: (ids, array [rows, dim]).

    Several directories (the shards of one job) are merged by record index. int8 is dequantized to
    float32; binary stays packed (uint8, as sentence-transformers' ubinary). Token tasks give a list
    of [num_tokens, dim] arrays instead of one array. Records that failed (--errors return) are not
    included; their errors are in errors-*.jsonl.
    """
    if not directories:
        raise ValueError("load_results needs at least one output directory")
    parts: list[tuple[int, str, np.ndarray]] = []
    token_task = False
    for directory in directories:
        directory = Path(directory)
        manifest = json.loads((directory / "manifest.json").read_text())
        token_task = manifest["task"] in TOKEN_TASKS
        for chunk in manifest["chunks"]:
            if not chunk.get("rows"):
                continue
            ids = json.loads((directory / chunk["ids"]).read_text())
            offset = chunk.get("index_offset", 0)  # Ray jobs: chunk-local indices
            indices = [offset + i for i in ids["index"]]
            if chunk["data"].endswith(".parquet"):
                import pyarrow.parquet as pq

                table = pq.read_table(directory / chunk["data"])
                shape = (-1, *chunk["shape"]) if token_task else tuple(chunk["shape"])
                rows = [np.frombuffer(b, dtype=chunk["dtype"]).reshape(shape) for b in table.column("data").to_pylist()]
            else:
                rows = _split(np.load(directory / chunk["data"]), chunk.get("offsets"))
            rows = [dequantize(r, manifest) for r in rows]
            parts.extend(zip(indices, ids["id"], rows))
    parts.sort(key=lambda p: p[0])
    ids_out = [p[1] for p in parts]
    rows_out = [p[2] for p in parts]
    if token_task:
        return ids_out, rows_out
    if not rows_out:
        return ids_out, np.zeros((0, 0), dtype=np.float32)
    return ids_out, np.stack(rows_out)
