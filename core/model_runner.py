"""Loads the model on its device and turns a batch of engine inputs into pooled outputs."""

from __future__ import annotations

import logging

import numpy as np
import torch

from core.config import ModelSpec
from core.messages import PoolingEngineInput
from core.pooling import finish_embeddings, pool

log = logging.getLogger("engine")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, config_dtype: object) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32  # half precision is slower than float32 on most CPUs
    if str(config_dtype) in ("bfloat16", "torch.bfloat16") and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16


class ModelRunner:
    def __init__(self, spec: ModelSpec, device: str, dtype: str) -> None:
        from transformers import AutoConfig, AutoModel

        self.spec = spec
        self.device = resolve_device(device)
        config = AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
        self.dtype = resolve_dtype(dtype, self.device, getattr(config, "torch_dtype", None))
        self.model = AutoModel.from_pretrained(
            spec.path, config=config, dtype=self.dtype, attn_implementation="sdpa",
            trust_remote_code=spec.trust_remote_code,
        ).to(self.device).eval()
        self.pad_token_id = int(getattr(config, "pad_token_id", 0) or 0)
        self.uses_token_types = "token_type_ids" in self.model.forward.__code__.co_varnames

    @torch.inference_mode()
    def run(self, batch: list[PoolingEngineInput]) -> tuple[list[np.ndarray], int]:
        """Returns one float32 vector per request and the number of padded tokens computed."""
        lengths_np = np.fromiter((len(r.token_ids) for r in batch), dtype=np.int64, count=len(batch))
        max_len = int(lengths_np.max())
        ids = np.full((len(batch), max_len), self.pad_token_id, dtype=np.int64)
        for row, request in enumerate(batch):
            ids[row, : lengths_np[row]] = request.token_ids
        input_ids = torch.from_numpy(ids).to(self.device, non_blocking=True)
        lengths = torch.from_numpy(lengths_np).to(self.device)
        mask = (torch.arange(max_len, device=self.device)[None, :] < lengths[:, None]).long()
        kwargs = {"input_ids": input_ids, "attention_mask": mask}
        if self.uses_token_types:
            kwargs["token_type_ids"] = torch.zeros_like(input_ids)
        hidden = self.model(**kwargs).last_hidden_state
        pooled = pool(hidden, mask, lengths, self.spec.pooling)
        return self._finish(pooled, batch), len(batch) * max_len

    def _finish(self, pooled: torch.Tensor, batch: list[PoolingEngineInput]) -> list[np.ndarray]:
        # Requests that share options are finished together (usually the whole batch).
        groups: dict[tuple[int | None, bool], list[int]] = {}
        for row, request in enumerate(batch):
            p = request.params
            normalize = self.spec.normalize if p.normalize is None else p.normalize
            groups.setdefault((p.dimensions, normalize), []).append(row)
        out: list[np.ndarray] = [None] * len(batch)  # type: ignore[list-item]
        for (dimensions, normalize), rows in groups.items():
            index = torch.tensor(rows, device=pooled.device) if len(rows) < len(batch) else None
            part = pooled if index is None else pooled.index_select(0, index)
            vectors = finish_embeddings(part, dimensions, normalize).cpu().numpy()
            for i, row in enumerate(rows):
                out[row] = vectors[i]
        return out
