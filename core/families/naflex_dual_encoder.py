"""SigLIP2 with its NaFlex processor: a dual encoder whose images keep their aspect ratio, resized to
at most `max_patches` patches (256 as Siglip2Processor calls it), as sentence-transformers 6 runs it.

Its pieces: the model folder read into a spec (core/shared/model_folder/dual_encoder.py, the
"siglip2" entry); the render worker's images (workers/naflex_images.py: the processor's own call,
its patches and grid as the row's payloads); the engine's runner (core/engine/naflex_runner.py).
Texts go as for SigLIP."""

from __future__ import annotations

from typing import Any

import numpy as np

from pooling_pipeline.core.families.dual_encoder import DualEncoderFamily
from pooling_pipeline.core.shared.config import PayloadSpec
from pooling_pipeline.core.shared.schema import MODALITIES


class NaFlexDualEncoderFamily(DualEncoderFamily):
    name = "naflex_dual_encoder"
    media_renderers = {"image": "pooling_pipeline.workers.naflex_images:NaFlexImages"}

    def payloads(self, spec) -> dict[str, PayloadSpec]:
        """An image row's patches (float32, 3 x patch x patch values each, at most max_patches) and
        its grid (one [rows, columns] item)."""
        image = spec.image
        return {"patches": PayloadSpec(dtype="<f4", item_shape=(3 * image.patch_size ** 2,), max_items=image.max_patches),
                "spatial_shape": PayloadSpec(dtype="<i8", item_shape=(2,), max_items=1)}

    def row_rules(self, spec) -> tuple:
        """An image row carries its patches, as many placeholder ids, and one grid of that many
        patches; a text row carries neither."""
        from pooling_pipeline.core.engine.columns import RowRule

        image_code = MODALITIES.index("image")

        def counts(r, name):
            payload = r.payloads.get(name)
            return np.zeros(len(r), np.int64) if payload is None else payload.counts

        def grid_patches(r):
            """Each row's (first) grid's patches, rows x columns; 0 without one."""
            grids, out = r.payloads.get("spatial_shape"), np.zeros(len(r), np.int64)
            if grids is not None:
                has = grids.counts > 0
                first = (np.cumsum(grids.counts) - grids.counts)[has]
                out[has] = grids.data[first, 0] * grids.data[first, 1]
            return out

        def image_broken(r, model, runs):
            patches = counts(r, "patches")
            return (r.modality == image_code) & ((patches < 1) | (patches != r.lengths) | (counts(r, "spatial_shape") != 1)
                                                 | (grid_patches(r) != patches))

        def text_broken(r, model, runs):
            return (r.modality != image_code) & ((counts(r, "patches") != 0) | (counts(r, "spatial_shape") != 0))

        return (RowRule(("modality",), image_broken, lambda r, model, row: "an image row must carry its patches, as many "
                        "placeholder ids and one grid of that many patches"),
                RowRule(("modality",), text_broken, lambda r, model, row: "a text row carries no patches"))

    def check_options(self, spec, image_decode: str) -> None:
        """Draft decoding shrinks a JPEG to what a fixed input size needs; a NaFlex image keeps its
        own size up to its patches, so there is nothing to shrink to: refused, not ignored."""
        if image_decode != "exact":
            raise ValueError(f"image_decode={image_decode!r} applies to CLIP and SigLIP's fixed image size; a SigLIP2 "
                             f"NaFlex model ({spec.path!r}) decodes its images exactly")

    def backend(self, backend: str, quantize: str | None, device: str, dtype: str) -> str:
        """Both towers on torch: NaFlex's variable patch counts are not converted to OpenVINO."""
        if quantize is not None:
            raise ValueError(f"quantize={quantize!r} is not supported for a dual encoder (CLIP, SigLIP, SigLIP2)")
        if backend == "openvino":
            raise ValueError("backend='openvino' cannot run a SigLIP2 NaFlex model (its images have any number of "
                             "patches): use backend='torch' or 'auto'")
        return "torch"

    def runner(self, cfg, **device_steps: Any):
        from pooling_pipeline.core.engine.model_runner import resolve_device, resolve_dtype
        from pooling_pipeline.core.engine.naflex_runner import NaFlexRunner

        device = resolve_device(cfg.device)
        return NaFlexRunner(cfg.model, device, resolve_dtype(cfg.dtype, device, "float32"), threads=cfg.torch_threads)
