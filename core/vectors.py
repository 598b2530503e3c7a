"""The last touch on embedding vectors, shared by the engine core and the frontend (which pools a
long document's chunk vectors itself): Matryoshka truncation, then L2 normalization. numpy only,
so the frontend does not import torch for it."""

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
