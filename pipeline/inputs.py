"""Checks the caller's prompts and options and turns each into RenderParams, lazily.

Every problem is a ValueError/TypeError raised in the caller's process that names the request's
index and what is wrong; nothing malformed reaches a worker.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from pooling_pipeline.core.config import ModelSpec
from pooling_pipeline.core.messages import PoolingParams, RenderParams
from pooling_pipeline.core.options import (
    ErrorsMode,
    LongInputs,
    NonNegativeInt,
    PositiveInt,
    Task,
    TruncationSide,
    checked,
)

# Priorities travel as msgpack ints and are compared in the engine: keep them in int64.
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class FailedRequest:
    """A request refused in the caller (errors="return"): it becomes an error output, never sent."""

    request_id: str
    index: int
    error: str


class CallOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one call was asked for: built and checked once (`checked`), carried to the Call."""

    task: Task  # what the engine runs
    plugin: bool = False  # prompts are raw items for the io_processor plugin
    pairs: bool = False  # prompts are (query, document) pairs for a cross-encoder
    pooling_params: Any = None  # one PoolingParams, a list with one per prompt, or None
    priority: Any = None  # one int, a list with one per prompt, or None (lower runs first)
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    use_tqdm: bool = True
    chat_template: str | None = None
    long_inputs: LongInputs = "truncate"
    chunk_overlap: NonNegativeInt = 0  # chunk mode: tokens shared by consecutive chunks
    truncation_side: TruncationSide | None = None  # None: the tokenizer's own
    errors: ErrorsMode = "raise"
    max_tokens_per_query: PositiveInt | None = None  # cross-encoder pairs: content tokens per side
    max_tokens_per_doc: PositiveInt | None = None
    prompt: Any = None  # text put in front of each text (one str, or one per prompt); wins over prompt_name
    prompt_name: Any = None  # a name in the model's `prompts` (one, or one per prompt)

    def __post_init__(self) -> None:
        if self.long_inputs == "chunk" and self.task != "embed":
            raise ValueError(f"long_inputs='chunk' pools chunks into one embedding: it applies to 'embed', "
                             f"not {self.task!r}")


@dataclass(frozen=True)
class Tokenization:
    """What the render workers reported about the model's tokenizer at start-up."""

    num_special_tokens: int
    truncation_side: str  # the tokenizer's default


def build_requests(prompts: object, opts: CallOptions, spec: ModelSpec, tokenization: Tokenization,
                   id_prefix: str) -> tuple[Iterator[RenderParams | FailedRequest], int | None]:
    """The call's requests, lazily, and how many there are when that is known.

    A list is checked here as far as can be without reading it all (per-request options); each
    prompt is checked as it is drawn, so a generator is never read ahead of the frontend."""
    if opts.pairs:
        items: Iterable = prompts  # the API pairs queries with documents
    elif opts.plugin:
        items = _plugin_items(prompts)
    else:
        items = as_prompt_iterable(prompts)
    count = len(items) if isinstance(items, (list, tuple)) else None
    if opts.pooling_params is not None and not isinstance(opts.pooling_params, (PoolingParams, list, tuple)):
        raise TypeError(f"pooling_params must be a PoolingParams, a list of them or None, "
                        f"got {type(opts.pooling_params).__name__}")
    params = per_request(PoolingParams() if opts.pooling_params is None else opts.pooling_params,
                         "pooling_params", lambda p, where: check_params(p, where, opts.task, spec), count)
    priorities = per_request(0 if opts.priority is None else opts.priority, "priority", check_priority, count)
    prefixes = _prompt_prefixes(opts, spec, count)
    side = opts.truncation_side or tokenization.truncation_side
    id_blocks = TokenIdBlocks(items, spec.vocab_size) if isinstance(items, (list, tuple)) and not opts.pairs \
        and not opts.plugin else None
    return _requests(iter(items), opts, spec, tokenization.num_special_tokens, side == "left", id_prefix,
                     params, priorities, prefixes, id_blocks), count


class TokenIdBlocks:
    """Token-id prompts of a list, checked a block at a time: one concatenation and one range
    check for a thousand integer arrays instead of a few numpy calls each (numpy's per-call cost
    is most of what a short prompt costs). `ids(index)` is the prompt's ids as an int32 view of
    its block's copy, or None when the prompt is not a 1-D integer array or its block holds an
    id out of range: such a prompt takes the per-request check, which names what is wrong."""

    BLOCK = 1024

    def __init__(self, items: list | tuple, vocab_size: int) -> None:
        self.items = items
        self.vocab_size = vocab_size
        self.block_start = -1
        self.views: dict[int, np.ndarray] = {}

    def ids(self, index: int) -> np.ndarray | None:
        start = index - index % self.BLOCK
        if start != self.block_start:
            self.block_start = start
            self.views = self._check_block(start)
        return self.views.get(index)

    def _check_block(self, start: int) -> dict[int, np.ndarray]:
        block = self.items[start:start + self.BLOCK]
        arrays = [(start + i, a) for i, a in enumerate(block)
                  if type(a) is np.ndarray and a.ndim == 1 and a.size and a.dtype.kind in "iu"]
        if not arrays:
            return {}
        # As int64 then read as unsigned: a negative id (or a uint64 one past 2**63) is huge, so
        # one maximum finds any id outside the vocabulary.
        flat = np.concatenate([a for _, a in arrays], dtype=np.int64, casting="unsafe")
        if int(flat.view(np.uint64).max()) >= self.vocab_size:
            return {}
        flat = flat.astype(np.int32)  # the caller's arrays are copied: changing them later changes nothing
        ends = np.cumsum([a.size for _, a in arrays]).tolist()
        return {index: flat[end - a.size:end] for (index, a), end in zip(arrays, ends)}


def _prompt_prefixes(opts: CallOptions, spec: ModelSpec, count: int | None) -> tuple[Iterator, int | None]:
    """Each request's prompt text, resolved as ST's encode does: an explicit `prompt` wins, else
    `prompt_name` (looked up in the model's prompts), else the model's default_prompt_name."""
    def check_prompt(value: object, where: str) -> None:
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{where} must be a str or None, got {type(value).__name__}")

    def check_name(value: object, where: str) -> None:
        check_prompt(value, where)
        if value is not None and value not in spec.prompts:
            raise ValueError(f"{where}={value!r} is not among the model's prompts {sorted(spec.prompts)}")

    prompts_it, prompts_count = per_request(opts.prompt, "prompt", check_prompt, count)
    names_it, names_count = per_request(opts.prompt_name, "prompt_name", check_name, count)
    default = spec.prompts.get(spec.default_prompt_name) if spec.default_prompt_name else None
    if prompts_count is None and names_count is None:  # one for the whole call
        prompt, name = opts.prompt, opts.prompt_name
        text = prompt if prompt is not None else spec.prompts[name] if name is not None else default
        return itertools.repeat(text or None), None

    def resolve() -> Iterator[str | None]:
        for prompt, name in zip(prompts_it, names_it):
            text = prompt if prompt is not None else spec.prompts[name] if name is not None else default
            yield text or None

    counts = [c for c in (prompts_count, names_count) if c is not None]
    return resolve(), (counts[0] if counts else None)


def is_conversation(prompt: object) -> bool:
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(m, dict) and "role" in m for m in prompt))


def is_single_prompt(prompts: object) -> bool:
    """A str, a dict, a 1-D integer array, a flat list of ints or one conversation is one prompt."""
    if isinstance(prompts, (str, dict)):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    if isinstance(prompts, (list, tuple)) and prompts:
        if is_conversation(prompts):
            return True
        return all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in prompts)
    return False


def as_prompt_iterable(prompts: object, what: str = "prompts") -> Iterable:
    if prompts is None:
        raise TypeError(f"{what} must be a prompt or an iterable of prompts, got None")
    prompts = from_column(prompts)
    if is_single_prompt(prompts):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise TypeError(f"{what} must be str, not bytes: decode the text first")
    if not isinstance(prompts, Iterable):
        raise TypeError(f"{what} must be a prompt or an iterable of prompts, got {type(prompts).__name__}")
    return prompts


def from_column(prompts: object) -> object:
    """The columns people hold, as prompts: a numpy array of strings (`df.text.values`, dtype object
    or str) is one text per element and a 2-D integer array one token-id list per row; a pandas
    Series, a pyarrow (chunked) array and a `datasets` column give their values (a chunked array
    lazily, chunk by chunk). Anything else is returned as it is."""
    if isinstance(prompts, np.ndarray):
        if prompts.ndim == 1 and prompts.dtype.kind in "OUS":
            return prompts.tolist()
        if prompts.ndim == 2 and prompts.dtype.kind in "iu":
            return list(prompts)
        return prompts
    module = type(prompts).__module__.split(".", 1)[0]
    if module == "pandas" and hasattr(prompts, "tolist"):
        return prompts.tolist()
    if module == "pyarrow":
        if hasattr(prompts, "chunks"):  # ChunkedArray: one chunk in Python objects at a time
            return (value for chunk in prompts.chunks for value in chunk.to_pylist())
        if hasattr(prompts, "to_pylist"):
            return prompts.to_pylist()
    if module == "datasets":
        return list(prompts)
    return prompts


def _plugin_items(data) -> list | Iterable:
    """Plugin input: a list or other iterable of raw items, or a single item (a str or dict is one item)."""
    if data is None:
        raise TypeError("plugin data must be an item or a list of items, got None")
    if isinstance(data, (str, dict, bytes)) or not isinstance(data, Iterable):
        return [data]
    return data


def per_request(value: object, name: str, check, count: int | None) -> tuple[Iterator, int | None]:
    """One value for every request, or a list with one per request (its length checked later)."""
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check(v, f"{name}[{i}]")
        if count is not None and len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries but there are {count} prompts")
        return iter(value), len(value)
    check(value, name)
    return itertools.repeat(value), None


def check_params(p: object, where: str, task: str, spec: ModelSpec) -> None:
    if not isinstance(p, PoolingParams):
        raise TypeError(f"{where} must be a PoolingParams, got {type(p).__name__}")
    # The caller may have built it with any values: check types and ranges as msgspec declares them.
    checked(PoolingParams, msgspec.structs.asdict(p), f"{where}.")
    p.verify(where, task, spec)


def check_priority(value: object, where: str) -> None:
    # One entry of a per-request list ("priority[3]") names its request.
    if where.startswith("priority["):
        where = f"request {where[len('priority['):-1]}: {where}"
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{where} must be an int, got {value!r}")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValueError(f"{where} must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {value}")


def _requests(prompts: Iterator, opts: CallOptions, spec: ModelSpec, num_special_tokens: int, truncate_left: bool,
              id_prefix: str, params: tuple[Iterator, int | None], priorities: tuple[Iterator, int | None],
              prefixes: tuple[Iterator, int | None], id_blocks: TokenIdBlocks | None = None
              ) -> Iterator[RenderParams | FailedRequest]:
    """Yields one RenderParams per prompt (a (query, document) tuple for pairs), validating as
    it goes and never reading ahead of what the frontend asks for."""
    params_it, params_count = params
    priority_it, priority_count = priorities
    prefix_it, prefix_count = prefixes
    per_request_counts = ((params_count, "pooling_params"), (priority_count, "priority"), (prefix_count, "prompt"))
    limits = [(count, name) for count, name in per_request_counts if count is not None]
    plain_text = not opts.pairs and not opts.plugin
    index = -1
    last_params, max_tokens = None, 0  # the params max_tokens was last resolved for
    for index, prompt in enumerate(prompts):
        for count, name in limits:
            if index >= count:
                raise ValueError(f"{name} has {count} entries but there are more prompts "
                                 f"(prompt {index} has none)")
        p, priority, text_prefix = next(params_it), next(priority_it), next(prefix_it)
        # The usual requests -- a text, or a well-formed token-id array (checked with its block,
        # or range-checked when sent) -- are built without a detour.
        ids = None
        if plain_text and (
                (type(prompt) is str and (prompt.isascii() or _valid_unicode(prompt))
                 and (text_prefix is None or opts.long_inputs != "chunk"))
                or (type(prompt) is np.ndarray
                    and (ids := id_blocks.ids(index) if id_blocks is not None else _quick_ids(prompt)) is not None)):
            if p is not last_params:  # (the same params for every request, as usual: resolved once)
                try:
                    max_tokens = resolve_max_tokens(spec, opts, num_special_tokens, p, index)
                except ValueError as e:
                    if opts.errors != "return":
                        raise
                    yield FailedRequest(f"{id_prefix}{index}", index, str(e))
                    continue
                last_params = p
            text = ids is None
            yield RenderParams(f"{id_prefix}{index}", index, opts.task, max_tokens, p, prompt if text else None,
                               token_ids=ids, max_query_tokens=opts.max_tokens_per_query,
                               max_doc_tokens=opts.max_tokens_per_doc, priority=priority, truncate_left=truncate_left,
                               long_inputs=opts.long_inputs, chunk_overlap=opts.chunk_overlap,
                               text_prefix=text_prefix if text else None)
            continue
        try:
            fields: dict[str, Any] = {}
            if opts.pairs:
                query, document = prompt
                fields["prompt"] = check_text(query, index, "query")
                fields["pair"] = check_text(document, index, "document")
            elif opts.plugin:
                fields["raw"] = _check_raw(prompt, index)
            else:
                fields = parse_prompt(prompt, index, spec)
            max_tokens = resolve_max_tokens(spec, opts, num_special_tokens, p, index)
            if text_prefix is not None and opts.long_inputs == "chunk":
                raise ValueError(f"request {index}: a prompt with long_inputs='chunk' is not supported "
                                 "(a long document's chunks would not all carry it)")
        except (ValueError, TypeError) as e:
            if opts.errors != "return":
                raise
            yield FailedRequest(f"{id_prefix}{index}", index, str(e))
            continue
        yield RenderParams(request_id=f"{id_prefix}{index}", index=index, task=opts.task, max_tokens=max_tokens,
                           params=p, max_query_tokens=opts.max_tokens_per_query,
                           max_doc_tokens=opts.max_tokens_per_doc, priority=priority, truncate_left=truncate_left,
                           long_inputs=opts.long_inputs, chunk_overlap=opts.chunk_overlap,
                           text_prefix=text_prefix if "prompt" in fields else None, **fields)
    for count, name in per_request_counts:
        if count is not None and index + 1 != count:
            raise ValueError(f"{name} has {count} entries but there are {index + 1} prompts")


def resolve_max_tokens(spec: ModelSpec, opts: CallOptions, num_special_tokens: int, p: PoolingParams,
                       index: int) -> int:
    limit = opts.truncate_prompt_tokens if opts.truncate_prompt_tokens is not None else p.truncate_prompt_tokens
    if limit is None:
        return spec.default_max_tokens
    if limit == -1:
        return spec.max_model_len
    if limit < max(1, num_special_tokens) or limit > spec.max_model_len:
        raise ValueError(f"request {index}: truncate_prompt_tokens={limit} must be -1 or in "
                         f"[{max(1, num_special_tokens)}, {spec.max_model_len}] for this model")
    return limit


def parse_prompt(prompt: object, index: int, spec: ModelSpec) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": check_text(prompt, index)}
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt_token_ids"}:
            return {"token_ids": _check_token_ids(prompt["prompt_token_ids"], index, spec.vocab_size)}
        if keys == {"prompt"}:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"request {index}: 'prompt' must be a str, got {type(prompt['prompt']).__name__}")
            return {"prompt": check_text(prompt["prompt"], index)}
        raise ValueError(f"request {index}: a dict prompt must have exactly one key, 'prompt_token_ids' "
                         f"or 'prompt'; got {sorted(map(str, keys))}")
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(x, dict) for x in prompt):
        return {"conversation": _check_conversation(prompt, index)}
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return {"token_ids": _check_token_ids(prompt, index, spec.vocab_size)}
    if prompt is None:
        raise TypeError(f"request {index}: prompt is None")
    raise TypeError(f"request {index}: a prompt must be a str, a list of token ids, a dict or a "
                    f"conversation, got {type(prompt).__name__}")


def _valid_unicode(text: str) -> bool:
    """No lone surrogate (which cannot be encoded, so no tokenizer can take it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_text(text: object, index: int, what: str = "text") -> str:
    if not isinstance(text, str):
        raise TypeError(f"request {index}: {what} must be a str, got {type(text).__name__}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"request {index}: {what} is not valid Unicode (lone surrogate "
                             f"{text[e.start]!r} at character {e.start})") from None
    return text


def _check_conversation(conversation: Sequence[dict], index: int) -> list[dict[str, str]]:
    messages = []
    for turn, message in enumerate(conversation):
        if set(message) - {"role", "content"} or not {"role", "content"} <= set(message):
            raise ValueError(f"request {index}: conversation message {turn} must have exactly the keys "
                             f"'role' and 'content', got {sorted(map(str, message))}")
        role = check_text(message["role"], index, f"conversation message {turn} role")
        content = check_text(message["content"], index, f"conversation message {turn} content")
        messages.append({"role": role, "content": content})
    return messages


def _check_raw(raw: object, index: int) -> object:
    if raw is None:
        raise TypeError(f"request {index}: plugin input is None")
    try:
        msgspec.msgpack.encode(raw)
    except (TypeError, msgspec.EncodeError) as e:
        raise TypeError(f"request {index}: plugin input must be plain data (str, numbers, lists, dicts): {e}") from None
    return raw


# Below this many ids, Python's min/max over a list beat numpy's per-call cost.
QUICK_CHECK_MAX_IDS = 128


def _quick_ids(arr: np.ndarray) -> np.ndarray | None:
    """A copy of a 1-D integer array, its range not checked yet (the frontend checks a whole
    message's ids at once before sending them: `token_id_errors`); None for anything else (then
    `_check_token_ids` says what is wrong). int32 when every value of its type fits, int64
    otherwise (narrowed once checked: a cast now could wrap an id into range); uint64 takes the
    per-request check (int64 cannot hold all of it)."""
    if arr.ndim != 1 or not arr.size or arr.dtype.kind not in "iu" or arr.dtype == np.uint64:
        return None
    narrow = arr.dtype.itemsize < 4 or arr.dtype == np.int32
    return arr.astype(np.int32 if narrow else np.int64)


def token_id_errors(requests: list[RenderParams], vocab_size: int) -> list[tuple[int, str]]:
    """(position, error) for each request whose token ids leave the vocabulary: one reduction
    over all of them in the usual case, the per-request check only when it finds something."""
    arrays = [r.token_ids for r in requests if r.token_ids is not None]
    if not arrays:
        return []
    flat = np.concatenate(arrays)  # int32 or int64: a negative id read as unsigned is huge
    if int(flat.view(np.uint32 if flat.dtype == np.int32 else np.uint64).max()) < vocab_size:
        return []
    errors = []
    for position, request in enumerate(requests):
        ids = request.token_ids
        if ids is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            try:
                _check_token_ids(ids, request.index, vocab_size)
            except ValueError as e:
                errors.append((position, str(e)))
    return errors


def _check_token_ids(ids: object, index: int, vocab_size: int) -> np.ndarray:
    if isinstance(ids, (list, tuple)) and any(isinstance(x, bool) for x in ids):
        raise TypeError(f"request {index}: token ids must be integers, not bools")
    try:
        arr = np.asarray(ids)
    except ValueError:  # ragged nesting
        raise TypeError(f"request {index}: token ids must be a flat list of integers") from None
    if arr.ndim != 1:
        raise TypeError(f"request {index}: token ids must be a flat list of integers, got an array "
                        f"of {arr.ndim} dimensions")
    if arr.size == 0:
        raise ValueError(f"request {index}: the prompt's token id list is empty")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"request {index}: token ids must be integers, got {arr.dtype} values")
    # One reduction: read as unsigned, a negative id is huge, so the maximum alone finds any id out of range.
    as_int64 = arr if arr.dtype == np.int64 else arr.astype(np.int64)
    if int(as_int64.view(np.uint64).max()) >= vocab_size:
        low, high = int(arr.min()), int(arr.max())
        bad = low if low < 0 else high
        position = int(np.flatnonzero(arr == bad)[0])
        raise ValueError(f"request {index}: token id {bad} at position {position} is outside the "
                         f"vocabulary [0, {vocab_size})")
    return arr.astype(np.int32)
