"""`pipeline-run`: a resumable, sharded offline job from files to arrays on disk.

    pipeline-run                                   # the bundled sample, default model -> ./pipeline-out
    pipeline-run --input corpus/ --output out/ --text-field body --id-field url --precision int8
    pipeline-run --input 'dumps/*.jsonl' --output out-3/ --shard 3/8 --resume     # machine 3 of 8
    pipeline-run --ray --ray-address auto --input 'dumps/*.jsonl' --output out/   # a Ray cluster
    cat lines.txt | pipeline-run --input - --output out/

Inputs are streamed, never loaded whole. Results go to chunked files with a manifest
(jobs/results_store.py); `--resume` continues a crashed job with identical output, and on a
missing or empty directory simply starts it, so one command line serves every (re)start.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections import deque
from pathlib import Path

from pooling_pipeline.call_stats import format_stats
from pooling_pipeline.core.options import ERRORS_MODES, LONG_INPUTS, TASKS
from pooling_pipeline.jobs.records import expand_inputs, read_records
from pooling_pipeline.jobs.results_store import FORMATS, PRECISIONS, ResultWriter

SAMPLE = Path(__file__).resolve().parent / "data" / "sample.jsonl"
# Pair scoring needs two texts per record: not a task of this one-text-per-record job.
JOB_TASKS = tuple(t for t in TASKS if t != "score")


def parse_shard(value: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard must look like I/N, got {value!r}") from None
    if n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard I/N needs 0 <= I < N, got {value!r}")
    return i, n


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pipeline-run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", default=[str(SAMPLE)],
                    help="JSONL, text (one record per line) or Parquet files, directories, globs, or - for stdin")
    ap.add_argument("--output", default="pipeline-out")
    ap.add_argument("--model", default=None, help="local model directory (default: bundled all-MiniLM-L6-v2)")
    ap.add_argument("--task", default="embed", choices=JOB_TASKS)
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--id-field", default="id")
    ap.add_argument("--workers", type=int, default=None, help="render workers (default: planned from the cores)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--truncate", type=int, default=None, help="keep at most this many tokens per record")
    ap.add_argument("--long-inputs", default="truncate", choices=LONG_INPUTS)
    ap.add_argument("--precision", default="float32", choices=PRECISIONS)
    ap.add_argument("--format", default="npy", choices=FORMATS)
    ap.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N",
                    help="process only records whose index %% N == I")
    ap.add_argument("--resume", action="store_true", help="continue the job in --output (or start it)")
    ap.add_argument("--errors", default="raise", choices=ERRORS_MODES,
                    help="return: failed records go to errors.jsonl and the run goes on")
    ap.add_argument("--limit", type=int, default=None, help="stop after this many records (of this shard)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunk-rows", type=int, default=65536, help="records per output chunk")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ray = ap.add_argument_group("Ray (pip install -e \".[ray]\"; see the README)")
    ray.add_argument("--ray", action="store_true", help="run the job with Ray Data: one process group per actor")
    ray.add_argument("--ray-address", default="local",
                     help="local: start a private Ray instance on this machine (default); auto: join the "
                          "running cluster (ray start); or a cluster address")
    ray.add_argument("--ray-actors", type=int, default=None, help="default: one per GPU, else CPUs / CPUs per actor")
    ray.add_argument("--ray-cpus-per-actor", type=int, default=None,
                     help="CPUs each actor's process group gets (default: up to 8; with GPUs, its share)")
    ray.add_argument("--ray-batch-size", type=int, default=1024, help="records per map_batches call")
    ray.add_argument("--ray-num-cpus", type=int, default=None, help="CPUs of a --ray-address local instance")
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
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"pipeline-run: error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    from pooling_pipeline import Pipeline, __version__
    from pooling_pipeline.core.config import load_model_spec

    files = expand_inputs(args.input)
    spec = load_model_spec(args.model)
    from pooling_pipeline.jobs.fingerprint import model_hash

    job = {
        "version": __version__,
        "task": args.task,
        "model": spec.path,
        "model_sha256": model_hash(spec.path),
        "inputs": [os.path.abspath(f) if f != "-" else f for f in files],
        "shard": list(args.shard),
        "params": {"truncate": args.truncate, "long_inputs": args.long_inputs, "precision": args.precision,
                   "format": args.format, "text_field": args.text_field, "id_field": args.id_field,
                   "chunk_rows": args.chunk_rows, "pooling": spec.pooling, "normalize": spec.normalize},
    }
    if args.ray:
        from pooling_pipeline.integrations.ray_job import run_ray

        return run_ray(args, job, files)
    writer = ResultWriter(args.output, job, resume=args.resume)
    if writer.manifest.get("complete"):
        print(f"pipeline-run: {args.output} is complete ({writer.records_done} records); nothing to do")
        return 0
    records = read_records(files, args.text_field, args.id_field, args.shard, skip=writer.records_done)
    # The total is not counted: that would read every input once more before the work (and a
    # stream cannot be read twice). The bar shows records done and the rate.
    remaining = None
    if args.limit is not None:
        remaining = max(0, args.limit - writer.records_done)
        records = itertools.islice(records, remaining)
    pending: deque = deque()  # records handed to the pipeline, in order, not yet written

    def texts():
        for record in records:
            pending.append(record)
            yield record.text

    launched = time.perf_counter()
    progress = None
    with Pipeline(model=args.model, num_render_workers=args.workers, max_num_seqs=args.max_num_seqs,
                  device=args.device, dtype=args.dtype) as pipe:
        start = time.perf_counter()  # throughput is measured from here; start-up is reported apart
        if not args.quiet:
            from tqdm.auto import tqdm

            progress = tqdm(total=remaining, desc="pipeline-run", unit="records", dynamic_ncols=True)
        tokens = 0
        for out in pipe.encode_stream(texts(), args.task, truncate_prompt_tokens=args.truncate,
                                      long_inputs=args.long_inputs, errors=args.errors):
            record = pending.popleft()
            writer.add(record.index, record.id, out.data, out.error)
            tokens += out.num_prompt_tokens
            if writer.pending_records >= args.chunk_rows:
                writer.flush(_stats(pipe, start))
            if progress is not None:
                progress.update(1)
                progress.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f} tok/s", refresh=False)
        stats = _stats(pipe, start)
        stats["startup_s"] = start - launched
        stats["peak_rss_mb"] = {"frontend": peak_rss_mb(os.getpid()), "engine": peak_rss_mb(pipe.pids["engine"]),
                                "workers": [peak_rss_mb(p) for p in pipe.pids["workers"]]}
    if progress is not None:
        progress.close()
    writer.close(stats)
    _print_summary(writer, stats, args.output)
    return 0


def _stats(pipe, start: float) -> dict:
    s = pipe.stats()
    return {"wall_s": time.perf_counter() - start, "records": s["requests"], "tokens": s["prompt_tokens"],
            "engine_busy_fraction": s["engine_busy_fraction"], "padding_fraction": s["padding_fraction"],
            "padding_efficiency": s["padding_efficiency"], "batches": s["batches"],
            "errors": s["errors"], "cpu_plan": s["cpu_plan"], "stages": s["stages"], "queue_depths": s["queue_depths"]}


def _print_summary(writer: ResultWriter, stats: dict, out_dir: str) -> None:
    m = writer.manifest
    wall = stats["wall_s"]
    rss = stats["peak_rss_mb"]
    print_summary([
        ("records (this run)", f"{stats['records'] + stats['errors']}"),
        ("records in output", f"{m['rows']} ({m['errors']} failed)"),
        ("tokens", f"{stats['tokens']:,}"),
        ("wall time", f"{wall:.1f} s (+ {stats['startup_s']:.1f} s start-up)"),
        ("throughput", f"{stats['records'] / max(wall, 1e-9):.1f} records/s, "
                       f"{stats['tokens'] / max(wall, 1e-9):,.0f} tokens/s"),
        ("engine busy", f"{stats['engine_busy_fraction']:.0%}"),
        ("padding efficiency", f"{1 - stats['padding_fraction']:.0%}"),
        ("peak RSS", f"frontend {rss['frontend']:.0f} MB, engine {rss['engine']:.0f} MB, workers "
                     + ", ".join(f"{w:.0f} MB" for w in rss["workers"] if w is not None)),
        ("errors", f"{m['errors']}" + (" (see errors.jsonl)" if m["errors"] else "")),
        ("output", f"{out_dir}/"),
    ], stats["records"], format_stats(stats))


def print_summary(rows: list[tuple[str, str]], records: int, details: list[str] = ()) -> None:
    """The end-of-run report, the same for a local and a Ray job: aligned rows, then details."""
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for line in details:
        print(line)
    print(f"embedded {records} records")


if __name__ == "__main__":
    sys.exit(main())
