"""A multimodal reranker (Qwen2-VL, Qwen3-VL) in the engine, as sentence-transformers 6's CrossEncoder
runs its generative VLM: a step's pairs -- each rendered as chat messages with roles "query" and
"document", texts and images -- padded on the right, the image tokens marked in `mm_token_type_ids`,
the step's patches and grids concatenated in their rows' order; the model's base (no lm_head over
the vocabulary) gives each row's last attended token's hidden state, and only LogitScore's rows of
the lm_head score it: logit(yes) - logit(no), then the activation ST's predict applies (a row's
padding moves its score by float noise only: ~5e-7 on the test model, where ST pads on the left)."""

from __future__ import annotations

import inspect
import time

import numpy as np
import torch

from pooling_pipeline.core.engine.columns import Requests, probe_batch
from pooling_pipeline.core.engine.device_copies import finish_step, record_end, start_events, to_device, to_host, use_device
from pooling_pipeline.core.engine.heads import activated_logits, logit_score_rows
from pooling_pipeline.core.engine.step_cost import probe_step_cost
from pooling_pipeline.core.engine.step_runner import PendingStep
from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.options import TASKS
from pooling_pipeline.core.shared.schema import MODALITIES

IMAGE = MODALITIES.index("image")


class VlmRerankerRunner:
    """A StepRunner (core/engine/step_runner.py) for a multimodal reranker (torch)."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoConfig, AutoModelForImageTextToText

        device = use_device(device)
        self.spec, self.device, self.dtype = spec, device, dtype
        self.model = AutoModelForImageTextToText.from_pretrained(spec.path, dtype=dtype).to(device).eval()
        config = AutoConfig.from_pretrained(spec.path)
        text = getattr(config, "text_config", config)
        self.pad_id = int(text.pad_token_id if text.pad_token_id is not None else 0)
        self.image_token_id = int(config.image_token_id)
        self.token_types = "mm_token_type_ids" in inspect.signature(self.model.model.forward).parameters
        self.score_rows = logit_score_rows(spec, self.model, device, dtype)  # (checked against the model's own logits)
        self.backend_info: dict = {"backend": "torch",
                                   "model": f"multimodal reranker ({spec.model_type}: text and image pairs)"}

    def step_cost(self, max_tokens: int) -> tuple[float, float]:
        token = min(1000, self.spec.vocab_size - 1, self.image_token_id - 1)
        return probe_step_cost(lambda rows, tokens: self.run(probe_batch(rows, tokens, token, "score")),
                               max_tokens, self.spec.max_model_len)

    def run(self, batch: Requests) -> tuple[list | np.ndarray, int]:
        results, padded, _ = self.finish(self.launch(batch))
        return results, padded

    @torch.inference_mode()
    def launch(self, batch: Requests) -> PendingStep:
        started = time.perf_counter()
        tasks = {TASKS[int(code)] for code in np.unique(batch.task)}
        if tasks - {"score"}:
            raise ValueError(f"a multimodal reranker scores pairs only, not {sorted(tasks - {'score'})}")
        begin, end = start_events(self.device)
        ids, real = batch.padded(self.pad_id)
        input_ids = to_device(ids, self.device)
        inputs = {"input_ids": input_ids, "attention_mask": to_device(real, self.device).long()}
        if self.token_types:
            inputs["mm_token_type_ids"] = (input_ids == self.image_token_id).long()
        if (batch.modality == IMAGE).any():  # (the images' patches and grids, in their rows' order)
            inputs["pixel_values"] = to_device(batch.payloads["patches"].data, self.device).to(self.dtype)
            inputs["image_grid_thw"] = to_device(np.array(batch.payloads["grid_thw"].data), self.device)
        hidden = self.model.model(**inputs, use_cache=False, return_dict=True).last_hidden_state
        last = to_device(batch.lengths - 1, self.device)  # (right padding: a row's last attended token)
        rows = hidden[torch.arange(len(batch), device=self.device), last]
        logits = torch.nn.functional.linear(rows, *self.score_rows).float()
        scores = logits[:, :1] - logits[:, 1:2] if logits.shape[1] == 2 else logits[:, :1]
        tensors, finish = activated_logits(scores, batch.lengths, batch, self.spec, per_token=False)
        host = [to_host(t) for t in tensors]
        record_end(end, self.device)
        return PendingStep(ids.size, host, finish, started, begin, end)

    def finish(self, step: PendingStep) -> tuple[list, int, float]:
        return finish_step(step)
