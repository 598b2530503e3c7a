"""Turns RenderParams into PoolingEngineInput: tokenization and truncation, nothing else."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from core.config import ModelSpec
from core.messages import PoolingEngineInput, RenderParams
from workers.truncation import TruncatingEncoder


def load_tokenizer(spec: ModelSpec) -> Tokenizer:
    """The fast tokenizer exactly as transformers configures it for this model.

    transformers adjusts the backend from tokenizer_config.json (lowercasing, special tokens), so
    the backend is taken from AutoTokenizer rather than read from tokenizer.json directly.
    """
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"model {spec.path!r} has no fast tokenizer")
    return Tokenizer.from_str(backend.to_str())


class Renderer:
    def __init__(self, spec: ModelSpec, tokenizer: Tokenizer) -> None:
        self.spec = spec
        preprocess = str.lower if spec.do_lower_case else None
        self.encoder = TruncatingEncoder(tokenizer, preprocess=preprocess)
        self.tokens_out = 0

    def render(self, items: list[RenderParams]) -> tuple[list[PoolingEngineInput], list[tuple[RenderParams, str]]]:
        """Returns the engine inputs and, separately, the requests that failed with why."""
        ready: list[PoolingEngineInput] = []
        failed: list[tuple[RenderParams, str]] = []
        ids_by_pos: dict[int, list[int]] = {}

        # Short texts go through the tokenizer in one batched call; long ones are planned one by one.
        short = [i for i, it in enumerate(items)
                 if it.prompt is not None and self.encoder.short_enough(it.prompt, it.max_tokens)]
        if short:
            try:
                encoded = self.encoder.encode_many([items[i].prompt for i in short],
                                                   [items[i].max_tokens for i in short])
                ids_by_pos.update(zip(short, encoded))
            except Exception:
                pass  # retried one by one below, so the failure lands on the right request
        for pos, item in enumerate(items):
            try:
                token_ids = self._token_ids(item, ids_by_pos.get(pos))
            except Exception as e:  # tokenizer errors become per-request errors, never a crash
                failed.append((item, f"{type(e).__name__}: {e}"))
                continue
            self.tokens_out += len(token_ids)
            ready.append(PoolingEngineInput(request_id=item.request_id, seq=item.seq,
                                            token_ids=token_ids, params=item.params))
        return ready, failed

    def _token_ids(self, item: RenderParams, encoded: list[int] | None) -> np.ndarray:
        if item.max_tokens < self.encoder.num_special_tokens:
            raise ValueError(f"cannot keep {item.max_tokens} tokens: the model adds "
                             f"{self.encoder.num_special_tokens} special tokens")
        if item.token_ids is not None:
            ids = np.asarray(item.token_ids, dtype=np.int32)[: item.max_tokens]
        else:
            if item.prompt is None:
                raise ValueError("request has neither text nor token ids")
            if encoded is None:
                encoded = self.encoder.encode(item.prompt, item.max_tokens)
            ids = np.asarray(encoded, dtype=np.int32)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("prompt is empty after tokenization")
        if int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")
        return ids
