"""From the model's last hidden states (or logits) to one vector per request, as sentence-transformers
computes it: its Pooling modes, the Dense / LayerNorm / Normalize modules after pooling, SPLADE's
sparse pooling, and the classification activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pooling_pipeline.core.shared.config import HeadModule, ModelSpec, SparseSpec


def pool(hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, modes: list[str]) -> torch.Tensor:
    """hidden [B, L, H] (right-padded), mask [B, L] (1 for the tokens to pool: real tokens, the
    prompt's left out when the model says so), lengths [B] (real tokens) -> [B, H * len(modes)],
    float32, the modes concatenated in order. Same arithmetic as ST's Pooling module."""
    hidden = hidden.float()
    mask_f = mask.unsqueeze(-1).to(hidden.dtype)
    out = []
    for mode in modes:
        if mode == "cls":  # the first pooled token (after the prompt, when it is left out)
            first = mask.to(torch.int32).argmax(dim=1)
            out.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), first])
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            summed = (hidden * mask_f).sum(dim=1)
            count = torch.clamp(mask_f.sum(dim=1), min=1e-9)
            out.append(summed / (count if mode == "mean" else torch.sqrt(count)))
        elif mode == "max":
            out.append(hidden.masked_fill(mask_f == 0, float("-inf")).max(dim=1).values)
        elif mode == "weightedmean":  # position weights 1, 2, ... from the first real token
            weights = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype).view(1, -1, 1)
            weighted = mask_f * weights
            out.append((hidden * weighted).sum(dim=1) / torch.clamp(weighted.sum(dim=1), min=1e-9))
        elif mode == "lasttoken":  # (zero where even the last token is masked: a prompt kept whole, as ST)
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            out.append(hidden[rows, lengths - 1] * mask_f[rows, lengths - 1])
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)


class SentenceHead(torch.nn.Module):
    """The ST modules after pooling (Dense, LayerNorm, a Normalize that is not the last module),
    with their saved weights, applied in order."""

    def __init__(self, modules: list[HeadModule]) -> None:
        super().__init__()
        self.steps = torch.nn.ModuleList(_build(m) for m in modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = step(x)
        return x


class _Dense(torch.nn.Module):
    def __init__(self, spec: HeadModule) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
        self.activation = getattr(torch.nn, spec.activation)()
        if spec.use_residual and spec.in_features != spec.out_features:
            self.residual = torch.nn.Linear(spec.in_features, spec.out_features, bias=False)
        self.use_residual = spec.use_residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (self.residual(x) if hasattr(self, "residual") else x)
        return out


class _LayerNorm(torch.nn.Module):
    def __init__(self, spec: HeadModule) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(spec.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class _Normalize(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, p=2, dim=-1)


def _build(spec: HeadModule) -> torch.nn.Module:
    if spec.kind == "normalize":
        return _Normalize()
    module = _Dense(spec) if spec.kind == "dense" else _LayerNorm(spec)
    module.load_state_dict(_load_weights(spec.path))
    return module


def _load_weights(directory: str) -> dict[str, torch.Tensor]:
    """A module's weights as ST saves them: model.safetensors, or pytorch_model.bin from older saves."""
    import os

    safetensors_path = os.path.join(directory, "model.safetensors")
    if os.path.isfile(safetensors_path):
        from safetensors.torch import load_file

        return load_file(safetensors_path)
    bin_path = os.path.join(directory, "pytorch_model.bin")
    if os.path.isfile(bin_path):
        return torch.load(bin_path, map_location="cpu", weights_only=True)  # tensors only, never code
    raise ValueError(f"no weights (model.safetensors or pytorch_model.bin) in {directory}")


def splade(logits: torch.Tensor, mask: torch.Tensor, spec: SparseSpec) -> torch.Tensor:
    """MLM logits [B, L, V] -> [B, V]: log(1 + relu(logits)) over real tokens, max or summed."""
    values = torch.log1p(torch.relu(logits.float() * mask.unsqueeze(-1)))
    if spec.activation == "log1p_relu":
        values = torch.log1p(values)
    return values.max(dim=1).values if spec.pooling == "max" else values.sum(dim=1)


def apply_activation(logits: torch.Tensor, spec: ModelSpec, task: str) -> torch.Tensor:
    """classify: softmax over labels (sigmoid for a single-label or multi-label head);
    score: the activation ST's CrossEncoder applies for this model."""
    if task == "score":
        kind = spec.score_activation
        if kind == "sigmoid":
            return torch.sigmoid(logits)
        if kind == "softmax":
            return torch.softmax(logits, dim=-1)
        if kind == "tanh":
            return torch.tanh(logits)
        return logits
    if spec.num_labels == 1 or spec.multi_label:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
