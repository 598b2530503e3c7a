"""A page retriever (ColPali) in the engine, as sentence-transformers 6's MultiVectorEncoder runs
transformers' `ColPaliForRetrieval`: a step's rows -- text queries and page images together -- padded
on the right to the step's longest, with their attention mask, `token_type_ids` of zeros (what ST's
processor hands the model: with none, PaliGemma would attend causally) and the pages' pixels; the
model's `embeddings` (L2-normalised, padding zeroed) at the tokens ST's MultiVectorMask keeps
(`heads.kept_tokens`: the attended tokens, less a skiplist, only `keep_only_token_ids` on
documents). A row's vectors do not depend on what it is padded to (measured: 0.0 against ST
batched and alone). Pixels arrive as the image processor's uint8 resize (workers/page_retriever.py)
and are rescaled and normalized here in the processor's own arithmetic (bit for bit its float output)."""

from __future__ import annotations

import time

import numpy as np
import torch

from pooling_pipeline.core.engine.columns import Requests, probe_batch
from pooling_pipeline.core.engine.device_copies import finish_step, record_end, start_events, to_device, to_host, use_device
from pooling_pipeline.core.engine.heads import kept_token_vectors, kept_tokens, multi_vector_parts
from pooling_pipeline.core.engine.step_cost import probe_step_cost
from pooling_pipeline.core.engine.step_runner import PendingStep
from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.options import TASKS
from pooling_pipeline.core.shared.schema import MODALITIES

IMAGE = MODALITIES.index("image")


class PageRetrieverRunner:
    """A StepRunner (core/engine/step_runner.py) for a ColPali page retriever (torch)."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoConfig

        device = use_device(device)
        self.spec, self.device, self.dtype = spec, device, dtype
        self.model = self.model_class().from_pretrained(spec.path, dtype=dtype).to(device).eval()
        vlm = AutoConfig.from_pretrained(spec.path).vlm_config
        self.pad_id = int(getattr(getattr(vlm, "text_config", vlm), "pad_token_id", None)
                          or getattr(vlm, "pad_token_id", None) or 0)  # (masked: any id pads)
        self.token_head, self.skip_ids = multi_vector_parts(spec, device)
        self._prepare_images(spec, device)
        self.backend_info: dict = {"backend": "torch", "model": f"page retriever ({spec.model_type}: texts and pages)"}

    @staticmethod
    def model_class():
        from transformers import ColPaliForRetrieval

        return ColPaliForRetrieval

    def _prepare_images(self, spec: ModelSpec, device: torch.device) -> None:
        image = spec.image
        scale = image.rescale_factor if image.do_rescale else 1.0
        mean = image.mean if image.do_normalize else [0.0] * image.channels
        std = image.std if image.do_normalize else [1.0] * image.channels
        self.scale = torch.tensor(scale, dtype=torch.float64, device=device)  # (rescaled in float64, as the processor)
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)

    def step_cost(self, max_tokens: int) -> tuple[float, float]:
        token = min(1000, self.spec.vocab_size - 1)
        return probe_step_cost(lambda rows, tokens: self.run(probe_batch(rows, tokens, token, "token_embed")),
                               max_tokens, self.spec.max_model_len)

    def run(self, batch: Requests) -> tuple[list, int]:
        results, padded, _ = self.finish(self.launch(batch))
        return results, padded

    @torch.inference_mode()
    def launch(self, batch: Requests) -> PendingStep:
        started = time.perf_counter()
        tasks = {TASKS[int(code)] for code in np.unique(batch.task)}
        if tasks - {"token_embed", "score"}:
            raise ValueError(f"a page retriever gives token vectors only, not {sorted(tasks - {'token_embed', 'score'})}")
        begin, end = start_events(self.device)
        ids, real = batch.padded(self.pad_id)
        inputs = {"input_ids": to_device(ids, self.device), "attention_mask": to_device(real, self.device).long()}
        if (batch.modality == IMAGE).any():  # (the pages' pixels, in their rows' order)
            inputs.update(self._image_inputs(batch))
        vectors = self.model(**self._text_inputs(inputs, ids)).embeddings.float()
        if self.token_head is not None:
            vectors = self.token_head(vectors)
        keep = kept_tokens(self.spec, self.skip_ids, ids, real, batch)
        normalize = np.where(batch.normalize < 0, int(self.spec.normalize), batch.normalize)
        dimensions = batch.dimensions

        def finish(arrays: list[np.ndarray]) -> list[np.ndarray]:
            return kept_token_vectors(arrays[0], keep, dimensions, normalize)

        host = [to_host(vectors)]
        record_end(end, self.device)
        return PendingStep(ids.size, host, finish, started, begin, end)

    def _text_inputs(self, inputs: dict, ids: np.ndarray) -> dict:
        """`token_type_ids` of zeros: what ST's processor hands PaliGemma (with none, it would attend causally)."""
        return {**inputs, "token_type_ids": torch.zeros(ids.shape, dtype=torch.long, device=self.device)}

    def _image_inputs(self, batch: Requests) -> dict:
        # transformers' PIL processor, step for step: x * rescale_factor in float64, then float32,
        # then (x - mean) / std in float32 -- one ulp of a pixel moves a page's vectors by ~5e-6
        pixels = to_device(batch.payloads["pixels"].data, self.device).double()
        rescaled = (pixels * self.scale).float()
        return {"pixel_values": ((rescaled - self.mean) / self.std).to(self.dtype)}

    def finish(self, step: PendingStep) -> tuple[list, int, float]:
        return finish_step(step)


class QwenPageRetrieverRunner(PageRetrieverRunner):
    """ColQwen2 (transformers' `ColQwen2ForRetrieval`), as ST's MultiVectorEncoder runs it: a page's
    row carries the processor's float patches (its dynamic resolution) and its (t, h, w) grid; the
    pages of a step go to the model as its processor pads them ([pages, most patches, values], zeros
    after each page's own), with their grids. The model places its tokens by a plain range of
    positions (it calls its VLM with embeddings only), so right padding leaves each row as it is alone."""

    @staticmethod
    def model_class():
        from transformers import ColQwen2ForRetrieval

        return ColQwen2ForRetrieval

    def _prepare_images(self, spec: ModelSpec, device: torch.device) -> None:
        """Nothing: the patches arrive as the processor normalized them."""

    def _text_inputs(self, inputs: dict, ids: np.ndarray) -> dict:
        """No KV cache: Qwen2-VL's config asks for one, which a step would fill and drop (ST turns it off)."""
        return {**inputs, "use_cache": False}

    def _image_inputs(self, batch: Requests) -> dict:
        patches, grids = batch.payloads["patches"], batch.payloads["grid_thw"]
        counts = patches.counts[patches.counts > 0]  # (one entry per page row, in the rows' order)
        real = np.arange(int(counts.max()))[None, :] < counts[:, None]
        values = np.zeros((len(counts), real.shape[1], patches.data.shape[1]), np.float32)
        values[real] = patches.data  # (one masked assignment: no copy per page)
        return {"pixel_values": to_device(values, self.device).to(self.dtype),
                "image_grid_thw": to_device(np.array(grids.data), self.device)}
