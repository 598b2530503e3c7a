"""Checks the caller's prompts and options and turns each into RenderParams, lazily.

Every problem is a ValueError/TypeError raised in the caller's process that names the request's
index and what is wrong; nothing malformed reaches a worker.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from core.config import ModelSpec
from core.messages import PoolingParams, RenderParams

EMBEDDING_TASKS = ("embed", "token_embed")


@dataclass(frozen=True)
class FailedRequest:
    """A request refused in the caller (errors="return"): it becomes an error output, never sent."""

    request_id: str
    seq: int
    error: str


@dataclass(frozen=True)
class CallOptions:
    task: str  # the task the engine runs
    truncate_prompt_tokens: int | None
    num_special_tokens: int
    max_query_tokens: int | None = None
    max_doc_tokens: int | None = None
    plugin: bool = False  # prompts are raw data for the io_processor plugin
    truncate_left: bool = False
    long_inputs: str = "truncate"
    chunk_overlap: int = 0
    errors: str = "raise"  # "return": a bad request becomes an error output, the others go on


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
    if is_single_prompt(prompts):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise TypeError(f"{what} must be str, not bytes: decode the text first")
    if not isinstance(prompts, Iterable):
        raise TypeError(f"{what} must be a prompt or an iterable of prompts, got {type(prompts).__name__}")
    return prompts


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
    if p.task is not None and p.task != task:
        raise ValueError(f"{where}.task={p.task!r} conflicts with the call's task {task!r}")
    for name in ("normalize", "use_activation"):
        value = getattr(p, name)
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{where}.{name} must be a bool or None, got {value!r}")
    for name in ("dimensions", "truncate_prompt_tokens"):
        value = getattr(p, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{where}.{name} must be an int or None, got {value!r}")
    if p.dimensions is not None:
        if task not in EMBEDDING_TASKS:
            raise ValueError(f"{where}.dimensions applies to embedding tasks only, not {task!r}")
        if not 1 <= p.dimensions <= spec.hidden_size:
            raise ValueError(f"{where}: dimensions={p.dimensions} is outside [1, {spec.hidden_size}]")
        if spec.matryoshka_dimensions and p.dimensions not in spec.matryoshka_dimensions:
            raise ValueError(f"{where}: dimensions={p.dimensions} is not among the model's declared "
                             f"dimensions {spec.matryoshka_dimensions}")
    if p.normalize is not None and task not in EMBEDDING_TASKS:
        raise ValueError(f"{where}.normalize applies to embedding tasks; use use_activation for {task!r}")


def check_priority(value: object, where: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{where} must be an int, got {value!r}")


def build_requests(prompts: Iterable, spec: ModelSpec, opts: CallOptions, id_prefix: str,
                   params: tuple[Iterator, int | None], priorities: tuple[Iterator, int | None],
                   pairs: bool = False) -> Iterator[RenderParams]:
    """Yields one RenderParams per prompt (a (query, document) tuple when `pairs`), validating as
    it goes and never reading ahead of what the frontend asks for."""
    params_it, params_count = params
    priority_it, priority_count = priorities
    index = -1
    for index, prompt in enumerate(prompts):
        for count, name in ((params_count, "pooling_params"), (priority_count, "priority")):
            if count is not None and index >= count:
                raise ValueError(f"{name} has {count} entries but there are more prompts "
                                 f"(prompt {index} has none)")
        p, priority = next(params_it), next(priority_it)
        try:
            fields: dict[str, Any] = {}
            if pairs:
                fields["prompt"], fields["pair"] = prompt
            elif opts.plugin:
                fields["raw"] = _check_raw(prompt, index)
            else:
                fields = parse_prompt(prompt, index, spec)
            max_tokens = resolve_max_tokens(spec, opts, p, index)
        except (ValueError, TypeError) as e:
            if opts.errors != "return":
                raise
            yield FailedRequest(f"{id_prefix}{index}", index, str(e))
            continue
        yield RenderParams(request_id=f"{id_prefix}{index}", seq=index, task=opts.task, max_tokens=max_tokens,
                           params=p, max_query_tokens=opts.max_query_tokens, max_doc_tokens=opts.max_doc_tokens,
                           priority=priority, truncate_left=opts.truncate_left, long_inputs=opts.long_inputs,
                           chunk_overlap=opts.chunk_overlap, **fields)
    for count, name in ((params_count, "pooling_params"), (priority_count, "priority")):
        if count is not None and index + 1 != count:
            raise ValueError(f"{name} has {count} entries but there are {index + 1} prompts")


def resolve_max_tokens(spec: ModelSpec, opts: CallOptions, p: PoolingParams, index: int) -> int:
    limit = opts.truncate_prompt_tokens if opts.truncate_prompt_tokens is not None else p.truncate_prompt_tokens
    if limit is None:
        return spec.default_max_tokens
    if limit == -1:
        return spec.max_model_len
    if limit < max(1, opts.num_special_tokens) or limit > spec.max_model_len:
        raise ValueError(f"request {index}: truncate_prompt_tokens={limit} must be -1 or in "
                         f"[{max(1, opts.num_special_tokens)}, {spec.max_model_len}] for this model")
    return limit


def parse_prompt(prompt: object, index: int, spec: ModelSpec) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": check_text(prompt, index)}
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt_token_ids"}:
            return {"token_ids": _check_token_ids(prompt["prompt_token_ids"], index, spec)}
        if keys == {"prompt"}:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"request {index}: 'prompt' must be a str, got {type(prompt['prompt']).__name__}")
            return {"prompt": check_text(prompt["prompt"], index)}
        raise ValueError(f"request {index}: a dict prompt must have exactly one key, 'prompt_token_ids' "
                         f"or 'prompt'; got {sorted(map(str, keys))}")
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(x, dict) for x in prompt):
        return {"conversation": _check_conversation(prompt, index)}
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return {"token_ids": _check_token_ids(prompt, index, spec)}
    if prompt is None:
        raise TypeError(f"request {index}: prompt is None")
    raise TypeError(f"request {index}: a prompt must be a str, a list of token ids, a dict or a "
                    f"conversation, got {type(prompt).__name__}")


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


def _check_token_ids(ids: object, index: int, spec: ModelSpec) -> np.ndarray:
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
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= spec.vocab_size:
        bad = low if low < 0 else high
        position = int(np.flatnonzero(arr == bad)[0])
        raise ValueError(f"request {index}: token id {bad} at position {position} is outside the "
                         f"vocabulary [0, {spec.vocab_size})")
    return arr.astype(np.int32)
