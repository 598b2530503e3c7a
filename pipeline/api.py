"""The public Python API: `Pipeline` spawns the process group and runs calls through it."""

from __future__ import annotations

import itertools
import logging
import re
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from core.config import load_model_spec
from core.messages import PoolingParams
from pipeline.cpu_plan import plan_cpu
from pipeline.errors import EngineDeadError, PipelineError
from pipeline.call_stats import CallStats
from pipeline.frontend import Call
from pipeline.inputs import (CallOptions, as_prompt_iterable, build_requests, check_params, check_priority,
                             check_text, per_request)
from pipeline.outputs import ClassificationOutput, EmbeddingOutput, PoolingRequestOutput, ScoringOutput
from pipeline.process_group import ProcessGroup

log = logging.getLogger("pipeline")

DTYPE_ALIASES = {"auto": "auto", "float32": "float32", "float": "float32", "fp32": "float32",
                 "float16": "float16", "half": "float16", "fp16": "float16",
                 "bfloat16": "bfloat16", "bf16": "bfloat16"}
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
MAX_MESSAGE_ITEMS = 64


def _positive_int(name: str, value: object, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


class Pipeline:
    """A frontend (this object), N render worker processes and one engine-core process.

    Use it as a context manager, or call `close()`: either stops every process of the group.
    """

    def __init__(self, model: str | None = None, num_render_workers: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int | None = None, max_inflight: int | None = None,
                 device: str = "auto", dtype: str = "auto", *, engine_window: int | None = None,
                 engine_threads: int | None = None,
                 io_processor: str | None = None, trust_remote_code: bool = False,
                 startup_timeout_s: float = 300.0, heartbeat_timeout_s: float = 30.0, step_timeout_s: float = 600.0,
                 log_level: str = "WARNING") -> None:
        self._group: ProcessGroup | None = None
        _positive_int("num_render_workers", num_render_workers)
        _positive_int("max_num_seqs", max_num_seqs, allow_none=False)
        _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        _positive_int("max_inflight", max_inflight)
        if not isinstance(device, str) or not DEVICE_PATTERN.fullmatch(device):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        for name, value in (("startup_timeout_s", startup_timeout_s), ("heartbeat_timeout_s", heartbeat_timeout_s),
                            ("step_timeout_s", step_timeout_s)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if dtype not in DTYPE_ALIASES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_ALIASES)}, got {dtype!r}")
        self.model_spec = spec = load_model_spec(model, trust_remote_code=trust_remote_code)
        self.max_num_seqs = max_num_seqs
        if max_num_batched_tokens is not None and max_num_batched_tokens < spec.max_model_len:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} is below the model's "
                             f"max length {spec.max_model_len}: a long request could never be scheduled")
        # The engine's window is what it sorts by length to form batches: a wider one gives
        # tighter batches (on the 2-core CPU, 8 x max_num_seqs brings padding from 12% to 5% on
        # short sentences). The frontend keeps twice that in flight so the workers stay ahead
        # of the engine while finished results wait in the reorder buffer (inside the bound too).
        _positive_int("engine_window", engine_window)
        self.max_inflight = max_inflight or 16 * max_num_seqs
        self.engine_window = engine_window or max(1, self.max_inflight // 2)
        # Requests per message to a worker (and from it to the engine): per-message costs (a
        # socket round, a decode) are paid once per this many; 64 measured 12% faster than 16
        # with a tokenizer-bound load.
        self.batch_items = max(1, min(MAX_MESSAGE_ITEMS, max_num_seqs, self.engine_window))
        self._plugin = None
        if io_processor is not None:
            from workers.render import load_plugin

            self._plugin = load_plugin(io_processor)  # in the caller too, for post_process (errors early)
        _positive_int("engine_threads", engine_threads)
        self.cpu_plan = plan_cpu(num_render_workers, device, engine_threads=engine_threads)
        log.debug("CPU plan: %s", self.cpu_plan)
        self._lock = threading.Lock()
        self._call: Call | None = None
        self._last_stats = CallStats()
        self._ids = itertools.count()
        self._group = ProcessGroup(
            spec, num_workers=self.cpu_plan.render_workers, engine_threads=self.cpu_plan.engine_threads,
            device=device, dtype=DTYPE_ALIASES[dtype], max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, window=self.engine_window,
            max_message_items=self.batch_items, io_processor=io_processor, log_level=log_level,
            heartbeat_timeout_s=heartbeat_timeout_s, step_timeout_s=step_timeout_s)
        self._finalizer = weakref.finalize(self, ProcessGroup.close, self._group)
        try:
            self._group.wait_ready(startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self.num_special_tokens = int(self._group.worker_info.get("num_special_tokens", 0))

    # ---- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        if self._group is not None:
            self._finalizer()
            self._group = None

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> dict:
        return self._live_group().pids

    def _live_group(self) -> ProcessGroup:
        if self._group is None:
            raise PipelineError("this Pipeline is closed")
        return self._group

    # ---- calls -----------------------------------------------------------------------------

    def embed(self, prompts, pooling_params: ParamsArg = None, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, priority: PriorityArg = None, chat_template: str | None = None,
              long_inputs: str = "truncate", chunk_overlap: int = 0, truncation_side: str | None = None,
              errors: str = "raise") -> list[EmbeddingOutput]:
        """Embeds a prompt or a list of prompts; returns a list in input order.

        long_inputs: "truncate" (keep the first -- or with truncation_side="left" the last --
        tokens), "error" (a ValueError naming the request and its token count) or "chunk" (embed
        every window of the whole document, `chunk_overlap` tokens shared between neighbours, and
        pool them into one normalized, token-weighted mean; `.num_windows` says how many).

        errors: "raise" (the first bad request raises, naming it; everything else in flight is
        aborted) or "return" (a bad request's output has `.error` and no data; the others go on).
        """
        return self._collect(prompts, "embed", pooling_params, truncate_prompt_tokens, use_tqdm, priority,
                             chat_template, long_inputs, chunk_overlap, truncation_side, errors)

    def embed_stream(self, prompts: Iterable, pooling_params: ParamsArg = None,
                     truncate_prompt_tokens: int | None = None, use_tqdm: bool = False,
                     priority: PriorityArg = None, chat_template: str | None = None, long_inputs: str = "truncate",
                     chunk_overlap: int = 0, truncation_side: str | None = None,
                     errors: str = "raise") -> Iterator[EmbeddingOutput]:
        """Embeds any iterable (a generator of unknown length too), yielding in input order as
        results complete. Holds at most `max_inflight` requests at a time."""
        return self.encode_stream(prompts, "embed", pooling_params, truncate_prompt_tokens, use_tqdm,
                                  priority, chat_template, long_inputs, chunk_overlap, truncation_side, errors)

    def classify(self, prompts, pooling_params: ParamsArg = None, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True, priority: PriorityArg = None, chat_template: str | None = None,
                 long_inputs: str = "truncate", truncation_side: str | None = None,
                 errors: str = "raise") -> list[ClassificationOutput]:
        """Class probabilities (softmax, or sigmoid for single-label / multi-label heads) per prompt."""
        return self._collect(prompts, "classify", pooling_params, truncate_prompt_tokens, use_tqdm, priority,
                             chat_template, long_inputs, 0, truncation_side, errors)

    def encode(self, prompts, task: str | None = None, pooling_params: ParamsArg = None,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True, priority: PriorityArg = None,
               chat_template: str | None = None, long_inputs: str = "truncate", chunk_overlap: int = 0,
               truncation_side: str | None = None, errors: str = "raise") -> list:
        """Any task of the model: "embed", "classify", "token_embed", "token_classify", or "plugin"
        (the io_processor's render/post_process around the forward pass). Defaults to the model's first task."""
        return list(self.encode_stream(prompts, task, pooling_params, truncate_prompt_tokens, use_tqdm,
                                       priority, chat_template, long_inputs, chunk_overlap, truncation_side,
                                       errors, materialize=True))

    def encode_stream(self, prompts: Iterable, task: str | None = None, pooling_params: ParamsArg = None,
                      truncate_prompt_tokens: int | None = None, use_tqdm: bool = False,
                      priority: PriorityArg = None, chat_template: str | None = None,
                      long_inputs: str = "truncate", chunk_overlap: int = 0, truncation_side: str | None = None,
                      errors: str = "raise", materialize: bool = False) -> Iterator:
        task = task or self.model_spec.tasks[0]
        plugin = task == "plugin"
        engine_task = self._engine_task(task)
        items = as_prompt_iterable(prompts) if not plugin else _plugin_items(prompts)
        if materialize and not isinstance(items, (list, tuple)):
            items = list(items)
        total = len(items) if isinstance(items, (list, tuple)) else None
        wrap = OUTPUT_TYPES.get(engine_task, PoolingRequestOutput)
        render = self._render_options(engine_task, long_inputs, chunk_overlap, truncation_side, errors)
        requests = self._requests(items, engine_task, pooling_params, truncate_prompt_tokens, priority, plugin,
                                  render=render)
        if materialize:
            requests = iter(list(requests))  # a list is checked whole before any work starts
        outputs = (wrap(out.request_id, out.seq, out.data, out.num_prompt_tokens, max(out.num_windows, 1), out.error)
                   for out in self._run(requests, total, use_tqdm, chat_template, errors))
        return self._post_process(outputs) if plugin else outputs

    def score(self, data_1, data_2, pooling_params: ParamsArg = None, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, priority: PriorityArg = None, max_tokens_per_query: int | None = None,
              max_tokens_per_doc: int | None = None, errors: str = "raise") -> list[ScoringOutput]:
        """Scores query/document pairs: 1:1, 1:N (the single query against each document) or N:N.

        The kind follows the model: a cross-encoder (sequence-classification head with one label)
        reads each pair together; an embedding model gives the cosine similarity of the two
        embeddings (bi-encoder), or MaxSim over token embeddings for late-interaction models.
        """
        kind = self.model_spec.score_kind
        if kind is None:
            raise ValueError(f"this model cannot score; it can do {self.model_spec.tasks}")
        queries, docs = _score_side(data_1, "data_1"), _score_side(data_2, "data_2")
        if len(queries) != 1 and len(queries) != len(docs):
            raise ValueError(f"data_1 and data_2 must be 1:1, 1:N or N:N; got {len(queries)} and {len(docs)} items")
        for name, value in (("max_tokens_per_query", max_tokens_per_query), ("max_tokens_per_doc", max_tokens_per_doc)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if kind == "cross_encoder":
            return self._score_pairs(queries, docs, pooling_params, truncate_prompt_tokens, use_tqdm, priority,
                                     max_tokens_per_query, max_tokens_per_doc, errors)
        if isinstance(pooling_params, (list, tuple)):
            raise ValueError("per-pair pooling_params apply to cross-encoders only; give one PoolingParams")
        if max_tokens_per_query is not None or max_tokens_per_doc is not None:
            raise ValueError("max_tokens_per_query / max_tokens_per_doc apply to cross-encoders only; "
                             "use truncate_prompt_tokens")
        task = "embed" if kind == "bi_encoder" else "token_embed"
        outs = self.encode(list(queries) + list(docs), task, pooling_params, truncate_prompt_tokens, use_tqdm,
                           priority if not isinstance(priority, (list, tuple)) else None, errors=errors)
        q_outs, d_outs = outs[: len(queries)], outs[len(queries):]
        results = []
        for i, d in enumerate(d_outs):
            q = q_outs[0] if len(q_outs) == 1 else q_outs[i]
            error = q.error or d.error
            if error is not None:
                value = float("nan")
            else:
                value = _cosine(q.data, d.data) if kind == "bi_encoder" else _max_sim(q.data, d.data)
            results.append(ScoringOutput(f"{q.request_id}|{d.request_id}", i, value,
                                         q.num_prompt_tokens + d.num_prompt_tokens, error))
        return results

    def _score_pairs(self, queries, docs, pooling_params, truncate_prompt_tokens, use_tqdm, priority,
                     max_query, max_doc, errors) -> list[ScoringOutput]:
        pairs = [(queries[0] if len(queries) == 1 else queries[i], d) for i, d in enumerate(docs)]
        for i, (q, d) in enumerate(pairs):
            check_text(q, i, "query")
            check_text(d, i, "document")
        render = self._render_options("score", "truncate", 0, None, errors)
        requests = list(self._requests(pairs, "score", pooling_params, truncate_prompt_tokens, priority,
                                       max_query=max_query, max_doc=max_doc, render=render))
        return [ScoringOutput(out.request_id, out.seq, float(out.data[0]) if out.error is None else float("nan"),
                              out.num_prompt_tokens, out.error)
                for out in self._run(iter(requests), len(requests), use_tqdm, None, errors)]

    def stats(self) -> dict:
        """Counters of the last call (or the one running), plus the CPU plan and engine facts."""
        call = self._call
        stats = (call.stats if call is not None else self._last_stats).as_dict()
        stats["cpu_plan"] = self.cpu_plan.as_dict()
        if self._group is not None:
            stats["engine"] = dict(self._group.engine_info)
            stats["render"] = dict(self._group.worker_info)
        stats["max_inflight"] = self.max_inflight
        stats["engine_window"] = self.engine_window
        return stats

    # ---- internals ---------------------------------------------------------------------------

    def _engine_task(self, task: str) -> str:
        if task == "plugin":
            if self._plugin is None:
                raise ValueError("task 'plugin' needs Pipeline(io_processor='package.module:ClassName')")
            task = getattr(self._plugin, "task", "embed")
        if not isinstance(task, str) or task not in self.model_spec.tasks or task == "score":
            can = [t for t in self.model_spec.tasks if t != "score"] + (["plugin"] if self._plugin else [])
            raise ValueError(f"unknown or unsupported task {task!r}: this model can do {can}"
                             + (" and score() pairs" if "score" in self.model_spec.tasks else ""))
        return task

    def _collect(self, prompts, task, *args) -> list:
        self._engine_task(task)
        items = as_prompt_iterable(prompts)
        if not isinstance(items, (list, tuple)):
            items = list(items)
        if not items:
            return []
        return self.encode(items, task, *args)

    def _render_options(self, task: str, long_inputs: str, chunk_overlap: int, truncation_side: str | None,
                        errors: str = "raise") -> dict:
        if errors not in ("raise", "return"):
            raise ValueError(f"errors must be 'raise' or 'return', got {errors!r}")
        if long_inputs not in ("truncate", "error", "chunk"):
            raise ValueError(f"long_inputs must be 'truncate', 'error' or 'chunk', got {long_inputs!r}")
        if long_inputs == "chunk" and task != "embed":
            raise ValueError(f"long_inputs='chunk' pools windows into one embedding: it applies to 'embed', not {task!r}")
        if not isinstance(chunk_overlap, int) or isinstance(chunk_overlap, bool) or chunk_overlap < 0:
            raise ValueError(f"chunk_overlap must be a non-negative int, got {chunk_overlap!r}")
        side = truncation_side or str(self._group.worker_info.get("truncation_side", "right") if self._group else "right")
        if side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}")
        return {"truncate_left": side == "left", "long_inputs": long_inputs, "chunk_overlap": chunk_overlap,
                "errors": errors}

    def _requests(self, prompts, task, pooling_params, truncate_prompt_tokens, priority, plugin=False,
                  max_query=None, max_doc=None, render: dict | None = None):
        if truncate_prompt_tokens is not None and (not isinstance(truncate_prompt_tokens, int)
                                                   or isinstance(truncate_prompt_tokens, bool)):
            raise TypeError(f"truncate_prompt_tokens must be an int or None, got {truncate_prompt_tokens!r}")
        count = len(prompts) if isinstance(prompts, (list, tuple)) else None
        if pooling_params is not None and not isinstance(pooling_params, (PoolingParams, list, tuple)):
            raise TypeError(f"pooling_params must be a PoolingParams, a list of them or None, "
                            f"got {type(pooling_params).__name__}")
        params = per_request(PoolingParams() if pooling_params is None else pooling_params, "pooling_params",
                             lambda p, where: check_params(p, where, task, self.model_spec), count)
        priorities = per_request(0 if priority is None else priority, "priority", check_priority, count)
        opts = CallOptions(task, truncate_prompt_tokens, self.num_special_tokens, max_query, max_doc, plugin,
                           **(render or {}))
        return build_requests(iter(prompts), self.model_spec, opts, f"{next(self._ids)}-", params, priorities,
                              pairs=task == "score")

    def _post_process(self, outputs) -> Iterator:
        for out in outputs:
            if out.error is not None:
                yield out  # nothing to post-process: the error output itself
                continue
            try:
                yield self._plugin.post_process(out)
            except Exception as e:
                raise ValueError(f"request {out.index}: io_processor post_process failed: "
                                 f"{type(e).__name__}: {e}") from e

    def _run(self, requests, total: int | None, use_tqdm: bool, chat_template: str | None,
             errors: str = "raise") -> Iterator:
        group = self._live_group()
        with self._lock:
            if self._call is not None and not self._call.finished:
                # One call at a time: a newer call ends an unfinished stream (its generator was
                # abandoned or is being interleaved) rather than waiting on it forever.
                self._call.abort("this stream was ended because a newer call started on the same Pipeline "
                                 "(one call runs at a time)")
            progress = None
            if use_tqdm:
                from tqdm.auto import tqdm

                progress = tqdm(total=total, desc="Processed prompts", unit="docs", dynamic_ncols=True)
            call = self._call = Call(group, requests, max_inflight=self.max_inflight, batch_items=self.batch_items,
                                     progress=progress, chat_template=chat_template,
                                     default_normalize=self.model_spec.normalize, errors=errors)
        return self._results(call)

    def _results(self, call: Call) -> Iterator:
        try:
            yield from call.outputs()
        except EngineDeadError:
            self.close()  # the group cannot serve without its engine: stop the rest of it
            raise
        finally:
            self._last_stats = call.stats
            if self._call is call:
                self._call = None


ParamsArg = PoolingParams | Sequence[PoolingParams] | None
PriorityArg = int | Sequence[int] | None
OUTPUT_TYPES = {"embed": EmbeddingOutput, "classify": ClassificationOutput}


def _plugin_items(data) -> list | Iterable:
    """Plugin input: a list or other iterable of raw items, or a single item (a str or dict is one item)."""
    if data is None:
        raise TypeError("plugin data must be an item or a list of items, got None")
    if isinstance(data, (str, dict, bytes)) or not isinstance(data, Iterable):
        return [data]
    return data


def _score_side(data, name: str) -> list:
    if isinstance(data, str):
        return [data]
    if data is None or not isinstance(data, (list, tuple)):
        raise TypeError(f"{name} must be a str or a list of them, got {type(data).__name__}")
    if not data:
        raise ValueError(f"{name} is empty: score needs at least one query and one document")
    return list(data)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))


def _max_sim(query: np.ndarray, doc: np.ndarray) -> float:
    """Late interaction: for each query token the best-matching document token, summed."""
    return float((query @ doc.T).max(axis=1).sum())
