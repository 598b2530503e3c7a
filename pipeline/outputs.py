"""Result objects handed to the caller.

They are msgspec Structs (a C-level constructor: a fifth of a dataclass's cost, and one is made
per request) without cyclic-GC tracking; `request_id` -- the call's id followed by the index -- is
made when it is asked for, not for every result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import numpy as np


class PoolingRequestOutput(msgspec.Struct, gc=False):
    call_id: str  # the call's id: the request's external id is this followed by its index
    index: int  # position in the caller's input
    data: Any  # float32 array: [dim], [num_labels], [num_tokens, dim] or [num_tokens, num_labels]
    num_prompt_tokens: int  # after truncation, special tokens included (chunk mode: all chunks')
    num_chunks: int = 1  # chunk mode: chunks the document was embedded in
    error: str | None = None  # errors="return": what went wrong ("request i: ..."); data is None then

    @property
    def request_id(self) -> str:
        """The external id."""
        return f"{self.call_id}{self.index}"

    @property
    def outputs(self) -> PoolingRequestOutput:
        """vLLM's shape: `out.outputs.embedding` / `.probs` / `.data` (the result is its own outputs)."""
        return self


class EmbeddingOutput(PoolingRequestOutput, gc=False):
    @property
    def embedding(self) -> np.ndarray:  # 1-D float32
        return self.data


class ClassificationOutput(PoolingRequestOutput, gc=False):
    @property
    def probs(self) -> np.ndarray:  # 1-D float32 (raw logits with use_activation=False)
        return self.data


class SparseEmbeddingOutput(PoolingRequestOutput, gc=False):
    """sparse_embed (SPLADE): the vocabulary entries with a non-zero weight."""

    indices: Any = None  # int32 token ids, ascending

    @property
    def values(self) -> np.ndarray:  # float32 weights, one per index
        return self.data

    def to_dense(self, vocab_size: int) -> np.ndarray:
        dense = np.zeros(vocab_size, dtype=np.float32)
        dense[self.indices] = self.data
        return dense


class RankedDocument(NamedTuple):
    """One document of `Pipeline.rank`: its position in the documents given, and its score."""

    index: int
    score: float


# The result type of each task (the frontend builds results of it as outputs arrive).
OUTPUT_TYPES = {"embed": EmbeddingOutput, "classify": ClassificationOutput, "sparse_embed": SparseEmbeddingOutput}


@dataclass(slots=True)
class ScoringOutput:
    request_id: str  # the pair's external id (cross-encoder) or "<query id>|<document id>"
    index: int  # position of the pair
    score: float  # NaN when `error` is set
    num_prompt_tokens: int  # tokens the model saw for this pair (both sides for bi-encoders)
    error: str | None = None

    @property
    def outputs(self) -> ScoringOutput:
        """vLLM's shape: `out.outputs.score`."""
        return self
