"""A dual encoder (CLIP, SigLIP) in the engine, as sentence-transformers 6's Transformer module runs
it: a step's text rows through `get_text_features`, its image rows through `get_image_features`
(each's `pooler_output`: the projected embedding), then the modules saved after it (Dense,
LayerNorm, Normalize) and the caller's options, as for any sentence embedding.

Images arrive as the image processor's uint8 pixels after its resize and crop
(workers/images.py); the last two steps of the processor -- rescale (x * rescale_factor) and
normalize ((x - mean) / std) -- are done here on the device in float32, which equals the
processor's own float output within 1e-6 (it computes in float64 on the host).

SigLIP's text tower pools its last position whatever the padding, so ST's batched results move
with the batch's longest text (ST pads to it); here each text gets ST's result for that text
encoded alone: rows of one length run together, unpadded.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pooling_pipeline.core.engine.columns import Requests, option_groups, probe_batch
from pooling_pipeline.core.engine.device_copies import finish_step, record_end, start_events, to_device, to_host, use_device
from pooling_pipeline.core.engine.pooling import SentenceHead
from pooling_pipeline.core.engine.step_cost import probe_step_cost
from pooling_pipeline.core.engine.step_runner import PendingStep
from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.options import TASKS
from pooling_pipeline.core.shared.schema import MODALITIES
from pooling_pipeline.core.shared.vectors import finish_grouped_sentence_embeddings

TEXT = MODALITIES.index("text")


class DualEncoderRunner:
    """A StepRunner (core/engine/step_runner.py) for a dual encoder."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype, backend: str = "torch",
                 threads: int = 1) -> None:
        from transformers import AutoModel

        device = use_device(device)  # (made current before any CUDA call: see device_copies.use_device)
        self.spec, self.device, self.dtype = spec, device, dtype
        self.model = AutoModel.from_pretrained(spec.path, dtype=dtype).to(device).eval()
        self.image_tower = None  # backend "openvino": the image tower compiled by OpenVINO
        self.sentence_head = SentenceHead(spec.head_modules).to(device).eval() if spec.head_modules else None
        self.last_position_pooling = spec.model_type in ("siglip", "siglip2")  # (see the module's docstring)
        self.backend_info: dict = {"backend": "torch", "model": f"dual encoder ({spec.model_type}: text and image towers)"}
        self._prepare_second_tower(backend, threads)

    def _prepare_second_tower(self, backend: str, threads: int) -> None:
        """The image tower's rescale and normalize on the device, and its OpenVINO compilation."""
        image, device, dtype = self.spec.image, self.device, self.dtype
        scale = image.rescale_factor if image.do_rescale else 1.0
        mean = image.mean if image.do_normalize else [0.0] * image.channels
        std = image.std if image.do_normalize else [1.0] * image.channels
        # (x * scale - mean) / std, as the processor computes it, in float32
        self.scale = torch.tensor(scale, dtype=torch.float32, device=device)
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        if backend == "openvino" or (backend == "auto" and device.type == "cpu" and dtype == torch.float32):
            self._use_openvino_image_tower(backend, threads)

    def _use_openvino_image_tower(self, backend: str, threads: int) -> None:
        """The image tower on OpenVINO (core/engine/openvino_image_tower.py), the text tower on torch. Under
        "auto", where OpenVINO is not installed or cannot give torch's vectors, torch runs both
        towers and the reason is in the start-up facts."""
        try:
            from pooling_pipeline.core.engine.openvino_image_tower import compile_image_tower

            self.image_tower, info = compile_image_tower(self.model, self.spec, threads, (self.scale, self.mean, self.std))
        except Exception as e:  # not installed, BackendUnavailable, or OpenVINO itself failing
            if backend == "openvino":
                raise ValueError(f"backend='openvino' cannot run the image tower of {self.spec.path!r}: {e}") from e
            self.backend_info["openvino_refused"] = f"{type(e).__name__}: {e}"
            return
        self.backend_info.update(backend="openvino", image_tower="openvino", text_tower="torch", **info)

    def step_cost(self, max_tokens: int) -> tuple[float, float]:
        token = min(1000, self.spec.vocab_size - 1)
        return probe_step_cost(lambda rows, tokens: self.run(probe_batch(rows, tokens, token, "embed")),
                               max_tokens, self.spec.max_model_len)

    def run(self, batch: Requests) -> tuple[list | np.ndarray, int]:
        results, padded, _ = self.finish(self.launch(batch))
        return results, padded

    @torch.inference_mode()
    def launch(self, batch: Requests) -> PendingStep:
        started = time.perf_counter()
        tasks = {TASKS[int(code)] for code in np.unique(batch.task)}
        if tasks - {"embed", "score"}:
            raise ValueError(f"a dual encoder gives embeddings only, not {sorted(tasks - {'embed', 'score'})}")
        media = batch.modality != TEXT  # (the second tower's rows: images, or a CLAP model's audio)
        begin, end = start_events(self.device)  # (on CUDA: the step runs on while the engine goes on)
        vectors = torch.empty((len(batch), self.spec.hidden_size), dtype=torch.float32, device=self.device)
        padded = 0
        if not media.all():
            text_rows = np.flatnonzero(~media)
            groups = [text_rows] if not self.last_position_pooling else \
                [text_rows[batch.lengths[text_rows] == n] for n in np.unique(batch.lengths[text_rows]).tolist()]
            for rows in groups:
                texts = batch.select(rows) if len(rows) < len(batch) else batch
                ids, mask = texts.padded(0)  # (the mask hides the pad id; CLIP's argmax pooling never picks 0)
                out = self.model.get_text_features(input_ids=to_device(ids, self.device),
                                                   attention_mask=to_device(mask, self.device).long())
                vectors[to_device(rows, self.device)] = _pooled(out).float()
                padded += ids.size
        if media.any():
            rows = np.flatnonzero(media)
            embedded, computed = self._media_vectors(batch)
            vectors[to_device(rows, self.device)] = embedded
            padded += computed
        if self.sentence_head is not None:
            vectors = self.sentence_head(vectors)
        groups = option_groups(batch, batch.normalize)
        spec = self.spec

        def finish(arrays: list[np.ndarray]) -> list[np.ndarray] | np.ndarray:
            return finish_grouped_sentence_embeddings(arrays[0], groups, spec)

        host = [to_host(vectors)]
        record_end(end, self.device)
        return PendingStep(padded, host, finish, started, begin, end)

    def _media_vectors(self, batch: Requests) -> tuple[torch.Tensor, int]:
        """The image rows' embeddings (float32, in the rows' order) and the tokens their tower computed."""
        pixels = batch.payloads["pixels"].data  # (an image row's one item; its family's rules hold it)
        if self.image_tower is not None:  # (it rescales and normalizes the pixels itself)
            embedded = torch.from_numpy(self.image_tower(pixels)[0])
        else:
            values = self._normalized(pixels)
            embedded = _pooled(self.model.get_image_features(pixel_values=values.to(self.dtype))).float()
        return embedded, len(pixels) * self.spec.image.tokens

    def _normalized(self, pixels: np.ndarray) -> torch.Tensor:
        """(x * rescale_factor - mean) / std in float32, on the device: uint8 pixels travel there (a
        quarter of the bytes) and are converted there. (On a CPU the torch backend's; OpenVINO's
        graph does the same arithmetic itself.)"""
        return (to_device(pixels, self.device).float() * self.scale - self.mean) / self.std

    def finish(self, step: PendingStep) -> tuple[list, int, float]:
        return finish_step(step)


def _pooled(output) -> torch.Tensor:
    """A get_*_features output's `pooler_output` (transformers 5), or the tensor itself (older)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output
