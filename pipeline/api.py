"""The public Python API: `Pipeline` spawns the process group and runs calls through it.

Calls may come from several threads at once (each gets its own results, in its own order; the
in-flight bound holds for the group; a failure or abort of one call touches no other), and from
asyncio code through the `a...` methods (`aembed`, `aclassify`, `aencode`, `ascore`, `arank`,
and the async streams `aembed_stream` / `aencode_stream`), which never block the event loop.

The options of the constructor and of the calls are declared once, in `options.py`; each method
here names only its own arguments (`prompts`, `task`, ...) and says what its call sends (a
`_Plan`: prompts, checked `CallOptions`, how outputs become results). `_call_method` turns that into the
public method -- signature, docstring and binding from the declaration -- and `_async_twin` into
its asyncio twin, so the sync and async methods cannot drift apart.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from pooling_pipeline.backends import describe_backend, describe_checkpoint_precision, describe_faster_precision
from pooling_pipeline.call_stats import CallStats
from pooling_pipeline.core.families import family_of
from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.model_folder.load import load_model_spec
from pooling_pipeline.core.shared.options import checked
from pooling_pipeline.core.shared.sim_device import resolve_sim_device
from pooling_pipeline.cpu_plan import default_max_num_seqs, engine_devices, plan_cpu
from pooling_pipeline.errors import EngineDeadError, EngineRestartedError, PipelineError
from pooling_pipeline.frontend import Call, Dispatcher, new_call_prefix
from pooling_pipeline.frontend.call import ResultStream
from pooling_pipeline.inputs import Tokenization, build_requests
from pooling_pipeline.options import (
    CALL_OPTIONS,
    DTYPE_ALIASES,
    MAX_ENGINE_WINDOW,
    MAX_INFLIGHT,
    PIPELINE_POSITIONAL,
    CallOptions,
    OptionsSignature,
    PipelineOptions,
    takes_options,
)
from pooling_pipeline.outputs import RankedDocument, ScoringOutput
from pooling_pipeline.process_group import GroupPlan, ProcessGroup
from pooling_pipeline.request_options import refused_entries
from pooling_pipeline.similarity import similarity

log = logging.getLogger("pipeline")
_said_once: dict[str, bool] = {}  # notices a process is told once, not at every start

MAX_MESSAGE_ITEMS = 256
# An async call checks a list this long in a thread (a whole list is checked before any work
# starts; that must not hold the event loop).
ASYNC_INLINE_CHECK_ITEMS = 1024


class _Plan(NamedTuple):
    """What one call sends and how its outputs (in input order) become what it returns."""

    prompts: Any
    opts: CallOptions
    finish: Callable[[list], list] | None = None


def _call_method(options: str, returns: str | None = None, *, stream: bool = False, positional: int | None = None):
    """The public method made of `plan(self, own arguments..., **options) -> _Plan`: it takes the
    options of `CALL_OPTIONS[options]` (declared in options.py) and runs the plan as a list call
    (checked whole before any work starts) or, with `stream`, as a lazy stream. `returns`: the
    type of one result. A progress bar by default for a list call only."""
    def make(plan: Callable[..., _Plan]) -> Callable:
        return _method(plan, options, returns, stream, positional, asynchronous=False, doc=plan.__doc__)
    return make


def _async_twin(method: Callable, doc: str) -> Callable:
    """The asyncio twin of a method made by `_call_method`: the same arguments and plan, awaited (a
    list call) or an async iterator (a stream); no progress bar by default."""
    plan, options, returns, stream, positional = method._plan
    return _method(plan, options, returns, stream, positional, asynchronous=True, doc=doc)


def _method(plan: Callable, options: str, returns: str | None, stream: bool, positional: int | None,
            asynchronous: bool, doc: str | None) -> Callable:
    owner, _, name = plan.__qualname__.rpartition(".")
    name = "a" + name if asynchronous else name
    shape = ("AsyncIterator" if asynchronous else "Iterator") if stream else "list"
    sig = OptionsSignature(plan, CallOptions, CALL_OPTIONS[options], positional=positional,
                           defaults=None if not (stream or asynchronous) else {"use_tqdm": False},
                           returns=f"{shape}[{returns}]" if returns else shape, qualname=f"{owner}.{name}")
    if stream and not asynchronous:
        def method(*args, **kwargs):
            own, values = sig.bind(args, kwargs)
            call = plan(*own, **values)
            return own[0]._stream(call.prompts, call.opts)
    elif stream:
        def method(*args, **kwargs):  # checked now; the async iterator does the rest
            own, values = sig.bind(args, kwargs)
            call = plan(*own, **values)
            return own[0]._abortable_astream(call.prompts, call.opts)
    elif not asynchronous:
        def method(*args, **kwargs):
            own, values = sig.bind(args, kwargs)
            call = plan(*own, **values)
            outs = list(own[0]._stream(call.prompts, call.opts, materialize=True))
            return call.finish(outs) if call.finish else outs
    else:
        async def method(*args, **kwargs):
            own, values = sig.bind(args, kwargs)
            call = plan(*own, **values)
            outs = await own[0]._acollect(call.prompts, call.opts)
            return call.finish(outs) if call.finish else outs
    method.__module__ = plan.__module__
    method.__wrapped__ = plan
    method._plan = (plan, options, returns, stream, positional)
    return sig.dress(method, doc, name)


class Pipeline:
    """A frontend (this object), N render worker processes and one engine-core process (or
    `data_parallel_size` of them, each on its own device: cuda:k, or a share of the CPU threads).

    Use it as a context manager, or call `close()`: either stops every process of the group.
    """

    @takes_options(PipelineOptions, positional=PIPELINE_POSITIONAL)
    def __init__(self, model: str | os.PathLike | ModelSpec | None = None, **options) -> None:
        """`model`: None (the bundled all-MiniLM-L6-v2), a local model directory, or a hub id
        "org/name" (with `revision`) resolved through the Hugging Face cache; or a `ModelSpec` a
        caller read already with `load_model_spec` (as `pipeline-run` does), used as it is."""
        self._group: ProcessGroup | None = None
        opts = checked(PipelineOptions, options)
        device, engines = opts.device, opts.data_parallel_size
        max_num_seqs = opts.max_num_seqs or default_max_num_seqs(device)
        if opts.sim_device is not None and device != "sim":
            raise ValueError("sim_device applies to device='sim' (the simulated accelerator)")
        sim = resolve_sim_device(opts.sim_device) if device == "sim" else None
        self.data_parallel_size = engines
        devices = engine_devices(device, engines)  # engine core k: cuda:k, or the CPU, or its own sim device
        self.model_spec = spec = _model_spec(model, opts)
        self.max_num_seqs = max_num_seqs
        longest = family_of(spec).longest_input(spec)  # (the most tokens one request puts through a transformer)
        if opts.max_num_batched_tokens is not None and opts.max_num_batched_tokens < longest:
            raise ValueError(f"max_num_batched_tokens={opts.max_num_batched_tokens} is below the model's "
                             f"max length {longest}: a long request could never be scheduled")
        # The engine's window is what it sorts by length to form batches: a wider one gives
        # tighter batches (on the 2-core CPU, 8 x max_num_seqs brings padding from 12% to 5% on
        # short sentences). The frontend keeps twice that in flight so the workers stay ahead
        # of the engine while finished results wait in the reorder buffer (inside the bound too);
        # with several engine cores, twice all their windows.
        # (Derived defaults stay within the bounds the options declare: options.MAX_INFLIGHT, MAX_ENGINE_WINDOW.)
        self.max_inflight = opts.max_inflight or min(MAX_INFLIGHT, 16 * max_num_seqs * engines)
        row_bytes = payload_bytes_per_row(family_of(spec).inflight_payloads(spec))
        if opts.max_inflight is None and row_bytes:
            # A model whose rows carry arrays (an image's pixels, a clip's features: 0.15-0.8 MB a row)
            # holds them in the engine while they wait: the bound by count that suits texts (16,384 on a
            # GPU) would be gigabytes of pixels, so by bytes too (a 200-page request to ColPali was
            # 698 -> 854 MB of engine RSS, 400 pages 1,070, with all of them in flight).
            self.max_inflight = max(2 * engines, min(self.max_inflight, MEDIA_INFLIGHT_BYTES // row_bytes))
        self.engine_window = opts.engine_window or min(MAX_ENGINE_WINDOW, max(1, self.max_inflight // (2 * engines)))
        # Requests per message to a worker (and from it to the engine): per-message costs (a
        # socket round, a decode, a thread's wake-up and its GIL hand-offs) are paid once per this
        # many. 64 measured 12% faster than 16 with a tokenizer-bound load; with a fast device
        # (max_num_seqs=256, the simulated H100) messages of 256 cut the engine's input thread
        # from ~1.8 to ~0.9 us a request.
        self.batch_items = max(1, min(MAX_MESSAGE_ITEMS, max_num_seqs, self.engine_window))
        self._plugin = None
        if opts.io_processor is not None:
            from pooling_pipeline.workers.render import load_plugin

            self._plugin = load_plugin(opts.io_processor)  # in the caller too, for post_process (errors early)
        family = family_of(spec)  # (what the model is to each process: core/families/)
        family.check_options(spec, opts.image_decode)
        backend = family.backend(opts.backend, opts.quantize, device, DTYPE_ALIASES[opts.dtype])
        self.cpu_plan = plan_cpu(opts.num_render_workers, devices[0] if engines > 1 else device,
                                 engine_threads=opts.engine_threads, data_parallel_size=engines)
        log.debug("CPU plan: %s", self.cpu_plan)
        self._local = threading.local()  # per thread: its running call and its last call's stats
        self._last_stats = CallStats()  # the last call of any thread
        self._group = ProcessGroup(spec, GroupPlan(
            options=opts, render_workers=self.cpu_plan.render_workers, engine_threads=self.cpu_plan.engine_threads,
            engine_devices=devices, dtype=DTYPE_ALIASES[opts.dtype], max_num_seqs=max_num_seqs,
            engine_window=self.engine_window, message_items=self.batch_items, backend=backend, sim=sim))
        try:
            self._dispatcher = Dispatcher(self._group, max_inflight=self.max_inflight, batch_items=self.batch_items)
        except BaseException:
            self._group.close()
            raise
        # Closes the group when this object is collected or the interpreter exits (in the process
        # that created it only: a forked child's exit leaves its parent's group alone).
        self._finalizer = weakref.finalize(self, Dispatcher.close, self._dispatcher)
        try:
            self._group.wait_ready()
            self._dispatcher.start()
        except BaseException:
            self.close()
            raise
        engine = self._group.engine_info
        log.info("%s", describe_backend(engine))  # what runs the model, in which precision
        hint = describe_faster_precision(engine)
        if hint is not None and not _said_once.get("faster_precision"):
            _said_once["faster_precision"] = True
            log.info("%s", hint)
        # (the engine's own log is not the caller's: what it has to say at start-up travels in its info)
        for warning in str(engine.get("warnings") or "").splitlines():
            log.warning("%s", warning)
        notice = describe_checkpoint_precision(engine)
        if notice is not None:  # a result that differs from ST's default in the last digits: said once
            log.warning("%s", notice)
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

    def healthy(self) -> bool:
        """True while the process group can serve: not closed, its engine cores alive or being
        restarted (a server's health check; an engine core that keeps dying closes the group at the
        next call or health check)."""
        group = self._group
        return group is not None and not group.closed and self._dispatcher.failure is None

    def _live_group(self) -> ProcessGroup:
        group = self._group
        if group is None:
            raise PipelineError("this Pipeline is closed")
        if os.getpid() != group.owner_pid:
            raise PipelineError(f"this Pipeline belongs to process {group.owner_pid} and cannot be used in a forked "
                                f"child (pid {os.getpid()}): create a new Pipeline in the child")
        return group

    # ---- calls: each says what it sends; `_call_method` makes the method, `_async_twin` its twin ------

    @_call_method("embed", "EmbeddingOutput")
    def embed(self, prompts, **options) -> _Plan:
        """Embeds a prompt or a list of prompts; returns a list in input order. With
        long_inputs="chunk", `.num_chunks` says how many chunks (of the model's length, sharing
        `chunk_overlap` tokens with their neighbours) a document was embedded in."""
        return _Plan(prompts, self._options("embed", **options))

    @_call_method("embed", "EmbeddingOutput", stream=True)
    def embed_stream(self, prompts, **options) -> _Plan:
        """Embeds any iterable (a generator of unknown length too), yielding in input order as
        results complete. Holds at most `max_inflight` requests at a time."""
        return _Plan(prompts, self._options("embed", **options))

    @_call_method("classify", "ClassificationOutput")
    def classify(self, prompts, **options) -> _Plan:
        """Class probabilities (softmax, or sigmoid for single-label / multi-label heads) per prompt.

        A prompt may be a (text, text_pair) pair -- a tuple or list of two strs, or a dict
        {"text": ..., "text_pair": ...} -- for a cross-encoder (an NLI model): the pair is encoded as
        ST's CrossEncoder encodes it, and its probabilities equal
        `CrossEncoder.predict(pairs, activation_fn=Identity(), apply_softmax=True)`
        (use_activation=False: the raw logits, `predict(pairs, activation_fn=Identity())`)."""
        return _Plan(prompts, self._options("classify", **options))

    @_call_method("encode")
    def encode(self, prompts, task: str | None = None, **options) -> _Plan:
        """Any task the model runs, by name: "embed" (`.embedding`), "classify" (`.probs`),
        "token_embed" (`.data`: [num_tokens, dim]), "token_classify" (`.data`: [num_tokens, labels]),
        "sparse_embed" (SPLADE: `.indices`, the token ids, and `.values`, their weights), or "plugin"
        (the io_processor's render/post_process around the forward pass). Defaults to the model's
        first task. A cross-encoder's pairs ("score") go through `score` and `rank`."""
        return _Plan(prompts, self._options(task, **options))

    @_call_method("encode", stream=True)
    def encode_stream(self, prompts, task: str | None = None, **options) -> _Plan:
        """`encode` as a stream over any iterable, in input order, with bounded memory: any task the
        model runs, by name ("embed", "classify", "token_embed", "token_classify", "sparse_embed",
        "plugin"; the model's first by default)."""
        return _Plan(prompts, self._options(task, **options))

    @_call_method("score", "ScoringOutput")
    def score(self, data_1, data_2, **options) -> _Plan:
        """Scores query/document pairs: 1:1, 1:N (the single query against each document) or N:N.

        The kind follows the model: a cross-encoder (sequence-classification head with one label)
        reads each pair together, with the activation ST's CrossEncoder applies; an embedding model
        gives its similarity function (ST's similarity_fn_name, cosine by default) of the two
        embeddings (bi-encoder), or MaxSim over token embeddings for late-interaction models.
        """
        return self._score_plan(data_1, data_2, **options)

    @_call_method("score", "RankedDocument", positional=0)
    def rank(self, query: str, documents: Sequence[str], top_k: int | None = None, **options) -> _Plan:
        """The documents ordered by their score against the query, best first, as
        `(index, score)` pairs (ST's `CrossEncoder.rank`); `top_k` keeps the best k.
        The options are `score`'s."""
        _check_rank(query, top_k)
        plan = self._score_plan(query, list(documents), **options)
        return plan._replace(finish=lambda outs: _ranked(plan.finish(outs), top_k))

    # ---- async variants: the same calls for asyncio code --------------------------------------

    aembed = _async_twin(embed, """`embed` for asyncio code: awaits the results without blocking the event loop; other
        calls (threads, coroutines) run at the same time. Cancelling the task aborts this call only.""")
    aembed_stream = _async_twin(embed_stream, """`embed_stream` as an async iterator (`async for out in
        pipe.aembed_stream(texts)`): lazy, in input order, bounded; leaving the loop early aborts what is
        still in flight.""")
    aclassify = _async_twin(classify, "`classify` for asyncio code.")
    aencode = _async_twin(encode, "`encode` for asyncio code.")
    aencode_stream = _async_twin(encode_stream, "`encode_stream` as an async iterator.")
    ascore = _async_twin(score, "`score` for asyncio code.")
    arank = _async_twin(rank, "`rank` for asyncio code.")

    def stats(self) -> dict:
        """Counters of this thread's last call (or the one it runs; from a thread that ran none,
        the last call of any thread), plus the CPU plan, engine facts and the group's counters
        (`stats()["group"]`: requests in flight over all calls and their peak, calls running,
        worker restarts, outputs of ended calls dropped, ...). With several engine cores,
        `engine_busy_fraction` is the mean over them, `per_engine` has each one's share of the
        call, `engine` is the first engine core's facts and `engine_cores` every one's."""
        call = self._running_call()
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
            scores = " and score() / rank() pairs" if "score" in self.model_spec.tasks else ""
            if not can:  # an LLM reranker: pairs only
                raise ValueError(f"task {task!r} is not supported: this model only scores pairs (score() / rank())")
            raise ValueError(f"unknown or unsupported task {task!r}: this model can do {can}{scores}")
        return checked(CallOptions, {"task": task, "plugin": plugin, "pairs": pairs, **values})

    def _score_plan(self, data_1, data_2, **values) -> _Plan:
        """What `score` sends (prompts, options) and how its outputs become scores."""
        kind = self.model_spec.score_kind
        if kind is None:
            spec = self.model_spec
            if spec.head == "sequence_classification":
                raise ValueError(f"this classifier has {spec.num_labels} labels: score() needs a one-label "
                                 "cross-encoder (ST's CrossEncoder.predict would give the raw logits of every "
                                 "label); use classify() with (text, text_pair) pairs for each pair's class "
                                 "probabilities (use_activation=False: the logits)")
            raise ValueError(f"this model cannot score; it can do {spec.tasks}")
        queries, docs = _score_side(data_1, "data_1"), _score_side(data_2, "data_2")
        if len(queries) != 1 and len(queries) != len(docs):
            raise ValueError(f"data_1 and data_2 must be 1:1, 1:N or N:N; got {len(queries)} and {len(docs)} items")
        if values["long_inputs"] == "chunk":  # (an embedding model's score would take it: not ST's score)
            raise ValueError("long_inputs='chunk' pools a document's chunks into one embedding: it applies to "
                             "embed, not score; score takes 'truncate' (the default) or 'error'")
        if kind == "cross_encoder":
            opts = self._options("score", pairs=True, **values)
            pairs = [(queries[0] if len(queries) == 1 else queries[i], d) for i, d in enumerate(docs)]

            def cross(outs: list) -> list[ScoringOutput]:
                return [ScoringOutput(out.request_id, out.index,
                                      float(out.data[0]) if out.error is None else float("nan"),
                                      out.num_prompt_tokens, out.error) for out in outs]
            return _Plan(pairs, opts, cross)
        if isinstance(values["pooling_params"], (list, tuple)):
            raise ValueError("per-pair pooling_params apply to cross-encoders only; give one PoolingParams")
        if values.pop("max_tokens_per_query") is not None or values.pop("max_tokens_per_doc") is not None:
            raise ValueError("max_tokens_per_query / max_tokens_per_doc apply to cross-encoders only; "
                             "use truncate_prompt_tokens")
        if isinstance(values["priority"], (list, tuple)):  # (a list was once dropped here without a word)
            raise ValueError("per-pair priority applies to cross-encoders only (an embedding model's score embeds "
                             "each text once, and a query is shared by its pairs); give one int for the call")
        values["route"] = _score_routes(self.model_spec, values.get("route"), len(queries), len(docs))
        opts = self._options("embed" if kind == "bi_encoder" else "token_embed", **values)
        similarity_fn = self.model_spec.similarity
        length_normalize = self.model_spec.multi_vector is not None and self.model_spec.multi_vector.length_normalize

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
                        else _max_sim(q.data, d.data, length_normalize)
                results.append(ScoringOutput(f"{q.request_id}|{d.request_id}", i, value,
                                             q.num_prompt_tokens + d.num_prompt_tokens, error))
            return results
        return _Plan(list(queries) + list(docs), opts, pairwise)

    def _requests(self, prompts, opts: CallOptions, materialize: bool):
        """The call's id and its requests, lazily (with how many when known). `materialize`:
        a list call, checked whole before any work starts."""
        self._live_group()
        refused: dict[int, str] = {}
        if opts.errors == "return":  # a bad priority fails its request only (an error output naming it)
            opts, refused = refused_entries(opts)
        prefix = new_call_prefix()
        source, total = build_requests(prompts, opts, self.model_spec, self._tokenization, prefix, refused)
        return prefix, source, total

    def _start_call(self, prefix: str, source, opts: CallOptions, total: int | None,
                    loop: asyncio.AbstractEventLoop | None = None, materialize: bool = False) -> Call:
        progress = None
        if opts.use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=total, desc="Processed prompts", unit="docs", dynamic_ncols=True)
        call = Call(self._dispatcher, prefix, source, opts, progress=progress,
                    default_normalize=self.model_spec.normalize,
                    truncate_dim=self.model_spec.truncate_dim, loop=loop, keep_all=materialize)
        # A weak reference: a stream dropped unread must not stay alive (with its input) here.
        self._local.call = weakref.ref(call)
        return call

    def _stream(self, prompts, opts: CallOptions, materialize: bool = False) -> Iterator:
        """Builds the call's requests, runs them through the group, yields wrapped outputs in order."""
        prefix, source, total = self._requests(prompts, opts, materialize)
        if materialize:
            source = source.drain(self._dispatcher.batch_items)  # a list is checked whole before any work starts
        call = self._start_call(prefix, source, opts, total, materialize=materialize)
        outputs = ResultStream.of(self._turns(call))
        return self._post_process(outputs) if opts.plugin else outputs

    def _turns(self, call: Call) -> Iterator[list]:
        try:
            yield from call.turns()
        except EngineDeadError as e:
            self._close_if_dead(e)
            raise
        finally:
            self._ended(call)

    def _close_if_dead(self, error: EngineDeadError) -> None:
        """The group cannot serve without its engine core: the rest of it is stopped. (Not for an
        engine core that was restarted: only the calls it held failed, the Pipeline serves on.)"""
        if not isinstance(error, EngineRestartedError):
            self.close()

    def _abortable_astream(self, prompts, opts: CallOptions) -> AsyncIterator:
        """`_astream` whose call is aborted when the async generator is collected unclosed.
        asyncio closes a collected async generator (`aclose()`) only through its event loop: one
        whose loop was closed first (a `new_event_loop()` closed without `shutdown_asyncgens()`)
        is never closed, and its call would hold its slots for the Pipeline's life. The abort
        needs no event loop: it goes through the receiver thread."""
        started: list[Call] = []  # the call, once the stream has started (no reference to the generator)
        stream = self._astream(prompts, opts, started)
        weakref.finalize(stream, _abandon, started)
        return stream

    async def _astream(self, prompts, opts: CallOptions, started: list) -> AsyncIterator:
        """`_stream` on the caller's event loop (`started` gets its Call once there is one)."""
        call = await self._astart(prompts, opts, materialize=False)
        started.append(call)
        try:
            async for result in call.aoutputs():
                yield self._post_process_one(result) if opts.plugin else result
        except EngineDeadError as e:
            self._close_if_dead(e)
            raise
        finally:
            self._ended(call)

    async def _acollect(self, prompts, opts: CallOptions) -> list:
        """An async list call, checked whole before any work starts and gathered by its Call a
        turn's results at a time. Cancelled or closed unfinished, the call is aborted
        (`Call.acollect`)."""
        call = await self._astart(prompts, opts, materialize=True)
        try:
            outs = await call.acollect()
        except EngineDeadError as e:
            self._close_if_dead(e)
            raise
        finally:
            self._ended(call)
        return [self._post_process_one(out) for out in outs] if opts.plugin else outs

    async def _astart(self, prompts, opts: CallOptions, materialize: bool) -> Call:
        """The call of an async stream or list call, started on the caller's event loop."""
        prefix, source, total = self._requests(prompts, opts, materialize)
        if materialize:  # checked whole before any work starts; a long list in a thread
            items = self._dispatcher.batch_items
            if total is not None and total <= ASYNC_INLINE_CHECK_ITEMS:
                source = source.drain(items)
            else:
                source = await asyncio.to_thread(source.drain, items)
        return self._start_call(prefix, source, opts, total, loop=asyncio.get_running_loop(), materialize=materialize)

    def _ended(self, call: Call) -> None:
        self._last_stats = call.stats
        self._local.last_stats = call.stats
        if self._running_call() is call:
            self._local.call = None

    def _running_call(self) -> Call | None:
        """This thread's running (or last started) call, while it is alive."""
        ref = getattr(self._local, "call", None)
        return ref() if ref is not None else None

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


def _abandon(started: list) -> None:
    """An async stream collected without being closed: its call (if it started) is aborted and
    finished. (Nothing happens to a call that already ended.)"""
    for call in started:
        call.abort()
        call.finish()


def _check_rank(query, top_k) -> None:
    if not isinstance(query, str):
        raise TypeError(f"query must be a str, got {type(query).__name__}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")


def _ranked(scores: list[ScoringOutput], top_k: int | None) -> list[RankedDocument]:
    """Best first; documents that failed (errors="return": a NaN score) after every scored one, in
    their input order -- a NaN in the sort key would break the order and drop scored documents."""
    ranked = sorted((RankedDocument(s.index, s.score) for s in scores),
                    key=lambda r: (1, 0.0) if math.isnan(r.score) else (0, -r.score))
    return ranked[:top_k] if top_k is not None else ranked


# What the rows in flight may hold of arrays beyond their ids, where the caller leaves max_inflight
# unset (a ColPali page's pixels are 0.6 MB: ~210 pages; a CLIP image's 0.15 MB: ~870).
MEDIA_INFLIGHT_BYTES = 128 << 20


def payload_bytes_per_row(payloads: dict) -> int:
    """The most bytes one row's payloads can hold (`ModelFamily.payloads`); 0 for a text model."""
    return sum(np.dtype(p.dtype).itemsize * int(np.prod(p.item_shape)) * p.max_items for p in payloads.values())


def _model_spec(model: str | ModelSpec | None, opts: PipelineOptions) -> ModelSpec:
    """The model's spec: read from its folder, or as a caller read it (then `revision` and
    `trust_remote_code` were applied when it was read, and the options must not say otherwise)."""
    if not isinstance(model, ModelSpec):
        return load_model_spec(model, trust_remote_code=opts.trust_remote_code, revision=opts.revision)
    if opts.revision is not None:
        raise ValueError("revision applies to a hub model id, not to a ModelSpec (read at its revision already)")
    if opts.trust_remote_code != model.trust_remote_code:
        raise ValueError(f"trust_remote_code={opts.trust_remote_code} but the ModelSpec was read with "
                         f"trust_remote_code={model.trust_remote_code}")
    return model


def _score_routes(spec, route, num_queries: int, num_docs: int):
    """The routes of score()'s texts, as ST users compute it: similarity(encode_query(data_1),
    encode_document(data_2)) on a model with routes (a Router's, a ColBERT model's); the caller's
    `route` otherwise, or where a Router model is given one. A multi-vector model routes its queries
    and documents itself."""
    if spec.multi_vector is not None and route is not None:
        raise ValueError("score() of a multi-vector model routes queries and documents itself; give no route")
    if not spec.routes or route is not None:
        return route
    return ["query"] * num_queries + ["document"] * num_docs


def _score_side(data, name: str) -> list:
    if isinstance(data, str):
        return [data]
    if data is None or not isinstance(data, (list, tuple)):
        raise TypeError(f"{name} must be a str or a list of them, got {type(data).__name__}")
    if not data:
        raise ValueError(f"{name} is empty: score needs at least one query and one document")
    return list(data)


EMPTY_DOCUMENT_SCORE = -1e9  # ST's maxsim for a document with no vector


def _max_sim(query: np.ndarray, doc: np.ndarray, length_normalize: bool = False) -> float:
    """Late interaction (ST's maxsim): for each query token the best-matching document token,
    summed; divided by the query's token count for meanmaxsim (`length_normalize`)."""
    if not len(doc):
        total = EMPTY_DOCUMENT_SCORE  # ST: a document without vectors (all skiplisted) ranks last
    else:
        total = float((query @ doc.T).max(axis=1).sum()) if len(query) else 0.0
    return total / max(len(query), 1) if length_normalize else total
