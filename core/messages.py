"""Every message that crosses a process boundary, as typed msgspec structs.

One module so that the wire protocol can be read in one place. Each socket decodes against the
union of the message types it expects (tagged by class name); anything else is rejected.
The per-request structs are created with `gc=False`: thousands are alive at once in every
process, and the cyclic garbage collector would otherwise walk them all again and again (it cost
the frontend a fifth of its time); none can be part of a reference cycle (their fields are
scalars, strings, arrays and plain data).
Arrays (token ids, pooled outputs) are `np.ndarray` fields: `core.serial` moves them as raw bytes,
inline when small and as separate zero-copy frames when large. Nothing is pickled.

Flow:  frontend --RenderBatch--> render worker --EngineInputBatch--> engine core
       engine core --OutputBatch / StepFailed--> frontend;  render worker --RenderFailed--> frontend
       frontend --Abort / Shutdown--> engine core;  frontend --Shutdown--> render worker
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np

from pooling_pipeline.core.options import EMBEDDING_TASKS, LongInputs, PositiveInt, Task


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Per-request pooling options. `None` means "the model's default"."""

    task: Task | None = None
    normalize: bool | None = None  # embedding tasks: L2-normalize the vector
    dimensions: PositiveInt | None = None  # embedding tasks (Matryoshka): keep the first k values
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
            if model.matryoshka_dimensions and self.dimensions not in model.matryoshka_dimensions:
                raise ValueError(f"{where}: dimensions={self.dimensions} is not among the model's declared "
                                 f"dimensions {model.matryoshka_dimensions}")
        if self.normalize is not None and task not in EMBEDDING_TASKS:
            raise ValueError(f"{where}.normalize applies to embedding tasks; use use_activation for {task!r}")


class RenderParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's raw input and options, before tokenization (frontend -> render worker).

    Exactly one input form is set: `prompt` (text, with `pair` for a cross-encoder's document),
    `token_ids` (used verbatim), `conversation` (rendered with the chat template) or `raw`
    (handed to the io_processor plugin's `render`).
    """

    request_id: str  # external id
    index: int  # position in the caller's input; the frontend restores order with it
    task: Task
    max_tokens: int  # keep at most this many tokens (special tokens included), resolved by the frontend
    params: PoolingParams
    prompt: str | None = None
    pair: str | None = None
    token_ids: np.ndarray | None = None  # int32 (int64 in the frontend until its range is checked; int32 on the wire)
    conversation: list[dict[str, str]] | None = None
    raw: Any = None
    max_query_tokens: int | None = None  # pairs: content tokens kept of each side before pairing
    max_doc_tokens: int | None = None
    priority: int = 0
    truncate_left: bool = False  # keep the last tokens instead of the first
    long_inputs: LongInputs = "truncate"
    chunk_overlap: int = 0  # chunk mode: tokens shared by consecutive chunks
    # The model's prompt (ST's `prompts`), put in front of the text (of a pair's first text) in the
    # worker; sent apart so the worker can count its tokens (pooling may leave them out).
    text_prefix: str | None = None


class PoolingEngineInput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's token ids and params, ready for the engine core (render worker -> engine)."""

    request_id: str
    index: int
    task: Task
    token_ids: np.ndarray | None  # int32, already truncated (packed per batch on the wire: None there)
    params: PoolingParams
    # Token type ids are zeros then ones (a text pair): only the index of the first 1 travels.
    token_type_start: int | None = None
    priority: int = 0
    # Tokens at the start that pooling leaves out: the prompt's, when the model's Pooling has
    # include_prompt=false (ST's prompt_length).
    pool_start: int = 0
    # Chunk mode: this input is chunk `chunk` of `num_chunks` of one long document (same external id).
    chunk: int = -1
    num_chunks: int = 0


# ---- batches on the wire -------------------------------------------------------------------


class RenderBatch(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Requests for a render worker. Token-id prompts travel packed (`encode_packed` / `unpack`):
    one array for the message, like EngineInputBatch, not one encoded array per request."""

    items: list[RenderParams]  # token_ids None where they are in `token_ids` below
    chat_template: str | None = None  # the call's template for conversations (once per batch)
    engine: int = 0  # data parallel: the engine core these requests go to (the frontend picks it)
    token_ids: np.ndarray | None = None  # int32: the ids of the items in `with_ids`, back to back
    lengths: np.ndarray | None = None  # int64, one per item in `with_ids`
    with_ids: np.ndarray | None = None  # int64: positions in `items` of the token-id prompts

    @classmethod
    def encode_packed(cls, encoder, items: list[RenderParams], chat_template: str | None = None,
                      engine: int = 0) -> list:
        """The frames of a batch of these items with their ids packed. The items are the
        frontend's own (kept to re-send): their ids are taken out only while encoding."""
        with_ids = [i for i, item in enumerate(items) if item.token_ids is not None]
        if not with_ids:
            return encoder.encode(cls(items, chat_template, engine))
        arrays = [items[i].token_ids for i in with_ids]
        batch = cls(items, chat_template, engine, np.concatenate(arrays).astype(np.int32, copy=False),
                    np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays)),
                    np.asarray(with_ids, dtype=np.int64))
        try:
            for i in with_ids:
                items[i].token_ids = None
            return encoder.encode(batch)
        finally:
            for i, ids in zip(with_ids, arrays):
                items[i].token_ids = ids

    def unpack(self) -> list[RenderParams]:
        """The items, each token-id prompt with a view of its ids. ValueError when the parts do
        not fit together."""
        if self.token_ids is None and self.lengths is None and self.with_ids is None:
            return self.items
        ids, lengths, where = self.token_ids, self.lengths, self.with_ids
        if (ids is None or lengths is None or where is None or ids.ndim != 1 or lengths.ndim != 1
                or where.ndim != 1 or lengths.dtype.kind != "i" or where.dtype.kind != "i"
                or len(lengths) != len(where) or (lengths.size and int(lengths.min()) < 0)
                or int(lengths.sum()) != ids.size
                or (where.size and (int(where.min()) < 0 or int(where.max()) >= len(self.items)))
                or len(set(where.tolist())) != where.size):
            raise ValueError("packed token ids do not match the items")
        start = 0
        for i, length in zip(where.tolist(), lengths.tolist()):
            item = self.items[i]
            if (item.token_ids is not None or item.prompt is not None or item.pair is not None
                    or item.conversation is not None or item.raw is not None):
                raise ValueError(f"item {i} has packed token ids and another input")
            item.token_ids = ids[start:start + length]
            start += length
        return self.items


class EngineInputBatch(msgspec.Struct, tag=True, array_like=True):
    """Engine inputs with their token ids packed into one array (one buffer per message instead
    of one per request: decoding and validating cost per message, not per request).
    Build it with `pack`; `unpack` gives the inputs back with their ids."""

    worker: int
    items: list[PoolingEngineInput]  # token_ids None: they are in `token_ids` below
    token_ids: np.ndarray  # int32, every item's ids back to back
    lengths: np.ndarray  # int64, one per item
    render_s: float = 0.0  # the worker's rendering time since its previous message (for stats)

    @classmethod
    def pack(cls, worker: int, items: list[PoolingEngineInput], render_s: float = 0.0) -> EngineInputBatch:
        """Takes the items' ids into one array (the items themselves are left without them)."""
        arrays = [item.token_ids for item in items]
        flat = np.concatenate(arrays).astype(np.int32, copy=False) if arrays else np.zeros(0, np.int32)
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        for item in items:
            item.token_ids = None
        return cls(worker, items, flat, lengths, render_s)

    def unpack(self) -> list[PoolingEngineInput]:
        """The items, each with a view of its ids. ValueError when the parts do not fit together."""
        lengths, ids = self.lengths, self.token_ids
        if lengths.ndim != 1 or lengths.dtype.kind != "i" or len(lengths) != len(self.items) or ids.ndim != 1:
            raise ValueError("packed token ids do not match the items' lengths")
        sizes = lengths.tolist()  # (a message's few dozen: Python's min and sum beat numpy's per-call cost)
        if sizes and (min(sizes) < 0 or sum(sizes) != ids.size) or not sizes and ids.size:
            raise ValueError("packed token ids do not match the items' lengths")
        start = 0
        for item, length in zip(self.items, sizes):
            if item.token_ids is not None:
                raise ValueError("token ids must travel packed, not in the items")
            item.token_ids = ids[start:start + length]
            start += length
        return self.items


class OutputBatch(msgspec.Struct, tag=True, array_like=True):
    """A step's outputs, as columns: one entry per request in each (no struct per request).
    When they are all vectors of one size (embeddings, class probabilities, scores) their data
    travels as one [n, dim] array, `data`; otherwise each output's array is in `arrays`.
    Build it with `pack`; a receiver calls `unpack` (which checks it) before reading it."""

    request_ids: list[str]
    indices: np.ndarray  # int64: each request's position in its call's input
    num_prompt_tokens: np.ndarray  # int64
    busy_s: float  # engine time spent on this batch (forward + pooling)
    padded_tokens: int  # tokens the forward pass computed, padding included
    in_core: int  # requests admitted in the engine when this batch was formed
    data: np.ndarray | None = None  # [n, dim] float32: row i is output i
    arrays: list[np.ndarray] | None = None  # or output i's own array ([tokens, dim], sparse weights ...)
    sparse_ids: list[np.ndarray] | None = None  # sparse_embed: output i's token ids (int32), its weights in `arrays`
    chunks: np.ndarray | None = None  # chunk mode: [n, 2] int64 (chunk, num_chunks); None when no output is a chunk
    # Stage times since the previous OutputBatch, for stats: rendering per worker (reported by
    # the workers with their inputs) and the engine's own time reading and admitting inputs.
    render_s: dict[int, float] = {}
    admit_s: float = 0.0

    @classmethod
    def pack(cls, batch: list[PoolingEngineInput], results, busy_s: float, padded_tokens: int, in_core: int,
             render_s: dict[int, float] | None = None, admit_s: float = 0.0, sparse: bool = False) -> OutputBatch:
        """The outputs of `batch`: `results` is an [n, dim] array, or one array per request
        ((token ids, weights) pairs when `sparse`)."""
        n = len(batch)
        indices = np.array([r.index for r in batch], dtype=np.int64)
        tokens = np.array([r.token_ids.size for r in batch], dtype=np.int64)
        chunks = None
        if n and max([r.chunk for r in batch]) >= 0:
            chunks = np.array([(r.chunk, r.num_chunks) for r in batch], dtype=np.int64).reshape(n, 2)
        data = arrays = sparse_ids = None
        if isinstance(results, np.ndarray):
            data = np.ascontiguousarray(results, dtype=np.float32)
        elif sparse:
            sparse_ids = [ids for ids, _ in results]
            arrays = [weights for _, weights in results]
        elif results and all(a.ndim == 1 for a in results) and len({a.shape for a in results}) == 1:
            data = np.stack(results).astype(np.float32, copy=False)
        else:
            arrays = list(results)
        return cls([r.request_id for r in batch], indices, tokens, busy_s, padded_tokens, in_core, data, arrays,
                   sparse_ids, chunks, render_s or {}, admit_s)

    def check(self) -> None:
        """ValueError when the columns do not fit together (a malformed message)."""
        n = len(self.request_ids)
        if self.indices.shape != (n,) or self.num_prompt_tokens.shape != (n,) \
                or self.indices.dtype.kind != "i" or self.num_prompt_tokens.dtype.kind != "i":
            raise ValueError("output columns do not have one entry per request")
        if (self.data is None) == (self.arrays is None):
            raise ValueError("outputs need exactly one of data and arrays")
        if self.data is not None and (self.data.ndim != 2 or self.data.shape[0] != n):
            raise ValueError("packed output rows do not match the outputs")
        if self.arrays is not None and len(self.arrays) != n:
            raise ValueError("output arrays do not match the outputs")
        if self.sparse_ids is not None and (self.arrays is None or len(self.sparse_ids) != n or any(
                ids.shape != weights.shape for ids, weights in zip(self.sparse_ids, self.arrays))):
            raise ValueError("sparse token ids do not match their weights")
        if self.chunks is not None and (self.chunks.shape != (n, 2) or self.chunks.dtype.kind != "i"):
            raise ValueError("chunk numbers do not match the outputs")

    def unpack(self) -> None:
        """Checks the message (ValueError when malformed) and leaves each output's own array in
        `arrays` (`data` None): a copy of its row, or of its array when that is a view of a
        received frame -- a caller keeping a few results must not keep whole batches alive."""
        self.check()
        if self.data is not None:
            self.arrays, self.data = [row.copy() for row in self.data], None
        else:
            self.arrays = [a if a.flags.owndata else a.copy() for a in self.arrays]
        if self.sparse_ids is not None:
            self.sparse_ids = [a if a.flags.owndata else a.copy() for a in self.sparse_ids]

    def select(self, positions: list[int], share: float) -> OutputBatch:
        """The outputs at these positions, with the step's costs scaled by `share` (a step that
        served several calls: each gets its part)."""
        pick = np.asarray(positions, dtype=np.int64)
        return OutputBatch(
            [self.request_ids[i] for i in positions], self.indices[pick], self.num_prompt_tokens[pick],
            self.busy_s * share, round(self.padded_tokens * share), self.in_core,
            None if self.data is None else self.data[pick],
            None if self.arrays is None else [self.arrays[i] for i in positions],
            None if self.sparse_ids is None else [self.sparse_ids[i] for i in positions],
            None if self.chunks is None else self.chunks[pick],
            {w: s * share for w, s in self.render_s.items()}, self.admit_s * share)


class RenderFailed(msgspec.Struct, tag=True, array_like=True):
    """A render worker could not turn some requests into engine inputs."""

    request_ids: list[str]
    indices: list[int]
    errors: list[str]


class StepFailed(msgspec.Struct, tag=True, array_like=True):
    """A model step raised; its requests were aborted in the engine."""

    request_ids: list[str]
    indices: list[int]
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
