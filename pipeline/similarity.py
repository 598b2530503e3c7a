"""The similarity functions sentence-transformers names (`similarity_fn_name`): cosine, dot, and the
negative euclidean / manhattan distances, as ST computes them.

`similarity_matrix` / `similarity_pairwise` are ST's `similarity` / `similarity_pairwise`: matrix
operations in torch with ST's own calls (`F.normalize` then `mm`, `mm`, `cdist`; their pairwise
forms), so their values are ST's; `similarity` is one pair's value on numpy vectors (the frontend's
bi-encoder `score`, which has one pair at a time and no need of torch)."""

from __future__ import annotations

import numpy as np

SIMILARITY_FUNCTIONS = ("cosine", "dot", "euclidean", "manhattan")


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


def similarity_matrix(name: str, a, b):
    """[n, m] torch tensor: res[i, j] = the similarity of a[i] and b[j] (ST's `similarity`). `a`, `b`:
    [n, d] / [m, d] (or one [d] vector) as arrays, tensors or lists."""
    import torch
    import torch.nn.functional as F

    a, b = _batch(a), _batch(b)
    if name == "dot":
        return torch.mm(a, b.transpose(0, 1))
    if name == "euclidean":
        return -torch.cdist(a, b, p=2.0)
    if name == "manhattan":
        return -torch.cdist(a, b, p=1.0)
    _check(name)
    return torch.mm(F.normalize(a, p=2, dim=-1), F.normalize(b, p=2, dim=-1).transpose(0, 1))


def similarity_pairwise(name: str, a, b):
    """[n] torch tensor: res[i] = the similarity of a[i] and b[i] (ST's `similarity_pairwise`)."""
    import torch
    import torch.nn.functional as F

    a, b = _float(a), _float(b)
    if a.shape != b.shape:
        raise ValueError(f"similarity_pairwise needs two arrays of one shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if name == "dot":
        return (a * b).sum(dim=-1)
    if name == "euclidean":
        return -torch.linalg.vector_norm(a - b, dim=-1)
    if name == "manhattan":
        return -torch.sum(torch.abs(a - b), dim=-1)
    _check(name)
    return (F.normalize(a, p=2, dim=-1) * F.normalize(b, p=2, dim=-1)).sum(dim=-1)


def _check(name: str) -> None:
    if name != "cosine":
        raise ValueError(f"similarity function {name!r} is not one of {SIMILARITY_FUNCTIONS}")


def _float(x):
    """A float tensor of `x` (arrays and lists converted, as ST's `_convert_to_float_tensor`)."""
    import torch

    tensor = x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    return tensor if tensor.is_floating_point() else tensor.float()


def _batch(x):
    """A 2-D float tensor: one vector becomes a batch of one (ST's `_convert_to_batch_tensor`)."""
    tensor = _float(x)
    return tensor.unsqueeze(0) if tensor.dim() == 1 else tensor
