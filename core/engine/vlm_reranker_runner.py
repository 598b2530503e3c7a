"""A multimodal reranker (Qwen2-VL, Qwen3-VL) in the engine, as sentence-transformers 6's CrossEncoder
runs its generative VLM: a step's pairs -- each rendered as chat messages with roles "query" and
"document", texts and images -- padded on the right, the image tokens marked in `mm_token_type_ids`,
the step's patches and grids concatenated in their rows' order; the model's base (no lm_head over
the vocabulary) gives each row's last attended token's hidden state, and only LogitScore's rows of
the lm_head score it: logit(yes) - logit(no), then the activation ST's predict applies (a row's
padding moves its score by float noise only: ~5e-7 on the test model, where ST pads on the left)."""

from __future__ import annotations

import time

import numpy as np
import torch

from pooling_pipeline.core.engine.columns import Requests
from pooling_pipeline.core.engine.device_copies import record_end, start_events, to_host
from pooling_pipeline.core.engine.heads import activated_logits, logit_score_rows
from pooling_pipeline.core.engine.step_runner import PendingStep
from pooling_pipeline.core.engine.vlm_embedder_runner import QwenVlRunner
from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.options import TASKS


class VlmRerankerRunner(QwenVlRunner):
    """A StepRunner (core/engine/step_runner.py) for a multimodal reranker (torch)."""

    task = "score"

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(spec, device, dtype)
        self.score_rows = logit_score_rows(spec, self.model, device, dtype)  # (checked against the model's own logits)
        self.backend_info: dict = {"backend": "torch",
                                   "model": f"multimodal reranker ({spec.model_type}: text and image pairs)"}

    @staticmethod
    def model_class():
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText

    def base(self) -> torch.nn.Module:
        return self.model.model

    @torch.inference_mode()
    def launch(self, batch: Requests) -> PendingStep:
        started = time.perf_counter()
        tasks = {TASKS[int(code)] for code in np.unique(batch.task)}
        if tasks - {"score"}:
            raise ValueError(f"a multimodal reranker scores pairs only, not {sorted(tasks - {'score'})}")
        begin, end = start_events(self.device)
        rows, padded = self.last_hidden(batch)
        logits = torch.nn.functional.linear(rows, *self.score_rows).float()
        scores = logits[:, :1] - logits[:, 1:2] if logits.shape[1] == 2 else logits[:, :1]
        tensors, finish = activated_logits(scores, batch.lengths, batch, self.spec, per_token=False)
        host = [to_host(t) for t in tensors]
        record_end(end, self.device)
        return PendingStep(padded, host, finish, started, begin, end)
