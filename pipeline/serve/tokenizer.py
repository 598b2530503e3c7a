"""The model's tokenizer in the server process, for what a route must answer without the pipeline:
TEI's `/tokenize` and `/decode`, and what was cut of a scored pair (or text) where the dialect says so
(Cohere's meta.warnings; an over-long one is refused by the render workers, long_inputs='error').

It is the render workers' own tokenizer (`workers.render.render_backend`: transformers' configured
backend, ST's do_lower_case, special tokens as ST adds them), so its ids are the ones the model sees.
It is loaded on first use, once per server, in a thread: AutoTokenizer takes about a second, and the
event loop keeps answering meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import NamedTuple

import numpy as np


class ServedTokenizer:
    """One model's tokenizer: `tokenize` (whole texts, TEI's /tokenize), `decode` (TEI's /decode) and
    `content_tokens` (a text's length without special tokens, counted no further than a budget)."""

    def __init__(self, spec) -> None:
        from pooling_pipeline.workers.render import Renderer, load_hf_tokenizer, render_backend
        from pooling_pipeline.workers.truncation import TruncatingTokenizer

        hf = load_hf_tokenizer(spec)
        # An LLM reranker's pair is the workers' render of it through the chat template: their Renderer's.
        self.renderer = Renderer(spec, hf) if spec.chat_pairs is not None else None
        self.counter = self.renderer.tokenizer if self.renderer is not None else TruncatingTokenizer(
            render_backend(spec, hf))
        self.backend = self.counter.tokenizer  # (truncation and padding off: TruncatingTokenizer saw to it)
        self.num_special_tokens = self.counter.num_special_tokens
        self.num_special_tokens_pair = self.counter.num_special_tokens_pair

    def tokenize(self, text: str, add_special_tokens: bool) -> list[dict]:
        """TEI's tokens: id, the text it covers, whether it is special, and its UTF-8 byte offsets
        in `text` (TEI's offsets are the Rust library's, in bytes; a special token has none)."""
        enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        to_bytes = _byte_positions(text)
        tokens = []
        for id_, (start, stop), special, token in zip(enc.ids, enc.offsets, enc.special_tokens_mask, enc.tokens):
            if special:
                tokens.append({"id": id_, "text": token, "special": True, "start": None, "stop": None})
            else:
                tokens.append({"id": id_, "text": text[start:stop], "special": False,
                               "start": to_bytes(start), "stop": to_bytes(stop)})
        return tokens

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """TEI's /decode: the text of token ids (the library's own decoder, as TEI's)."""
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def content_tokens(self, text: str, budget: int) -> tuple[int, bool]:
        """Tokens of `text` without special tokens: (count, exact). Past `budget` the count is a
        lower bound: only a prefix was tokenized (a 10 MB text costs what the budget costs)."""
        return self.counter.count_tokens(text, budget)

    def measure(self, text: str, pair: str | None, limit: int, max_pair_tokens: int | None = None) -> Measured:
        """What the render workers would keep of a text, or of a (text, pair) pair whose second text is
        first cut to `max_pair_tokens` content tokens (max_tokens_per_doc), before the model's own cut:
        special tokens included, each text tokenized no further than `limit` (or `max_pair_tokens`)
        needs to tell."""
        specials = self.num_special_tokens if pair is None else self.num_special_tokens_pair
        budget = max(0, limit - specials)
        first, exact = self.content_tokens(text, budget)
        if pair is None:
            return Measured(specials + first, exact, False)
        second, second_exact = self.content_tokens(pair, max(budget, max_pair_tokens or 0))
        pair_cut = max_pair_tokens is not None and second > max_pair_tokens
        if pair_cut:
            second, second_exact = max_pair_tokens, True
        return Measured(specials + first + second, exact and second_exact, pair_cut)


    def chat_pair_tokens(self, query: str, document: str, prompt: str | None, limit: int) -> tuple[int, bool]:
        """An LLM reranker's pair as the render workers render it (the chat template's text included), tokenized
        no further than `limit` needs: (tokens, exact)."""
        return self.renderer.chat_pair_tokens(query, document, prompt, limit)


class Measured(NamedTuple):
    """A text's (or a pair's) length as `ServedTokenizer.measure` counts it."""

    tokens: int  # special tokens included; a lower bound where not `exact` (the rest was not tokenized)
    exact: bool
    pair_cut: bool  # the pair's second text has more content tokens than max_pair_tokens


def _byte_positions(text: str):
    """Character offset -> UTF-8 byte offset in `text`."""
    if text.isascii():
        return int
    code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    sizes = 1 + (code_points >= 0x80) + (code_points >= 0x800) + (code_points >= 0x10000)
    ends = np.concatenate(([0], np.cumsum(sizes)))
    return lambda offset: int(ends[offset])


_loaded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_loading = threading.Lock()


async def served_tokenizer(server) -> ServedTokenizer:
    """The server's tokenizer, loaded on the first call (in a thread; later calls wait for it)."""
    tokenizer = _loaded.get(server)
    if tokenizer is None:
        tokenizer = await asyncio.to_thread(_load, server)
    return tokenizer


def _load(server) -> ServedTokenizer:
    with _loading:
        if server not in _loaded:
            _loaded[server] = ServedTokenizer(server.spec)
        return _loaded[server]
