"""Every message that crosses a process boundary, as typed msgspec structs.

One module so that the wire protocol can be read in one place. Each socket decodes against the
union of the message types it expects (tagged by class name); anything else is rejected.
Arrays (token ids, pooled outputs) are `np.ndarray` fields: `core.serial` moves them as raw bytes,
inline when small and as separate zero-copy frames when large. Nothing is pickled.

Flow:  frontend --RenderBatch--> render worker --EngineInputBatch--> engine core
       engine core --OutputBatch / StepFailed--> frontend;  render worker --RenderFailed--> frontend
       frontend --Abort / Shutdown--> engine core;  frontend --Shutdown--> render worker
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request pooling options. `None` means "the model's default"."""

    task: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None


class RenderParams(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's raw input and options, before tokenization (frontend -> render worker).

    Exactly one input form is set: `prompt` (text, with `pair` for a cross-encoder's document),
    `token_ids` (used verbatim), `conversation` (rendered with the chat template) or `raw`
    (handed to the io_processor plugin's `render`).
    """

    request_id: str  # external id
    seq: int  # position in the caller's input; the frontend restores order with it
    task: str  # "embed" | "token_embed" | "classify" | "token_classify" | "score"
    max_tokens: int  # keep at most this many tokens (special tokens included), resolved by the frontend
    params: PoolingParams
    prompt: str | None = None
    pair: str | None = None
    token_ids: np.ndarray | None = None  # int32
    conversation: list[dict[str, str]] | None = None
    raw: Any = None
    max_query_tokens: int | None = None  # pairs: content tokens kept of each side before pairing
    max_doc_tokens: int | None = None
    priority: int = 0
    truncate_left: bool = False  # keep the last tokens instead of the first
    long_inputs: str = "truncate"  # "truncate" | "error" | "chunk"
    chunk_overlap: int = 0  # chunk mode: tokens shared by consecutive windows


class PoolingEngineInput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's token ids and params, ready for the engine core (render worker -> engine)."""

    request_id: str
    seq: int
    task: str
    token_ids: np.ndarray  # int32, already truncated
    params: PoolingParams
    # Token type ids are zeros then ones (a text pair): only the index of the first 1 travels.
    token_type_start: int | None = None
    priority: int = 0
    # Chunk mode: this input is window `window` of `num_windows` of one document (same external id).
    window: int = -1
    num_windows: int = 0


class PoolingOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's result (engine core -> frontend)."""

    request_id: str
    seq: int
    num_prompt_tokens: int
    data: np.ndarray | None = None  # float32; None when `error` is set
    error: str | None = None
    window: int = -1  # chunk mode: which window of the document this is
    num_windows: int = 0


# ---- batches on the wire -------------------------------------------------------------------


class RenderBatch(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    items: list[RenderParams]
    chat_template: str | None = None  # the call's template for conversations (once per batch)


class EngineInputBatch(msgspec.Struct, tag=True, array_like=True):
    worker: int
    items: list[PoolingEngineInput]


class OutputBatch(msgspec.Struct, tag=True, array_like=True):
    outputs: list[PoolingOutput]
    busy_s: float  # engine time spent on this batch (forward + pooling)
    padded_tokens: int  # tokens the forward pass computed, padding included
    in_core: int  # requests admitted in the engine when this batch was formed


class RenderFailed(msgspec.Struct, tag=True, array_like=True):
    """A render worker could not turn some requests into engine inputs."""

    request_ids: list[str]
    seqs: list[int]
    errors: list[str]


class StepFailed(msgspec.Struct, tag=True, array_like=True):
    """A model step raised; its requests were aborted in the engine."""

    request_ids: list[str]
    seqs: list[int]
    error: str


# ---- control ----------------------------------------------------------------------------


class Abort(msgspec.Struct, tag=True, array_like=True):
    """Drop these requests: waiting ones now, ones still on their way when they arrive."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Sent once by each child when it is ready to serve (or failed to start)."""

    role: str  # "engine" or "worker"
    index: int
    pid: int
    error: str | None = None
    info: dict[str, str | int | float | bool | None] = {}


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    """Sent every second by a thread of each child: it is alive, and how long its loop has been
    inside one piece of work (a wedged step shows here; a stopped process stops sending)."""

    role: str
    index: int
    busy_s: float


# What each socket accepts.
WorkerInbound = RenderBatch | Shutdown
EngineInbound = EngineInputBatch
EngineControl = Abort | Shutdown
FrontendInbound = OutputBatch | RenderFailed | StepFailed | Ready | Heartbeat
