"""Checks the caller's prompts and options and turns each into RenderParams, lazily.

Every problem is a ValueError/TypeError raised in the caller's process that names the request's
index and what is wrong; nothing malformed reaches a worker.
"""

from __future__ import annotations

import collections
import functools
import importlib
import itertools
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from pooling_pipeline.audio_inputs import is_audio_string
from pooling_pipeline.core.families import family_of
from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.messages import PoolingParams, RenderBatch, RenderOptions, RenderParams
from pooling_pipeline.core.shared.schema import ids_out_of_range
from pooling_pipeline.image_inputs import is_image_string, is_numeric_array, is_pil_image, is_video_string, prompt_size
from pooling_pipeline.options import CallOptions  # (declared there, with every option's default)
from pooling_pipeline.request_options import (
    RequestValues,
    route_spec,
)


@dataclass(frozen=True)
class FailedRequest:
    """A request refused in the caller (errors="return"): it becomes an error output, never sent."""

    index: int
    error: str


@dataclass(frozen=True)
class Tokenization:
    """What the render workers reported about the model's tokenizer at start-up."""

    num_special_tokens: int
    truncation_side: str  # the tokenizer's default


def build_requests(prompts: object, opts: CallOptions, spec: ModelSpec, tokenization: Tokenization, call: str,
                   refused: dict[int, str] | None = None) -> tuple[RequestSource, int | None]:
    """The call's requests (`call`: its id), drawn lazily as RenderBatch (`RequestSource.take`), and
    how many there are when that is known. A list is checked here as far as can be without reading it all
    (per-request options); each prompt is checked as it is drawn, so a generator is never read
    ahead of the frontend. `refused`: indices refused already (errors="return"), with why."""
    if opts.pairs:
        items: Iterable = prompts  # the API pairs queries with documents
    elif opts.plugin:
        items = _plugin_items(prompts)
    else:
        items = as_prompt_iterable(prompts, images=takes_media(spec))
    count = len(items) if isinstance(items, (list, tuple)) else None
    values = RequestValues(opts, spec, count)
    side = opts.truncation_side or tokenization.truncation_side
    return RequestSource(iter(items), opts, spec, call, tokenization.num_special_tokens, side == "left",
                         values, refused or {}), count


TEXT, PAIR, IDS, ITEM = range(4)  # a request's input form: text, (query, document) pair, token ids, RenderParams
_SIZED = frozenset({str, np.ndarray, list, tuple})  # prompts whose len() is about what they hold
_LEN_SIZED = frozenset({str, list, tuple})  # (their size is len(); an ndarray's is .size)
_array_size = operator.attrgetter("size")
# Inputs read a block at a time (`RequestSource._read_block`): a list's or a tuple's iterator, which
# nothing but the source reads. A generator is read one prompt at a time, never ahead: its code may
# start other calls, wait for them, or read what the caller did with earlier results.
_READ_AHEAD = (type(iter([])), type(iter(())))
# A render message stops growing once its requests hold this many characters (one request at
# least). The engine waits for a worker's whole message: fifty 400 KB web pages in one message
# kept it idle while all fifty were shipped and rendered (5% of a 2.6 s run); alone, the first
# reaches it in milliseconds. Short and medium texts still fill messages of up to MAX_MESSAGE_ITEMS.
MESSAGE_CHARS = 1 << 18


class RequestSource:
    """A call's prompts, checked and drawn in blocks as the frontend asks for them (`take`).

    The usual call -- texts or token-id arrays, one set of options for all -- takes a fast path:
    the options are resolved once into one RenderOptions, a block of prompts (a message's worth)
    is checked whole (all texts, or all integer arrays: one concatenation and one range check for
    the ids), and only a block that fails that check is gone through prompt by prompt. Anything
    else (per-request options, dict prompts, conversations, pairs, plugin data) is checked
    prompt by prompt, each with its own options where they differ."""

    def __init__(self, prompts: Iterator, opts: CallOptions, spec: ModelSpec, call: str, num_special_tokens: int,
                 truncate_left: bool, values: RequestValues, refused: dict[int, str]) -> None:
        self.prompts = prompts
        self.opts, self.spec, self.call = opts, spec, call
        self.takes_media = takes_media(spec)  # images or audio (the model's family says: core/families/)
        self.pair_reader = pair_reader(spec)  # (a pair whose sides may be images: a multimodal reranker)
        self.prompt_on_every_input = family_of(spec).prompt_on_every_input
        self.num_special_tokens, self.truncate_left = num_special_tokens, truncate_left
        self.values = values  # each request's per-request options
        self.refused = refused
        self.counts = values.counts
        self.index = 0  # of the next prompt
        self.exhausted = False
        self.read_ahead = type(prompts) in _READ_AHEAD and not self.takes_media  # (`_read_block`)
        self.ahead: list = []  # prompts read from a list or tuple past a block's character bound, not drawn yet
        self.shared = self._shared_options()  # None: options per request
        self._last_params, self._last_max_tokens = None, 0
        self._last_route: str | None = None

    def _shared_options(self) -> RenderOptions | None:
        """The one RenderOptions of a call whose requests all share them, or None."""
        if self.counts or self.refused:
            return None
        values = self.values.shared
        text_prefix = self.values.prompt_text(values)
        if text_prefix is not None and self.opts.long_inputs == "chunk":
            return None  # refused request by request (below)
        try:
            max_tokens = resolve_max_tokens(route_spec(self.spec, values["route"]), self.opts,
                                            self.num_special_tokens, values["pooling_params"], 0)
        except ValueError:
            return None  # every request is refused, each naming itself (below)
        return self._options(values, text_prefix, max_tokens)

    def _options(self, values: dict, text_prefix: str | None, max_tokens: int) -> RenderOptions:
        """A request's RenderOptions: the call's settings and its per-request options' values."""
        opts = self.opts
        return RenderOptions(task=opts.task, max_tokens=max_tokens, params=values["pooling_params"],
                             truncate_left=self.truncate_left, long_inputs=self._long_inputs(values),
                             chunk_overlap=opts.chunk_overlap,
                             text_prefix=None if text_prefix is None else plain_str(text_prefix),
                             max_query_tokens=opts.max_tokens_per_query, max_doc_tokens=opts.max_tokens_per_doc,
                             **self.values.column_values(values))

    def _long_inputs(self, values: dict) -> str:
        """The call's long_inputs, except where ST would keep the whole text (a model with no max
        length anywhere, ModelSpec.whole_text) and the call asks for no length: a text longer than
        the pipeline keeps whole is then refused, naming its length, never cut."""
        opts = self.opts
        if (opts.long_inputs == "truncate" and opts.truncate_prompt_tokens is None
                and values["pooling_params"].truncate_prompt_tokens is None
                and route_spec(self.spec, values["route"]).whole_text):
            return "error"
        return opts.long_inputs

    def take(self, limit: int, max_chars: int) -> list[RenderBatch | FailedRequest]:
        """Up to `limit` requests, strictly in input order (the call keeps them in a ring by index):
        blocks of consecutive requests of one input form, and the requests refused here
        (errors="return"; with errors="raise" the first refusal raises).
        Stops early once the requests drawn hold `max_chars` characters, or MESSAGE_CHARS (at least
        one is drawn)."""
        prompts, exhausted = self._read(limit, min(max_chars, MESSAGE_CHARS))
        first = self.index
        self.index += len(prompts)
        out = None
        if self.shared is not None and not self.opts.pairs and not self.opts.plugin and prompts:
            block = self._plain_block(first, prompts)  # the usual block: checked whole
            if block is not None:
                out = [block]
        if out is None:
            out = self._checked_one_by_one(first, prompts)
        if exhausted:
            self._finish()
        return out

    def _read(self, limit: int, max_chars: int) -> tuple[list, bool]:
        """The next prompts: at most `limit`, and no more once they hold `max_chars` characters
        (a generator is read one at a time, never ahead); and whether the input is exhausted."""
        if self.read_ahead:
            return self._read_block(limit, max_chars)
        prompts: list = []
        chars = 0
        if self.takes_media:
            for prompt in itertools.islice(self.prompts, limit):
                prompts.append(prompt)
                chars += len(prompt) if type(prompt) is str else prompt_size(prompt)
                if chars >= max_chars:
                    return prompts, False
            return prompts, len(prompts) < limit
        # (Per prompt, a few bytecodes: a stream of short inputs spends ~0.1 us a request here.)
        append, ndarray, sized = prompts.append, np.ndarray, _SIZED
        for prompt in itertools.islice(self.prompts, limit):
            append(prompt)
            kind = type(prompt)
            # (an ndarray's size: a 0-d array has no len(), and is refused by its own check later)
            chars += prompt.size if kind is ndarray else len(prompt) if kind in sized else 1
            if chars >= max_chars:
                return prompts, False
        return prompts, len(prompts) < limit

    def _read_block(self, limit: int, max_chars: int) -> tuple[list, bool]:
        """`_read` for a list or a tuple: `limit` prompts read at once and their characters counted
        by C loops (5,000 short texts alone: ~86 -> ~49 ns a text); the prompts past the character
        bound are held in `ahead` for the next draw, first."""
        held = self.ahead
        if len(held) >= limit:
            prompts, self.ahead = held[:limit], held[limit:]
        else:
            prompts, self.ahead = held, []
            prompts += itertools.islice(self.prompts, limit - len(held))
        if sum(_sizes(prompts)) < max_chars:
            return prompts, len(prompts) < limit
        # The bound is reached: up to the prompt that reaches it, as `_read` stops.
        cut = next(k for k, chars in enumerate(itertools.accumulate(_sizes(prompts)), 1) if chars >= max_chars)
        self.ahead = prompts[cut:] + self.ahead
        return prompts[:cut], False

    def _plain_block(self, first: int, prompts: list) -> RenderBatch | None:
        """The prompts as one RenderBatch when they are all texts (valid Unicode), or all 1-D integer
        arrays with every id in the vocabulary: checked with a few calls for the whole block. None
        otherwise (then each is checked alone, and a bad one is named)."""
        kinds = set(map(type, prompts))
        indices = np.arange(first, first + len(prompts), dtype=np.int64)
        if kinds == {str}:
            if self.takes_media and any(is_image_string(p) or is_audio_string(p) or is_video_string(p) for p in prompts):
                return None  # images or audio among the texts (each is checked alone)
            joined = "".join(prompts)
            if not joined.isascii() and not _valid_unicode(joined):
                return None
            return self._batch(indices, self.shared, texts=prompts)
        if kinds != {np.ndarray} or self.takes_media:
            return None  # (arrays are images, or refused, for a model that takes images: each checked alone)
        try:
            # (a copy: the caller may change its arrays later). Arrays of one dtype -- the usual --
            # are joined as such: numpy's dtype promotion over a message of arrays cost ~0.1 us
            # an array; mixed ones are promoted (casting="no" refuses them first).
            try:
                flat = np.concatenate(prompts, dtype=prompts[0].dtype, casting="no")
            except TypeError:
                # Mixed dtypes: each must be token ids itself (a bool or float array among int ones
                # would be promoted to ints and pass): otherwise each is checked alone, and refused.
                if any(p.dtype.kind not in "iu" or p.dtype == np.uint64 for p in prompts):
                    return None
                flat = np.concatenate(prompts)
        except ValueError:  # arrays of no or of different dimensions
            return None
        if flat.ndim != 1 or flat.dtype.kind not in "iu" or flat.dtype == np.uint64:
            return None  # (int64 with uint64 concatenates to float64: refused here too)
        lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
        if int(lengths.min()) < 1:
            return None
        if ids_out_of_range(flat, self.spec.vocab_size):
            return None
        return self._batch(indices, self.shared, token_ids=flat.astype(np.int32, copy=False), lengths=lengths)

    def _checked_one_by_one(self, first: int, prompts: list) -> list[RenderBatch | FailedRequest]:
        out: list[RenderBatch | FailedRequest] = []
        form, indices, payload = -1, [], []
        for index, prompt in enumerate(prompts, first):
            try:
                this, value = self._checked(prompt, index)
            except (ValueError, TypeError) as e:
                if self.opts.errors != "return":
                    raise
                this, value = -1, FailedRequest(index, str(e))
            if this != form and indices:
                out.extend(self._close(form, indices, payload))
                indices, payload = [], []
            form = this
            if this < 0:
                out.append(value)
                continue
            indices.append(index)
            payload.append(value)
        if indices:
            out.extend(self._close(form, indices, payload))
        return out

    def _checked(self, prompt: object, index: int) -> tuple[int, object]:
        """A prompt off the fast path: (its form, what its RenderBatch holds for it). Raises
        ValueError/TypeError naming the request."""
        for count, name in self.counts:
            if index >= count:
                raise ValueError(f"{name} has {count} entries but there are more prompts (prompt {index} has none)")
        values = None
        if self.shared is None:
            values = self.values.at(index)
            text_prefix = self.values.prompt_text(values)
        else:
            text_prefix = self.shared.text_prefix
        if index in self.refused:
            raise ValueError(self.refused[index])
        opts = self.opts
        if opts.pairs:
            query, document = prompt
            pairs = self.pair_reader
            fields = {"prompt": check_text(query, index, "query"), "pair": check_text(document, index, "document")} \
                if pairs is None else {"messages": pairs(query, document, index, self.spec)}
        elif opts.plugin:
            fields = {"raw": _check_raw(prompt, index)}
        else:
            fields = parse_prompt(prompt, index, self.spec)
            if "pair" in fields:
                self._check_pair_request(index)
        if text_prefix is not None and opts.long_inputs == "chunk" and "prompt" in fields:
            raise ValueError(f"request {index}: a prompt with long_inputs='chunk' is not supported "
                             "(a long document's chunks would not all carry it)")
        if self.shared is not None and fields.keys().isdisjoint(("raw", "conversation", "media", "messages")):
            if "pair" in fields:
                return PAIR, (fields["prompt"], fields["pair"])
            return (TEXT, fields["prompt"]) if "prompt" in fields else (IDS, fields["token_ids"])
        if self.shared is not None:
            return ITEM, RenderParams(options=self.shared, **fields)
        params, route = values["pooling_params"], values["route"]
        if params is not self._last_params or route != self._last_route:  # (usually as the request before)
            self._last_max_tokens = resolve_max_tokens(route_spec(self.spec, route), opts, self.num_special_tokens,
                                                       params, index)
            self._last_params, self._last_route = params, route
        prompted = "prompt" in fields or self.prompt_on_every_input
        options = self._options(values, text_prefix if prompted else None, self._last_max_tokens)
        return ITEM, RenderParams(options=options, **fields)

    def _check_pair_request(self, index: int) -> None:
        """A (text, text_pair) prompt is classified as ST's CrossEncoder reads a pair: by a
        sequence-classification head, encoded the way score() encodes its pairs (text/text_pair,
        longest-first truncation from the right; refused past the tokens kept under long_inputs='error').
        What that encoding cannot honour is refused."""
        opts, spec = self.opts, self.spec
        if spec.head != "sequence_classification":
            raise ValueError(f"request {index}: a (text, text_pair) pair is classified by a cross-encoder (a "
                             "sequence-classification model's classify()); this model has no such head")
        if opts.task != "classify":
            raise ValueError(f"request {index}: a (text, text_pair) pair is classified by classify(), not by "
                             f"task {opts.task!r}")
        if self.truncate_left:
            raise ValueError(f"request {index}: a (text, text_pair) pair is truncated longest-first from the right "
                             "(as ST's CrossEncoder does); truncation_side='left' is not supported for pairs")
        if opts.long_inputs == "chunk":  # ('error' refuses a pair longer than the tokens kept, as score's)
            raise ValueError(f"request {index}: long_inputs='chunk' is not supported for a (text, text_pair) pair: "
                             "a pair is truncated longest-first to the model's length")

    def _close(self, form: int, indices: list[int], payload: list) -> list[RenderBatch | FailedRequest]:
        """The batch of these requests (and, for token ids, the requests refused by its check)."""
        if form == TEXT:
            return [self._batch(indices, self.shared, texts=payload)]
        if form == PAIR:
            return [self._batch(indices, self.shared, texts=[q for q, _ in payload], pairs=[d for _, d in payload])]
        if form == ITEM:
            return [self._batch(indices, items=payload)]
        # Token ids: copied once (the caller may change its arrays later) and range-checked in
        # one reduction for the whole batch.
        flat = np.concatenate(payload, dtype=np.int64, casting="unsafe")
        vocab = self.spec.vocab_size
        if ids_out_of_range(flat, vocab):
            # Someone's id is out of range: each prompt checked alone, the refused ones answered
            # apart -- in input order, as everything a source hands out (the call counts on it).
            pieces: list[RenderBatch | FailedRequest] = []
            run: list[int] = []  # positions of consecutive prompts that passed
            for position, (index, ids) in enumerate(zip(indices, payload)):
                try:
                    _check_token_ids(ids, index, vocab)
                    run.append(position)
                    continue
                except ValueError as e:
                    if self.opts.errors != "return":
                        raise
                    failed = FailedRequest(index, str(e))
                if run:
                    pieces.append(self._ids_batch([indices[i] for i in run], [payload[i] for i in run]))
                    run = []
                pieces.append(failed)
            if run:
                pieces.append(self._ids_batch([indices[i] for i in run], [payload[i] for i in run]))
            return pieces
        return [self._ids_batch(indices, payload, flat)]

    def _ids_batch(self, indices: list[int], arrays: list[np.ndarray], flat: np.ndarray | None = None) -> RenderBatch:
        if flat is None:
            flat = np.concatenate(arrays, dtype=np.int64, casting="unsafe")
        return self._batch(indices, self.shared, token_ids=flat.astype(np.int32),
                           lengths=np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays)))

    def _batch(self, indices, options: RenderOptions | None = None, **inputs) -> RenderBatch:
        """A RenderBatch of this call (`inputs`: one input form); the call's chat template goes
        with conversations only."""
        chat_template = self.opts.chat_template if "items" in inputs else None
        return RenderBatch(call=self.call, indices=np.asarray(indices, dtype=np.int64), options=options,
                           chat_template=chat_template, **inputs)

    def _finish(self) -> None:
        self.exhausted = True
        for count, name in self.counts:
            if self.index != count:
                raise ValueError(f"{name} has {count} entries but there are {self.index} prompts")

    def drain(self, block_items: int) -> PreparedSource:
        """Every request now (a list is checked whole before any work starts), as a source that
        hands them out as this one would."""
        pieces: list[RenderBatch | FailedRequest] = []
        while not self.exhausted:
            pieces.extend(self.take(block_items, 1 << 62))
        return PreparedSource(pieces)


def _sizes(prompts: list) -> Iterator[int]:
    """What each prompt holds, as `RequestSource._read` counts it (by C loops where the prompts are all
    texts, lists or tuples, or all arrays)."""
    kinds = set(map(type, prompts))
    if kinds <= _LEN_SIZED:
        return map(len, prompts)
    if kinds == {np.ndarray}:
        return map(_array_size, prompts)
    return map(_prompt_chars, prompts)


def _prompt_chars(prompt: object) -> int:
    kind = type(prompt)
    # (an ndarray's size: a 0-d array has no len(), and is refused by its own check later)
    return prompt.size if kind is np.ndarray else len(prompt) if kind in _SIZED else 1


class PreparedSource:
    """Requests drawn beforehand (`RequestSource.drain`), handed out by `take` in the same way."""

    def __init__(self, pieces: list[RenderBatch | FailedRequest]) -> None:
        self.pieces = collections.deque(pieces)
        self.exhausted = not pieces

    def take(self, limit: int, max_chars: int) -> list[RenderBatch | FailedRequest]:
        out: list[RenderBatch | FailedRequest] = []
        chars = 0
        while self.pieces and limit > 0 and chars < max_chars:
            piece = self.pieces[0]
            if type(piece) is FailedRequest:
                out.append(self.pieces.popleft())
                limit -= 1
                continue
            if len(piece) > limit:  # a part of it now, the rest later
                out.append(piece.select(list(range(limit))))
                self.pieces[0] = piece.select(list(range(limit, len(piece))))
                break
            out.append(self.pieces.popleft())
            limit -= len(piece)
            chars += int(piece.sizes.sum())
        self.exhausted = not self.pieces
        return out


def is_conversation(prompt: object) -> bool:
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(m, dict) and "role" in m for m in prompt))


def is_single_prompt(prompts: object) -> bool:
    """A str, a dict, a 1-D integer array, a flat list of ints or one conversation is one prompt."""
    if isinstance(prompts, (str, dict)) or is_pil_image(prompts):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim in (1, 3)  # token ids, or an image (H, W, C)
    if isinstance(prompts, (list, tuple)) and prompts:
        if is_conversation(prompts):
            return True
        # Numbers with an integer among them are one prompt's token ids, a float or a bool among them
        # refused as such ([101, 2.5] is no list of two prompts, the first of them "an int").
        return (all(isinstance(x, (int, float, np.integer, np.floating)) for x in prompts)
                and any(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in prompts))
    return False


def as_prompt_iterable(prompts: object, what: str = "prompts", images: bool = False) -> Iterable:
    """The call's prompts as an iterable. `images`: a model that takes images, for which a numeric
    array or tensor is one input whatever its shape, as ST's `is_singular_input` decides (a 2-D
    array is not rows of token ids there: it is audio, refused naming the request)."""
    if prompts is None:
        raise TypeError(f"{what} must be a prompt or an iterable of prompts, got None")
    if images and is_numeric_array(prompts):
        return [prompts]
    if images and isinstance(prompts, np.ndarray):  # strings or objects: a batch of their rows, as ST
        return prompts.tolist() if prompts.ndim == 1 else list(prompts)
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


@functools.cache
def _media_reader(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def media_reader(spec: ModelSpec):
    """What reads the caller's image or audio inputs for the model's family (`ModelFamily.media_input`):
    fn(prompt, index, spec) -> MediaData, or None for a text."""
    target = family_of(spec).media_input
    return None if target is None else _media_reader(target)


def message_reader(spec: ModelSpec):
    """What reads the caller's inputs of several parts for the model's family (`ModelFamily.message_input`):
    fn(prompt, index, spec) -> a list of ChatTurn, or None for a prompt that is not one."""
    target = family_of(spec).message_input
    return None if target is None else _media_reader(target)


def pair_reader(spec: ModelSpec):
    """What reads a pair whose sides may be images for the model's family (`ModelFamily.pair_input`):
    fn(query, document, index, spec) -> a list of ChatTurn; None where a pair is two texts."""
    target = family_of(spec).pair_input
    return None if target is None else _media_reader(target)


def takes_media(spec: ModelSpec) -> bool:
    """The model takes images or audio: a numeric array is one input to it, and some strings are files."""
    return bool(family_of(spec).media_renderers)


def _family_input(prompt: object, index: int, spec: ModelSpec) -> dict[str, Any] | None:
    """The prompt as the family's own input form -- chat messages with images, an image or an audio
    clip -- decided before a text is, as ST decides a modality; None for any other prompt."""
    messages = message_reader(spec)
    if messages is not None:  # (a text and an image in one input, chat messages: before a single image)
        turns = messages(prompt, index, spec)
        if turns is not None:
            return {"messages": turns}
    reader = media_reader(spec)
    if reader is not None and isinstance(prompt, str) and is_video_string(prompt):
        raise ValueError(f"request {index}: {prompt[:200]!r} is a video to sentence-transformers; video inputs are not "
                         f"supported (model {spec.path!r} takes no video)")
    if reader is not None:
        media = reader(prompt, index, spec)
        return None if media is None else {"media": media}
    if isinstance(prompt, dict) and set(prompt) in ({"image"}, {"audio"}, {"video"}):
        kind = next(iter(prompt))
        raise ValueError(f"request {index}: {'an' if kind[0] in 'aeiou' else 'a'} {kind} input, but model "
                         f"{spec.path!r} takes text only")
    return None


def parse_prompt(prompt: object, index: int, spec: ModelSpec) -> dict[str, Any]:
    own = _family_input(prompt, index, spec)
    if own is not None:
        return own
    if media_reader(spec) is not None and isinstance(prompt, dict) and set(prompt) == {"text"}:
        prompt = {"prompt": prompt["text"]}  # ST's {"text": ...}
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
        if keys == {"text", "text_pair"}:  # transformers' text-classification pipeline's pair
            return _check_pair((prompt["text"], prompt["text_pair"]), index)
        raise ValueError(f"request {index}: a dict prompt must have exactly one key, 'prompt_token_ids' "
                         f"or 'prompt' (or be a pair: 'text' and 'text_pair'); got {sorted(map(str, keys))}")
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(x, dict) for x in prompt):
        return {"conversation": _check_conversation(prompt, index)}
    if isinstance(prompt, (list, tuple)) and any(isinstance(x, str) for x in prompt):
        return _check_pair(prompt, index)  # texts in a list or tuple: a (text, text_pair) pair
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


def plain_str(text: str) -> str:
    """A str subclass (numpy's `np.str_`: the items of a string array, `zip(df.a.values, ...)`) as
    the plain str the wire encodes; a plain str as it is."""
    return text if type(text) is str else str.__str__(text)


def check_text(text: object, index: int, what: str = "text") -> str:
    if not isinstance(text, str):
        raise TypeError(f"request {index}: {what} must be a str, got {type(text).__name__}")
    text = plain_str(text)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"request {index}: {what} is not valid Unicode (lone surrogate "
                             f"{text[e.start]!r} at character {e.start})") from None
    return text


def _check_pair(pair: Sequence, index: int) -> dict[str, str]:
    """A (text, text_pair) pair -- a tuple or list of two strs, as ST's CrossEncoder.predict takes
    them -- as the fields of its request."""
    if len(pair) != 2:
        raise ValueError(f"request {index}: a pair must be (text, text_pair), two strs; got {len(pair)} items")
    text, text_pair = pair
    return {"prompt": check_text(text, index, "a pair's text"), "pair": check_text(text_pair, index, "text_pair")}


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


def _not_an_integer(ids: object, arr: np.ndarray) -> str:
    """A list's first value that is no integer, and where it is; an array's dtype."""
    if isinstance(ids, (list, tuple)):
        for position, x in enumerate(ids):
            if not isinstance(x, (int, np.integer)):
                return f"{type(x).__name__} {x!r} at position {position}"
    return f"{arr.dtype} values"


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
        raise TypeError(f"request {index}: token ids must be integers, got {_not_an_integer(ids, arr)}")
    if ids_out_of_range(arr, vocab_size):
        low, high = int(arr.min()), int(arr.max())
        bad = low if low < 0 else high
        position = int(np.flatnonzero(arr == bad)[0])
        raise ValueError(f"request {index}: token id {bad} at position {position} is outside the "
                         f"vocabulary [0, {vocab_size})")
    return arr.astype(np.int32)
