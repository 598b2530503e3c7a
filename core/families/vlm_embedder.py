"""VLM embedders (Qwen3-VL-Embedding and others on Qwen2-VL / Qwen3-VL): texts and images of any
size, each rendered as chat messages by the model's processor, the last token's hidden state, as
sentence-transformers 6's Transformer module runs them.

Its pieces: the model folder read into a spec (core/shared/model_folder/vlm_embedder.py); the render
worker's texts and images (workers/vlm_messages.py: the processor's chat template and its dynamic
resolution, an image's float patches and (t, h, w) grid as the row's payloads); the engine's runner
(core/engine/vlm_embedder_runner.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from pooling_pipeline.core.families.base import ModelFamily
from pooling_pipeline.core.shared.config import PayloadSpec
from pooling_pipeline.core.shared.schema import MODALITIES

# Images one input may hold (a text and images in chat messages): its patches and grids travel in
# one row, whose bytes this bounds.
MAX_IMAGES_PER_INPUT = 8


class VlmEmbedderFamily(ModelFamily):
    name = "vlm_embedder"
    modalities = frozenset({"text", "image"})
    media_renderers = {"image": "pooling_pipeline.workers.vlm_messages:VlmImages"}
    media_input = "pooling_pipeline.image_inputs:image_input"
    text_renderer = "pooling_pipeline.workers.vlm_messages:VlmTexts"
    message_input = "pooling_pipeline.vlm_inputs:message_input"
    prompt_on_every_input = True

    def worker_imports(self) -> tuple[str, ...]:
        """PIL, torch and torchvision: transformers 5 loads a Qwen-VL processor only with its video
        processor, which needs torchvision."""
        return ("PIL", "torch", "torchvision")

    def payloads(self, spec) -> dict[str, PayloadSpec]:
        """An image row's patches (float32, the processor's normalized values: 3 x temporal x patch x
        patch each, at most max_patches an image) and a (t, h, w) grid per image."""
        image = spec.image
        width = image.channels * image.patch_size ** 2  # (channels: 3 x the temporal patch)
        return {"patches": PayloadSpec(dtype="<f4", item_shape=(width,),
                                       max_items=image.max_patches * MAX_IMAGES_PER_INPUT),
                "grid_thw": PayloadSpec(dtype="<i8", item_shape=(3,), max_items=MAX_IMAGES_PER_INPUT)}

    def inflight_payloads(self, spec) -> dict[str, PayloadSpec]:
        """One image's most (a row of up to MAX_IMAGES_PER_INPUT images would bound the requests in
        flight to 2, and an input of several images is the exception): the in-flight bytes stay
        within MAX_IMAGES_PER_INPUT times the caller's bound in the worst case."""
        return {name: msgspec.structs.replace(payload, max_items=payload.max_items // MAX_IMAGES_PER_INPUT)
                for name, payload in self.payloads(spec).items()}

    def row_rules(self, spec) -> tuple:
        return qwen_image_row_rules(spec)

    def check_options(self, spec, image_decode: str) -> None:
        if image_decode != "exact":
            raise ValueError(f"image_decode={image_decode!r} applies to CLIP and SigLIP's fixed image size; a VLM "
                             f"embedder ({spec.path!r}) decodes its images exactly")

    def backend(self, backend: str, quantize: str | None, device: str, dtype: str) -> str:
        if quantize is not None:
            raise ValueError(f"quantize={quantize!r} is not supported for a VLM embedder")
        if backend == "openvino":
            raise ValueError("backend='openvino' cannot run a VLM embedder (Qwen2-VL, Qwen3-VL): use backend='torch' "
                             "or 'auto'")
        return "torch"

    def runner(self, cfg, **device_steps: Any):
        from pooling_pipeline.core.engine.model_runner import resolve_device, resolve_dtype
        from pooling_pipeline.core.engine.vlm_embedder_runner import VlmEmbedderRunner

        device = resolve_device(cfg.device)
        return VlmEmbedderRunner(cfg.model, device, resolve_dtype(cfg.dtype, device, "float32"))


def qwen_image_row_rules(spec) -> tuple:
    """The rows of a Qwen-VL model (a VLM embedder, ColQwen2): an image row carries a grid per image,
    their patches (t x h x w each) and one image token per merged group of them in its ids; a text
    row carries none of the three."""
    from pooling_pipeline.core.engine.columns import RowRule

    image_code, token, merged = MODALITIES.index("image"), spec.image.image_token_id, spec.image.merge_size ** 2

    def counts(r, name):
        payload = r.payloads.get(name)
        return np.zeros(len(r), np.int64) if payload is None else payload.counts

    def grid_patches(r):
        """Each row's patches by its grids (t x h x w summed over them); 0 without one."""
        grids, out = r.payloads.get("grid_thw"), np.zeros(len(r), np.int64)
        if grids is not None:
            has = grids.counts > 0
            first = (np.cumsum(grids.counts) - grids.counts)[has]
            if first.size:
                out[has] = np.add.reduceat(grids.data.prod(axis=1), first)
        return out

    def image_tokens(r):
        out = np.zeros(len(r), np.int64)
        rows = np.flatnonzero(r.lengths > 0)
        if rows.size:
            out[rows] = np.add.reduceat((r.token_ids == token).astype(np.int64), r.starts[rows])
        return out

    def image_broken(r, model, runs):
        patches = counts(r, "patches")
        return (r.modality == image_code) & ((patches < 1) | (counts(r, "grid_thw") < 1)
                                             | (grid_patches(r) != patches)
                                             | (image_tokens(r) * merged != patches))

    def text_broken(r, model, runs):
        return (r.modality != image_code) & ((counts(r, "patches") != 0) | (counts(r, "grid_thw") != 0)
                                             | (image_tokens(r) != 0))

    return (RowRule(("modality",), image_broken, lambda r, model, row: "an image row must carry a (t, h, w) grid per "
                    "image, their t x h x w patches and one image token per merged group of them"),
            RowRule(("modality",), text_broken, lambda r, model, row: "a text row carries no patches, grid or image "
                    "tokens (a text holding the model's image token is refused, as the model refuses it)"))
