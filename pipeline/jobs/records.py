"""Input records for pipeline-run, streamed: JSONL, plain text, Parquet; files, directories, globs,
FIFOs (`<(cmd)`) and stdin.

Every record gets its index in the whole input (inputs in the order given, a directory's files
sorted), so shards (index % N == I) and resumes (skip the first K of this shard) are deterministic.

Text is read as people write files: lines end at "\\n" only (a lone "\\r" inside a line is text,
"\\r\\n" ends a line), a UTF-8 byte order mark at the start of a file is skipped, and each line is
decoded on its own, so an invalid byte is the error of that line, not of the whole file.

A record that cannot be embedded (invalid UTF-8, invalid JSON, a text that is missing, null or not a
string, a missing id) is yielded with its `error` set and its file and line: the launcher stops on it,
or, under --errors return, writes it to errors.jsonl and goes on.

Ids: `--id-field NAME` makes every record carry a NAME field. Without it the first record of the
whole input decides once: an `id` field there means every record needs one; none means every id
is `file:line`. Either way a record never silently falls back to another kind of id.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pooling_pipeline.jobs.job_errors import InputError, UsageError

INPUT_FORMATS = ("auto", "jsonl", "text", "parquet")
SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".txt": "text", ".text": "text",
                  ".parquet": "parquet"}
DEFAULT_ID_FIELD = "id"
# Before the model starts, the first records of each JSONL input are read to check that --text-field
# (and --id-field) match something. Bounded both ways: a few records, at most ~1 MiB per input.
PROBE_RECORDS = 100
PROBE_BYTES = 1 << 20
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Source:
    path: str     # as given; "-" is stdin
    format: str   # "jsonl" | "text" | "parquet"
    stream: bool  # stdin, a FIFO, /dev/fd/N: read once, in order; cannot be fingerprinted ahead

    @property
    def name(self) -> str:
        return "stdin" if self.path == "-" else self.path

    @property
    def unit(self) -> str:
        return "row" if self.format == "parquet" else "line"


@dataclass(frozen=True)
class Record:
    index: int                    # position in the whole input
    file: str                     # the input's name ("stdin" for -)
    line: int                     # line (text, JSONL) or row (Parquet) in that input, from 1
    id: str | None                # None only when the record has no usable id (then `error` says so)
    text: str | None              # None when `error` is set
    error: str | None = None      # why this record cannot be embedded
    fields: dict | None = None    # --keep-fields values
    unit: str = "line"
    stream_sha256: str | None = None  # hash of the stream bytes read up to this record (resume check)

    @property
    def where(self) -> str:
        """'file line N (id X)': how every message names a record, also under --shard."""
        named = self.id is not None and self.id != f"{self.file}:{self.line}"  # a file:line id says no more
        return f"{self.file} {self.unit} {self.line}" + (f" (id {self.id!r})" if named else "")


# -- which files ----------------------------------------------------------------------------------

def expand_inputs(paths: list[str], input_format: str = "auto") -> list[Source]:
    """Inputs in a fixed order: each argument as given, a directory's files sorted, a glob sorted.

    An existing path is always that path, even when its name holds glob characters (`d[1].txt`).
    A FIFO or /dev/fd/N (bash's `<(cmd)`) is streamed like stdin.
    """
    if input_format not in INPUT_FORMATS:
        raise UsageError(f"--input-format must be one of {INPUT_FORMATS}, got {input_format!r}")
    sources: list[Source] = []
    for path in paths:
        if path == "-":
            sources.append(_source(path, input_format, stream=True))
        elif os.path.isdir(path):
            found = _directory_files(path)
            if not found:
                raise InputError(f"input directory {path!r} holds no {', '.join(SUFFIX_FORMATS)} files")
            sources.extend(_source(f, input_format) for f in found)
        elif os.path.exists(path):
            sources.append(_source(path, input_format))
        elif glob.has_magic(path):
            found = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not found:
                raise InputError(f"input pattern {path!r} matches no file")
            sources.extend(_source(f, input_format) for f in found)
        else:
            raise InputError(f"input {path!r} does not exist")
    return sources


def _directory_files(path: str) -> list[str]:
    """A directory's input files, sorted. Names starting with "." or "_" are skipped at every level
    (as pyarrow's readers do): hidden files, and another job's metadata (`__job__/errors.jsonl`)."""
    found = []
    for p in Path(path).rglob("*"):
        parts = p.relative_to(path).parts
        if p.is_file() and p.suffix in SUFFIX_FORMATS and not any(s.startswith((".", "_")) for s in parts):
            found.append(str(p))
    return sorted(found)


def _source(path: str, input_format: str, stream: bool | None = None) -> Source:
    if stream is None:
        mode = os.stat(path).st_mode
        stream = not stat.S_ISREG(mode)
    fmt = input_format
    if fmt == "auto":
        # stdin is text unless declared JSONL: a text line that happens to start with "{" stays text.
        fmt = "text" if path == "-" else SUFFIX_FORMATS.get(Path(path).suffix, "text")
    if fmt == "parquet" and stream:
        raise UsageError(f"{path}: Parquet is read from a file, not a stream (it is read from its end first)")
    return Source(path, fmt, stream)


# -- reading --------------------------------------------------------------------------------------

class InputReader:
    """The records of a list of sources. `probe()` checks them before the model starts and decides
    where ids come from; `records()` streams one shard's records."""

    def __init__(self, sources: list[Source], text_field: str = "text", id_field: str | None = None,
                 keep_fields: tuple[str, ...] = ()) -> None:
        self.sources = sources
        self.text_field = text_field
        self.explicit_id = id_field is not None
        self.id_field = id_field  # decided by probe() when not given
        self.keep_fields = keep_fields
        # Lines a probe read from a stream: a stream cannot be read twice, so they are replayed.
        self._replay: dict[int, list[bytes]] = {}
        self._streams: dict[int, object] = {}
        self.probed = False

    # - before the model starts -

    def probe(self) -> None:
        """Checks what can be checked from the first records of each input, before any work:
        --text-field, --id-field and --keep-fields must match something. Decides the id field."""
        for i, source in enumerate(self.sources):
            if source.format == "parquet":
                self._probe_parquet(i, source)
            elif source.format == "jsonl":
                self._probe_jsonl(i, source)
            elif i == 0 and not self.explicit_id:
                self.id_field = None  # text first: every id is file:line
        text = [s.name for s in self.sources if s.format == "text"]
        if text and (self.id_field is not None or self.keep_fields):
            why = ("--keep-fields needs fields" if self.keep_fields else
                   f"the ids come from field {self.id_field!r}" + ("" if self.explicit_id else " (the first record has one)"))
            raise UsageError(f"{why}, but {text[0]} is read as text (one record per line, ids file:line); "
                             "give JSONL or Parquet inputs, or --input-format")
        self.probed = True

    def _probe_parquet(self, i: int, source: Source) -> None:
        names = _parquet_file(source.path).schema_arrow.names
        if i == 0 and not self.explicit_id:
            self.id_field = DEFAULT_ID_FIELD if DEFAULT_ID_FIELD in names else None
        wanted = [("--text-field", self.text_field)] + [("--keep-fields", f) for f in self.keep_fields]
        if self.id_field is not None:
            wanted.append(("--id-field", self.id_field))
        for option, name in wanted:
            if name not in names:
                raise InputError(f"{source.name}: {option} {name!r} matches no column (columns: {names})")

    def _probe_jsonl(self, i: int, source: Source) -> None:
        objects = []
        for line_no, raw in self._probe_lines(i, source):
            try:
                value = json.loads(raw[len(BOM):] if line_no == 1 and raw.startswith(BOM) else raw)
            except ValueError:  # a bad line is that record's error later, not the probe's
                continue
            if isinstance(value, dict):
                objects.append(value)
        if not objects:
            return
        if i == 0 and not self.explicit_id:
            # The first record decides, once, for the whole job (and the manifest records it).
            self.id_field = DEFAULT_ID_FIELD if DEFAULT_ID_FIELD in objects[0] else None
        wanted = [("--text-field", self.text_field)] + [("--keep-fields", f) for f in self.keep_fields]
        if self.id_field is not None:
            wanted.append(("--id-field", self.id_field))
        seen = sorted({k for o in objects for k in o})
        for option, name in wanted:
            if not any(name in o for o in objects):
                raise InputError(f"{source.name}: {option} {name!r} matches nothing in its first {len(objects)} "
                                 f"records (fields there: {seen})")

    def _probe_lines(self, i: int, source: Source) -> list[tuple[int, bytes]]:
        """Up to PROBE_RECORDS non-blank lines (PROBE_BYTES at most) of one file, the first one of a stream."""
        out: list[tuple[int, bytes]] = []
        read = 0
        if source.stream:
            # Only the first record of a stream: waiting for more could wait for as long as the
            # producer takes (a slow `<(cmd)`, a terminal).
            lines = self._stream(i, source)
            kept: list[bytes] = []
            for raw in lines:
                kept.append(raw)
                if raw.strip():
                    out.append((len(kept), raw))
                    break
            self._replay[i] = kept
            return out
        with _open(source.path) as f:
            for line_no, raw in enumerate(f, start=1):
                read += len(raw)
                if raw.strip():
                    out.append((line_no, raw))
                if len(out) >= PROBE_RECORDS or read >= PROBE_BYTES:
                    break
        return out

    def _stream(self, i: int, source: Source):
        if i not in self._streams:
            self._streams[i] = sys.stdin.buffer if source.path == "-" else _open(source.path)
        return self._streams[i]

    # - the records -

    def records(self, shard: tuple[int, int] = (0, 1), skip: int = 0,
                resume_stream_sha256: str | None = None) -> Iterator[Record]:
        """The records of this shard, after the first `skip` of them (done by an earlier run).

        Records of other shards and skipped ones are not parsed. The bytes read from streams are
        hashed as they go: at the end of the skipped records that hash must equal the one the job
        recorded, or the stream is not the one the job began with.
        """
        if not self.probed:
            self.probe()
        shard_i, shard_n = shard
        index = mine = 0
        digest = hashlib.sha256() if any(s.stream for s in self.sources) else None
        for i, source in enumerate(self.sources):
            units = self._parquet_rows(source) if source.format == "parquet" else self._lines(i, source, digest)
            for line_no, raw in units:
                ours = index % shard_n == shard_i
                index += 1
                if not ours:
                    continue
                mine += 1
                if mine < skip:
                    continue
                if mine == skip:
                    self._check_resumed_stream(digest, resume_stream_sha256, skip)
                    continue
                yield self._record(source, index - 1, line_no, raw, digest)
        if mine < skip:
            raise InputError(f"--resume: the inputs now hold {mine} records of this shard, but the job had already "
                             f"done {skip}: an input changed since the job began")
        for stream in self._streams.values():
            if stream is not sys.stdin.buffer:
                stream.close()

    @staticmethod
    def _check_resumed_stream(digest, expected: str | None, skip: int) -> None:
        if digest is not None and expected is not None and digest.hexdigest() != expected:
            raise InputError(f"--resume: the input stream differs from the one the job began with (its first {skip} "
                             "records hash differently); start a new job in another --output")

    def _record(self, source: Source, index: int, line_no: int, raw, digest) -> Record:
        if source.format == "parquet":
            rid, text, fields, error = _fields(raw, self.text_field, self.id_field, self.keep_fields)
        else:
            rid, text, fields, error = self._parse_line(source, line_no, raw)
        if rid is None and self.id_field is None:
            rid = f"{source.name}:{line_no}"
        return Record(index, source.name, line_no, rid, text if error is None else None, error, fields, source.unit,
                      digest.hexdigest() if digest is not None else None)

    def _parse_line(self, source: Source, line_no: int, raw: bytes):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            error = f"not valid UTF-8 (byte {e.start + 1} of the line is {raw[e.start:e.start + 1]!r})"
            return self._id_despite(source, raw), None, None, error
        if source.format == "text":
            return None, line, None, None
        try:
            value = json.loads(line)
        except ValueError as e:
            return None, None, None, f"not valid JSON ({e})"
        if not isinstance(value, dict):
            return None, None, None, f"a JSON object is expected, got {type(value).__name__}"
        return _fields(value, self.text_field, self.id_field, self.keep_fields)

    def _id_despite(self, source: Source, raw: bytes) -> str | None:
        """The id of a JSONL line that is not valid UTF-8, when it can be read anyway: it names the
        record in the error (the record stays an error)."""
        if source.format != "jsonl" or self.id_field is None:
            return None
        try:
            rid = json.loads(raw.decode("utf-8", "replace")).get(self.id_field)
        except (ValueError, AttributeError):
            return None
        return str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None

    def _lines(self, i: int, source: Source, digest) -> Iterator[tuple[int, bytes]]:
        """(line number, line without its end) for each record line of one text or JSONL input."""
        if source.stream:
            stream = self._stream(i, source)
            lines = _chain(self._replay.pop(i, []), stream)
        else:
            stream = lines = _open(source.path)
        try:
            for line_no, raw in enumerate(lines, start=1):
                if digest is not None and source.stream:
                    digest.update(raw)
                if line_no == 1 and raw.startswith(BOM):
                    raw = raw[len(BOM):]
                raw = raw[:-1] if raw.endswith(b"\n") else raw
                raw = raw[:-1] if raw.endswith(b"\r") else raw  # "\r\n" ends a line; a lone "\r" is text
                if source.format == "jsonl" and not raw.strip():
                    continue  # a blank JSONL line is no record
                yield line_no, raw
        finally:
            if not source.stream:
                stream.close()

    def _parquet_rows(self, source: Source) -> Iterator[tuple[int, tuple]]:
        pf = _parquet_file(source.path)
        names = pf.schema_arrow.names
        columns = list(dict.fromkeys([self.text_field] + ([self.id_field] if self.id_field in names else [])
                                     + list(self.keep_fields)))
        row = 0
        for batch in pf.iter_batches(batch_size=4096, columns=columns):  # streamed, never loaded whole
            values = {c: batch.column(c).to_pylist() for c in columns}
            for k in range(batch.num_rows):
                row += 1
                yield row, {c: values[c][k] for c in columns}


def _fields(record: dict, text_field: str, id_field: str | None, keep_fields: tuple[str, ...]):
    """(id, text, kept fields, error) of one JSON object or Parquet row."""
    fields = {k: record.get(k) for k in keep_fields} if keep_fields else None
    rid = None
    if id_field is not None:
        rid = record.get(id_field)
        if rid is None:
            return None, None, fields, f"no field {id_field!r} (this job's ids come from {id_field!r})"
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            return None, None, fields, f"field {id_field!r} must be a string or an integer, got {type(rid).__name__}"
        rid = str(rid)
    if text_field not in record:
        return rid, None, fields, f"no field {text_field!r}"
    text = record[text_field]
    if not isinstance(text, str):
        return rid, None, fields, f"field {text_field!r} must be a string, got {type(text).__name__}"
    return rid, text, fields, None


def _chain(first: list[bytes], rest) -> Iterator[bytes]:
    yield from first
    yield from rest


def _open(path: str):
    # Binary: lines are split at b"\n" only, and each is decoded on its own.
    try:
        return open(path, "rb")
    except OSError as e:
        raise InputError(f"{path}: cannot be read ({e.strerror})") from None


def _parquet_file(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(f"{path}: reading Parquet needs pyarrow (pip install 'pooling-pipeline[parquet]')") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid, OSError, ...
        raise InputError(f"{path}: not a readable Parquet file ({e})") from None
