"""`pipeline-run`: a resumable, sharded offline job from files to arrays on disk.

    pipeline-run                                   # the bundled sample, default model -> ./pipeline-out
    pipeline-run --input corpus/ --output out/ --text-field body --id-field url --precision int8
    pipeline-run --input 'dumps/*.jsonl' --output out-3/ --shard 3/8 --resume     # machine 3 of 8
    pipeline-run --input docs.jsonl --output out/ --format parquet --keep-fields title,url
    pipeline-run --ray --ray-address auto --input 'dumps/*.jsonl' --output out/   # a Ray cluster
    pipeline-run --model clip/ --input photos/ --output out/     # a folder of images (a dual encoder)
    pipeline-run --model clip/ --input pics.parquet --image-field image --output out/
    cat lines.txt | pipeline-run --input - --output out/

Inputs are streamed, never loaded whole. Results go to chunked files with a manifest
(__job__/manifest.json); --resume continues an interrupted job on the same inputs, and on a
missing or empty directory simply starts it, so one command line serves every (re)start.

exit codes: 0 done (or nothing to do, or stopped at --limit); 1 runtime failure (the model or the
engine failed); 2 usage error (a bad option, an --output that cannot be used); 3 input error (a
missing input, a bad record without --errors return, an input changed since the job began);
130 / 143 interrupted by SIGINT / SIGTERM (completed work is kept: resume with --resume).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import signal
import sys
import time
from collections import deque
from pathlib import Path

import msgspec
import numpy as np

from pooling_pipeline.backends import describe_backend
from pooling_pipeline.call_stats import format_stats
from pooling_pipeline.cli_flags import declared_flag, positive_int
from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.jobs.image_records import (
    ImageRecordReader,
    check_image_field,
    check_image_job,
    check_image_model,
    check_resumed_image_decode,
    expand_job_inputs,
    image_job,
    image_params,
    job_modality,
    media_field,
    model_modality,
)
from pooling_pipeline.jobs.job_errors import EXIT_INPUT, EXIT_RUNTIME, EXIT_USAGE, InputError, UsageError
from pooling_pipeline.jobs.job_spec import JobModel, JobSpec
from pooling_pipeline.jobs.output_dir import OutputLock, check_output
from pooling_pipeline.jobs.records import INPUT_FORMATS, RecordReader
from pooling_pipeline.jobs.results_store import CALIBRATION_ROWS, ERRORS, FORMATS, PRECISIONS, VECTOR_COLUMNS, ResultWriter
from pooling_pipeline.jobs.summary import print_local_summary
from pooling_pipeline.options import CallOptions, PipelineOptions

SAMPLE = Path(__file__).resolve().parent / "data" / "sample.jsonl"
# One result per record (pair scoring needs two texts per record): a vector, per-token rows, or
# sparse [token id, weight] rows.
JOB_TASKS = tuple(VECTOR_COLUMNS)
# The pipeline numbers requests within its call ("request 12: ..."); the launcher names the record
# by file, line and id instead, which stays right under --shard and --resume.
REQUEST_PREFIX = re.compile(r"^request \d+: ")


def parse_shard(value: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard must look like I/N, got {value!r}") from None
    if n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard I/N needs 0 <= I < N, got {value!r}")
    return i, n


def field_list(value: str) -> tuple[str, ...]:
    fields = tuple(f.strip() for f in value.split(",") if f.strip())
    if not fields:
        raise argparse.ArgumentTypeError("give field names separated by commas, e.g. title,url")
    return fields


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pipeline-run", description=__doc__,
                                 formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=100))
    d = " (default: %(default)s)"
    ap.add_argument("--input", nargs="+", default=[str(SAMPLE)], metavar="PATH",
                    help="JSONL, text (one record per line) or Parquet files, directories (their files, sorted; "
                         "for a model that takes images, a folder of image files: one record per image), globs, "
                         "FIFOs such as <(cmd), or - for stdin (default: the bundled 500-record sample)")
    ap.add_argument("--input-format", default="auto", choices=INPUT_FORMATS,
                    help="auto: by suffix (.jsonl/.ndjson/.json, .parquet, anything else text; stdin is text); "
                         "or one format for every input" + d)
    ap.add_argument("--output", default="pipeline-out", metavar="DIR",
                    help="output directory: data-NNNNN.* chunks, and __job__/ with the manifest and errors" + d)
    ap.add_argument("--model", default=None,
                    help="local model directory or hub id 'org/name' (default: bundled all-MiniLM-L6-v2)")
    declared_flag(ap, "--revision", PipelineOptions, "revision", metavar="REV")
    declared_flag(ap, "--trust-remote-code", PipelineOptions, "trust_remote_code")
    declared_flag(ap, "--prompt-name", CallOptions, "prompt_name", metavar="NAME")
    declared_flag(ap, "--prompt", CallOptions, "prompt", metavar="TEXT")
    declared_flag(ap, "--route", CallOptions, "route", metavar="NAME",
                  help="the model's route every record takes (ST's encode(task=...): 'query', 'document' or another "
                       "route its Router declares; default: the model's default route)")
    ap.add_argument("--task", default="embed", choices=JOB_TASKS, help="what to compute per record" + d)
    ap.add_argument("--text-field", default="text", metavar="NAME",
                    help="JSONL field or Parquet column holding the text" + d)
    ap.add_argument("--pair-field", default=None, metavar="NAME",
                    help="--task classify: field or column holding each record's second text; the record is then "
                         "the pair (text, pair) of a cross-encoder such as an NLI model (default: single texts)")
    ap.add_argument("--image-field", default=None, metavar="NAME",
                    help="a dual encoder (CLIP, SigLIP): field or column holding each record's image instead of a "
                         "text: a path (relative to the input file's folder), bytes, or a datasets Image struct "
                         "{bytes, path} (default: texts)")
    ap.add_argument("--audio-field", default=None, metavar="NAME",
                    help="a CLAP model: field or column holding each record's audio clip instead of a text: a path "
                         "(.wav, .flac, .ogg, .mp3; relative to the input file's folder), bytes, or a datasets Audio "
                         "struct {bytes, path} (default: texts)")
    ap.add_argument("--id-field", default=None, metavar="NAME",
                    help="field holding each record's id; every record must have it (default: 'id' when the "
                         "first record has one, then required of every record; otherwise ids are file:line)")
    ap.add_argument("--keep-fields", type=field_list, default=(), metavar="A,B",
                    help="input fields copied into the output as columns (--format parquet; default: none)")
    declared_flag(ap, "--workers", PipelineOptions, "num_render_workers", metavar="N")
    declared_flag(ap, "--max-num-seqs", PipelineOptions, "max_num_seqs", metavar="N")
    declared_flag(ap, "--max-num-batched-tokens", PipelineOptions, "max_num_batched_tokens", metavar="N")
    declared_flag(ap, "--data-parallel-size", PipelineOptions, "data_parallel_size", metavar="N")
    declared_flag(ap, "--truncate", CallOptions, "truncate_prompt_tokens", type=positive_int, metavar="N",
                  help="keep at most N tokens per record (default: the model's max_seq_length)")
    declared_flag(ap, "--long-inputs", CallOptions, "long_inputs")
    ap.add_argument("--precision", default="float32", choices=PRECISIONS,
                    help="stored precision; int8 is calibrated on the first --int8-calibration-rows rows, "
                         "binary is packed sign bits" + d)
    ap.add_argument("--int8-calibration-rows", type=positive_int, default=CALIBRATION_ROWS, metavar="N",
                    help="rows int8 ranges are calibrated on before anything is written" + d)
    ap.add_argument("--format", default="npy", choices=FORMATS,
                    help="chunk files: .npy (+ ids-NNNNN.json) or .parquet (id, index, vectors, kept fields)" + d)
    ap.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N",
                    help="process only the records whose index in the whole input %% N == I (default: 0/1, all)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the job in --output (or start it when there is none); refused when the inputs, "
                         "model or options differ from the job's")
    declared_flag(ap, "--errors", CallOptions, "errors",
                  help="raise: the first bad record stops the job, naming its file and line; return: failed "
                       f"records go to {ERRORS} and the job goes on" + d)
    ap.add_argument("--limit", type=positive_int, default=None, metavar="N",
                    help="stop when N records of this shard are done, counting earlier runs; the job stays "
                         "unfinished and --resume without --limit completes it (default: no limit)")
    declared_flag(ap, "--device", PipelineOptions, "device", metavar="DEVICE")
    declared_flag(ap, "--dtype", PipelineOptions, "dtype")
    declared_flag(ap, "--backend", PipelineOptions, "backend")
    declared_flag(ap, "--quantize", PipelineOptions, "quantize")
    declared_flag(ap, "--image-decode", PipelineOptions, "image_decode")
    declared_flag(ap, "--max-image-pixels", PipelineOptions, "max_image_pixels", metavar="N")
    ap.add_argument("--chunk-rows", type=positive_int, default=65536, metavar="N", help="records per output chunk" + d)
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--verbose", action="store_true",
                    help="the end-of-run report in full: engine load, padding, memory, stage times, queue depths")
    ray = ap.add_argument_group("Ray (pip install -e \".[ray]\"; see the README)")
    ray.add_argument("--ray", action="store_true", help="run the job with Ray Data: one process group per actor")
    ray.add_argument("--ray-address", default="local",
                     help="local: start a private Ray instance on this machine; auto: join the running cluster "
                          "(ray start); or a cluster address" + d)
    ray.add_argument("--ray-actors", type=positive_int, default=None,
                     help="default: one per GPU, else CPUs / CPUs per actor")
    ray.add_argument("--ray-cpus-per-actor", type=positive_int, default=None,
                     help="CPUs each actor's process group gets (default: up to 8; with GPUs, its share)")
    ray.add_argument("--ray-batch-size", type=positive_int, default=1024, help="records per map_batches call" + d)
    ray.add_argument("--ray-num-cpus", type=positive_int, default=None,
                     help="CPUs of a --ray-address local instance (default: all)")
    return ap


def peak_rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    job = JobSpec.from_args(build_parser().parse_args(argv))  # a usage error exits 2 here
    with Interrupt() as interrupt:  # SIGINT / SIGTERM: see Interrupt; the job keeps what is complete
        try:
            return run(job, interrupt)
        except InputError as e:
            print(f"pipeline-run: input error: {e}", file=sys.stderr)
            return EXIT_INPUT
        except ValueError as e:  # UsageError, and what the API refuses (a task the model cannot do, ...)
            print(f"pipeline-run: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt:  # before the job started (input checks, model start): nothing to keep
            signum = interrupt.signum or signal.SIGINT
            print(f"pipeline-run: stopped by {signal.Signals(signum).name} before any result; nothing written",
                  file=sys.stderr)
            return 128 + signum
        except Exception as e:
            print(f"pipeline-run: failed: {type(e).__name__}: {e}", file=sys.stderr)
            if not _known_failure(e):  # a bug: its traceback is what a report needs
                import traceback

                traceback.print_exc()
            print(f"pipeline-run: completed chunks are kept in {job.output}; run the same command with --resume "
                  "to continue", file=sys.stderr)
            return EXIT_RUNTIME


def _stored(out):
    """What is written for one result: its vector(s); a sparse one as [token id, weight] rows."""
    if out.error is None and getattr(out, "indices", None) is not None:
        return np.stack([out.indices.astype(np.float32), out.data.astype(np.float32)], axis=1)
    return out.data


def _known_failure(e: Exception) -> bool:
    from pooling_pipeline.errors import PipelineError

    return isinstance(e, (PipelineError, OSError))


def run(job: JobSpec, interrupt: Interrupt | None = None) -> int:
    from pooling_pipeline.jobs.fingerprint import input_fingerprints

    if job.task == "sparse_embed" and job.precision != "float32":
        raise UsageError("--task sparse_embed stores (token id, weight) pairs in float32: drop --precision")
    if job.ray and job.data_parallel_size != 1:
        raise UsageError("--data-parallel-size is for a run on one machine; with --ray each actor is one process "
                         "group on one GPU: use --ray-actors")
    check_image_field(job)  # (before --pair-field's checks: it names both)
    _check_pair_field(job)
    if job.keep_fields and job.format != "parquet":
        raise UsageError("--keep-fields needs --format parquet (the columns go into the Parquet chunks)")
    clash = set(job.keep_fields) & {"id", "index", VECTOR_COLUMNS[job.task]}
    if clash:
        raise UsageError(f"--keep-fields {sorted(clash)}: these names are the output's own columns")
    # Everything that can be checked without the model is, before it loads: inputs exist, the
    # output directory is usable and ours alone, the fields match the records. The model's folder is
    # read once (the job's description and its Pipeline both use it), early only where a folder
    # holding images asks whether the model takes images.
    models: list[JobModel] = []

    def job_model() -> JobModel:
        if not models:
            models.append(JobModel.read(job))
        return models[0]

    sources = expand_job_inputs(job.input, job.input_format, media_field(job)[0], lambda: model_modality(job_model().spec))
    check_image_job(job, sources)
    out = check_output(job.output, job.input)
    lock = OutputLock(out)
    try:
        if image_job(job, sources):
            reader = ImageRecordReader(sources, media_field(job)[0], job.id_field, job.keep_fields,
                                       job_modality(job, sources))
        else:
            reader = RecordReader(sources, job.text_field, job.id_field, job.keep_fields, job.pair_field)
        if job.ray:  # Ray Data reads the inputs itself, and needs an id field
            from pooling_pipeline.integrations.ray_job import run_ray  # (the ray extra: only when asked for)

            job = dataclasses.replace(job, id_field=job.id_field or "id")
            return run_ray(job, describe_job(job, job_model(), sources, job.id_field), [s.path for s in sources])
        reader.probe()
        fingerprints = input_fingerprints(sources)
        model = job_model()
        description = describe_job(job, model, sources, reader.id_field)
        check_resumed_image_decode(out, description["params"], job.resume)
        writer = ResultWriter(out, description, resume=job.resume,
                              fingerprints=fingerprints, calibration_rows=job.int8_calibration_rows,
                              field_types=reader.kept_types())
        _say_grown_inputs(writer.manifest.get("input_fingerprints", []), fingerprints)
        if writer.manifest["complete"]:
            print(f"pipeline-run: {out} is complete ({writer.records_done} records); nothing to do")
            return 0
        if job.limit is not None and writer.records_done >= job.limit:
            print(f"pipeline-run: {out} already has {writer.records_done} records (--limit {job.limit}); nothing to "
                  "do (drop --limit to finish the job)")
            return 0
        return Job(job, model.spec, reader, writer, interrupt or Interrupt()).run()
    finally:
        lock.release()


def resume_sha256(writer: ResultWriter, sources: list) -> str | None:
    """The hash of all the job read up to its last committed record, which a resume checks its
    inputs against (RecordReader.records); None when nothing is done yet. A job begun by an older
    pipeline-run kept none for files (only samples of them, which a rewrite in place can pass): its
    resume is refused, as one whose model fingerprint was sampled is."""
    manifest = writer.manifest
    if not writer.records_done:
        return None
    if manifest.get("read_sha256") is not None:
        return manifest["read_sha256"]
    if manifest.get("stream_sha256") is not None and all(s.stream for s in sources):
        return manifest["stream_sha256"]  # an older run's hash of its streams: the same bytes, hashed alike
    raise UsageError(f"--resume: the job in {writer.dir} was begun by an older pipeline-run that checked its input "
                     "files by samples (which a rewrite in place can pass), so whether the records it has done are "
                     "still the ones its inputs hold cannot be told; start a new job in another --output")


def _say_grown_inputs(then: list[dict], now: list[dict]) -> None:
    """A resume on inputs appended to since the job began reads what they held then: it says so."""
    for old, new in zip(then, now):
        if not new.get("stream") and "size" in new and new["size"] > old["size"]:
            print(f"pipeline-run: input {new['path']} has grown since the job began ({old['size']} bytes then, "
                  f"{new['size']} now); the job reads its first {old['size']} bytes, as it began (a new job in "
                  "another --output reads the rest)", file=sys.stderr)


def _check_pair_field(job: JobSpec) -> None:
    """--pair-field: pairs are classified (a cross-encoder's classify), on one machine."""
    if job.pair_field is None:
        return
    if job.task != "classify":
        raise UsageError(f"--pair-field gives each record a second text for pair classification: it needs --task "
                         f"classify, not {job.task!r}")
    if job.ray:
        raise UsageError("--pair-field is not supported with --ray (its actors read one text column)")
    if job.pair_field == job.text_field:
        raise UsageError(f"--pair-field {job.pair_field!r} is the --text-field too: give the field of the second text")
    if job.long_inputs != "truncate":
        raise UsageError("--pair-field: a pair is truncated longest-first to the model's length; "
                         f"--long-inputs {job.long_inputs} is not supported for pairs")


def model_fingerprint_files(model: JobModel) -> dict[str, str]:
    """{file: fingerprint} of all that shapes the job's output: the whole model directory, not only
    the transformer's folder (spec.path) -- ST's modules after it (1_Pooling/, 2_Dense/, a Router's
    routes) shape the output too --, and a PEFT adapter's base model where it is a folder of its
    own (its weights are merged with the adapter's)."""
    from pooling_pipeline.core.shared.content_hash import model_files

    files = model_files(str(model.root))
    bases = dict.fromkeys(part.adapter.base_path for part in (model.spec, *model.spec.route_specs)
                          if part.adapter is not None and part.adapter.base_path != part.path)
    for k, base in enumerate(bases):
        files.update({f"adapter-base{k or ''}/{name}": digest for name, digest in model_files(base).items()})
    return files


def describe_job(job: JobSpec, model: JobModel, sources: list, id_field: str | None) -> dict:
    """What identifies a job: a resume must match it, and load_results reads shards of one job only."""
    from pooling_pipeline import __version__
    from pooling_pipeline.core.shared.content_hash import model_hash
    from pooling_pipeline.request_options import model_prompts

    spec = model.spec
    files = model_fingerprint_files(model)
    prompts = model_prompts(spec)  # ST's "query" / "document" placeholders among them
    if job.prompt_name is not None and job.prompt_name not in prompts:  # before the model loads
        raise UsageError(f"--prompt-name {job.prompt_name!r} is not among the model's prompts {sorted(prompts)}")
    check_image_model(job, sources, spec)
    if job.pair_field is not None and spec.head != "sequence_classification":
        raise UsageError("--pair-field: pairs are classified by a sequence-classification model (a cross-encoder); "
                         f"{spec.path!r} has no such head")
    # A pair job says so; a single-text job's description stays what it was (its resumes still match).
    pair = {"pair_field": job.pair_field} if job.pair_field is not None else {}
    return {
        "version": __version__,
        "task": job.task,
        "model": spec.path,
        "model_sha256": model_hash(files),
        "model_files": files,  # per file: a resume refused for a changed model names the file
        "inputs": [os.path.abspath(s.path) if s.path != "-" else "-" for s in sources],
        "shard": list(job.shard),
        "params": {"truncate": job.truncate, "long_inputs": job.long_inputs, "precision": job.precision,
                   "format": job.format, "text_field": job.text_field, "input_format": job.input_format,
                   "id_field": id_field, "keep_fields": list(job.keep_fields), "chunk_rows": job.chunk_rows,
                   "int8_calibration_rows": job.int8_calibration_rows,
                   "pooling": msgspec.to_builtins(spec.pooling), "normalize": spec.normalize,
                   "prompt_name": job.prompt_name, "prompt": job.prompt, **pair, **image_params(job, sources),
                   # int8 weights give other vectors: a resume must not mix them (float32 backends agree
                   # within the stated tolerance, so the backend itself is not part of the job).
                   **({"quantize": job.quantize} if job.quantize else {})},
    }


class Interrupt:
    """SIGINT / SIGTERM during a job. During start-up it stops at once (KeyboardInterrupt). Once
    results flow (`soft`), the first signal only sets `signum`: the loop stops reading and keeps
    what is complete; a second one, or one that comes while the input is being waited for
    (`reading`), stops at once. Never while results are being written (`writing`), so a chunk and
    the manifest are always written whole."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.soft = False
        self.writing = False
        self.reading = False
        self._previous: dict = {}

    def __enter__(self) -> Interrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        first = self.signum is None
        self.signum = signum
        if first:
            # The stop was asked for: the group's warnings about the requests it then drops (or
            # about children that got the terminal's SIGINT too) would only bury the one line
            # that says how to resume.
            for name in ("pipeline", "pooling_pipeline"):
                logging.getLogger(name).setLevel(logging.ERROR)
        if self.reading or (not self.writing and not (self.soft and first)):
            raise KeyboardInterrupt


# How often (in records) the progress bar's total is re-estimated from the bytes read so far.
PROGRESS_TOTAL_EVERY = 256


class Job:
    """One run of a local job: records in, results out in input order, completed work always kept."""

    def __init__(self, job: JobSpec, model_spec: ModelSpec, reader: RecordReader, writer: ResultWriter,
                 interrupt: Interrupt) -> None:
        self.job = job
        self.model_spec = model_spec  # read once for the job (JobModel): the Pipeline takes it as it is
        self.interrupt = interrupt
        self.reader = reader
        self.writer = writer
        self.pending: deque = deque()  # records read, in order, whose results are not handed to the writer
        self.exhausted = False         # the input ended (not --limit, not a signal, not a bad record)
        self.stopped_on = None         # (record, error) that stopped the job under --errors raise
        self.done = 0                  # records of this run handed to the writer
        self.tokens = 0
        self.progress = None

    def run(self) -> int:
        job, writer = self.job, self.writer
        if writer.records_done and not job.quiet:
            print(f"pipeline-run: --resume: reading the {writer.records_done} records already done again, to check "
                  "that the inputs still hold them", file=sys.stderr)
        # The inputs as the job began (the fingerprinted sizes): what a file gains while it is read,
        # or between runs, is not this job's. The records done are read (and checked) here, before
        # the model starts.
        records = self.reader.records(job.shard, skip=writer.records_done,
                                      resume_sha256=resume_sha256(writer, self.reader.sources),
                                      snapshot=writer.manifest.get("input_fingerprints"))
        remaining = None if job.limit is None else job.limit - writer.records_done
        stats: dict | None = None
        failure: BaseException | None = None
        interrupt = self.interrupt
        try:
            stats = self._compute(records, remaining, interrupt)
        except KeyboardInterrupt:
            pass
        except Exception as e:
            if interrupt.signum is None:  # after a Ctrl-C, a dying group is the signal's doing
                failure = e
        finally:
            interrupt.writing = True  # from here on a signal waits: the manifest is written whole
            if self.progress is not None:
                if self.exhausted:  # the whole input read: the total is what was done
                    self.progress.total = self.progress.n
                    self.progress.refresh()
                self.progress.close()
        if stats is not None:
            stats["records_this_run"] = self.done  # failed ones included, those refused before the model too
        signum = interrupt.signum  # one that comes while the manifest is written changes nothing
        complete = self.exhausted and signum is None and failure is None and self.stopped_on is None
        dropped = writer.finish(stats, complete)
        return self._report(signum, failure, dropped, stats)

    def _texts(self, records, remaining: int | None, interrupt: Interrupt):
        """The texts handed to the pipeline: stops at a signal, at --limit, or at a bad record
        under --errors raise. Bad records wait in `pending` to be written in their place."""
        taken = 0
        while True:
            # Waiting on a slow stream (stdin, a FIFO) is the one wait a signal must break at once.
            interrupt.reading = True
            record = next(records, None)
            interrupt.reading = False
            if record is None:
                break
            if interrupt.signum is not None or (remaining is not None and taken >= remaining):
                return  # a record was there: the input is not exhausted
            taken += 1
            self.pending.append(record)
            if record.error is None:
                yield record.text
            elif self.job.errors == "raise":
                return
        self.exhausted = True

    def _compute(self, records, remaining: int | None, interrupt: Interrupt) -> dict:
        from pooling_pipeline import Pipeline

        job = self.job
        launched = time.perf_counter()
        # The model folder was read for the job already: the Pipeline takes that spec as it is (a hub
        # id is not resolved again; the revision was applied when it was read).
        with Pipeline(model=self.model_spec, **{**job.pipeline_options(), "revision": None}) as pipe:
            start = time.perf_counter()  # throughput is measured from here; start-up is reported apart
            if not job.quiet:
                print(f"pipeline-run: {describe_backend(pipe.stats()['engine'])}", file=sys.stderr)
            if not job.quiet:
                from tqdm.auto import tqdm

                # smoothing=0: the rate shown is records done / time since the model was ready (the
                # default moving average swings with the batches, which come in bursts).
                # The total (so the rate gives an ETA): exact for Parquet, else estimated from the bytes read
                # so far and refined as the job goes (`RecordReader.estimated_total`); a resume starts
                # at the records the job already has.
                self.progress = tqdm(desc="pipeline-run", unit="records", dynamic_ncols=True, smoothing=0,
                                     initial=self.writer.records_done, total=self._expected_total())
            interrupt.soft = True  # from here a first signal lets the loop keep what is complete
            stream = pipe.encode_stream(self._texts(records, remaining, interrupt), job.task, **job.call_options(),
                                        errors="return")  # --errors raise is applied here, naming the record
            try:
                for out in stream:
                    interrupt.writing = True
                    self._write_bad_records()
                    record = self.pending.popleft()
                    if out.error is not None and job.errors == "raise":
                        self.stopped_on = (record, out.error)
                        break
                    self._write(record, _stored(out), out.error, out.num_prompt_tokens)
                    if interrupt.signum is not None:
                        break
                    interrupt.writing = False
                interrupt.writing = True
                self._write_bad_records()
            finally:
                stream.close()  # aborts what is still in flight
            stats = _stats(pipe, start)
            stats["startup_s"] = start - launched
            stats["peak_rss_mb"] = {"frontend": peak_rss_mb(os.getpid()), "engine": peak_rss_mb(pipe.pids["engine"]),
                                    "engines": [peak_rss_mb(p) for p in pipe.pids.get("engines", [])],
                                    "workers": [peak_rss_mb(p) for p in pipe.pids["workers"]]}
        return stats

    def _write_bad_records(self) -> None:
        """Records that never reached the pipeline (bad line, missing field), in their place."""
        while self.pending and self.pending[0].error is not None:
            record = self.pending.popleft()
            if self.job.errors == "raise":
                self.stopped_on = (record, record.error)
                return
            self._write(record, None, record.error, 0)

    def _write(self, record, data, error: str | None, tokens: int) -> None:
        if error is not None:
            error = REQUEST_PREFIX.sub("", error)
        self.writer.add(record, data, error)
        self.done += 1
        self.tokens += tokens
        if self.progress is not None:
            self.progress.update(1)
            if self.done % PROGRESS_TOTAL_EVERY == 1 or self.progress.n >= (self.progress.total or 0):
                self._refresh_total()
            self.progress.set_postfix_str(f"{self.tokens / max(self.progress.format_dict['elapsed'], 1e-9):,.0f} tok/s",
                                          refresh=False)

    def _expected_total(self) -> int | None:
        """This run's bar total: the shard's records in all (limited by --limit), or None while unknown."""
        estimate = self.reader.estimated_total(self.job.shard)
        if estimate is None:
            return None
        total = estimate[0]
        return min(total, self.job.limit) if self.job.limit is not None else total

    def _refresh_total(self) -> None:
        total = self._expected_total()
        if total is not None:
            total = max(total, self.progress.n + 1)  # (still reading: at least one more to come)
            if total != self.progress.total:
                self.progress.total = total
                self.progress.refresh()

    def _report(self, signum: int | None, failure: BaseException | None, dropped: int, stats: dict | None) -> int:
        job, writer = self.job, self.writer
        kept = f"{writer.records_done} records kept in {job.output}"
        if dropped:
            kept += (f" ({dropped} more computed but not kept: int8 is written once {job.int8_calibration_rows} "
                     "rows have calibrated it)")
        if signum is not None:
            name = signal.Signals(signum).name
            print(f"pipeline-run: stopped by {name}; {kept}; run the same command with --resume to continue",
                  file=sys.stderr)
            return 128 + signum
        if failure is not None:
            raise failure
        if self.stopped_on is not None:
            record, error = self.stopped_on
            raise InputError(f"{record.where}: {REQUEST_PREFIX.sub('', error)} ({kept}; --errors return writes failed "
                             f"records to {ERRORS} and goes on)")
        if not writer.manifest["complete"]:
            print(f"pipeline-run: stopped at --limit {job.limit}; {kept}; the job is not complete: run again with "
                  "--resume and without --limit to finish it")
        if stats is not None:
            print_local_summary(writer.manifest, stats, job.output, format_stats(stats) if job.verbose else [],
                                verbose=job.verbose)
        return 0


def _stats(pipe, start: float) -> dict:
    s = pipe.stats()
    return {"wall_s": time.perf_counter() - start, "records": s["requests"], "tokens": s["prompt_tokens"],
            "engine_busy_fraction": s["engine_busy_fraction"], "padding_fraction": s["padding_fraction"],
            "padding_efficiency": s["padding_efficiency"], "batches": s["batches"],
            "errors": s["errors"], "cpu_plan": s["cpu_plan"], "stages": s["stages"], "queue_depths": s["queue_depths"]}


if __name__ == "__main__":
    sys.exit(main())
