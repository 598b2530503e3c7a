"""Turns RenderParams into PoolingEngineInput: tokenization and truncation, nothing else."""

from __future__ import annotations

import importlib
import json

import numpy as np
from tokenizers import Tokenizer

from pooling_pipeline.core.config import ModelSpec
from pooling_pipeline.core.messages import PoolingEngineInput, PoolingParams, RenderParams
from pooling_pipeline.workers.truncation import TruncatingTokenizer

MAX_CACHED_PROMPTS = 1024  # prompts whose token count a worker remembers


def load_hf_tokenizer(spec: ModelSpec):
    """The tokenizer exactly as transformers configures it for this model.

    transformers adjusts the backend from tokenizer_config.json (lowercasing, special tokens), so
    the fast backend is taken from AutoTokenizer rather than read from tokenizer.json directly.
    """
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    if getattr(hf, "backend_tokenizer", None) is None:
        raise ValueError(f"model {spec.path!r} has no fast tokenizer")
    return hf


def load_tokenizer(spec: ModelSpec) -> Tokenizer:
    return Tokenizer.from_str(load_hf_tokenizer(spec).backend_tokenizer.to_str())


def load_plugin(target: str):
    """Instantiates "package.module:ClassName" (an io_processor plugin)."""
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"io_processor must look like 'package.module:ClassName', got {target!r}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load io_processor {target!r}: {e}") from None
    for method in ("render", "post_process"):
        if not callable(getattr(cls, method, None)):
            raise ValueError(f"io_processor {target!r} has no {method}() method")
    return cls()


class Renderer:
    def __init__(self, spec: ModelSpec, hf_tokenizer, plugin=None) -> None:
        self.spec = spec
        self.hf = hf_tokenizer  # for chat templates
        backend = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
        if spec.do_lower_case:
            lowercase_first(backend)
        self.tokenizer = TruncatingTokenizer(backend)
        self.plugin = plugin
        # ST leaves the prompt's tokens out of pooling when its Pooling has include_prompt=false.
        self.pools_without_prompt = not spec.pooling.include_prompt
        self.special_ids = set(getattr(hf_tokenizer, "all_special_ids", []))
        self.prompt_tokens: dict[str, int] = {}
        # A tokenizer that does not hand token_type_ids to its model (RoBERTa style, or a config
        # that drops them) means the model sees zeros: then no boundary travels either.
        self.sends_token_types = "token_type_ids" in getattr(hf_tokenizer, "model_input_names", ["token_type_ids"])

    def render(self, items: list[RenderParams], chat_template: str | None = None
               ) -> tuple[list[PoolingEngineInput], list[tuple[RenderParams, str]]]:
        """Returns the engine inputs and, separately, the requests that failed with why."""
        ready: list[PoolingEngineInput] = []
        failed: list[tuple[RenderParams, str]] = []
        ids_by_pos: dict[int, list[int]] = {}
        for item in items:
            if item.text_prefix and item.prompt is not None:  # as ST: the prompt, then the text
                item.prompt = item.text_prefix + item.prompt

        # Short single texts go through the tokenizer in one batched call; the rest one by one.
        min_tokens = self.tokenizer.num_special_tokens
        short = [i for i, it in enumerate(items) if it.prompt is not None and it.pair is None
                 and it.long_inputs == "truncate" and not it.truncate_left and it.max_tokens >= min_tokens
                 and self.tokenizer.short_enough(it.prompt, it.max_tokens)]
        if short:
            try:
                encoded = self.tokenizer.encode_many([items[i].prompt for i in short],
                                                   [items[i].max_tokens for i in short])
                ids_by_pos.update(zip(short, encoded))
            except Exception:
                pass  # retried one by one below, so the failure lands on the right request
        unchecked: list[tuple[RenderParams, PoolingEngineInput]] = []
        for pos, item in enumerate(items):
            if item.long_inputs == "chunk" and item.prompt is not None:
                try:
                    ready.extend(self._chunks(item))
                except Exception as e:
                    failed.append((item, f"{type(e).__name__}: {e}"))
                continue
            try:
                token_ids, type_start = self._render_one(item, ids_by_pos.get(pos), chat_template)
            except Exception as e:  # any failure becomes this request's error, never a crash
                failed.append((item, f"{type(e).__name__}: {e}"))
                continue
            unchecked.append((item, PoolingEngineInput(
                request_id=item.request_id, index=item.index, task=item.task, token_ids=token_ids,
                params=item.params, token_type_start=type_start, priority=item.priority,
                pool_start=self._prompt_tokens(item.text_prefix) if self.pools_without_prompt else 0)))
        ready.extend(self._checked(unchecked, failed))
        return ready, failed

    def _prompt_tokens(self, prompt: str | None) -> int:
        """ST's prompt_length: the prompt tokenized alone, special tokens included, less a
        trailing special token (the text follows the prompt, not the end of the sequence)."""
        if not prompt:
            return 0
        if prompt not in self.prompt_tokens:
            if len(self.prompt_tokens) >= MAX_CACHED_PROMPTS:  # per-request prompts: stay bounded
                self.prompt_tokens.clear()
            ids = self.tokenizer.encode(prompt, self.spec.max_model_len)
            self.prompt_tokens[prompt] = len(ids) - (1 if ids and ids[-1] in self.special_ids else 0)
        return self.prompt_tokens[prompt]

    def _checked(self, rendered: list[tuple[RenderParams, PoolingEngineInput]],
                 failed: list[tuple[RenderParams, str]]) -> list[PoolingEngineInput]:
        """The inputs whose ids the model can take; the others go to `failed`. One check for the
        whole batch in the usual case, request by request only when it finds a problem."""
        if not rendered:
            return []
        arrays = [inp.token_ids for _, inp in rendered]
        flat = np.concatenate(arrays)
        if min(map(len, arrays)) > 0 and int(flat.min()) >= 0 and int(flat.max()) < self.spec.vocab_size:
            return [inp for _, inp in rendered]
        good = []
        for item, inp in rendered:
            try:
                self._check(inp.token_ids)
                good.append(inp)
            except ValueError as e:
                failed.append((item, f"{type(e).__name__}: {e}"))
        return good

    def _render_one(self, item: RenderParams, encoded: list[int] | None, chat_template: str | None
                    ) -> tuple[np.ndarray, int | None]:
        if item.max_tokens < self.tokenizer.num_special_tokens:
            raise ValueError(f"cannot keep {item.max_tokens} tokens: the model adds "
                             f"{self.tokenizer.num_special_tokens} special tokens")
        if encoded is not None:
            return np.asarray(encoded, dtype=np.int32), None
        if item.raw is not None:
            if self.plugin is None:
                raise ValueError("this pipeline has no io_processor to render plugin input")
            rendered = self.plugin.render(item.raw)
            if isinstance(rendered, str):
                return self._ids(self.tokenizer.encode(rendered, item.max_tokens)), None
            return self._ids(list(rendered)[: item.max_tokens]), None
        if item.token_ids is not None:
            return np.asarray(item.token_ids, dtype=np.int32)[: item.max_tokens], None
        if item.conversation is not None:
            text = self.hf.apply_chat_template(item.conversation, chat_template=chat_template, tokenize=False)
            # Like transformers' apply_chat_template(tokenize=True): the template owns the special tokens.
            return self._ids(self.tokenizer.encode(text, item.max_tokens, add_special_tokens=False)), None
        if item.prompt is None:
            raise ValueError("request has no input")
        if item.pair is not None:
            ids, type_ids = self.tokenizer.encode_pair(item.prompt, item.pair, item.max_tokens,
                                                     item.max_query_tokens, item.max_doc_tokens)
            return self._ids(ids), compress_token_type_ids(type_ids) if self.sends_token_types else None
        if item.long_inputs == "error":
            self._refuse_if_too_long(item)
        return self._ids(self.tokenizer.encode(item.prompt, item.max_tokens, left=item.truncate_left)), None

    def _refuse_if_too_long(self, item: RenderParams) -> None:
        budget = self.tokenizer.content_budget(item.max_tokens)
        count, exact = self.tokenizer.count_tokens(item.prompt, budget)
        if count > budget:
            total = count + self.tokenizer.num_special_tokens
            raise ValueError(f"prompt has {'' if exact else 'at least '}{total} tokens, more than the "
                             f"{item.max_tokens} this call keeps (long_inputs='error')")

    def _chunks(self, item: RenderParams) -> list[PoolingEngineInput]:
        """Chunk mode: the whole document in chunks of `max_tokens` (special tokens included),
        consecutive chunks sharing `chunk_overlap` tokens. Each chunk is its own engine input
        under the document's external id; the frontend pools them back into one embedding."""
        width = self.tokenizer.content_budget(item.max_tokens)
        step = width - item.chunk_overlap
        if width < 1 or step < 1:
            raise ValueError(f"chunk_overlap={item.chunk_overlap} leaves no room in chunks of "
                             f"{item.max_tokens} tokens")
        chunks: list[list[int]] = []
        buffer: list[int] = []
        for piece in self.tokenizer.content_ids(item.prompt):
            buffer.extend(piece)
            while len(buffer) > width:  # more tokens follow: this chunk is not the last
                chunks.append(buffer[:width])
                buffer = buffer[step:]
        if buffer or not chunks:
            chunks.append(buffer)
        params = PoolingParams(normalize=False)  # raw chunk vectors: the frontend pools, then normalizes
        inputs = []
        for k, content in enumerate(chunks):
            ids = self._ids(self.tokenizer.with_special_tokens(content))
            self._check(ids)
            inputs.append(PoolingEngineInput(request_id=item.request_id, index=item.index, task=item.task,
                                             token_ids=ids, params=params, priority=item.priority,
                                             chunk=k, num_chunks=len(chunks)))
        return inputs

    @staticmethod
    def _ids(ids) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise TypeError("rendered input must be a flat list of integer token ids")
        return arr.astype(np.int32)

    def _check(self, ids: np.ndarray) -> None:
        if ids.size == 0:
            raise ValueError("prompt is empty after tokenization")
        if int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")


def lowercase_first(tokenizer: Tokenizer) -> None:
    """ST's do_lower_case: a Lowercase normalizer in front of the tokenizer's own (unless that one
    lowercases already), so the text is lowercased exactly as ST's tokenizer does it."""
    from tokenizers import normalizers

    described = json.dumps(json.loads(tokenizer.to_str()).get("normalizer"))
    if '"type": "Lowercase"' in described or '"lowercase": true' in described:
        return
    current = tokenizer.normalizer
    tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase()] + ([current] if current else []))


def compress_token_type_ids(type_ids: list[int]) -> int | None:
    """Zeros then ones -> the index of the first 1 (None when all zeros)."""
    arr = np.asarray(type_ids)
    ones = np.flatnonzero(arr)
    if ones.size == 0:
        return None
    start = int(ones[0])
    if not (arr[start:] == 1).all():
        raise ValueError("token type ids are not zeros followed by ones")
    return start

