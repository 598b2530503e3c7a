"""The public Python API: `Pipeline` spawns the process group and runs calls through it.

Calls may come from several threads at once (each gets its own results, in its own order; the
in-flight bound holds for the group; a failure or abort of one call touches no other), and from
asyncio code through the `a...` methods (`aembed`, `aclassify`, `aencode`, `ascore`, `arank`,
and the async streams `aembed_stream` / `aencode_stream`), which never block the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Annotated, Literal

import msgspec
import numpy as np

from pooling_pipeline.call_stats import CallStats
from pooling_pipeline.core.messages import PoolingParams
from pooling_pipeline.core.model_layout import load_model_spec
from pooling_pipeline.core.options import PositiveInt, Seconds, checked
from pooling_pipeline.core.sim_device import resolve_sim_device
from pooling_pipeline.cpu_plan import engine_devices, plan_cpu
from pooling_pipeline.errors import EngineDeadError, PipelineError
from pooling_pipeline.frontend import Call, Dispatcher, new_call_prefix
from pooling_pipeline.inputs import CallOptions, Tokenization, build_requests, check_priority
from pooling_pipeline.outputs import ClassificationOutput, EmbeddingOutput, RankedDocument, ScoringOutput
from pooling_pipeline.process_group import ProcessGroup
from pooling_pipeline.similarity import similarity

log = logging.getLogger("pipeline")

DTYPE_ALIASES = {"auto": "auto", "float32": "float32", "float": "float32", "fp32": "float32",
                 "float16": "float16", "half": "float16", "fp16": "float16",
                 "bfloat16": "bfloat16", "bf16": "bfloat16"}
Dtype = Literal["auto", "float32", "float", "fp32", "float16", "half", "fp16", "bfloat16", "bf16"]
# "sim": the simulated accelerator (core/sim_device.py), a measurement instrument.
Device = Annotated[str, msgspec.Meta(pattern=r"^(auto|cpu|sim|cuda(:\d+)?)$")]
MAX_MESSAGE_ITEMS = 256
# An async call checks a list this long in a thread (a whole list is checked before any work
# starts; that must not hold the event loop).
ASYNC_INLINE_CHECK_ITEMS = 1024


class PipelineOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How the process group is shaped, checked once when a Pipeline is built."""

    num_render_workers: PositiveInt | None = None  # None: planned from the cores
    max_num_seqs: PositiveInt = 64  # most requests in one engine step
    max_num_batched_tokens: PositiveInt | None = None  # padded tokens in one step; None: by device
    max_inflight: PositiveInt | None = None  # requests issued and not yet handed back; None: 16 x max_num_seqs
    #                                            per engine core
    device: Device = "auto"
    dtype: Dtype = "auto"
    engine_window: PositiveInt | None = None  # requests admitted in each engine core; None: 8 x max_num_seqs
    engine_threads: PositiveInt | None = None  # torch threads of each CPU engine core; None: planned
    data_parallel_size: PositiveInt = 1  # engine cores on this machine, fed by the same render workers
    io_processor: str | None = None
    trust_remote_code: bool = False
    startup_timeout_s: Seconds = 300.0
    heartbeat_timeout_s: Seconds = 30.0
    step_timeout_s: Seconds = 600.0
    log_level: str = "WARNING"


class Pipeline:
    """A frontend (this object), N render worker processes and one engine-core process (or
    `data_parallel_size` of them, each on its own device: cuda:k, or a share of the CPU threads).

    Use it as a context manager, or call `close()`: either stops every process of the group.
    """

    def __init__(self, model: str | None = None, num_render_workers: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int | None = None, max_inflight: int | None = None,
                 device: str = "auto", dtype: str = "auto", *, engine_window: int | None = None,
                 engine_threads: int | None = None,
                 io_processor: str | None = None, trust_remote_code: bool = False, revision: str | None = None,
                 sim_device=None, startup_timeout_s: float = 300.0, heartbeat_timeout_s: float = 30.0,
                 step_timeout_s: float = 600.0, log_level: str = "WARNING", data_parallel_size: int = 1) -> None:
        self._group: ProcessGroup | None = None
        opts = checked(PipelineOptions, {
            "num_render_workers": num_render_workers, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "max_inflight": max_inflight, "device": device,
            "dtype": dtype, "engine_window": engine_window, "engine_threads": engine_threads,
            "io_processor": io_processor, "trust_remote_code": trust_remote_code,
            "startup_timeout_s": startup_timeout_s, "heartbeat_timeout_s": heartbeat_timeout_s,
            "step_timeout_s": step_timeout_s, "log_level": log_level, "data_parallel_size": data_parallel_size})
        if sim_device is not None and device != "sim":
            raise ValueError("sim_device applies to device='sim' (the simulated accelerator)")
        sim = resolve_sim_device(sim_device) if device == "sim" else None
        self.data_parallel_size = engines = opts.data_parallel_size
        devices = engine_devices(device, engines)  # engine core k: cuda:k, or the CPU, or its own sim device
        self.model_spec = spec = load_model_spec(model, trust_remote_code=trust_remote_code, revision=revision)
        self.max_num_seqs = max_num_seqs
        if max_num_batched_tokens is not None and max_num_batched_tokens < spec.max_model_len:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} is below the model's "
                             f"max length {spec.max_model_len}: a long request could never be scheduled")
        # The engine's window is what it sorts by length to form batches: a wider one gives
        # tighter batches (on the 2-core CPU, 8 x max_num_seqs brings padding from 12% to 5% on
        # short sentences). The frontend keeps twice that in flight so the workers stay ahead
        # of the engine while finished results wait in the reorder buffer (inside the bound too);
        # with several engine cores, twice all their windows.
        self.max_inflight = max_inflight or 16 * max_num_seqs * engines
        self.engine_window = engine_window or max(1, self.max_inflight // (2 * engines))
        # Requests per message to a worker (and from it to the engine): per-message costs (a
        # socket round, a decode, a thread's wake-up and its GIL hand-offs) are paid once per this
        # many. 64 measured 12% faster than 16 with a tokenizer-bound load; with a fast device
        # (max_num_seqs=256, the simulated H100) messages of 256 cut the engine's input thread
        # from ~1.8 to ~0.9 us a request.
        self.batch_items = max(1, min(MAX_MESSAGE_ITEMS, max_num_seqs, self.engine_window))
        self._plugin = None
        if io_processor is not None:
            from pooling_pipeline.workers.render import load_plugin

            self._plugin = load_plugin(io_processor)  # in the caller too, for post_process (errors early)
        self.cpu_plan = plan_cpu(num_render_workers, devices[0] if engines > 1 else device,
                                 engine_threads=engine_threads, data_parallel_size=engines)
        log.debug("CPU plan: %s", self.cpu_plan)
        self._local = threading.local()  # per thread: its running call and its last call's stats
        self._last_stats = CallStats()  # the last call of any thread
        self._group = ProcessGroup(
            spec, num_workers=self.cpu_plan.render_workers, engine_threads=self.cpu_plan.engine_threads,
            device=device, dtype=DTYPE_ALIASES[dtype], max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, window=self.engine_window,
            max_message_items=self.batch_items, io_processor=io_processor, log_level=log_level,
            heartbeat_timeout_s=opts.heartbeat_timeout_s, step_timeout_s=opts.step_timeout_s,
            data_parallel_size=engines, engine_devices=devices, **({"sim": sim} if sim is not None else {}))
        try:
            self._dispatcher = Dispatcher(self._group, max_inflight=self.max_inflight, batch_items=self.batch_items)
        except BaseException:
            self._group.close()
            raise
        # Closes the group when this object is collected or the interpreter exits (in the process
        # that created it only: a forked child's exit leaves its parent's group alone).
        self._finalizer = weakref.finalize(self, Dispatcher.close, self._dispatcher)
        try:
            self._group.wait_ready(opts.startup_timeout_s)
            self._dispatcher.start()
        except BaseException:
            self.close()
            raise
        info = self._group.worker_info
        self._tokenization = Tokenization(num_special_tokens=int(info.get("num_special_tokens", 0)),
                                          truncation_side=str(info.get("truncation_side", "right")))

    # ---- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        if self._group is not None:
            self._finalizer()
            self._group = None

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> dict:
        return self._live_group().pids

    def _live_group(self) -> ProcessGroup:
        group = self._group
        if group is None:
            raise PipelineError("this Pipeline is closed")
        if os.getpid() != group.owner_pid:
            raise PipelineError(f"this Pipeline belongs to process {group.owner_pid} and cannot be used in a forked "
                                f"child (pid {os.getpid()}): create a new Pipeline in the child")
        return group

    # ---- calls -----------------------------------------------------------------------------

    def embed(self, prompts, pooling_params: ParamsArg = None, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, priority: PriorityArg = None, chat_template: str | None = None,
              long_inputs: str = "truncate", chunk_overlap: int = 0, truncation_side: str | None = None,
              errors: str = "raise", prompt_name: PromptArg = None, prompt: PromptArg = None) -> list[EmbeddingOutput]:
        """Embeds a prompt or a list of prompts; returns a list in input order.

        long_inputs: "truncate" (keep the first -- or with truncation_side="left" the last --
        tokens), "error" (a ValueError naming the request and its token count) or "chunk" (embed
        every chunk of the whole document, `chunk_overlap` tokens shared between neighbours, and
        pool them into one normalized, token-weighted mean; `.num_chunks` says how many).

        errors: "raise" (the first bad request raises, naming it; everything else in flight is
        aborted) or "return" (a bad request's output has `.error` and no data; the others go on).
        """
        opts = self._options("embed", pooling_params=pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                             use_tqdm=use_tqdm, priority=priority, chat_template=chat_template,
                             long_inputs=long_inputs, chunk_overlap=chunk_overlap, truncation_side=truncation_side,
                             errors=errors, prompt_name=prompt_name, prompt=prompt)
        return list(self._stream(prompts, opts, materialize=True))

    def embed_stream(self, prompts: Iterable, pooling_params: ParamsArg = None,
                     truncate_prompt_tokens: int | None = None, use_tqdm: bool = False,
                     priority: PriorityArg = None, chat_template: str | None = None, long_inputs: str = "truncate",
                     chunk_overlap: int = 0, truncation_side: str | None = None,
                     errors: str = "raise", prompt_name: PromptArg = None,
                     prompt: PromptArg = None) -> Iterator[EmbeddingOutput]:
        """Embeds any iterable (a generator of unknown length too), yielding in input order as
        results complete. Holds at most `max_inflight` requests at a time."""
        opts = self._options("embed", pooling_params=pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                             use_tqdm=use_tqdm, priority=priority, chat_template=chat_template,
                             long_inputs=long_inputs, chunk_overlap=chunk_overlap, truncation_side=truncation_side,
                             errors=errors, prompt_name=prompt_name, prompt=prompt)
        return self._stream(prompts, opts)

    def classify(self, prompts, pooling_params: ParamsArg = None, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True, priority: PriorityArg = None, chat_template: str | None = None,
                 long_inputs: str = "truncate", truncation_side: str | None = None,
                 errors: str = "raise", prompt_name: PromptArg = None,
                 prompt: PromptArg = None) -> list[ClassificationOutput]:
        """Class probabilities (softmax, or sigmoid for single-label / multi-label heads) per prompt."""
        opts = self._options("classify", pooling_params=pooling_params,
                             truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm, priority=priority,
                             chat_template=chat_template, long_inputs=long_inputs, truncation_side=truncation_side,
                             errors=errors, prompt_name=prompt_name, prompt=prompt)
        return list(self._stream(prompts, opts, materialize=True))

    def encode(self, prompts, task: str | None = None, pooling_params: ParamsArg = None,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True, priority: PriorityArg = None,
               chat_template: str | None = None, long_inputs: str = "truncate", chunk_overlap: int = 0,
               truncation_side: str | None = None, errors: str = "raise", prompt_name: PromptArg = None,
               prompt: PromptArg = None) -> list:
        """Any task of the model: "embed", "classify", "token_embed", "token_classify", or "plugin"
        (the io_processor's render/post_process around the forward pass). Defaults to the model's first task."""
        opts = self._options(task, pooling_params=pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                             use_tqdm=use_tqdm, priority=priority, chat_template=chat_template,
                             long_inputs=long_inputs, chunk_overlap=chunk_overlap, truncation_side=truncation_side,
                             errors=errors, prompt_name=prompt_name, prompt=prompt)
        return list(self._stream(prompts, opts, materialize=True))

    def encode_stream(self, prompts: Iterable, task: str | None = None, pooling_params: ParamsArg = None,
                      truncate_prompt_tokens: int | None = None, use_tqdm: bool = False,
                      priority: PriorityArg = None, chat_template: str | None = None,
                      long_inputs: str = "truncate", chunk_overlap: int = 0, truncation_side: str | None = None,
                      errors: str = "raise", prompt_name: PromptArg = None, prompt: PromptArg = None) -> Iterator:
        """`encode` as a stream over any iterable, in input order, with bounded memory."""
        opts = self._options(task, pooling_params=pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                             use_tqdm=use_tqdm, priority=priority, chat_template=chat_template,
                             long_inputs=long_inputs, chunk_overlap=chunk_overlap, truncation_side=truncation_side,
                             errors=errors, prompt_name=prompt_name, prompt=prompt)
        return self._stream(prompts, opts)

    def score(self, data_1, data_2, pooling_params: ParamsArg = None, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, priority: PriorityArg = None, max_tokens_per_query: int | None = None,
              max_tokens_per_doc: int | None = None, errors: str = "raise", prompt_name: PromptArg = None,
              prompt: PromptArg = None) -> list[ScoringOutput]:
        """Scores query/document pairs: 1:1, 1:N (the single query against each document) or N:N.

        The kind follows the model: a cross-encoder (sequence-classification head with one label)
        reads each pair together, with the activation ST's CrossEncoder applies; an embedding model
        gives its similarity function (ST's similarity_fn_name, cosine by default) of the two
        embeddings (bi-encoder), or MaxSim over token embeddings for late-interaction models.
        """
        prompts, opts, finish = self._score_plan(
            data_1, data_2, pooling_params=pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm, priority=priority, max_tokens_per_query=max_tokens_per_query,
            max_tokens_per_doc=max_tokens_per_doc, errors=errors, prompt_name=prompt_name, prompt=prompt)
        return finish(list(self._stream(prompts, opts, materialize=True)))

    def rank(self, query: str, documents: Sequence[str], top_k: int | None = None, **score_options
             ) -> list[RankedDocument]:
        """The documents ordered by their score against the query, best first, as
        `(index, score)` pairs (ST's `CrossEncoder.rank`); `top_k` keeps the best k.
        Other keyword arguments go to `score`."""
        _check_rank(query, top_k)
        return _ranked(self.score(query, list(documents), **score_options), top_k)

    # ---- async variants: the same calls for asyncio code --------------------------------------

    async def aembed(self, prompts, pooling_params: ParamsArg = None, truncate_prompt_tokens: int | None = None,
                     use_tqdm: bool = False, priority: PriorityArg = None, chat_template: str | None = None,
                     long_inputs: str = "truncate", chunk_overlap: int = 0, truncation_side: str | None = None,
                     errors: str = "raise", prompt_name: PromptArg = None,
                     prompt: PromptArg = None) -> list[EmbeddingOutput]:
        """`embed` for asyncio code: awaits the results without blocking the event loop; other
        calls (threads, coroutines) run at the same time. Cancelling the task aborts this call only."""
        opts = self._options("embed", pooling_params=pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                             use_tqdm=use_tqdm, priority=priority, chat_template=chat_template,
                             long_inputs=long_inputs, chunk_overlap=chunk_overlap, truncation_side=truncation_side,
                             errors=errors, prompt_name=prompt_name, prompt=prompt)
        return [out async for out in self._astream(prompts, opts, materialize=True)]

    def aembed_stream(self, prompts: Iterable, pooling_params: ParamsArg = None,
                      truncate_prompt_tokens: int | None = None, use_tqdm: bool = False,
                      priority: PriorityArg = None, chat_template: str | None = None, long_inputs: str = "truncate",
                      chunk_overlap: int = 0, truncation_side: str | None = None,
                      errors: str = "raise", prompt_name: PromptArg = None,
                      prompt: PromptArg = None) -> AsyncIterator[EmbeddingOutput]:
        """`embed_stream` as an async iterator (`async for out in pipe.aembed_stream(texts)`):
        lazy, in input order, bounded; leaving the loop early aborts what is still in flight."""
        opts = self._options("embed", pooling_params=pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                             use_tqdm=use_tqdm, priority=priority, chat_template=chat_template,
                             long_inputs=long_inputs, chunk_overlap=chunk_overlap, truncation_side=truncation_side,
                             errors=errors, prompt_name=prompt_name, prompt=prompt)
        return self._astream(prompts, opts)

    async def aclassify(self, prompts, pooling_params: ParamsArg = None, truncate_prompt_tokens: int | None = None,
                        use_tqdm: bool = False, priority: PriorityArg = None, chat_template: str | None = None,
                        long_inputs: str = "truncate", truncation_side: str | None = None,
                        errors: str = "raise", prompt_name: PromptArg = None,
                        prompt: PromptArg = None) -> list[ClassificationOutput]:
        """`classify` for asyncio code."""
        opts = self._options("classify", pooling_params=pooling_params,
                             truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm, priority=priority,
                             chat_template=chat_template, long_inputs=long_inputs, truncation_side=truncation_side,
                             errors=errors, prompt_name=prompt_name, prompt=prompt)
        return [out async for out in self._astream(prompts, opts, materialize=True)]

    async def aencode(self, prompts, task: str | None = None, pooling_params: ParamsArg = None,
                      truncate_prompt_tokens: int | None = None, use_tqdm: bool = False, priority: PriorityArg = None,
                      chat_template: str | None = None, long_inputs: str = "truncate", chunk_overlap: int = 0,
                      truncation_side: str | None = None, errors: str = "raise", prompt_name: PromptArg = None,
                      prompt: PromptArg = None) -> list:
        """`encode` for asyncio code."""
        opts = self._options(task, pooling_params=pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                             use_tqdm=use_tqdm, priority=priority, chat_template=chat_template,
                             long_inputs=long_inputs, chunk_overlap=chunk_overlap, truncation_side=truncation_side,
                             errors=errors, prompt_name=prompt_name, prompt=prompt)
        return [out async for out in self._astream(prompts, opts, materialize=True)]

    def aencode_stream(self, prompts: Iterable, task: str | None = None, pooling_params: ParamsArg = None,
                       truncate_prompt_tokens: int | None = None, use_tqdm: bool = False,
                       priority: PriorityArg = None, chat_template: str | None = None,
                       long_inputs: str = "truncate", chunk_overlap: int = 0, truncation_side: str | None = None,
                       errors: str = "raise", prompt_name: PromptArg = None,
                       prompt: PromptArg = None) -> AsyncIterator:
        """`encode_stream` as an async iterator."""
        opts = self._options(task, pooling_params=pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                             use_tqdm=use_tqdm, priority=priority, chat_template=chat_template,
                             long_inputs=long_inputs, chunk_overlap=chunk_overlap, truncation_side=truncation_side,
                             errors=errors, prompt_name=prompt_name, prompt=prompt)
        return self._astream(prompts, opts)

    async def ascore(self, data_1, data_2, pooling_params: ParamsArg = None,
                     truncate_prompt_tokens: int | None = None, use_tqdm: bool = False, priority: PriorityArg = None,
                     max_tokens_per_query: int | None = None, max_tokens_per_doc: int | None = None,
                     errors: str = "raise", prompt_name: PromptArg = None,
                     prompt: PromptArg = None) -> list[ScoringOutput]:
        """`score` for asyncio code."""
        prompts, opts, finish = self._score_plan(
            data_1, data_2, pooling_params=pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm, priority=priority, max_tokens_per_query=max_tokens_per_query,
            max_tokens_per_doc=max_tokens_per_doc, errors=errors, prompt_name=prompt_name, prompt=prompt)
        return finish([out async for out in self._astream(prompts, opts, materialize=True)])

    async def arank(self, query: str, documents: Sequence[str], top_k: int | None = None, **score_options
                    ) -> list[RankedDocument]:
        """`rank` for asyncio code."""
        _check_rank(query, top_k)
        return _ranked(await self.ascore(query, list(documents), **score_options), top_k)

    def stats(self) -> dict:
        """Counters of this thread's last call (or the one it runs; from a thread that ran none,
        the last call of any thread), plus the CPU plan, engine facts and the group's counters
        (`stats()["group"]`: requests in flight over all calls and their peak, calls running,
        worker restarts, outputs of ended calls dropped, ...). With several engine cores,
        `engine_busy_fraction` is the mean over them, `per_engine` has each one's share of the
        call, `engine` is the first engine core's facts and `engine_cores` every one's."""
        call = getattr(self._local, "call", None)
        if call is not None and not call.finished:
            stats = call.stats.as_dict()
        else:
            stats = getattr(self._local, "last_stats", self._last_stats).as_dict()
        stats["cpu_plan"] = self.cpu_plan.as_dict()
        if self._group is not None:
            stats["engine"] = dict(self._group.engine_info)
            stats["engine_cores"] = [dict(info) for info in self._group.engine_infos]
            stats["render"] = dict(self._group.worker_info)
            stats["group"] = self._dispatcher.stats()
        stats["max_inflight"] = self.max_inflight
        stats["engine_window"] = self.engine_window
        return stats

    # ---- one call's path: options -> requests -> Call -> outputs ----------------------------

    def _options(self, task: str | None, pairs: bool = False, **values) -> CallOptions:
        """The call's options, checked once; `task` resolved to what the engine runs. Pair scoring
        (task "score") is reached through `score()` only."""
        task = task or self.model_spec.tasks[0]
        plugin = task == "plugin"
        if plugin:
            if self._plugin is None:
                raise ValueError("task 'plugin' needs Pipeline(io_processor='package.module:ClassName')")
            task = getattr(self._plugin, "task", "embed")
        if not isinstance(task, str) or task not in self.model_spec.tasks or (task == "score") != pairs:
            can = [t for t in self.model_spec.tasks if t != "score"] + (["plugin"] if self._plugin else [])
            raise ValueError(f"unknown or unsupported task {task!r}: this model can do {can}"
                             + (" and score() pairs" if "score" in self.model_spec.tasks else ""))
        return checked(CallOptions, {"task": task, "plugin": plugin, "pairs": pairs, **values})

    def _score_plan(self, data_1, data_2, **values) -> tuple[list, CallOptions, Callable[[list], list[ScoringOutput]]]:
        """What `score` sends (prompts, options) and how its outputs become scores."""
        kind = self.model_spec.score_kind
        if kind is None:
            spec = self.model_spec
            if spec.head == "sequence_classification":
                raise ValueError(f"this classifier has {spec.num_labels} labels: score() needs a one-label "
                                 "cross-encoder (ST's CrossEncoder.predict would give the raw logits of every "
                                 "label); use classify() for its class probabilities")
            raise ValueError(f"this model cannot score; it can do {spec.tasks}")
        queries, docs = _score_side(data_1, "data_1"), _score_side(data_2, "data_2")
        if len(queries) != 1 and len(queries) != len(docs):
            raise ValueError(f"data_1 and data_2 must be 1:1, 1:N or N:N; got {len(queries)} and {len(docs)} items")
        if kind == "cross_encoder":
            opts = self._options("score", pairs=True, **values)
            pairs = [(queries[0] if len(queries) == 1 else queries[i], d) for i, d in enumerate(docs)]

            def cross(outs: list) -> list[ScoringOutput]:
                return [ScoringOutput(out.request_id, out.index,
                                      float(out.data[0]) if out.error is None else float("nan"),
                                      out.num_prompt_tokens, out.error) for out in outs]
            return pairs, opts, cross
        if isinstance(values["pooling_params"], (list, tuple)):
            raise ValueError("per-pair pooling_params apply to cross-encoders only; give one PoolingParams")
        if values.pop("max_tokens_per_query") is not None or values.pop("max_tokens_per_doc") is not None:
            raise ValueError("max_tokens_per_query / max_tokens_per_doc apply to cross-encoders only; "
                             "use truncate_prompt_tokens")
        if isinstance(values["priority"], (list, tuple)):
            values["priority"] = None
        opts = self._options("embed" if kind == "bi_encoder" else "token_embed", **values)
        similarity_fn = self.model_spec.similarity

        def pairwise(outs: list) -> list[ScoringOutput]:
            q_outs, d_outs = outs[: len(queries)], outs[len(queries):]
            results = []
            for i, d in enumerate(d_outs):
                q = q_outs[0] if len(q_outs) == 1 else q_outs[i]
                error = q.error or d.error
                if error is not None:
                    value = float("nan")
                else:
                    value = similarity(similarity_fn, q.data, d.data) if kind == "bi_encoder" \
                        else _max_sim(q.data, d.data)
                results.append(ScoringOutput(f"{q.request_id}|{d.request_id}", i, value,
                                             q.num_prompt_tokens + d.num_prompt_tokens, error))
            return results
        return list(queries) + list(docs), opts, pairwise

    def _requests(self, prompts, opts: CallOptions, materialize: bool):
        """The call's id and its requests, lazily (with how many when known). `materialize`:
        a list call, checked whole before any work starts."""
        self._live_group()
        refused: dict[int, str] = {}
        if opts.errors == "return" and isinstance(opts.priority, (list, tuple)):
            # errors="return": a bad priority fails its request only (an error output naming it).
            priorities = list(opts.priority)
            for i, value in enumerate(priorities):
                try:
                    check_priority(value, f"priority[{i}]")
                except (TypeError, ValueError) as e:
                    refused[i] = str(e)
                    priorities[i] = 0
            if refused:
                opts = msgspec.structs.replace(opts, priority=priorities)
        prefix = new_call_prefix()
        source, total = build_requests(prompts, opts, self.model_spec, self._tokenization, prefix, refused)
        return prefix, source, total

    def _call(self, prefix: str, source, opts: CallOptions, total: int | None,
              loop: asyncio.AbstractEventLoop | None = None, materialize: bool = False) -> Call:
        progress = None
        if opts.use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=total, desc="Processed prompts", unit="docs", dynamic_ncols=True)
        call = Call(self._dispatcher, prefix, source, opts, progress=progress,
                    default_normalize=self.model_spec.normalize, loop=loop, keep_all=materialize)
        self._local.call = call
        return call

    def _stream(self, prompts, opts: CallOptions, materialize: bool = False) -> Iterator:
        """Builds the call's requests, runs them through the group, yields wrapped outputs in order."""
        prefix, source, total = self._requests(prompts, opts, materialize)
        if materialize:
            source = source.drain(self._dispatcher.batch_items)  # a list is checked whole before any work starts
        call = self._call(prefix, source, opts, total, materialize=materialize)
        outputs = self._outputs(call)
        return self._post_process(outputs) if opts.plugin else outputs

    def _outputs(self, call: Call) -> Iterator:
        try:
            yield from call.outputs()
        except EngineDeadError:
            self.close()  # the group cannot serve without its engine: stop the rest of it
            raise
        finally:
            self._ended(call)

    async def _astream(self, prompts, opts: CallOptions, materialize: bool = False) -> AsyncIterator:
        """`_stream` on the caller's event loop."""
        prefix, source, total = self._requests(prompts, opts, materialize)
        if materialize:  # checked whole before any work starts; a long list in a thread
            items = self._dispatcher.batch_items
            if total is not None and total <= ASYNC_INLINE_CHECK_ITEMS:
                source = source.drain(items)
            else:
                source = await asyncio.to_thread(source.drain, items)
        call = self._call(prefix, source, opts, total, loop=asyncio.get_running_loop(), materialize=materialize)
        try:
            async for result in call.aoutputs():
                yield self._post_process_one(result) if opts.plugin else result
        except EngineDeadError:
            self.close()
            raise
        finally:
            self._ended(call)

    def _ended(self, call: Call) -> None:
        self._last_stats = call.stats
        self._local.last_stats = call.stats
        if getattr(self._local, "call", None) is call:
            self._local.call = None  # (it holds the caller's input iterator)

    def _post_process(self, outputs) -> Iterator:
        for out in outputs:
            yield self._post_process_one(out)

    def _post_process_one(self, out):
        if out.error is not None:
            return out  # nothing to post-process: the error output itself
        try:
            return self._plugin.post_process(out)
        except Exception as e:
            raise ValueError(f"request {out.index}: io_processor post_process failed: "
                             f"{type(e).__name__}: {e}") from e


def _check_rank(query, top_k) -> None:
    if not isinstance(query, str):
        raise TypeError(f"query must be a str, got {type(query).__name__}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")


def _ranked(scores: list[ScoringOutput], top_k: int | None) -> list[RankedDocument]:
    ranked = sorted((RankedDocument(s.index, s.score) for s in scores), key=lambda r: -r.score)
    return ranked[:top_k] if top_k is not None else ranked


ParamsArg = PoolingParams | Sequence[PoolingParams] | None
PromptArg = str | Sequence[str | None] | None
PriorityArg = int | Sequence[int] | None


def _score_side(data, name: str) -> list:
    if isinstance(data, str):
        return [data]
    if data is None or not isinstance(data, (list, tuple)):
        raise TypeError(f"{name} must be a str or a list of them, got {type(data).__name__}")
    if not data:
        raise ValueError(f"{name} is empty: score needs at least one query and one document")
    return list(data)


def _max_sim(query: np.ndarray, doc: np.ndarray) -> float:
    """Late interaction: for each query token the best-matching document token, summed."""
    return float((query @ doc.T).max(axis=1).sum())
