"""From the model's last hidden states to one vector per request."""

from __future__ import annotations

import torch


def pool(hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, method: str) -> torch.Tensor:
    """hidden [B, L, H], mask [B, L] (1 for real tokens), lengths [B] -> [B, H] in float32.

    Same arithmetic as sentence-transformers' Pooling module, so results match it to float precision.
    """
    hidden = hidden.float()
    if method == "mean":
        mask_f = mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * mask_f).sum(dim=1)
        return summed / torch.clamp(mask_f.sum(dim=1), min=1e-9)
    if method == "cls":
        return hidden[:, 0]
    if method == "max":
        return hidden.masked_fill(mask.unsqueeze(-1) == 0, -1e9).max(dim=1).values
    if method == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    raise ValueError(f"unknown pooling method {method!r}")


def apply_activation(logits: torch.Tensor, num_labels: int, multi_label: bool) -> torch.Tensor:
    """Softmax over labels; sigmoid for a single-label score head or a multi-label config."""
    if num_labels == 1 or multi_label:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
