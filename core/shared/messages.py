"""Every message that crosses a process boundary, as typed msgspec structs.

One module so that the wire protocol can be read in one place. Each socket decodes against the
union of the message types it expects (tagged by class name); anything else is rejected.
Arrays (token ids, pooled outputs) are `np.ndarray` fields: `core.shared.serial` moves them as raw bytes,
inline when small and as separate zero-copy frames when large. Nothing is pickled.

A message is a batch in columns, not a list of per-request structs: the requests of one message
belong to one call (a step's outputs may serve several: `OutputBatch.calls`), so a request is
named by two explicit fields, its call's id and its index in the call's input, and travels as one
entry of an `indices` column; token ids travel as one packed array with a `lengths` column; the
options every request of a message shares travel once. Decoding, validation and bookkeeping
then cost per message, not per request, in every process. (The string a caller sees as
`request_id` is the call's id followed by the index; it is made only for the caller's results.)

Flow:  frontend --RenderBatch--> render worker --EngineInputBatch--> engine core
       engine core --OutputBatch / StepFailed--> frontend;  render worker --RenderFailed--> frontend
       frontend --Abort / Shutdown--> engine core;  frontend --Shutdown--> render worker
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from pooling_pipeline.core.shared.options import COLUMN_OPTIONS, EMBEDDING_TASKS, LongInputs, PositiveInt, Task
from pooling_pipeline.core.shared.schema import (
    DEFAULTS,
    int_column,
    packed_lengths,
    payload_counts,
    ragged_positions,
    select_packed,
)


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Per-request pooling options. `None` means "the model's default"."""

    task: Task | None = None
    normalize: bool | None = None  # embedding tasks: L2-normalize the vector
    # embedding tasks (Matryoshka, vLLM's `dimensions`): keep the first k values of the model's full
    # output (a saved truncate_dim does not apply then), normalized when normalization is on
    dimensions: PositiveInt | None = None
    use_activation: bool | None = None  # classify / score / token_classify: softmax or sigmoid
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None  # -1: the model's maximum

    def verify(self, where: str, task: str, model) -> None:
        """Checks these options against the call's task and the model (a `ModelSpec`).
        Types and ranges were checked where the object was built (`checked`)."""
        if self.task is not None and self.task != task:
            raise ValueError(f"{where}.task={self.task!r} conflicts with the call's task {task!r}")
        if self.dimensions is not None:
            if task not in EMBEDDING_TASKS:
                raise ValueError(f"{where}.dimensions applies to embedding tasks only, not {task!r}")
            width = model.hidden_size if task == "token_embed" else model.embedding_size
            if self.dimensions > width:
                raise ValueError(f"{where}: dimensions={self.dimensions} is outside [1, {width}]")
            # (the full width is always a valid answer: it cuts nothing)
            if model.matryoshka_dimensions and self.dimensions not in (*model.matryoshka_dimensions, width):
                raise ValueError(f"{where}: dimensions={self.dimensions} is not among the model's declared "
                                 f"dimensions {model.matryoshka_dimensions}")
        if self.normalize is not None and task not in EMBEDDING_TASKS:
            raise ValueError(f"{where}.normalize applies to embedding tasks; use use_activation for {task!r}")


class RenderSettings(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """How to render a request, as the frontend resolved it (`RenderOptions` adds the per-request
    options that travel to the engine as they are)."""

    task: Task
    max_tokens: int  # keep at most this many tokens (special tokens included)
    params: PoolingParams
    truncate_left: bool = False  # keep the last tokens instead of the first
    long_inputs: LongInputs = "truncate"
    chunk_overlap: int = 0  # chunk mode: tokens shared by consecutive chunks
    # The model's prompt (ST's `prompts`), put in front of the text (of a pair's first text) in the
    # worker; sent apart so the worker can count its tokens (pooling may leave them out).
    text_prefix: str | None = None
    max_query_tokens: int | None = None  # pairs: content tokens kept of each side before pairing
    max_doc_tokens: int | None = None


# The settings, then each per-request option with a column (`core.shared.options.COLUMN_OPTIONS`: priority,
# route, ...) by name, an int with its column's default: the packer copies them into the columns.
# Declared from that table, so a new such option needs no line here; last, so a default is not sent.
RenderOptions = msgspec.defstruct(
    "RenderOptions", [(o.name, int, o.column) for o in COLUMN_OPTIONS], bases=(RenderSettings,),
    module=__name__, kw_only=True, array_like=True, omit_defaults=True, gc=False,
    namespace={"__doc__": """How to render a request and its per-request options' values, as the frontend resolved
    them: shared by every request of a RenderBatch (the usual case: a call's options are the same for
    all its requests), or one request's own (`RenderParams`)."""})


class MediaData(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """An image or audio clip (`modality`) as the frontend hands it to a render worker, which opens,
    decodes and processes it with the renderer its model's family names for that modality. Exactly
    one source is set: a file `path`, a `data:` URI or raw base64 `uri`, a file's `encoded` bytes --
    opened as transformers' `load_image` / `load_audio` open them -- or an in-memory input's
    `values` (a flat uint8 array of its bytes): a PIL image's raw bytes in its `mode` and `size`
    (with its palette and transparency), or a numpy array's values (`mode` None, `shape` and the
    array's `dtype`), which the processor takes as ST hands them to it. Audio values come with the
    `sampling_rate` the caller gave (None: the processor's own, as ST assumes)."""

    modality: str = "image"  # a name of schema.MODALITIES other than "text"
    path: str | None = None
    uri: str | None = None
    encoded: bytes | None = None
    values: np.ndarray | None = None
    mode: str | None = None  # a PIL image's mode
    dtype: str | None = None  # a numpy array's dtype (numpy's `dtype.str`)
    shape: list[int] = []  # a PIL image's (width, height), or a numpy array's shape
    palette: bytes | None = None  # a "P" / "PA" image's palette, in `palette_mode`
    palette_mode: str | None = None
    transparency: int | bytes | list[int] | None = None  # a PIL image's info["transparency"]
    sampling_rate: int | None = None  # audio values' rate, as the caller gave it
    nbytes: int = 0  # the size of what it holds (a file's size), for the frontend's in-flight budget


class ChatPart(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """One part of a chat message's content: a `text`, or a `media` input (an image)."""

    text: str | None = None
    media: MediaData | None = None


class ChatTurn(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """One chat message of a multimodal input (a model whose processor renders every input as chat
    messages, a VLM embedder): its role, and its content as the caller gave it -- a plain string
    (`content`, which ST hands the template as it is) or a list of `parts`."""

    role: str
    content: str | None = None
    parts: list[ChatPart] | None = None

    def size(self) -> int:
        return len(self.content or "") + sum(len(p.text or "") + (p.media.nbytes if p.media else 0)
                                             for p in self.parts or ())


class RenderParams(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """One request's raw input with its own options, before tokenization (the general path of a
    RenderBatch: per-request options, conversations, plugin data, images). Exactly one input form
    is set: `prompt` (with `pair` for a cross-encoder's document), `token_ids` (used verbatim),
    `conversation` (rendered with the chat template), `raw` (the io_processor plugin's `render`),
    `media` (an image or audio clip of a model whose family takes it) or `messages` (chat messages
    whose parts may be images, or a text and an image in one input, of a model whose family
    renders such)."""

    options: RenderOptions
    prompt: str | None = None
    pair: str | None = None
    token_ids: np.ndarray | None = None  # int32
    conversation: list[dict[str, str]] | None = None
    raw: Any = None
    media: MediaData | None = None
    messages: list[ChatTurn] | None = None

    def size(self) -> int:
        """Roughly the characters (or token ids, or an image's bytes) it holds."""
        if self.media is not None:
            return max(self.media.nbytes, 1)
        if self.messages is not None:
            return max(sum(turn.size() for turn in self.messages), 1)
        size = len(self.prompt or "") + len(self.pair or "")
        if self.token_ids is not None:
            size += self.token_ids.size
        if self.conversation is not None:
            size += sum(len(turn["content"]) for turn in self.conversation)
        return max(size, 1)


# ---- batches on the wire -------------------------------------------------------------------


class RenderBatch(msgspec.Struct, kw_only=True, tag=True, array_like=True, omit_defaults=True):
    """Requests of one call for a render worker. Exactly one input column is set: `texts` (with
    `pairs`, a cross-encoder's (query, document) pairs) or packed `token_ids`, all rendered with
    `options`; or `items`, each request with its own options and input."""

    call: str  # the call's id
    indices: np.ndarray  # int64: each request's position in the call's input
    options: RenderOptions | None = None  # for texts / token ids
    texts: list[str] | None = None
    pairs: list[str] | None = None
    token_ids: np.ndarray | None = None  # int32, every request's ids back to back
    lengths: np.ndarray | None = None  # int64, one per request
    items: list[RenderParams] | None = None
    chat_template: str | None = None  # the call's template for conversations (once per batch)
    engine: int = 0  # data parallel: the engine core these requests go to (the frontend picks it)
    # Requests sent before to a render worker that was lost: some may already wait in the engine,
    # which then keeps only this copy (it looks up only the requests of a message marked so).
    resent: bool = False

    def check(self) -> int:
        """The number of requests; ValueError when the columns do not fit together."""
        if self.indices.ndim != 1:
            raise ValueError("indices must be one flat array")
        n = len(self.indices)
        int_column(self.indices, n, "indices", optional=False)
        forms = [self.texts is not None, self.token_ids is not None, self.items is not None]
        if sum(forms) != 1:
            raise ValueError("a RenderBatch needs exactly one of texts, token_ids and items")
        if (self.items is None) == (self.options is None):
            raise ValueError("texts and token ids need the batch's options; items carry their own")
        if self.texts is not None and len(self.texts) != n or self.items is not None and len(self.items) != n:
            raise ValueError("inputs do not match the indices")
        if self.pairs is not None and (self.texts is None or len(self.pairs) != n):
            raise ValueError("pairs need one query text each")
        if self.token_ids is not None:
            packed_lengths(self.token_ids, self.lengths, n)
        elif self.lengths is not None:
            raise ValueError("lengths without packed token ids")
        return n

    def __len__(self) -> int:
        return len(self.indices)

    # The frontend keeps each RenderBatch it sent until its requests are answered (to re-send
    # the rest if their worker dies): these read it as a set of requests.

    @property
    def sizes(self) -> np.ndarray:
        """Roughly the characters (or token ids) each request holds, at least 1 (int64, one per
        request): what the frontend's in-flight budget counts. (An array: the frontend writes it
        into its ring in one operation; a list cost it ~0.1 us a request.)"""
        if self.token_ids is not None:
            return np.maximum(self.lengths, 1)
        if self.texts is not None:
            n = len(self.texts)
            sizes = np.fromiter(map(len, self.texts), np.int64, n)
            if self.pairs is not None:
                sizes += np.fromiter(map(len, self.pairs), np.int64, n)
            return np.maximum(sizes, 1)
        return np.fromiter((item.size() for item in self.items), np.int64, len(self.items))

    def select(self, positions: list[int]) -> RenderBatch:
        """The requests at these positions, as a batch of their own (to re-send them)."""
        pick = (lambda column: None if column is None else [column[i] for i in positions])
        token_ids, lengths = self.token_ids, self.lengths
        if token_ids is not None:
            token_ids, lengths = select_packed(token_ids, lengths, positions)
        return msgspec.structs.replace(self, indices=self.indices[positions], texts=pick(self.texts),
                                       pairs=pick(self.pairs), token_ids=token_ids, lengths=lengths,
                                       items=pick(self.items))

    def position_of(self, index: int) -> int:
        """Where the request of this index is in the batch."""
        return int(np.flatnonzero(self.indices == index)[0])

    def options_of(self, position: int) -> RenderOptions:
        return self.options if self.items is None else self.items[position].options


class Payload(msgspec.Struct, kw_only=True, array_like=True):
    """One named array per row of an engine input, each of its own length along the first axis
    (an image's pixels, its patches and their grid, audio features): `counts`, each row's items
    (int64 [n]; 0: the row has none), `data`, every row's items back to back ([sum(counts), *item
    shape], one dtype). What a name holds, its dtype and item shape, is the model family's
    (`ModelFamily.payloads`); the wire and the engine carry any."""

    counts: np.ndarray
    data: np.ndarray

    def rows(self, rows: np.ndarray) -> Payload:
        """The items of these rows (positions, in any order), as a payload of their own."""
        counts = self.counts.take(rows)
        starts = np.cumsum(self.counts) - self.counts
        return Payload(counts=counts, data=self.data.take(ragged_positions(starts.take(rows), counts), axis=0))


class EngineInputBatch(msgspec.Struct, kw_only=True, tag=True, array_like=True, omit_defaults=True):
    """Engine inputs of one call in columns -- each row is one request's PoolingEngineInput: its
    token ids and params, ready for the engine: one packed ids array with a lengths column, the
    message's distinct (task, params) once, and the per-request columns of `core.shared.schema` that
    differ from their defaults (the others are absent). Built by the render worker's packer
    (`workers.packer.EngineInputPacker`); a receiver calls `check` before reading one."""

    worker: int
    call: str
    indices: np.ndarray  # int64 [n]: each request's position in its call's input
    lengths: np.ndarray  # int64 [n]
    token_ids: np.ndarray  # int32, every request's ids back to back
    tasks: list[Task]  # the message's distinct (task, params) pairs, usually one ...
    params: list[PoolingParams]
    columns: dict[str, np.ndarray] = {}  # schema.REQUEST_COLUMNS name -> int64 [n], when not all default
    render_s: float = 0.0  # the worker's rendering time since its previous message (for stats)
    # The rows' arrays beyond their ids, by name (a dual encoder's image rows: "pixels", uint8
    # [C, H, W] each, with `modality` 1 and placeholder ids counting their vision sequence, which
    # the step's token budget weighs).
    payloads: dict[str, Payload] = {}
    resent: bool = False  # the RenderBatch's `resent`: a waiting copy of a request is replaced

    def check(self) -> list[int]:
        """The lengths; ValueError when the columns do not fit together (a malformed message)."""
        if self.indices.ndim != 1:
            raise ValueError("indices must be one flat array")
        n = len(self.indices)
        int_column(self.indices, n, "indices", optional=False)
        sizes = packed_lengths(self.token_ids, self.lengths, n)
        for name, payload in self.payloads.items():
            payload_counts(payload.counts, payload.data, n, name)
        if not self.tasks or len(self.tasks) != len(self.params):
            raise ValueError("tasks and params must be pairs, at least one")
        for name, values in self.columns.items():
            if name not in DEFAULTS:
                raise ValueError(f"unknown per-request column {name!r}")
            int_column(values, n, name)
        param_of = self.columns.get("param_of")
        if param_of is not None and n and (int(param_of.min()) < 0 or int(param_of.max()) >= len(self.tasks)):
            raise ValueError("param_of names no entry of tasks/params")
        return sizes


class OutputBatch(msgspec.Struct, kw_only=True, tag=True, array_like=True, omit_defaults=True):
    """A step's outputs, as columns: one entry per request in each (no struct per request).
    When they are all vectors of one size (embeddings, class probabilities, scores) their data
    travels as one [n, dim] array, `data`; otherwise each output's array is in `arrays`.
    A receiver calls `check` before reading one."""

    calls: list[str]  # the calls whose requests the step served
    indices: np.ndarray  # int64: each request's position in its call's input
    num_prompt_tokens: np.ndarray  # int64
    busy_s: float  # engine time spent on this batch (forward + pooling)
    padded_tokens: int  # tokens the forward pass computed, padding included
    in_core: int  # requests admitted in the engine when this batch was formed
    call_of: np.ndarray | None = None  # int64: each output's call, a position in `calls`; None: calls[0]
    data: np.ndarray | None = None  # [n, dim] float32: row i is output i
    arrays: list[np.ndarray] | None = None  # or output i's own array ([tokens, dim], sparse weights ...)
    sparse_ids: list[np.ndarray] | None = None  # sparse_embed: output i's token ids (int32), its weights in `arrays`
    chunks: np.ndarray | None = None  # chunk mode: [n, 2] int64 (chunk, num_chunks); None when no output is a chunk
    # Stage times since the previous OutputBatch, for stats: rendering per worker (reported by
    # the workers with their inputs) and the engine's own time reading and admitting inputs.
    render_s: dict[int, float] = {}
    admit_s: float = 0.0

    def check(self) -> None:
        """ValueError when the columns do not fit together (a malformed message)."""
        if self.indices.ndim != 1:
            raise ValueError("indices must be one flat array")
        n = len(self.indices)
        int_column(self.indices, n, "indices", optional=False)
        int_column(self.num_prompt_tokens, n, "num_prompt_tokens", optional=False)
        if not self.calls and n:
            raise ValueError("outputs need their calls")
        int_column(self.call_of, n, "call_of")
        if self.call_of is not None and n and (int(self.call_of.min()) < 0 or int(self.call_of.max()) >= len(self.calls)):
            raise ValueError("call_of names no entry of calls")
        if (self.data is None) == (self.arrays is None):
            raise ValueError("outputs need exactly one of data and arrays")
        if self.data is not None and (self.data.ndim != 2 or self.data.shape[0] != n):
            raise ValueError("packed output rows do not match the outputs")
        if self.arrays is not None and len(self.arrays) != n:
            raise ValueError("output arrays do not match the outputs")
        if self.sparse_ids is not None and (self.arrays is None or len(self.sparse_ids) != n or any(
                ids.shape != weights.shape for ids, weights in zip(self.sparse_ids, self.arrays))):
            raise ValueError("sparse token ids do not match their weights")
        int_column(self.chunks, n, "chunks", shape=(2,))

    def own_arrays(self) -> None:
        """Each output array that is a view of a received frame becomes a copy of its own: a
        caller keeping a few results must not keep whole frames alive. (`data` is copied where
        the receiver puts its rows.)"""
        if self.arrays is not None:
            self.arrays = [a if a.flags.owndata else a.copy() for a in self.arrays]
        if self.sparse_ids is not None:
            self.sparse_ids = [a if a.flags.owndata else a.copy() for a in self.sparse_ids]

    def part(self, call: int) -> OutputBatch:
        """The outputs of `calls[call]` alone, with the step's costs split by requests (a step
        that served several calls: each gets its share)."""
        rows = np.flatnonzero(self.call_of == call)
        share = len(rows) / max(len(self.indices), 1)
        pick = rows.tolist()
        return OutputBatch(
            calls=[self.calls[call]], indices=self.indices[rows], num_prompt_tokens=self.num_prompt_tokens[rows],
            busy_s=self.busy_s * share, padded_tokens=round(self.padded_tokens * share), in_core=self.in_core,
            data=None if self.data is None else self.data[rows],
            arrays=None if self.arrays is None else [self.arrays[i] for i in pick],
            sparse_ids=None if self.sparse_ids is None else [self.sparse_ids[i] for i in pick],
            chunks=None if self.chunks is None else self.chunks[rows],
            render_s={w: s * share for w, s in self.render_s.items()}, admit_s=self.admit_s * share)


class RenderFailed(msgspec.Struct, kw_only=True, tag=True, array_like=True):
    """Requests of one call that could not be turned into engine inputs, with why."""

    call: str
    indices: list[int]
    errors: list[str]


class StepFailed(msgspec.Struct, kw_only=True, tag=True, array_like=True):
    """A model step raised; its requests were aborted in the engine. `calls[i]` is request i's call."""

    calls: list[str]
    indices: list[int]
    error: str


# ---- control ----------------------------------------------------------------------------


class Abort(msgspec.Struct, kw_only=True, tag=True, array_like=True, omit_defaults=True):
    """Drop these requests of a call -- every one of them when `indices` is None -- waiting ones
    now, ones still on their way when they arrive."""

    call: str
    indices: list[int] | None = None


class Shutdown(msgspec.Struct, kw_only=True, tag=True, array_like=True):
    pass


class Probe(msgspec.Struct, kw_only=True, tag=True, array_like=True):
    """A no-op the frontend sends a child that said Ready: a render worker on its work socket, an
    engine core on its control socket. The Ready comes on another socket, so it can arrive before
    that socket's connection is set up at the frontend (a send then is refused); a probe that goes
    through proves the connection, and only then is a worker given work (or, at start-up, the
    group ready: an abort sent right after would otherwise be lost). (Counted as a work message
    on both sides of a worker's socket.)"""


# A child's start-up failure that is a refusal -- the model or an option refused, as a check in the
# caller would have refused it -- is raised in the caller as the error it is; any other failure is
# the child's crash (EngineDeadError, WorkerStartError).
Refusal = Literal["ValueError", "TypeError"]


class Ready(msgspec.Struct, kw_only=True, tag=True, array_like=True, omit_defaults=True):
    """Sent once by each child when it is ready to serve (or failed to start: `Ready.failed`)."""

    role: str  # "engine" or "worker"
    index: int
    pid: int
    error: str | None = None  # why it could not start: the exception's message
    info: dict[str, str | int | float | bool | None] = {}
    error_type: str | None = None  # the exception's type, by name
    refusal: Refusal | None = None  # the exception is this refusal (an instance of it)

    @classmethod
    def failed(cls, role: str, index: int, pid: int, error: BaseException) -> Ready:
        """The report of a start that raised `error`."""
        refusal = next((kind.__name__ for kind in (ValueError, TypeError) if isinstance(error, kind)), None)
        return cls(role=role, index=index, pid=pid, error=str(error) or type(error).__name__,
                   error_type=type(error).__name__, refusal=refusal)


class Heartbeat(msgspec.Struct, kw_only=True, tag=True, array_like=True):
    """Sent every second by a thread of each child: it is alive, and how long its loop has been
    inside one piece of work (a wedged step shows here; a stopped process stops sending). A render
    worker also counts the work messages it has received and finished: the frontend compares them
    with what it sent, so a batch that never reached an idle worker is noticed (ProcessGroup).
    An engine sends figures that change while it runs (its step cost estimate), for stats."""

    role: str
    index: int
    busy_s: float
    pid: int = 0  # the sender's process (a late heartbeat of a replaced worker is not the new one's)
    received: int = 0  # work messages taken from the work socket so far (render workers)
    finished: int = 0  # of those, handled to the end (rendered and sent on)
    sent_at: float = 0.0  # the sender's time.monotonic() (system-wide) when it made this heartbeat
    info: dict[str, float] = {}  # figures that change while it runs (the engine's step cost estimate), for stats


# What each socket accepts.
WorkerInbound = RenderBatch | Probe | Shutdown
EngineInbound = EngineInputBatch
EngineControl = Abort | Probe | Shutdown
FrontendInbound = OutputBatch | RenderFailed | StepFailed | Ready | Heartbeat
