"""The public Python API: `Pipeline` spawns the process group and runs calls through it."""

from __future__ import annotations

import itertools
import logging
import re
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence

from core.config import load_model_spec
from core.messages import PoolingParams
from pipeline.cpu_plan import plan_cpu
from pipeline.errors import EngineDeadError, PipelineError
from pipeline.frontend import Call, CallStats
from pipeline.inputs import EMBED_TASKS, CallOptions, as_prompt_iterable, build_requests, params_for
from pipeline.outputs import EmbeddingOutput
from pipeline.process_group import ProcessGroup

log = logging.getLogger("pipeline")

DTYPE_ALIASES = {"auto": "auto", "float32": "float32", "float": "float32", "fp32": "float32",
                 "float16": "float16", "half": "float16", "fp16": "float16",
                 "bfloat16": "bfloat16", "bf16": "bfloat16"}
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


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
                 trust_remote_code: bool = False,
                 startup_timeout_s: float = 300.0, log_level: str = "WARNING") -> None:
        self._group: ProcessGroup | None = None
        _positive_int("num_render_workers", num_render_workers)
        _positive_int("max_num_seqs", max_num_seqs, allow_none=False)
        _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        _positive_int("max_inflight", max_inflight)
        if not isinstance(device, str) or not DEVICE_PATTERN.fullmatch(device):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
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
        self.batch_items = max(1, min(16, max_num_seqs, self.engine_window))  # requests per message to a worker
        self.cpu_plan = plan_cpu(num_render_workers, device)
        log.debug("CPU plan: %s", self.cpu_plan)
        self._lock = threading.Lock()
        self._call: Call | None = None
        self._last_stats = CallStats()
        self._ids = itertools.count()
        self._group = ProcessGroup(
            spec, num_workers=self.cpu_plan.render_workers, engine_threads=self.cpu_plan.engine_threads,
            device=device, dtype=DTYPE_ALIASES[dtype], max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, window=self.engine_window,
            max_message_items=self.batch_items, log_level=log_level)
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

    def embed(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[EmbeddingOutput]:
        """Embeds a prompt or a list of prompts; returns a list in input order."""
        items = as_prompt_iterable(prompts)
        if not isinstance(items, (list, tuple)):
            items = list(items)
        if not items:
            return []
        # A list is checked whole before any work starts, so a bad prompt costs nothing.
        requests = list(self._requests(items, pooling_params, truncate_prompt_tokens, "embed"))
        return list(self._run(iter(requests), "embed", len(requests), use_tqdm))

    def embed_stream(self, prompts: Iterable, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                     truncate_prompt_tokens: int | None = None, use_tqdm: bool = False) -> Iterator[EmbeddingOutput]:
        """Embeds any iterable (a generator of unknown length too), yielding in input order as
        results complete. Holds at most `max_inflight` requests at a time."""
        items = as_prompt_iterable(prompts)
        total = len(items) if isinstance(items, (list, tuple)) else None
        requests = self._requests(iter(items), pooling_params, truncate_prompt_tokens, "embed")
        return self._run(requests, "embed", total, use_tqdm)

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

    def _requests(self, prompts, pooling_params, truncate_prompt_tokens, task):
        if task not in EMBED_TASKS:
            raise ValueError(f"unknown task {task!r}; this model supports {list(EMBED_TASKS)}")
        if truncate_prompt_tokens is not None and (not isinstance(truncate_prompt_tokens, int)
                                                   or isinstance(truncate_prompt_tokens, bool)):
            raise TypeError(f"truncate_prompt_tokens must be an int or None, got {truncate_prompt_tokens!r}")
        params = params_for(pooling_params, task)
        params_count = len(pooling_params) if isinstance(pooling_params, (list, tuple)) else None
        if params_count is not None and isinstance(prompts, (list, tuple)) and params_count != len(prompts):
            raise ValueError(f"pooling_params has {params_count} entries but there are {len(prompts)} prompts")
        opts = CallOptions(task, truncate_prompt_tokens, self.num_special_tokens)
        return build_requests(prompts, params, self.model_spec, opts, f"{next(self._ids)}-", params_count)

    def _run(self, requests, task: str, total: int | None, use_tqdm: bool) -> Iterator[EmbeddingOutput]:
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
            call = self._call = Call(group, requests, max_inflight=self.max_inflight,
                                     batch_items=self.batch_items, progress=progress)
        return self._results(call)

    def _results(self, call: Call) -> Iterator[EmbeddingOutput]:
        try:
            for out in call.outputs():
                yield EmbeddingOutput(request_id=out.request_id, index=out.seq, embedding=out.data,
                                      num_prompt_tokens=out.num_prompt_tokens)
        except EngineDeadError:
            self.close()  # the group cannot serve without its engine: stop the rest of it
            raise
        finally:
            self._last_stats = call.stats
            if self._call is call:
                self._call = None
