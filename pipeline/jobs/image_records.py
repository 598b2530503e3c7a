"""pipeline-run's image and audio records, for a model that takes images (a dual encoder: CLIP,
SigLIP) or audio (CLAP).

Two ways in:
- `--image-field NAME` (`--audio-field NAME`): each JSONL / Parquet record's image (clip) is in field
  NAME, instead of a text: a path (relative to the input file's folder; absolute allowed; a `data:`
  URI as it is), bytes (a Parquet binary column) or a `datasets` Image / Audio struct {"bytes",
  "path"} (the bytes when present, else the path).
- a folder of image (audio) files as an input (`--input photos/`): one record per file of the
  modality the model takes (by extension, recursive, sorted by relative path), its path relative to
  the folder as its id.

A record's prompt is {"image": absolute path} or {"image": bytes} ({"audio": ...}), which the
Pipeline opens and decodes in its render workers: a bad file is that record's error, as a bad text
is. A job's records are all images, all clips or all texts. docs/cli.md ("Images") states the decisions to users: what
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

from pooling_pipeline.audio_inputs import AUDIO_EXTENSIONS
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

IMAGE_FOLDER = "images"  # the Source.format of a folder of image or audio files (not an --input-format)
# The files a folder input's records are, by the modality the model takes.
MEDIA_EXTENSIONS = {"image": IMAGE_EXTENSIONS, "audio": AUDIO_EXTENSIONS}
# What each modality is called in messages: (one, many).
MEDIA_WORDS = {"image": ("image", "images"), "audio": ("audio clip", "audio clips")}
# Parquet rows of images per batch read: a binary column's rows are whole image files.
IMAGE_PARQUET_BATCH_ROWS = 64
# What an image field's string is taken as it is, never joined to the input's folder.
AS_GIVEN = ("data:", "http://", "https://")


# -- a folder of images -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ImageFolder(Source):
    """A folder input whose records are its image (or audio) files (`files`: paths relative to it,
    sorted), listed once when the job starts."""

    files: tuple[str, ...] = ()
    modality: str = "image"

    @property
    def unit(self) -> str:
        """What a record is called in messages and errors.jsonl: "image", or "clip" for audio."""
        return "image" if self.modality == "image" else "clip"

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
    has_fields = False

    @property
    def unit(self) -> str:  # (its folder's: "image" or "clip")
        return self.source.unit

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
        return raw, {self.source.modality: os.path.join(self.source.root, *raw.split("/"))}, None, None


def image_files(folder: str, extensions: tuple[str, ...] = IMAGE_EXTENSIONS) -> list[str]:
    """A folder's image (or other media) files (by extension, case-insensitive), as sorted paths
    relative to it with "/" separators. Names starting with "." or "_" are skipped at every level,
    as for record files."""
    found = []
    for p in Path(folder).rglob("*"):
        parts = p.relative_to(folder).parts
        if p.suffix.lower() in extensions and not any(s.startswith((".", "_")) for s in parts) and p.is_file():
            found.append("/".join(parts))
    return sorted(found)


# -- which inputs -----------------------------------------------------------------------------------

def expand_job_inputs(paths: Sequence[str], input_format: str, media_field: str | None,
                      media_of_model: Callable[[], str | None]) -> list[Source]:
    """`records.expand_inputs`, with folders of images or audio files: a directory holding files of
    the modality the model takes is an ImageFolder of them (`media_of_model()`: "image", "audio" or
    None, asked only when it matters: it reads the model's folder). Without a media field a job's
    inputs are all such folders or none."""
    sources: list[Source] = []
    for path in paths:
        folder = _media_folder(path, media_field, media_of_model) if path != "-" and os.path.isdir(path) else None
        if folder is not None:
            sources.append(folder)
            continue
        found = expand_inputs([path], input_format)
        for modality, extensions in MEDIA_EXTENSIONS.items():
            loose = [s.path for s in found if s.path.lower().endswith(extensions)]
            if loose and media_field is None and media_of_model() == modality:
                one, many = MEDIA_WORDS[modality]
                raise UsageError(f"input {loose[0]} is an {one} file: give the folder that holds the {many} (--input "
                                 f"DIR: one record per {one} file), or list them in a JSONL or Parquet file read with "
                                 f"--{modality}-field")
        sources.extend(found)
    folders = [s for s in sources if isinstance(s, ImageFolder)]
    others = [s for s in sources if not isinstance(s, ImageFolder)]
    if folders and others and media_field is None:
        many = MEDIA_WORDS[folders[0].modality][1]
        raise UsageError(f"input folder {folders[0].name} holds {many}, but input {others[0].name} holds texts: a "
                         f"job's records are all {many} or all texts (an input file can name {many} with "
                         f"--{folders[0].modality}-field)")
    return sources


def _media_folder(path: str, media_field: str | None, media_of_model: Callable[[], str | None]) -> ImageFolder | None:
    """The folder as an ImageFolder of the model's modality, or None when its record files are the
    input (a text folder, or any folder under a media field: its JSONL / Parquet files name the files)."""
    if media_field is not None:
        return None
    found = {modality: image_files(path, extensions) for modality, extensions in MEDIA_EXTENSIONS.items()}
    if not any(found.values()):
        return None
    record_files = _directory_files(path)
    modality = media_of_model()
    files = found.get(modality) if modality is not None else None
    if not files:
        if record_files:
            return None  # a text folder, as always: its image or audio files are not inputs
        held = next(m for m, f in found.items() if f)
        one, many = MEDIA_WORDS[held]
        takes = "a dual encoder such as CLIP or SigLIP does" if held == "image" else "a CLAP model does"
        raise UsageError(f"input directory {path!r} holds {one} files ({len(found[held])}) and no JSONL, text or "
                         f"Parquet files, but the model takes no {many} ({takes})")
    if record_files:
        one, many = MEDIA_WORDS[modality]
        raise UsageError(f"input directory {path!r} holds both {one} files ({len(files)}, e.g. {files[0]}) and "
                         f"record files ({len(record_files)}, e.g. {os.path.relpath(record_files[0], path)}): a job's "
                         f"records are all {many} or all texts. Move the {many} to a folder of their own, or read a "
                         f"record file that names them: --input DIR/metadata.jsonl --{modality}-field file_name")
    return ImageFolder(path, IMAGE_FOLDER, False, tuple(files), modality)


def media_field(job) -> tuple[str | None, str | None]:
    """(the field that holds each record's image or clip, its modality): --image-field or
    --audio-field; (None, None) for neither."""
    if job.image_field is not None:
        return job.image_field, "image"
    if job.audio_field is not None:
        return job.audio_field, "audio"
    return None, None


def model_modality(spec) -> str | None:
    """What a folder input's files are for this model: "image", "audio", or None (a text model)."""
    family = family_of(spec)
    return next((m for m in MEDIA_EXTENSIONS if family.takes(m)), None)


def job_modality(job, sources: Sequence[Source]) -> str | None:
    """What the job's records are, beyond texts: "image", "audio", or None for texts."""
    folder = next((s for s in sources if isinstance(s, ImageFolder)), None)
    return media_field(job)[1] or (folder.modality if folder is not None else None)


def image_job(job, sources: Sequence[Source]) -> bool:
    """Whether the job's records are images or audio clips."""
    return job_modality(job, sources) is not None


def check_image_field(job) -> None:
    """--image-field (--audio-field) names a record's content: not with --text-field, --pair-field
    or the other."""
    if job.image_field is not None and job.audio_field is not None:
        raise UsageError("--image-field and --audio-field: a record is an image or an audio clip; give one")
    field, modality = media_field(job)
    if field is None:
        return
    one = MEDIA_WORDS[modality][0]
    if job.pair_field is not None:
        raise UsageError(f"--{modality}-field and --pair-field: a record is an {one} or a pair of texts, not both")
    if job.text_field != "text":
        raise UsageError(f"--{modality}-field {field!r} and --text-field {job.text_field!r}: a record's content "
                         f"is its {one if modality == 'image' else 'clip'} or its text; give one")


def check_image_job(job, sources: Sequence[Source]) -> None:
    """What an image or audio job refuses before the model loads: texts' options, other tasks, --ray."""
    modality = job_modality(job, sources)
    if modality is None:
        return
    field = media_field(job)[0]
    one, many = MEDIA_WORDS[modality]
    what = f"--{modality}-field {field!r}" if field is not None else f"a folder of {many}"
    if job.ray:
        raise UsageError(f"{what}: {many} are not supported with --ray (its actors read one text column)")
    if job.task not in ("embed", "token_embed"):
        embeds = "a dual encoder embeds images (a page retriever: token_embed)" if modality == "image" else \
            "a CLAP model embeds audio"
        raise UsageError(f"{what}: {embeds}: --task embed, not {job.task!r}")
    text_only = [flag for flag, given in (("--long-inputs", job.long_inputs != "truncate"),
                                          ("--truncate", job.truncate is not None), ("--prompt", job.prompt is not None),
                                          ("--prompt-name", job.prompt_name is not None)) if given]
    if text_only:
        raise UsageError(f"{what}: {', '.join(text_only)} shape texts; this job's records are {many} (an {one} is "
                         "one input, never truncated, chunked or prefixed): drop them")
    if modality == "audio" and job.image_decode != "exact":
        raise UsageError(f"{what}: --image-decode {job.image_decode} applies to images; this job's records are audio "
                         "clips: drop it")
    if any(isinstance(s, ImageFolder) for s in sources) and (job.id_field is not None or job.keep_fields):
        raise UsageError(f"a folder of {many} has no fields: each record's id is its {one}'s path relative to the "
                         "folder; drop --id-field and --keep-fields")


def check_image_model(job, sources: Sequence[Source], spec) -> None:
    """--image-field (--audio-field) needs a model that takes images (audio); a folder was only
    taken for one."""
    modality = job_modality(job, sources)
    if modality is not None and job.task not in spec.tasks:  # (token_embed: a page retriever's, such as ColPali)
        computed = [t for t in spec.tasks if t != "score"]
        raise UsageError(f"--task {job.task}: model {spec.path!r} does not compute it for its {MEDIA_WORDS[modality][1]}"
                         f": --task {computed[0]}")
    field, modality = media_field(job)
    if field is not None and not family_of(spec).takes(modality):
        takes = "a dual encoder such as CLIP or SigLIP does" if modality == "image" else "a CLAP model does"
        raise UsageError(f"--{modality}-field {field!r}: model {spec.path!r} takes no {MEDIA_WORDS[modality][1]} "
                         f"({takes})")


def image_params(job, sources: Sequence[Source]) -> dict:
    """What an image or audio job adds to the job's params (a text job's stay as they were, so its
    resumes still match): the field, and for images the decoding, which a resume must not mix."""
    modality = job_modality(job, sources)
    if modality == "image":
        return {"image_field": job.image_field, "image_decode": job.image_decode}
    if modality == "audio":
        return {"audio_field": job.audio_field}
    return {}


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


# -- records whose content is an image or a clip ----------------------------------------------------

@dataclass
class ImageFields(Fields):
    """The fields of an --image-field (--audio-field) job: `text` names the field (so the readers
    read that column); the id and kept fields as for texts."""

    modality: str = "image"

    def wanted(self) -> list[tuple[str, str]]:
        return [(f"--{self.modality}-field", self.text)] + super().wanted()[1:]

    def of(self, record: dict):
        """(id, {"image": path or bytes}, kept fields, error) of one JSON object or Parquet row."""
        rid, _, fields, error = super().of({**record, self.text: ""})  # the id and kept fields, as for a text
        if error is not None:
            return rid, None, fields, error
        if self.text not in record:
            return rid, None, fields, f"no field {self.text!r} (--{self.modality}-field)"
        image, error = image_value(record[self.text], self.text, self.modality)
        return rid, image, fields, error


def image_value(value, name: str, modality: str = "image") -> tuple[dict | None, str | None]:
    """({"image": path or bytes}, None) ({"audio": ...}), or (None, why this field's value is none)."""
    one = MEDIA_WORDS[modality][0]
    if value is None:
        return None, f"field {name!r} is null"
    if isinstance(value, dict) and value and set(value) <= {"bytes", "path"}:  # a `datasets` Image / Audio struct
        data, path = value.get("bytes"), value.get("path")
        if data is None and path is None:
            return None, f"field {name!r} is an {modality} struct with neither bytes nor a path"
        value = data if data is not None else path
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not len(value):
            return None, f"field {name!r} holds no bytes (an empty {one})"
        return {modality: bytes(value)}, None
    if isinstance(value, str):
        if not value.strip():
            return None, f"field {name!r} is an empty path"
        return {modality: value}, None
    return None, (f"field {name!r} must be an {one} path, bytes or a datasets {modality.capitalize()} struct "
                  f"{{bytes, path}}, got {type(value).__name__}")


class ImageParquetReader(ParquetReader):
    """Parquet rows whose image column holds whole image files: read in small batches."""

    batch_rows: ClassVar[int] = IMAGE_PARQUET_BATCH_ROWS


class ImageRecordReader(RecordReader):
    """The records of an image (audio) job: folders of images (clips), and JSONL / Parquet inputs
    read with --image-field (--audio-field), their relative paths resolved against each input
    file's folder."""

    def __init__(self, sources: list[Source], image_field: str | None, id_field: str | None = None,
                 keep_fields: tuple[str, ...] = (), modality: str = "image") -> None:
        self.sources = sources
        self.fields = ImageFields(text=image_field or "", id=id_field, keep=keep_fields,
                                  explicit_id=id_field is not None, modality=modality)
        readers = {**FORMATS, "parquet": ImageParquetReader, IMAGE_FOLDER: ImageFolderReader}
        self.readers = [readers[s.format](s, self.fields) for s in sources]
        self.probed = False
        self._sizes = None

    def probe(self) -> None:
        fieldless = [r.source.name for r in self.readers if not r.has_fields and not isinstance(r, ImageFolderReader)]
        if fieldless:
            raise UsageError(f"--{self.fields.modality}-field needs fields, but {fieldless[0]} is read as text (one "
                             "record per line); "
                             "give JSONL or Parquet inputs, or --input-format")
        super().probe()

    def _record(self, reader: FormatReader, index: int, line_no: int, raw, digest) -> Record:
        record = super()._record(reader, index, line_no, raw, digest)
        media, key = record.text, self.fields.modality
        if isinstance(media, dict) and isinstance(media.get(key), str):
            path = media[key]
            if not (os.path.isabs(path) or path.startswith(AS_GIVEN)):
                source = reader.source
                base = os.getcwd() if source.stream else os.path.dirname(os.path.abspath(source.path))
                record = dataclasses.replace(record, text={key: os.path.join(base, path)})
        return record
