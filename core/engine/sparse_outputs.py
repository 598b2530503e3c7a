"""Sparse vectors (SPLADE, a sparse static route) from a step's dense [rows, vocab] weights: the
tensors a step copies back and the host-side finish that makes each row's (token ids, weights).

Only the non-zero weights come back -- a [rows, vocab] copy would be most of the step. On a CPU
they are found with `nonzero`, whose output size is the data's. On an accelerator that size would
be a device-to-host read in the middle of the step, so there each row's weights come back as a
fixed top-k by magnitude with the row's count of non-zeros: the first `count` of them are exactly
its non-zeros while `count` <= k, the usual case (SPLADE documents have a few hundred); a row with
more is read whole from the device in `finish`, after the step is done (nothing waits for it).
"""

from __future__ import annotations

import numpy as np
import torch

# Non-zeros per row a device step copies back at once (rows with more are read whole afterwards).
DEVICE_TOP_K = 512


def limited(weights: torch.Tensor, max_active_dims: int | None) -> torch.Tensor:
    """ST's max_active_dims: each row's k largest weights (by |weight|), the rest 0."""
    k = max_active_dims
    if k is None or k >= weights.shape[1]:
        return weights
    top = torch.topk(weights.abs(), k, dim=1)
    return torch.zeros_like(weights).scatter_(1, top.indices, weights.gather(1, top.indices))


def sparse_outputs(weights: torch.Tensor, max_active_dims: int | None, on_device: bool = False):
    """[rows, vocab] weights -> (the tensors to copy back, the finish giving (token ids int32,
    weights float32) per row, ids ascending)."""
    weights = limited(weights, max_active_dims)
    return _fixed_top(weights, max_active_dims) if on_device else _nonzero(weights)


def _nonzero(weights: torch.Tensor):
    # Their flat positions, sorted, so rows come out in order.
    flat = torch.nonzero(weights.flatten() != 0).flatten()
    tensors = [flat, weights.flatten()[flat].float()]
    vocab, rows = weights.shape[1], weights.shape[0]

    def finish(arrays: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        positions, values = arrays
        row_of = positions // vocab
        bounds = np.searchsorted(row_of, np.arange(rows + 1))
        return [((positions[a:b] % vocab).astype(np.int32), values[a:b].astype(np.float32))
                for a, b in zip(bounds[:-1], bounds[1:])]

    return tensors, finish


def _fixed_top(weights: torch.Tensor, max_active_dims: int | None):
    vocab = weights.shape[1]
    k = min(vocab, DEVICE_TOP_K if max_active_dims is None else min(max_active_dims, vocab))
    counts = (weights != 0).sum(dim=1)
    top = torch.topk(weights.abs(), k, dim=1)  # a row's non-zeros first (|w| > 0 = every zero's)
    tensors = [counts, top.indices, weights.gather(1, top.indices).float()]

    def finish(arrays: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        counts_np, indices, values = arrays
        out = []
        for row, count in enumerate(counts_np.tolist()):
            if count > k:  # more non-zeros than came back: the row read whole, the step being done
                full = weights[row].float().cpu().numpy()
                ids = np.flatnonzero(full)
                out.append((ids.astype(np.int32), full[ids].astype(np.float32)))
                continue
            order = np.argsort(indices[row, :count], kind="stable")
            out.append((indices[row, :count][order].astype(np.int32), values[row, :count][order].astype(np.float32)))
        return out

    return tensors, finish
