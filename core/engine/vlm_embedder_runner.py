"""A VLM embedder (Qwen2-VL, Qwen3-VL) in the engine, as sentence-transformers 6's Transformer module
runs transformers' `Qwen2VLModel` / `Qwen3VLModel`: a step's rows -- texts and images together --
padded on the right to the step's longest, with their attention mask (the model places its
multimodal rotary positions by it), each image token marked in `mm_token_type_ids`, and the images'
patches and (t, h, w) grids concatenated in their rows' order (the processor's float values, made
in the render workers: workers/vlm_messages.py); the last attended token's hidden state, finished
as the model's modules say (Normalize, truncate_dim)."""

from __future__ import annotations

import inspect
import time

import numpy as np
import torch

from pooling_pipeline.core.engine.columns import Requests, option_groups, probe_batch
from pooling_pipeline.core.engine.device_copies import finish_step, record_end, start_events, to_device, to_host, use_device
from pooling_pipeline.core.engine.step_cost import probe_step_cost
from pooling_pipeline.core.engine.step_runner import PendingStep
from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.options import TASKS
from pooling_pipeline.core.shared.schema import MODALITIES
from pooling_pipeline.core.shared.vectors import finish_grouped_sentence_embeddings

IMAGE = MODALITIES.index("image")


class QwenVlRunner:
    """What a Qwen-VL model's StepRunners share (core/engine/step_runner.py): the model, the step's
    inputs, and each row's last attended token's hidden state. `task`: what its steps run."""

    task = "embed"

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoConfig

        device = use_device(device)
        self.spec, self.device, self.dtype = spec, device, dtype
        self.model = self.model_class().from_pretrained(spec.path, dtype=dtype).to(device).eval()
        config = AutoConfig.from_pretrained(spec.path)
        text = getattr(config, "text_config", config)
        self.pad_id = int(text.pad_token_id if text.pad_token_id is not None else 0)
        self.image_token_id = int(config.image_token_id)
        # (transformers 5's Qwen-VL models read the image tokens' places from this mask, where it takes one)
        self.token_types = "mm_token_type_ids" in inspect.signature(self.base().forward).parameters

    @staticmethod
    def model_class():
        from transformers import AutoModel

        return AutoModel

    def base(self) -> torch.nn.Module:
        """The model without a head over the vocabulary."""
        return self.model

    def step_cost(self, max_tokens: int) -> tuple[float, float]:
        token = min(1000, self.spec.vocab_size - 1, self.image_token_id - 1)
        return probe_step_cost(lambda rows, tokens: self.run(probe_batch(rows, tokens, token, self.task)),
                               max_tokens, self.spec.max_model_len)

    def run(self, batch: Requests) -> tuple[list | np.ndarray, int]:
        results, padded, _ = self.finish(self.launch(batch))
        return results, padded

    def last_hidden(self, batch: Requests) -> tuple[torch.Tensor, int]:
        """Each row's last attended token's hidden state [rows, hidden], and the tokens the step padded to."""
        ids, real = batch.padded(self.pad_id)
        input_ids = to_device(ids, self.device)
        inputs = {"input_ids": input_ids, "attention_mask": to_device(real, self.device).long()}
        if self.token_types:
            inputs["mm_token_type_ids"] = (input_ids == self.image_token_id).long()
        if (batch.modality == IMAGE).any():  # (the images' patches and grids, in their rows' order)
            inputs["pixel_values"] = to_device(batch.payloads["patches"].data, self.device).to(self.dtype)
            inputs["image_grid_thw"] = to_device(np.array(batch.payloads["grid_thw"].data), self.device)
        hidden = self.base()(**inputs, use_cache=False, return_dict=True).last_hidden_state
        last = to_device(batch.lengths - 1, self.device)  # (right padding: a row's last attended token)
        return hidden[torch.arange(len(batch), device=self.device), last], ids.size

    def finish(self, step: PendingStep) -> tuple[list, int, float]:
        return finish_step(step)


class VlmEmbedderRunner(QwenVlRunner):
    """A StepRunner for a VLM embedder (torch)."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(spec, device, dtype)
        self.backend_info: dict = {"backend": "torch", "model": f"VLM embedder ({spec.model_type}: texts and images)"}

    @torch.inference_mode()
    def launch(self, batch: Requests) -> PendingStep:
        started = time.perf_counter()
        tasks = {TASKS[int(code)] for code in np.unique(batch.task)}
        if tasks - {"embed", "score"}:
            raise ValueError(f"a VLM embedder gives embeddings only, not {sorted(tasks - {'embed', 'score'})}")
        begin, end = start_events(self.device)
        vectors, padded = self.last_hidden(batch)
        groups = option_groups(batch, batch.normalize)
        spec = self.spec

        def finish(arrays: list[np.ndarray]) -> list[np.ndarray] | np.ndarray:
            return finish_grouped_sentence_embeddings(arrays[0], groups, spec)

        host = [to_host(vectors.float())]
        record_end(end, self.device)
        return PendingStep(padded, host, finish, started, begin, end)
