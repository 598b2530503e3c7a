"""Scale-out through Ray Data: one process group per Ray actor, fed by `Dataset.map_batches`.

    import ray
    from pooling_pipeline.integrations.ray_data import PoolingBatches

    ds = ray.data.read_parquet("s3://bucket/corpus/")
    ds = ds.map_batches(PoolingBatches, fn_constructor_kwargs={"task": "embed"},
                        batch_size=1024, num_cpus=4, compute=ray.data.ActorPoolStrategy(size=8))
    ds.write_parquet("s3://bucket/embeddings/")

Each actor starts its own frontend + render workers + engine core, sized from what Ray gave it:
its CPUs become render workers and engine threads (the same CPU plan as on one machine), and a
GPU, when it has one, runs the engine (Ray sets CUDA_VISIBLE_DEVICES for the actor; the engine
process inherits it). The group lives as long as the actor and is closed when the actor exits
(and if the actor is killed outright, the children notice their parent is gone and exit).

Needs the `[ray]` extra (`pip install -e ".[ray]"`).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import numpy as np

from pooling_pipeline.core.shared.options import checked
from pooling_pipeline.options import CALL_OPTIONS, CallOptions, PipelineOptions, defaults

# The column a task's output goes to, unless the caller names another.
OUTPUT_COLUMNS = {"embed": "embedding", "classify": "probs", "score": "score",
                  "token_embed": "token_embeddings", "token_classify": "token_probs"}
# The Pipeline method each task runs, and so the call options it takes (options.CALL_OPTIONS).
TASK_CALLS = {"embed": "embed", "classify": "classify", "score": "score", "token_embed": "encode",
              "token_classify": "encode"}
_PIPELINE, _CALL = defaults(PipelineOptions), defaults(CallOptions)
ERROR_COLUMN = "error"


def actor_resources() -> tuple[int, int]:
    """(CPUs, GPUs) Ray assigned to the calling actor or task; (cores, 0) outside Ray."""
    from pooling_pipeline.cpu_plan import available_cores

    try:
        import ray
    except ImportError:  # used without Ray (a plain function over batches): size for this machine
        return available_cores(), 0
    context = ray.get_runtime_context()
    # Ray assigns resources to its tasks and actors; a driver (or no Ray at all) has the machine.
    if not ray.is_initialized() or context.worker.mode != ray._private.worker.WORKER_MODE:
        return available_cores(), 0
    assigned = context.get_assigned_resources()
    return max(1, int(assigned.get("CPU", 1))), int(assigned.get("GPU", 0))


class PoolingBatches:
    """A callable class for `ray.data.Dataset.map_batches`: batch in, batch with the output column out.

    task: "embed" | "classify" | "score" | "token_embed" | "token_classify".
    text_column: the input text; score also takes `pair_column` (the documents; `text_column`
    holds the queries). The output goes to `output_column` (default: embedding, probs, score,
    token_embeddings, token_probs): a 2-D array for vector tasks, one array per row for token
    tasks, floats for score. `errors="return"` keeps going past a bad row: the `error` column says
    why (empty for rows that worked) and its output is NaN (token tasks: no rows), so the column
    keeps one type across batches, as Ray Data needs.
    Other keyword arguments are options of the task's call (`Pipeline.embed`, `classify`, `score`,
    or `encode` for token tasks: truncate_prompt_tokens, long_inputs, prompt_name, ...; None means
    the default), checked here: one the call does not take is a TypeError naming it. Defaults and
    checks are the declared ones (options.py). `pipeline_kwargs` go to the `Pipeline` constructor;
    `tokens_column` adds each row's token count.
    """

    def __init__(self, task: str = "embed", *, model: str | None = None, text_column: str = "text",
                 pair_column: str | None = None, output_column: str | None = None, errors: str = _CALL["errors"],
                 device: str = _PIPELINE["device"], dtype: str = _PIPELINE["dtype"],
                 num_render_workers: int | None = _PIPELINE["num_render_workers"],
                 pipeline_kwargs: dict | None = None, tokens_column: str | None = None,
                 **call_kwargs: Any) -> None:
        from pooling_pipeline.api import Pipeline
        from pooling_pipeline.cpu_plan import plan_cpu

        if task not in OUTPUT_COLUMNS:
            raise ValueError(f"task must be one of {tuple(OUTPUT_COLUMNS)}, got {task!r}")
        if task == "score" and pair_column is None:
            raise ValueError("task 'score' needs pair_column (the documents; text_column holds the queries)")
        takes = [name for name in CALL_OPTIONS[TASK_CALLS[task]] if name not in ("use_tqdm", "errors")]
        unknown = sorted(set(call_kwargs) - set(takes))
        if unknown:
            raise TypeError(f"PoolingBatches() got an unexpected keyword argument {unknown[0]!r}: task {task!r} "
                            f"takes {takes}")
        call_kwargs = {k: v for k, v in call_kwargs.items() if v is not None}
        checked(CallOptions, {"task": task, "errors": errors, **call_kwargs})  # what the call would refuse
        self.task = task
        self.text_column = text_column
        self.pair_column = pair_column
        self.output_column = output_column or OUTPUT_COLUMNS[task]
        self.errors = errors
        self.tokens_column = tokens_column
        self.call_kwargs = call_kwargs
        cpus, gpus = actor_resources()
        if device == "auto":
            device = "cuda" if gpus > 0 else "cpu"
        plan = plan_cpu(num_render_workers, device, cores=cpus)
        kwargs = dict(pipeline_kwargs or {})
        kwargs.setdefault("engine_threads", plan.engine_threads)
        self.pipe = Pipeline(model=model, num_render_workers=plan.render_workers, device=device, dtype=dtype,
                             **kwargs)
        # Closed when this object is collected or at a normal actor exit (a kill is covered by the
        # children's parent watchdog). The finalizer holds the Pipeline, not this object.
        self._finalizer = weakref.finalize(self, self.pipe.close)
        # The shape of one output (per token for token tasks), for the rows that fail.
        self.failed_row = None if task == "score" else self._failed_row()

    def _failed_row(self) -> np.ndarray:
        data = self._run(["probe"], None, use_tqdm=False, **self.call_kwargs)[0].data
        if self.task.startswith("token_"):
            return np.zeros((0, data.shape[-1]), dtype=np.float32)
        return np.full(data.shape, np.nan, dtype=np.float32)

    def _run(self, texts: list, pairs: list | None, **kwargs):
        if self.task == "score":
            return self.pipe.score(texts, pairs, **kwargs)
        if self.task == "embed":
            return self.pipe.embed(texts, **kwargs)
        if self.task == "classify":
            return self.pipe.classify(texts, **kwargs)
        return self.pipe.encode(texts, self.task, **kwargs)

    def __call__(self, batch):
        texts = _column(batch, self.text_column)
        pairs = _column(batch, self.pair_column) if self.task == "score" else None
        outs = self._run(texts, pairs, use_tqdm=False, errors=self.errors, **self.call_kwargs)
        if self.task == "score":
            values = np.array([o.score for o in outs], dtype=np.float32)
        else:
            arrays = [self.failed_row if o.error is not None else o.data for o in outs]
            values = _as_column(arrays, ragged=self.task.startswith("token_"))
        columns = {self.output_column: values}
        if self.tokens_column:
            columns[self.tokens_column] = np.array([o.num_prompt_tokens for o in outs], dtype=np.int64)
        if self.errors == "return":
            columns[ERROR_COLUMN] = np.array([o.error or "" for o in outs], dtype=object)
        return _with_columns(batch, columns)

    def close(self) -> None:
        self._finalizer()


def _column(batch, name: str) -> list:
    try:
        values = batch[name]
    except (KeyError, IndexError):
        have = list(batch.columns) if hasattr(batch, "columns") else list(batch)
        raise ValueError(f"the batch has no column {name!r} (it has {have})") from None
    return [v.item() if isinstance(v, np.generic) else v for v in values]


def _as_column(arrays: list[np.ndarray], ragged: bool) -> np.ndarray:
    """A 2-D array for vectors, one object per row for token tasks (their lengths differ)."""
    if not ragged and arrays:
        return np.stack(arrays)
    column = np.empty(len(arrays), dtype=object)
    for i, a in enumerate(arrays):
        column[i] = a
    return column


def _with_columns(batch, columns: dict[str, np.ndarray]):
    if hasattr(batch, "assign"):  # pandas
        batch = batch.copy()
        for name, values in columns.items():
            batch[name] = list(values) if values.ndim > 1 else values
        return batch
    out = dict(batch)
    out.update(columns)
    return out


def default_ray_init_kwargs(address: str, num_cpus: int | None = None) -> dict:
    """ray.init arguments: `local` starts a private instance on this machine (no dashboard,
    loopback only, `num_cpus` CPUs); anything else (e.g. `auto`) joins a running cluster."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # never phone home
    if address == "local":
        kwargs = {"address": "local", "include_dashboard": False, "_node_ip_address": "127.0.0.1",
                  "log_to_driver": False}
        if num_cpus is not None:
            kwargs["num_cpus"] = num_cpus
        return kwargs
    return {"address": address, "log_to_driver": False}
