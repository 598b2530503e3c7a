"""The similarity functions sentence-transformers names (`similarity_fn_name`), on numpy vectors."""

from __future__ import annotations

import numpy as np


def similarity(name: str, a: np.ndarray, b: np.ndarray) -> float:
    """The model's similarity function between two embeddings: cosine (default), dot, or the
    negative euclidean / manhattan distance, as ST computes them."""
    if name == "dot":
        return float(np.dot(a, b))
    if name == "euclidean":
        return -float(np.linalg.norm(a - b))
    if name == "manhattan":
        return -float(np.abs(a - b).sum())
    return float(np.dot(a, b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))
