"""Checks the caller's prompts and options and turns each into RenderParams, lazily.

Every problem is a ValueError/TypeError raised in the caller's process that names the request's
index and what is wrong; nothing malformed reaches a worker.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from core.config import ModelSpec
from core.messages import PoolingParams, RenderParams

Prompt = str | Sequence[int] | dict | np.ndarray
EMBED_TASKS = ("embed",)


@dataclass(frozen=True)
class CallOptions:
    task: str
    truncate_prompt_tokens: int | None
    num_special_tokens: int


def is_single_prompt(prompts: object) -> bool:
    """A str, a dict, a 1-D integer array or a flat list of ints is one prompt, not a list of them."""
    if isinstance(prompts, (str, dict)):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    if isinstance(prompts, (list, tuple)) and prompts:
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


def params_for(pooling_params: PoolingParams | Sequence[PoolingParams] | None, task: str) -> Iterator[PoolingParams]:
    """One PoolingParams per request, checked; a list must be as long as the prompts (checked by the caller)."""
    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        single = pooling_params or PoolingParams()
        _check_params(single, task, None)
        return itertools.repeat(single)
    if isinstance(pooling_params, (list, tuple)):
        for i, p in enumerate(pooling_params):
            _check_params(p, task, i)
        return iter(pooling_params)
    raise TypeError(f"pooling_params must be a PoolingParams, a list of them or None, got {type(pooling_params).__name__}")


def _check_params(p: object, task: str, index: int | None) -> None:
    where = "pooling_params" if index is None else f"pooling_params[{index}]"
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


def build_requests(prompts: Iterable, params: Iterator[PoolingParams], spec: ModelSpec, opts: CallOptions,
                   id_prefix: str, params_count: int | None) -> Iterator[RenderParams]:
    """Yields one RenderParams per prompt, validating as it goes (never reads ahead)."""
    index = -1
    for index, prompt in enumerate(prompts):
        if params_count is not None and index >= params_count:
            raise ValueError(f"pooling_params has {params_count} entries but there are more prompts "
                             f"(prompt {index} has none)")
        p = next(params)
        max_tokens = resolve_max_tokens(spec, opts, p, index)
        text, token_ids = parse_prompt(prompt, index, spec)
        if p.dimensions is not None and not 1 <= p.dimensions <= spec.hidden_size:
            raise ValueError(f"request {index}: dimensions={p.dimensions} is outside [1, {spec.hidden_size}]")
        yield RenderParams(request_id=f"{id_prefix}{index}", seq=index, max_tokens=max_tokens, params=p,
                           prompt=text, token_ids=token_ids)
    if params_count is not None and index + 1 != params_count:
        raise ValueError(f"pooling_params has {params_count} entries but there are {index + 1} prompts")


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


def parse_prompt(prompt: object, index: int, spec: ModelSpec) -> tuple[str | None, np.ndarray | None]:
    if isinstance(prompt, str):
        return _check_text(prompt, index), None
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt_token_ids"}:
            return None, _check_token_ids(prompt["prompt_token_ids"], index, spec)
        if keys == {"prompt"}:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"request {index}: 'prompt' must be a str, got {type(prompt['prompt']).__name__}")
            return _check_text(prompt["prompt"], index), None
        raise ValueError(f"request {index}: a dict prompt must have exactly one key, 'prompt_token_ids' "
                         f"or 'prompt'; got {sorted(map(str, keys))}")
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return None, _check_token_ids(prompt, index, spec)
    if prompt is None:
        raise TypeError(f"request {index}: prompt is None")
    raise TypeError(f"request {index}: a prompt must be a str, a list of token ids or a dict, "
                    f"got {type(prompt).__name__}")


def _check_text(text: str, index: int) -> str:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"request {index}: text is not valid Unicode (lone surrogate "
                             f"{text[e.start]!r} at character {e.start})") from None
    return text


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
