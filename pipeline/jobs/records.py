"""Input records for pipeline-run, streamed: JSONL, plain text, Parquet; files, directories, globs, stdin.

Every record gets its index in the whole input (files in the order given, a directory's files
sorted), so shards (index % N == I) and resumes (skip the first K of this shard) are deterministic.
Bad files get errors that name the file and the line.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SUFFIXES = (".jsonl", ".ndjson", ".json", ".txt", ".text", ".parquet")


@dataclass(frozen=True)
class Record:
    index: int  # position in the whole input
    id: str
    text: str


def expand_inputs(paths: list[str]) -> list[str]:
    """Files in a fixed order: each argument as given, a directory's matching files sorted, a glob sorted."""
    files: list[str] = []
    for path in paths:
        if path == "-":
            files.append(path)
        elif os.path.isdir(path):
            found = sorted(str(p) for p in Path(path).rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise ValueError(f"input directory {path!r} holds no {', '.join(SUFFIXES)} files")
            files.extend(found)
        elif any(ch in path for ch in "*?["):
            found = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not found:
                raise ValueError(f"input pattern {path!r} matches no file")
            files.extend(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise ValueError(f"input {path!r} does not exist")
    return files


def read_records(files: list[str], text_field: str = "text", id_field: str | None = "id",
                 shard: tuple[int, int] = (0, 1), skip: int = 0) -> Iterator[Record]:
    """The records of this shard, after the first `skip` of them (already done by a resumed run).

    Records of other shards and skipped ones are passed over without being parsed where the format
    allows (a JSONL line is only decoded when it is ours).
    """
    index = 0
    mine = 0
    shard_i, shard_n = shard
    for path in files:
        for line_no, raw in _lines(path, text_field, id_field):
            ours = index % shard_n == shard_i
            index += 1
            if not ours:
                continue
            mine += 1
            if mine <= skip:
                continue
            rid, text = raw() if callable(raw) else raw
            yield Record(index - 1, rid if rid is not None else f"{_name(path)}:{line_no}", text)


def _name(path: str) -> str:
    return "stdin" if path == "-" else path


def _lines(path: str, text_field: str, id_field: str | None):
    """(line number, record or a function that parses it) for each record of one file."""
    if path.endswith(".parquet"):
        yield from _parquet(path, text_field, id_field)
        return
    stream = sys.stdin if path == "-" else open(path, encoding="utf-8")
    try:
        is_jsonl = path.endswith((".jsonl", ".ndjson", ".json"))
        for line_no, line in enumerate(stream, start=1):
            line = line.rstrip("\n").rstrip("\r")
            if is_jsonl or (path == "-" and line.startswith("{")):
                if not line.strip():
                    continue
                yield line_no, (lambda line=line, line_no=line_no: _parse_json(path, line_no, line, text_field, id_field))
            else:
                yield line_no, (None, line)
    except UnicodeDecodeError as e:
        raise ValueError(f"{_name(path)}: not UTF-8 text ({e})") from None
    finally:
        if stream is not sys.stdin:
            stream.close()


def _parse_json(path: str, line_no: int, line: str, text_field: str, id_field: str | None) -> tuple[str | None, str]:
    where = f"{_name(path)} line {line_no}"
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a JSON object is expected, got {type(record).__name__}")
    if text_field not in record:
        raise ValueError(f"{where}: no field {text_field!r}")
    if not isinstance(record[text_field], str):
        raise ValueError(f"{where}: field {text_field!r} must be a string, got {type(record[text_field]).__name__}")
    rid = record.get(id_field) if id_field else None
    if rid is not None and not isinstance(rid, (str, int)):
        raise ValueError(f"{where}: field {id_field!r} must be a string or an integer")
    return (str(rid) if rid is not None else None), record[text_field]


def _parquet(path: str, text_field: str, id_field: str | None):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install 'pooling-pipeline[parquet]')") from None
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if text_field not in names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {names})")
    columns = [text_field] + ([id_field] if id_field and id_field in names else [])
    row = 0
    for batch in pf.iter_batches(batch_size=4096, columns=columns):  # streamed, never loaded whole
        texts = batch.column(text_field).to_pylist()
        ids = batch.column(id_field).to_pylist() if len(columns) > 1 else [None] * len(texts)
        for text, rid in zip(texts, ids):
            row += 1
            if not isinstance(text, str):
                raise ValueError(f"{path} row {row}: column {text_field!r} must be a string, got {type(text).__name__}")
            yield row, ((str(rid) if rid is not None else None), text)
