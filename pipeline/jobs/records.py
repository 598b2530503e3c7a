"""Input records for pipeline-run, streamed: JSONL, plain text, Parquet; files, directories, globs,
FIFOs (`<(cmd)`) and stdin.

One reader class per format behind the small `FormatReader` interface; `FORMATS` is the one table
of which suffix is which format (the Ray job reads it too). `RecordReader` strings a job's inputs
together and numbers every record in the whole input (inputs in the order given, a directory's
files sorted), so shards (index % N == I) and resumes (skip the first K of this shard) are
deterministic; everything it reads goes into one running hash, which a resume checks the records it
skips against (`RecordReader.records`). A record that cannot be embedded is yielded with its `error` set, in its place.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import stat
import sys
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from pooling_pipeline.jobs.job_errors import InputError, UsageError

DEFAULT_ID_FIELD = "id"
# Before the model starts, the first records of each JSONL input are read to check that --text-field
# (and --id-field) match something. Bounded both ways: a few records, at most ~1 MiB per input.
PROBE_RECORDS = 100
PROBE_BYTES = 1 << 20
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Source:
    path: str     # as given; "-" is stdin
    format: str   # a FORMATS name: "jsonl" | "text" | "parquet"
    stream: bool  # stdin, a FIFO, /dev/fd/N: read once, in order; cannot be fingerprinted ahead

    @property
    def name(self) -> str:
        return "stdin" if self.path == "-" else self.path

    @property
    def unit(self) -> str:
        return FORMATS[self.format].unit


@dataclass(frozen=True)
class Record:
    index: int                    # position in the whole input
    file: str                     # the input's name ("stdin" for -)
    line: int                     # line (text, JSONL) or row (Parquet) in that input, from 1
    id: str | None                # None only when the record has no usable id (then `error` says so)
    text: str | tuple[str, str] | dict | None  # None on `error`; (text, text_pair) with --pair-field; {"image": ...}
    error: str | None = None      # why this record cannot be embedded
    fields: dict | None = None    # --keep-fields values
    unit: str = "line"
    read_sha256: str | None = None  # sha256 of all the job read up to this record (RecordReader.records)

    @property
    def where(self) -> str:
        """'file line N (id X)': how every message names a record, also under --shard."""
        named = self.id is not None and self.id != f"{self.file}:{self.line}"  # a file:line id says no more
        return f"{self.file} {self.unit} {self.line}" + (f" (id {self.id!r})" if named else "")


@dataclass
class Fields:
    """The fields a job reads from each record: the text (and with --pair-field the pair's second
    text: the record's text is then the pair), the id, and the ones it keeps.

    Ids: `--id-field NAME` makes every record carry a NAME field. Without it the first record of the
    whole input decides once: an `id` field there means every record needs one; none means every id
    is `file:line`. Either way a record never silently falls back to another kind of id. A record
    whose text is missing, null or not a string, or whose id is missing, gets an error instead."""

    text: str = "text"
    id: str | None = None  # decided by the probe of the first input unless given (explicit)
    keep: tuple[str, ...] = ()
    explicit_id: bool = False
    pair: str | None = None  # --pair-field: each record's second text (pair classification)

    def decide_id(self, first_record: Container[str]) -> None:
        """Without --id-field, the names in the job's first record decide, once for the whole job (and
        the manifest records it)."""
        if not self.explicit_id:
            self.id = DEFAULT_ID_FIELD if DEFAULT_ID_FIELD in first_record else None

    def wanted(self) -> list[tuple[str, str]]:
        """(option, field name) pairs the probe checks the inputs for."""
        wanted = [("--text-field", self.text)] + [("--keep-fields", f) for f in self.keep]
        if self.pair is not None:
            wanted.append(("--pair-field", self.pair))
        if self.id is not None:
            wanted.append(("--id-field", self.id))
        return wanted

    def of(self, record: dict):
        """(id, text, kept fields, error) of one JSON object or Parquet row."""
        fields = {k: record.get(k) for k in self.keep} if self.keep else None
        rid = None
        if self.id is not None:
            rid = record.get(self.id)
            if rid is None:
                return None, None, fields, f"no field {self.id!r} (this job's ids come from {self.id!r})"
            if isinstance(rid, bool) or not isinstance(rid, (str, int)):
                return None, None, fields, f"field {self.id!r} must be a string or an integer, got {type(rid).__name__}"
            rid = str(rid)
        if self.text not in record:
            return rid, None, fields, f"no field {self.text!r}"
        text = record[self.text]
        if not isinstance(text, str):
            return rid, None, fields, f"field {self.text!r} must be a string, got {type(text).__name__}"
        if self.pair is not None:
            return self._pair_of(record, rid, text, fields)
        return rid, text, fields, None

    def _pair_of(self, record: dict, rid: str | None, text: str, fields: dict | None):
        """(id, (text, text_pair), kept fields, error): the record's pair, its second text from --pair-field."""
        if self.pair not in record:
            return rid, None, fields, f"no field {self.pair!r} (--pair-field)"
        second = record[self.pair]
        if not isinstance(second, str):
            return rid, None, fields, f"field {self.pair!r} must be a string, got {type(second).__name__}"
        return rid, (text, second), fields, None


# -- one reader per format ------------------------------------------------------------------------

class FormatReader:
    """The records of one input in one format. `probe` checks the first ones before the model starts;
    `units` yields (line or row number, raw unit) and `parse` turns a unit into
    (id, text, kept fields, error)."""

    name: ClassVar[str]
    suffixes: ClassVar[tuple[str, ...]]  # what `--input-format auto` reads as this format
    unit: ClassVar[str] = "line"
    has_fields: ClassVar[bool] = True  # False: no --id-field or --keep-fields
    cannot_stream: ClassVar[str] = ""  # why a stream (stdin, a FIFO) cannot be read in this format

    def __init__(self, source: Source, fields: Fields) -> None:
        self.source = source
        self.fields = fields
        # How far `units` has read, for the progress bar's estimate: bytes of a file, rows of Parquet;
        # and the records those units held (every shard's).
        self.done_units = 0
        self.done_records = 0

    def probe(self, first: bool) -> None:
        """Checks the fields against the first records; `first`: the job's first input, which decides the ids."""

    def size(self, snapshot: dict | None) -> tuple[int, bool] | None:
        """(the input's size in the units `done_units` counts, whether it counts records exactly), or
        None where it cannot be known ahead (a stream)."""
        if self.source.stream:
            return None
        if snapshot is not None and "size" in snapshot:
            return int(snapshot["size"]), False
        try:
            return os.stat(self.source.path).st_size, False
        except OSError:
            return None

    def units(self, digest, snapshot: dict | None = None) -> Iterator[tuple[int, object]]:
        """(line or row number, raw unit) of each record; everything read goes into `digest` (the
        running hash a resume checks: see RecordReader.records). `snapshot`: the input's fingerprint
        when the job began (fingerprint.file_fingerprint); the records are those of its first
        `snapshot["size"]` bytes, whatever was appended since."""
        raise NotImplementedError

    def parse(self, raw):
        raise NotImplementedError

    def close(self) -> None:
        """Closes what the reader left open (a stream)."""


class _LineReader(FormatReader):
    """Text and JSONL, read as people write files: lines end at "\\n" only (a lone "\\r" inside a
    line is text, "\\r\\n" ends a line), a UTF-8 byte order mark at the start of a file is skipped,
    and each line is decoded on its own, so an invalid byte is the error of that line, not of the
    whole file."""

    skips_blank_lines: ClassVar[bool] = False

    def __init__(self, source: Source, fields: Fields) -> None:
        super().__init__(source, fields)
        self._stream = None  # stdin or an opened FIFO: read once
        # Lines a probe read from a stream: a stream cannot be read twice, so they are replayed.
        self._replay: list[bytes] = []

    def units(self, digest, snapshot: dict | None = None) -> Iterator[tuple[int, bytes]]:
        """(line number, line without its end) for each record line; every byte read goes into
        `digest`, blank lines, byte order mark and line ends included."""
        source = self.source
        if source.stream:
            lines = _chain(self._replay, self._open_stream())
            self._replay = []
        else:
            lines = _open(source.path)
        try:
            in_snapshot = lines if source.stream or snapshot is None else _snapshot_lines(lines, source, snapshot)
            for line_no, raw in enumerate(in_snapshot, start=1):
                self.done_units += len(raw)
                digest.update(raw)
                if line_no == 1 and raw.startswith(BOM):
                    raw = raw[len(BOM):]
                raw = raw[:-1] if raw.endswith(b"\n") else raw
                raw = raw[:-1] if raw.endswith(b"\r") else raw  # "\r\n" ends a line; a lone "\r" is text
                if self.skips_blank_lines and not raw.strip():
                    continue
                yield line_no, raw
        finally:
            if not source.stream:
                lines.close()

    def parse(self, raw: bytes):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            error = f"not valid UTF-8 (byte {e.start + 1} of the line is {raw[e.start:e.start + 1]!r})"
            return self._id_despite(raw), None, None, error
        return self._parse_line(line)

    def _parse_line(self, line: str):
        raise NotImplementedError

    def _id_despite(self, raw: bytes) -> str | None:
        """The id of a line that is not valid UTF-8, when it can be read anyway (it names the record in
        its error)."""
        return None

    def _first_lines(self) -> list[tuple[int, bytes]]:
        """Up to PROBE_RECORDS non-blank lines (PROBE_BYTES at most) of a file, the first one of a stream."""
        out: list[tuple[int, bytes]] = []
        if self.source.stream:
            # Only the first record of a stream: waiting for more could wait for as long as the
            # producer takes (a slow `<(cmd)`, a terminal).
            kept: list[bytes] = []
            for raw in self._open_stream():
                kept.append(raw)
                if raw.strip():
                    out.append((len(kept), raw))
                    break
            self._replay = kept
            return out
        read = 0
        with _open(self.source.path) as f:
            for line_no, raw in enumerate(f, start=1):
                read += len(raw)
                if raw.strip():
                    out.append((line_no, raw))
                if len(out) >= PROBE_RECORDS or read >= PROBE_BYTES:
                    break
        return out

    def _open_stream(self):
        if self._stream is None:
            self._stream = sys.stdin.buffer if self.source.path == "-" else _open(self.source.path)
        return self._stream

    def close(self) -> None:
        if self._stream is not None and self._stream is not sys.stdin.buffer:
            self._stream.close()


class TextReader(_LineReader):
    """Plain text: every line is a record's text; ids are file:line."""

    name = "text"
    suffixes = (".txt", ".text")
    has_fields = False

    def probe(self, first: bool) -> None:
        if first:
            self.fields.decide_id(())  # text first: every id is file:line

    def _parse_line(self, line: str):
        return None, line, None, None


class JsonlReader(_LineReader):
    """JSON Lines: one object per line; a blank line is no record."""

    name = "jsonl"
    suffixes = (".jsonl", ".ndjson", ".json")
    skips_blank_lines = True

    def probe(self, first: bool) -> None:
        objects = []
        for line_no, raw in self._first_lines():
            try:
                value = json.loads(raw[len(BOM):] if line_no == 1 and raw.startswith(BOM) else raw)
            except ValueError:  # a bad line is that record's error later, not the probe's
                continue
            if isinstance(value, dict):
                objects.append(value)
        if not objects:
            return
        if first:
            self.fields.decide_id(objects[0])
        seen = sorted({k for o in objects for k in o})
        for option, name in self.fields.wanted():
            if not any(name in o for o in objects):
                raise InputError(f"{self.source.name}: {option} {name!r} matches nothing in its first {len(objects)} "
                                 f"records (fields there: {seen})")

    def _parse_line(self, line: str):
        try:
            value = json.loads(line)
        except ValueError as e:
            return None, None, None, f"not valid JSON ({e})"
        if not isinstance(value, dict):
            return None, None, None, f"a JSON object is expected, got {type(value).__name__}"
        return self.fields.of(value)

    def _id_despite(self, raw: bytes) -> str | None:
        if self.fields.id is None:
            return None
        try:
            rid = json.loads(raw.decode("utf-8", "replace")).get(self.fields.id)
        except (ValueError, AttributeError):
            return None
        return str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


class ParquetReader(FormatReader):
    """Parquet: one record per row, read in batches of the columns the job needs."""

    name = "parquet"
    suffixes = (".parquet",)
    unit = "row"
    cannot_stream = "Parquet is read from a file, not a stream (it is read from its end first)"
    batch_rows: ClassVar[int] = 4096  # rows per batch read (image_records.py reads images in fewer)

    def probe(self, first: bool) -> None:
        names = _parquet_file(self.source.path).schema_arrow.names
        if first:
            self.fields.decide_id(names)
        for option, name in self.fields.wanted():
            if name not in names:
                raise InputError(f"{self.source.name}: {option} {name!r} matches no column (columns: {names})")

    def size(self, snapshot: dict | None) -> tuple[int, bool] | None:
        """Its rows, from the file's metadata: an exact count."""
        return _parquet_file(self.source.path).metadata.num_rows, True

    def units(self, digest, snapshot: dict | None = None) -> Iterator[tuple[int, dict]]:
        if snapshot is not None:
            _check_size(self.source, snapshot)
        pf = _parquet_file(self.source.path)
        names = pf.schema_arrow.names
        f = self.fields
        columns = list(dict.fromkeys([f.text] + ([f.pair] if f.pair else []) + ([f.id] if f.id in names else [])
                                     + list(f.keep)))
        row = 0
        for batch in pf.iter_batches(batch_size=self.batch_rows, columns=columns):  # streamed, never loaded whole
            values = {c: batch.column(c).to_pylist() for c in columns}
            for k in range(batch.num_rows):
                row += 1
                self.done_units += 1
                unit = {c: values[c][k] for c in columns}
                digest_values(digest, unit.values())  # a row has no bytes of its own: its values are hashed
                yield row, unit
        if snapshot is not None:  # a file rewritten while it was read is not the one the job began with
            _check_size(self.source, snapshot)

    def parse(self, raw: dict):
        return self.fields.of(raw)


FORMATS: dict[str, type[FormatReader]] = {r.name: r for r in (JsonlReader, TextReader, ParquetReader)}
SUFFIX_FORMATS = {suffix: r.name for r in FORMATS.values() for suffix in r.suffixes}
INPUT_FORMATS = ("auto", *FORMATS)


def format_for(path: str) -> str | None:
    """The format a file's suffix names (what `--input-format auto` reads it as), None for another suffix."""
    return SUFFIX_FORMATS.get(Path(path).suffix)


# -- which files ----------------------------------------------------------------------------------

def expand_inputs(paths: Sequence[str], input_format: str = "auto") -> list[Source]:
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
        if p.is_file() and format_for(str(p)) is not None and not any(s.startswith((".", "_")) for s in parts):
            found.append(str(p))
    return sorted(found)


def _source(path: str, input_format: str, stream: bool | None = None) -> Source:
    if stream is None:
        mode = os.stat(path).st_mode
        stream = not stat.S_ISREG(mode)
    fmt = input_format
    if fmt == "auto":
        # stdin is text unless declared JSONL: a text line that happens to start with "{" stays text.
        fmt = "text" if path == "-" else format_for(path) or "text"
    if stream and FORMATS[fmt].cannot_stream:
        raise UsageError(f"{path}: {FORMATS[fmt].cannot_stream}")
    return Source(path, fmt, stream)


# -- the job's records ----------------------------------------------------------------------------

class RecordReader:
    """The records of a list of sources, one FormatReader each. `probe()` checks them before the
    model starts and decides where ids come from; `records()` streams one shard's records."""

    def __init__(self, sources: list[Source], text_field: str = "text", id_field: str | None = None,
                 keep_fields: tuple[str, ...] = (), pair_field: str | None = None) -> None:
        self.sources = sources
        self.fields = Fields(text=text_field, id=id_field, keep=keep_fields, explicit_id=id_field is not None,
                             pair=pair_field)
        self.readers = [FORMATS[s.format](s, self.fields) for s in sources]
        self.probed = False
        self._sizes: list[tuple[int, bool] | None] | None = None

    @property
    def id_field(self) -> str | None:
        """The field ids come from (None: file:line), decided by probe() when not given."""
        return self.fields.id

    def probe(self) -> None:
        """Checks what can be checked from the first records of each input, before any work:
        --text-field, --pair-field, --id-field and --keep-fields must match something. Decides the id field."""
        for i, reader in enumerate(self.readers):
            reader.probe(first=i == 0)
        fieldless = [r.source.name for r in self.readers if not r.has_fields]
        if fieldless and self.fields.pair is not None:
            raise UsageError(f"--pair-field needs fields, but {fieldless[0]} is read as text (one record per line); "
                             "give JSONL or Parquet inputs, or --input-format")
        if fieldless and (self.fields.id is not None or self.fields.keep):
            why = ("--keep-fields needs fields" if self.fields.keep else
                   f"the ids come from field {self.fields.id!r}"
                   + ("" if self.fields.explicit_id else " (the first record has one)"))
            raise UsageError(f"{why}, but {fieldless[0]} is read as text (one record per line, ids file:line); "
                             "give JSONL or Parquet inputs, or --input-format")
        self.probed = True

    def kept_types(self) -> dict:
        """The Arrow types of the --keep-fields columns when every input is Parquet: the output keeps
        them (kept_fields.py). The inputs must agree on each; {} when some input is not Parquet."""
        if not self.fields.keep or any(r.source.format != "parquet" for r in self.readers):
            return {}
        types: dict = {}
        for reader in self.readers:
            schema = _parquet_file(reader.source.path).schema_arrow
            for name in self.fields.keep:
                kind, first = types.setdefault(name, (schema.field(name).type, reader.source.name))
                if kind != schema.field(name).type:
                    raise InputError(f"--keep-fields {name!r} is {kind} in {first} but {schema.field(name).type} in "
                                     f"{reader.source.name}: an output column has one type")
        return {name: kind for name, (kind, _) in types.items()}

    def records(self, shard: tuple[int, int] = (0, 1), skip: int = 0, resume_sha256: str | None = None,
                snapshot: list[dict] | None = None) -> Iterator[Record]:
        """The records of this shard, after the first `skip` of them (done by an earlier run).

        Everything read -- every byte of a line input, blank lines and line ends included; the
        values of a Parquet row's columns the job reads; an image folder's file names -- goes into
        one running sha256 over the whole input, in order, and each record carries it as it stood
        after that record (`read_sha256`; the writer commits the last one of each chunk). The
        `skip` records are read again before this returns (before the model starts, on --resume):
        after the last of them the hash must be `resume_sha256`, the one committed with them, or
        the records the job has done are not the ones the inputs now hold, and it is refused
        (InputError) -- whatever the files' sizes and modification times say. So a resume can
        never hold one record twice and miss another. It costs reading the done part again
        (streamed, O(1) memory), far less than embedding it did.

        Records of other shards and skipped ones are not parsed. `snapshot`, the inputs'
        fingerprints when the job began (one per source): each file is read up to the size it had
        then, so a file appended to while the job runs gives the same records on every run.
        """
        if not self.probed:
            self.probe()
        if skip and resume_sha256 is None:
            raise RuntimeError("a resume without the hash of the records it has done: this is a bug")
        snapshots = snapshot if snapshot is not None else [None] * len(self.readers)
        if len(snapshots) != len(self.readers):
            raise RuntimeError(f"{len(snapshots)} input fingerprints for {len(self.readers)} inputs: this is a bug")
        snapshots = [None if s is None or s.get("stream") else s for s in snapshots]
        self._sizes = [reader.size(s) for reader, s in zip(self.readers, snapshots)]
        digest = hashlib.sha256()
        units = self._shard_units(shard, snapshots, digest)
        if skip:
            self._skip_done(units, skip, digest, resume_sha256)
        return (self._record(reader, index, line_no, raw, digest) for reader, index, line_no, raw in units)

    def _shard_units(self, shard: tuple[int, int], snapshots: list[dict | None], digest) -> Iterator[tuple]:
        """(reader, index in the whole input, line or row number, raw unit) of this shard's records;
        every input's units are read (and hashed), only this shard's are yielded."""
        shard_i, shard_n = shard
        index = 0
        for reader, fingerprint in zip(self.readers, snapshots):
            for line_no, raw in reader.units(digest, fingerprint):
                ours = index % shard_n == shard_i
                index += 1
                reader.done_records += 1
                if ours:
                    yield reader, index - 1, line_no, raw
        for reader in self.readers:
            reader.close()

    def _skip_done(self, units: Iterator[tuple], skip: int, digest, expected: str) -> None:
        """Reads the `skip` records done by earlier runs and checks what was read against their hash."""
        mine, last = 0, None
        while mine < skip:
            last = next(units, None)
            if last is None:
                break
            mine += 1
        if mine < skip:
            raise InputError(f"--resume: the inputs now hold {mine} records of this shard, but the job had already "
                             f"done {skip}: an input changed since the job began")
        if digest.hexdigest() != expected:
            reader, _, line_no, _ = last
            read = self.readers[:self.readers.index(reader) + 1]
            what = "input stream differs from the one" if any(r.source.stream for r in read) else "inputs differ from the ones"
            raise InputError(f"--resume: the {what} the job began with: what it read for its first "
                             f"{skip} records of this shard (read up to {reader.source.name} {reader.unit} {line_no}) "
                             "hashes differently now, so an input was rewritten since (its size and modification time "
                             "may not show it). Resuming would double some records and miss others; start a new job "
                             "in another --output")

    def estimated_total(self, shard: tuple[int, int] = (0, 1)) -> tuple[int, bool] | None:
        """This shard's records in all, as far as can be told while `records()` runs: (count, exact).
        Exact when every input is Parquet (row counts); else estimated from the bytes read so far
        and the records they held; None for a stream, or before anything was read."""
        sizes = self._sizes
        if not sizes or any(size is None for size in sizes):
            return None
        shard_i, shard_n = shard
        # Each input's records: counted (Parquet), else its bytes at the records-per-byte its read part
        # showed -- or, not read yet, the one every file read so far showed.
        read = [(r.done_records, r.done_units) for r, (_, exact) in zip(self.readers, sizes) if not exact and r.done_units]
        if any(not exact for _, exact in sizes) and not read:
            return None
        per_unit = sum(n for n, _ in read) / sum(u for _, u in read) if read else 0.0
        total, exact = 0, True
        for reader, (size, counted) in zip(self.readers, sizes):
            if counted:
                total += size
            elif reader.done_units >= size:  # read whole: its records are known
                total += reader.done_records
            else:
                rate = reader.done_records / reader.done_units if reader.done_units else per_unit
                total += round(size * rate)
                exact = False
        return len(range(shard_i, max(total, 1), shard_n)) or 1, exact

    def _record(self, reader: FormatReader, index: int, line_no: int, raw, digest) -> Record:
        source = reader.source
        rid, text, fields, error = reader.parse(raw)
        if rid is None and self.fields.id is None:
            rid = f"{source.name}:{line_no}"
        return Record(index, source.name, line_no, rid, text if error is None else None, error, fields, source.unit,
                      digest.hexdigest())


def digest_values(digest, values) -> None:
    """Feeds values read from a Parquet row (what `to_pylist` gives: None, bool, int, float, str,
    bytes, dates, decimals, and lists and dicts of them) into a running hash, unambiguously: each
    value is a type tag, a length and its content, so ("ab", "c") and ("a", "bc") differ. Strings
    and bytes go in as they are (an image column's bytes are not copied into a repr); other scalars
    as their repr, which is exact for them (a float's repr reads back as the same float)."""
    for value in values:
        if isinstance(value, str):
            data, tag = value.encode("utf-8", "surrogatepass"), b"s"
        elif isinstance(value, (bytes, bytearray, memoryview)):
            data, tag = bytes(value), b"b"
        elif isinstance(value, dict):
            digest.update(b"d%d:" % len(value))
            digest_values(digest, (x for item in value.items() for x in item))
            continue
        elif isinstance(value, (list, tuple)):
            digest.update(b"l%d:" % len(value))
            digest_values(digest, value)
            continue
        else:
            data, tag = repr(value).encode(), b"r"
        digest.update(b"%s%d:" % (tag, len(data)))
        digest.update(data)


def _snapshot_lines(f, source: Source, snapshot: dict) -> Iterator[bytes]:
    """The lines of the first snapshot["size"] bytes of an open file: what the job fingerprinted when
    it began. A file that grows meanwhile (a log being appended to) is read to that size and no
    further; one that shrank or was rewritten is refused, naming it. The snapshot's last line is a
    record only when it is whole: it ends with "\n", or the file ends (or a "\n" follows) right there.
    """
    size, read = snapshot["size"], 0
    for raw in f if size else ():
        raw = raw[:size - read]  # what lies past `size` was appended after the job began
        read += len(raw)
        if not raw.endswith(b"\n"):  # the last line of the snapshot, or of a file that shrank
            if read < size:
                break
            _check_line_ends_at(f, source, size)
        yield raw
        if read == size:
            break
    if read < size:  # before the fragment the file now ends with is taken for a record
        raise InputError(f"input {source.name} shrank while it was read: it had {size} bytes when the job began, "
                         f"{read} now; its records would not be the ones the job began with")
    _check_unchanged(source, snapshot)


def _check_line_ends_at(f, source: Source, size: int) -> None:
    """The snapshot ends inside a line: a whole record only if nothing, or a "\n", follows in the file."""
    f.seek(size)
    after = f.read(2)
    if not (after in (b"", b"\r") or after.startswith((b"\n", b"\r\n"))):
        raise InputError(f"input {source.name} was being written when the job began: its line that ends the "
                         f"{size} bytes the job fingerprinted goes on past them, and half a line is no record. Run "
                         "the job once the file is complete, or on a copy of it")


def _check_unchanged(source: Source, snapshot: dict) -> None:
    """The bytes the job read are still the ones it fingerprinted (a sample of them: see fingerprint.py)."""
    from pooling_pipeline.jobs.fingerprint import file_fingerprint

    if file_fingerprint(source.path, snapshot["size"])["sample_sha256"] != snapshot["sample_sha256"]:
        raise InputError(f"input {source.name} changed while it was read (its first {snapshot['size']} bytes differ "
                         "from when the job began); its records are not one version of the file")


def _check_size(source: Source, snapshot: dict) -> None:
    try:
        size = os.stat(source.path).st_size
    except OSError as e:
        raise InputError(f"input {source.name} cannot be read ({e.strerror})") from None
    if size != snapshot["size"]:
        raise InputError(f"input {source.name} changed while the job read it ({snapshot['size']} bytes when the job "
                         f"began, {size} now); a Parquet file is read whole, as one version")


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
