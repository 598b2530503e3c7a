"""`pipeline-run --ray`: the launcher's job run by Ray Data across a cluster.

Ray Data reads the inputs (JSONL, Parquet) in parallel, an actor pool of `PoolingBatches` (one
process group each) computes, and `ResultsDatasink` writes the same chunk files and manifest as
the single-machine launcher, so `load_results` reads either. Each write task writes its chunk
under its own task index: a task Ray retries rewrites the same files (atomically), so a retried
block never duplicates rows. The manifest is written last, by the driver, once every chunk is in.

Records keep their input order (Ray's preserve_order): chunk k holds the rows after those of
chunks 0..k-1, and the manifest records where each chunk starts.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import ray
from ray.data import Datasink
from ray.data.block import BlockAccessor

from pooling_pipeline.jobs.job_spec import JobSpec
from pooling_pipeline.jobs.records import format_for
from pooling_pipeline.jobs.results_store import LAYOUT, MANIFEST, Quantizer, write_chunk, write_errors_file, write_manifest
from pooling_pipeline.jobs.summary import print_ray_summary

DATA_COLUMN, TOKENS_COLUMN, ERROR_COLUMN = "data", "num_tokens", "error"


class ResultsDatasink(Datasink):
    """A Ray Data datasink writing pipeline-run's chunk files (see jobs/results_store.py)."""

    def __init__(self, out_dir: str, job: dict, id_column: str) -> None:
        """`job`: the job's description (launcher.describe_job), the manifest's head."""
        self.dir = Path(out_dir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.job = job
        self.id_column = id_column
        self.manifest: dict | None = None

    def write(self, blocks, ctx) -> dict:
        rows: list[np.ndarray] = []
        ids: list[str] = []
        indices: list[int] = []  # chunk-local: the driver learns where each chunk starts at the end
        errors: list[dict] = []
        tokens = records = 0
        for block in blocks:
            columns = BlockAccessor.for_block(block).to_numpy()
            data, failed = columns[DATA_COLUMN], columns.get(ERROR_COLUMN)
            for i, rid in enumerate(columns[self.id_column]):
                if failed is not None and failed[i]:
                    errors.append({"index": records, "id": str(rid), "error": str(failed[i])})
                else:
                    rows.append(np.asarray(data[i], dtype=np.float32))
                    ids.append(str(rid))
                    indices.append(records)
                records += 1
            if TOKENS_COLUMN in columns:
                tokens += int(np.sum(columns[TOKENS_COLUMN]))
        quantize = Quantizer(self.job["params"]["precision"])
        chunk = write_chunk(self.dir, f"t{ctx.task_idx:06d}", rows, indices, ids, errors, self.job["task"],
                            self.job["params"]["format"], quantize)
        chunk.update(task=ctx.task_idx, tokens=tokens)
        if rows:
            chunk["dim"] = int(rows[0].shape[-1])
        return chunk

    def on_write_complete(self, write_result) -> None:
        chunks = sorted((c for c in write_result.write_returns if c["records"]), key=lambda c: c["task"])
        offset = 0
        for chunk in chunks:
            chunk["index_offset"] = offset
            offset += chunk["records"]
        manifest = {"layout": LAYOUT, **self.job, "records_done": offset, "rows": sum(c["rows"] for c in chunks),
                    "errors": sum(c["records"] - c["rows"] for c in chunks), "chunks": chunks, "complete": False}
        dims = {c["dim"] for c in chunks if "dim" in c}
        if dims:
            manifest["dim"] = dims.pop()
        write_errors_file(self.dir, chunks)
        self.manifest = manifest

    @property
    def supports_distributed_writes(self) -> bool:
        return False  # files go to --output on the driver's node (a local path)


def plan_actors(job: JobSpec) -> dict:
    """How many actors, with what each: a GPU each when the cluster has GPUs, else CPUs."""
    total = ray.cluster_resources()
    cpus, gpus = int(total.get("CPU", 1)), int(total.get("GPU", 0))
    use_gpu = gpus > 0 and job.device != "cpu"
    if use_gpu:
        actors = job.ray_actors or gpus
        per_actor = job.ray_cpus_per_actor or max(1, cpus // actors - 1)
        return {"actors": actors, "num_cpus": per_actor, "num_gpus": 1}
    # One CPU is left to Ray Data's readers and writers; the rest go to the actors.
    per_actor = job.ray_cpus_per_actor or max(1, min(8, cpus - 1))
    actors = job.ray_actors or max(1, (cpus - 1) // per_actor)
    return {"actors": actors, "num_cpus": per_actor, "num_gpus": 0}


def read_dataset(files: list[str], text_field: str, id_field: str):
    if any(f == "-" for f in files):
        raise ValueError("--ray reads files (JSONL or Parquet), not standard input")
    parquet = [f for f in files if format_for(f) == "parquet"]
    jsonl = [f for f in files if format_for(f) == "jsonl"]
    other = [f for f in files if f not in parquet and f not in jsonl]
    if other:
        raise ValueError(f"--ray reads JSONL and Parquet inputs; cannot read {other[:3]}")
    if parquet and jsonl:
        raise ValueError("--ray: give either JSONL or Parquet inputs, not both")
    if parquet:
        ds = ray.data.read_parquet(parquet, columns=[id_field, text_field])
    else:
        ds = ray.data.read_json(jsonl, lines=True)
    missing = {id_field, text_field} - set(ds.schema().names)
    if missing:
        raise ValueError(f"--ray: the inputs have no {sorted(missing)} field (--ray needs an id for every "
                         "record: Ray reads blocks in parallel, so a record's line is not known)")
    return ds.select_columns([id_field, text_field])


def batches_kwargs(job: JobSpec) -> dict:
    """What each actor's PoolingBatches is built with: the job's columns, and the Pipeline and call
    options the launcher's flags set (the same ones a local run uses; PoolingBatches takes some
    Pipeline options as its own arguments, the rest in pipeline_kwargs)."""
    import inspect

    from pooling_pipeline.integrations.ray_data import PoolingBatches

    pipeline = job.pipeline_options()
    own = inspect.signature(PoolingBatches).parameters
    return {"task": job.task, "model": job.model, "text_column": job.text_field, "output_column": DATA_COLUMN,
            "errors": job.errors, "tokens_column": TOKENS_COLUMN,
            **{name: pipeline.pop(name) for name in list(pipeline) if name in own},
            "pipeline_kwargs": pipeline, **job.call_options()}


def run_ray(job: JobSpec, description: dict, files: list[str]) -> int:
    """The job on Ray Data; `description` is what identifies it (launcher.describe_job)."""
    from pooling_pipeline.integrations.ray_data import PoolingBatches, default_ray_init_kwargs
    from pooling_pipeline.jobs.results_store import load_manifest

    if job.shard != (0, 1):
        raise ValueError("--ray shares the work itself: drop --shard")
    if job.precision == "int8":
        raise ValueError("--ray cannot calibrate int8 across actors: use float32, float16 or binary")
    if job.keep_fields:
        raise ValueError("--ray does not carry --keep-fields through (yet): drop it, or run without --ray")
    out = Path(job.output)
    existing = load_manifest(out)
    if existing is not None:
        if existing.get("complete") and job.resume:
            print(f"pipeline-run: {out} is complete ({existing['records_done']} records); nothing to do")
            return 0
        raise ValueError(f"{out} already holds a job ({MANIFEST}): --ray runs a job whole; choose another "
                         "--output" + ("" if existing.get("complete") else " (that one did not finish)"))
    init = default_ray_init_kwargs(job.ray_address, job.ray_num_cpus)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(**init)
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = not job.quiet
        plan = plan_actors(job)
        ds = read_dataset(files, job.text_field, job.id_field)
        if job.limit is not None:
            ds = ds.limit(job.limit)
        ds = ds.map_batches(
            PoolingBatches,
            fn_constructor_kwargs=batches_kwargs(job),
            batch_size=job.ray_batch_size, num_cpus=plan["num_cpus"], num_gpus=plan["num_gpus"] or None,
            compute=ray.data.ActorPoolStrategy(size=plan["actors"]), batch_format="numpy")
        sink = ResultsDatasink(job.output, description, job.id_field)
        start = time.perf_counter()
        ds.write_datasink(sink)
        wall = time.perf_counter() - start
    finally:
        if started_ray:
            ray.shutdown()
    manifest = sink.manifest
    if manifest is None:
        raise RuntimeError("Ray finished the job without reporting its chunks")
    tokens = sum(c.get("tokens", 0) for c in manifest["chunks"])
    manifest["ray"] = {"address": job.ray_address, **plan, "batch_size": job.ray_batch_size}
    manifest["stats"] = {"wall_s": wall, "records": manifest["rows"], "errors": manifest["errors"], "tokens": tokens}
    manifest["complete"] = True
    write_manifest(out, manifest)
    print_ray_summary(manifest, plan, wall, tokens, out)
    return 0
