"""pipeline-run's image records, for a model that takes images (a dual encoder: CLIP, SigLIP).

Two ways in:
- `--image-field NAME`: each JSONL / Parquet record's image is in field NAME, instead of a text: a
  path (relative to the input file's folder; absolute allowed; a `data:image/` URI as it is), bytes
  (a Parquet binary column) or a `datasets` Image struct {"bytes", "path"} (the bytes when present,
  else the path).
- a folder of image files as an input (`--input photos/`): one record per image file (by extension,
  recursive, sorted by relative path), its path relative to the folder as its id.

A record's prompt is {"image": absolute path} or {"image": bytes}, which the Pipeline opens and
decodes in its render workers: a bad image is that record's error, as a bad text is. A job's
records are all images or all texts. docs/cli.md ("Images") states the decisions to users: what
is refused, and what the fingerprint covers (a folder's listing; for --image-field the input
file, not the image files its paths name).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from pooling_pipeline.core.families import family_of
from pooling_pipeline.image_inputs import IMAGE_EXTENSIONS
from pooling_pipeline.jobs.job_errors import InputError, UsageError
from pooling_pipeline.jobs.records import (
    FORMATS,
    Fields,
    FormatReader,
    ParquetReader,
    Record,
    RecordReader,
    Source,
    _directory_files,
    expand_inputs,
)

IMAGE_FOLDER = "images"  # the Source.format of a folder of image files (not an --input-format)
# Parquet rows of images per batch read: a binary column's rows are whole image files.
IMAGE_PARQUET_BATCH_ROWS = 64
# What an image field's string is taken as it is, never joined to the input's folder.
AS_GIVEN = ("data:", "http://", "https://")


# -- a folder of images -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ImageFolder(Source):
    """A folder input whose records are its image files (`files`: paths relative to it, sorted),
    listed once when the job starts."""

    files: tuple[str, ...] = ()

    @property
    def unit(self) -> str:
        return ImageFolderReader.unit

    @property
    def root(self) -> str:
        return os.path.abspath(self.path)

    def fingerprint(self) -> dict:
        """The folder's listing (each file's relative path, size and modification time) hashed; the
        images' bytes are not read (a resume refuses a folder whose listing changed)."""
        digest = hashlib.sha256()
        for rel in self.files:
            try:
                st = os.stat(os.path.join(self.root, rel))
            except OSError as e:
                raise InputError(f"input folder {self.name}: {rel} vanished while the folder was listed "
                                 f"({e.strerror})") from None
            digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return {"path": self.root, "images": len(self.files), "listing_sha256": digest.hexdigest()}


class ImageFolderReader(FormatReader):
    """The image files of an ImageFolder: record N is its Nth file; id the file's relative path."""

    name = IMAGE_FOLDER
    suffixes = ()
    unit = "image"
    has_fields = False

    def probe(self, first: bool) -> None:
        if first:
            self.fields.decide_id(())

    def size(self, snapshot: dict | None) -> tuple[int, bool] | None:
        return len(self.source.files), True

    def units(self, digest, snapshot: dict | None = None):
        """The folder's image files as listed; their names go into `digest` (what a resume re-reads and
        checks; the images' sizes and modification times are the folder's fingerprint, `ImageFolder.fingerprint`)."""
        for number, rel in enumerate(self.source.files, start=1):
            self.done_units += 1
            digest.update(rel.encode("utf-8", "surrogateescape") + b"\0")
            yield number, rel

    def parse(self, raw: str):
        return raw, {"image": os.path.join(self.source.root, *raw.split("/"))}, None, None


def image_files(folder: str) -> list[str]:
    """A folder's image files (by extension, case-insensitive), as sorted paths relative to it with
    "/" separators. Names starting with "." or "_" are skipped at every level, as for record files."""
    found = []
    for p in Path(folder).rglob("*"):
        parts = p.relative_to(folder).parts
        if p.suffix.lower() in IMAGE_EXTENSIONS and not any(s.startswith((".", "_")) for s in parts) and p.is_file():
            found.append("/".join(parts))
    return sorted(found)


# -- which inputs -----------------------------------------------------------------------------------

def expand_job_inputs(paths: Sequence[str], input_format: str, image_field: str | None,
                      takes_images: Callable[[], bool]) -> list[Source]:
    """`records.expand_inputs`, with folders of images: a directory holding image files is an
    ImageFolder when the model takes images (`takes_images()`, asked only when it matters: it reads
    the model's folder). Without --image-field a job's inputs are all folders of images or none."""
    sources: list[Source] = []
    for path in paths:
        folder = _image_folder(path, image_field, takes_images) if path != "-" and os.path.isdir(path) else None
        if folder is not None:
            sources.append(folder)
            continue
        found = expand_inputs([path], input_format)
        loose = [s.path for s in found if s.path.lower().endswith(IMAGE_EXTENSIONS)]
        if loose and image_field is None and takes_images():
            raise UsageError(f"input {loose[0]} is an image file: give the folder that holds the images (--input DIR: "
                             "one record per image file), or list them in a JSONL or Parquet file read with "
                             "--image-field")
        sources.extend(found)
    folders = [s for s in sources if isinstance(s, ImageFolder)]
    others = [s for s in sources if not isinstance(s, ImageFolder)]
    if folders and others and image_field is None:
        raise UsageError(f"input folder {folders[0].name} holds images, but input {others[0].name} holds texts: a "
                         "job's records are all images or all texts (an input file can name images with --image-field)")
    return sources


def _image_folder(path: str, image_field: str | None, takes_images: Callable[[], bool]) -> ImageFolder | None:
    """The folder as an ImageFolder, or None when its record files are the input (a text folder, or
    any folder under --image-field: its JSONL / Parquet files name the images)."""
    images = image_files(path) if image_field is None else []
    if not images:
        return None
    record_files = _directory_files(path)
    if not takes_images():
        if record_files:
            return None  # a text folder, as always: its image files are not inputs
        raise UsageError(f"input directory {path!r} holds image files ({len(images)}) and no JSONL, text or Parquet "
                         "files, but the model takes no images (a dual encoder such as CLIP or SigLIP does)")
    if record_files:
        raise UsageError(f"input directory {path!r} holds both image files ({len(images)}, e.g. {images[0]}) and "
                         f"record files ({len(record_files)}, e.g. {os.path.relpath(record_files[0], path)}): a job's "
                         "records are all images or all texts. Move the images to a folder of their own, or read a "
                         "record file that names them: --input DIR/metadata.jsonl --image-field file_name")
    return ImageFolder(path, IMAGE_FOLDER, False, tuple(images))


def image_job(job, sources: Sequence[Source]) -> bool:
    """Whether the job's records are images."""
    return job.image_field is not None or any(isinstance(s, ImageFolder) for s in sources)


def check_image_field(job) -> None:
    """--image-field names a record's content: not with --text-field or --pair-field."""
    if job.image_field is None:
        return
    if job.pair_field is not None:
        raise UsageError("--image-field and --pair-field: a record is an image or a pair of texts, not both")
    if job.text_field != "text":
        raise UsageError(f"--image-field {job.image_field!r} and --text-field {job.text_field!r}: a record's content "
                         "is its image or its text; give one")


def check_image_job(job, sources: Sequence[Source]) -> None:
    """What an image job refuses before the model loads: texts' options, other tasks, --ray."""
    if not image_job(job, sources):
        return
    what = f"--image-field {job.image_field!r}" if job.image_field is not None else "a folder of images"
    if job.ray:
        raise UsageError(f"{what}: images are not supported with --ray (its actors read one text column)")
    if job.task != "embed":
        raise UsageError(f"{what}: a dual encoder embeds images: --task embed, not {job.task!r}")
    text_only = [flag for flag, given in (("--long-inputs", job.long_inputs != "truncate"),
                                          ("--truncate", job.truncate is not None), ("--prompt", job.prompt is not None),
                                          ("--prompt-name", job.prompt_name is not None)) if given]
    if text_only:
        raise UsageError(f"{what}: {', '.join(text_only)} shape texts; this job's records are images (an image is "
                         "one input, never truncated, chunked or prefixed): drop them")
    if any(isinstance(s, ImageFolder) for s in sources) and (job.id_field is not None or job.keep_fields):
        raise UsageError("a folder of images has no fields: each record's id is its image's path relative to the "
                         "folder; drop --id-field and --keep-fields")


def check_image_model(job, sources: Sequence[Source], spec) -> None:
    """--image-field needs a model that takes images (a folder of images was only taken for one)."""
    if job.image_field is not None and not family_of(spec).takes("image"):
        raise UsageError(f"--image-field {job.image_field!r}: model {spec.path!r} takes no images (a dual encoder "
                         "such as CLIP or SigLIP does)")


def image_params(job, sources: Sequence[Source]) -> dict:
    """What an image job adds to the job's params (a text job's stay as they were, so its resumes
    still match): the image field, and the decoding, which a resume must not mix."""
    if not image_job(job, sources):
        return {}
    return {"image_field": job.image_field, "image_decode": job.image_decode}


def check_resumed_image_decode(out: Path, params: dict, resume: bool) -> None:
    """A resume decodes images as the job began: another --image-decode is refused, naming both."""
    from pooling_pipeline.jobs.results_store import read_manifest

    if not resume or "image_decode" not in params:
        return
    try:
        then = (read_manifest(out).get("params") or {}).get("image_decode")
    except ValueError:  # no job there yet (or a damaged one: the writer says what is wrong)
        return
    now = params["image_decode"]
    if then is not None and then != now:
        raise UsageError(f"--resume: the job in {out} decoded its images with --image-decode {then}, this run asks for "
                         f"--image-decode {now}: one job's vectors come from one decoding. Resume with --image-decode "
                         f"{then}, or start a new job in another --output")


# -- records whose content is an image --------------------------------------------------------------

@dataclass
class ImageFields(Fields):
    """The fields of an --image-field job: `text` names the image field (so the readers read that
    column); the id and kept fields as for texts."""

    def wanted(self) -> list[tuple[str, str]]:
        return [("--image-field", self.text)] + super().wanted()[1:]

    def of(self, record: dict):
        """(id, {"image": path or bytes}, kept fields, error) of one JSON object or Parquet row."""
        rid, _, fields, error = super().of({**record, self.text: ""})  # the id and kept fields, as for a text
        if error is not None:
            return rid, None, fields, error
        if self.text not in record:
            return rid, None, fields, f"no field {self.text!r} (--image-field)"
        image, error = image_value(record[self.text], self.text)
        return rid, image, fields, error


def image_value(value, name: str) -> tuple[dict | None, str | None]:
    """({"image": path or bytes}, None), or (None, why this field's value is no image)."""
    if value is None:
        return None, f"field {name!r} is null"
    if isinstance(value, dict) and value and set(value) <= {"bytes", "path"}:  # a `datasets` Image struct
        data, path = value.get("bytes"), value.get("path")
        if data is None and path is None:
            return None, f"field {name!r} is an image struct with neither bytes nor a path"
        value = data if data is not None else path
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not len(value):
            return None, f"field {name!r} holds no bytes (an empty image)"
        return {"image": bytes(value)}, None
    if isinstance(value, str):
        if not value.strip():
            return None, f"field {name!r} is an empty path"
        return {"image": value}, None
    return None, (f"field {name!r} must be an image path, bytes or a datasets Image struct {{bytes, path}}, got "
                  f"{type(value).__name__}")


class ImageParquetReader(ParquetReader):
    """Parquet rows whose image column holds whole image files: read in small batches."""

    batch_rows: ClassVar[int] = IMAGE_PARQUET_BATCH_ROWS


class ImageRecordReader(RecordReader):
    """The records of an image job: folders of images, and JSONL / Parquet inputs read with
    --image-field, their relative paths resolved against each input file's folder."""

    def __init__(self, sources: list[Source], image_field: str | None, id_field: str | None = None,
                 keep_fields: tuple[str, ...] = ()) -> None:
        self.sources = sources
        self.fields = ImageFields(text=image_field or "", id=id_field, keep=keep_fields,
                                  explicit_id=id_field is not None)
        readers = {**FORMATS, "parquet": ImageParquetReader, IMAGE_FOLDER: ImageFolderReader}
        self.readers = [readers[s.format](s, self.fields) for s in sources]
        self.probed = False
        self._sizes = None

    def probe(self) -> None:
        fieldless = [r.source.name for r in self.readers if not r.has_fields and not isinstance(r, ImageFolderReader)]
        if fieldless:
            raise UsageError(f"--image-field needs fields, but {fieldless[0]} is read as text (one record per line); "
                             "give JSONL or Parquet inputs, or --input-format")
        super().probe()

    def _record(self, reader: FormatReader, index: int, line_no: int, raw, digest) -> Record:
        record = super()._record(reader, index, line_no, raw, digest)
        image = record.text
        if isinstance(image, dict) and isinstance(image.get("image"), str):
            path = image["image"]
            if not (os.path.isabs(path) or path.startswith(AS_GIVEN)):
                source = reader.source
                base = os.getcwd() if source.stream else os.path.dirname(os.path.abspath(source.path))
                record = dataclasses.replace(record, text={"image": os.path.join(base, path)})
        return record
