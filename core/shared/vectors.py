"""The numpy side of pooling, shared by the engine core and the frontend: the last touch on
embedding vectors (Matryoshka truncation, then L2 normalization) and, in chunk mode, a long
document's chunk vectors pooled back into one. The frontend does that pooling itself (a document's
chunks come back in different steps); numpy only, so it does not import torch for it (the
model-side pooling is `pooling.py`)."""

from __future__ import annotations

import numpy as np


def finish_embeddings(vectors: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Keeps the first `dimensions` values of the last axis, then L2-normalizes along it (as
    torch's F.normalize: divided by max(norm, 1e-12)). Works on [H], [B, H] and [B, L, H]."""
    if dimensions is not None:
        vectors = vectors[..., :dimensions]
    if normalize:
        norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
        vectors = vectors / np.maximum(norms, np.float32(1e-12))
    return vectors


def finish_sentence_embeddings(vectors: np.ndarray, dimensions: int | None, normalize: bool | None,
                               model_normalize: bool, truncate_dim: int | None) -> np.ndarray:
    """The last touch on a model's sentence embeddings ([H] or [B, H], the model's full width, before
    its final Normalize), as the caller's options ask and as the libraries they come from define them:

    - `dimensions=k` (vLLM's `dimensions`): the first k values, L2-normalized when normalization is
      on (`normalize`, else the model's final Normalize), so a normalized model gives unit vectors
      at any k;
    - else a saved `truncate_dim` t (ST's encode): with `normalize` unset, the model's output as ST
      gives it -- its final Normalize on the full width, then the first t values, not renormalized;
      with `normalize=True`, the first t values normalized (ST's `normalize_embeddings=True`, which
      cuts, then normalizes); with `normalize=False`, the first t raw values;
    - else the vector, normalized when normalization is on."""
    effective = model_normalize if normalize is None else normalize
    if dimensions is None and truncate_dim is not None and normalize is None:
        return finish_embeddings(vectors, None, effective)[..., :truncate_dim]
    return finish_embeddings(vectors, dimensions if dimensions is not None else truncate_dim, effective)


class ChunkSum:
    """Chunk mode: a document's chunk vectors pooled back into one (token-weighted mean)."""

    def __init__(self, num_chunks: int) -> None:
        self.num_chunks = num_chunks
        self.seen: set[int] = set()
        self.total: np.ndarray | None = None
        self.tokens = 0

    def add(self, chunk: int, vector: np.ndarray, num_tokens: int) -> bool:
        """Adds a chunk; False for a duplicate (a re-sent request's chunk seen before)."""
        if chunk in self.seen:
            return False
        self.seen.add(chunk)
        weighted = vector.astype(np.float64) * num_tokens
        self.total = weighted if self.total is None else self.total + weighted
        self.tokens += num_tokens
        return True

    @property
    def complete(self) -> bool:
        return len(self.seen) == self.num_chunks

    def finish(self, dimensions: int | None, normalize: bool | None, model_normalize: bool,
               truncate_dim: int | None) -> np.ndarray:
        """The document's vector: the chunks' token-weighted mean (of full-width raw vectors), then
        `finish_sentence_embeddings`."""
        mean = (self.total / max(self.tokens, 1)).astype(np.float32)
        return finish_sentence_embeddings(mean, dimensions, normalize, model_normalize, truncate_dim)


def finish_grouped_sentence_embeddings(vectors: np.ndarray, groups: list, spec) -> list[np.ndarray] | np.ndarray:
    """`finish_sentence_embeddings` over a step's rows [B, H] grouped by their options
    (`core.engine.columns.option_groups`: ((task, dimensions, normalize), rows) each): the [B, H'] array
    itself where one group holds every row, else one vector per row in the step's order."""
    out: list = [None] * len(vectors)
    for (_, dimensions, normalize), rows in groups:
        whole = len(rows) == len(vectors)
        finished = finish_sentence_embeddings(vectors if whole else vectors[rows], dimensions, normalize,
                                              spec.normalize, spec.truncate_dim)
        if whole:
            return finished
        for i, row in enumerate(rows.tolist()):
            out[row] = finished[i]
    return out
