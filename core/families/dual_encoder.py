"""Dual encoders (CLIP, SigLIP): texts through a text tower, images through an image tower, both
ending in one embedding space, as sentence-transformers 6 runs them.

Its pieces, each in its own module: the model folder read into a spec (core/shared/model_folder/
dual_encoder.py: the towers, the image processor's facts); the engine's runner
(core/engine/dual_encoder_runner.py) and the image tower on OpenVINO (core/engine/openvino_image_tower.py,
core/engine/image_features.py); the render worker's images (workers/images.py, workers/crop_window.py);
which caller inputs are images (pipeline/image_inputs.py)."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

from pooling_pipeline.core.families.base import ModelFamily
from pooling_pipeline.core.families.transformer import INSTALL_HINT
from pooling_pipeline.core.shared.config import PayloadSpec
from pooling_pipeline.core.shared.devices import cuda_expected, openvino_installed
from pooling_pipeline.core.shared.schema import MODALITIES


class DualEncoderFamily(ModelFamily):
    name = "dual_encoder"
    modalities = frozenset({"text", "image"})
    media_renderers = {"image": "pooling_pipeline.workers.images:ImageRenderer"}
    media_input = "pooling_pipeline.image_inputs:image_input"

    def worker_imports(self) -> tuple[str, ...]:
        """PIL, and torch where torchvision is installed: transformers picks its torchvision image
        processors only where it finds torch too (as in ST's process), and they run on torch tensors."""
        return ("PIL", "torch") if importlib.util.find_spec("torchvision") is not None else ("PIL",)

    def longest_input(self, spec) -> int:
        return max(spec.max_model_len, spec.image.tokens)  # a text's, or an image's vision sequence

    def payloads(self, spec) -> dict[str, PayloadSpec]:
        """An image row's pixels: one uint8 [C, H, W] item, the image processor's resize and crop."""
        image = spec.image
        return {"pixels": PayloadSpec(dtype="|u1", item_shape=(image.channels, image.height, image.width), max_items=1)}

    def row_rules(self, spec) -> tuple:
        """An image row carries its pixels and as many placeholder ids as its vision sequence; a
        text row carries no pixels."""
        from pooling_pipeline.core.engine.columns import RowRule

        image_code, tokens = MODALITIES.index("image"), spec.image.tokens

        def pixels_of(r):
            payload = r.payloads.get("pixels")
            return np.zeros(len(r), np.int64) if payload is None else payload.counts

        return (RowRule(("modality",), lambda r, model, runs: (r.modality == image_code) & (pixels_of(r) != 1),
                        lambda r, model, row: "an image row must carry its pixels, one image"),
                RowRule(("modality",), lambda r, model, runs: (r.modality != image_code) & (pixels_of(r) != 0),
                        lambda r, model, row: "a text row carries no pixels"),
                RowRule(("modality",), lambda r, model, runs: (r.modality == image_code) & (r.lengths != tokens),
                        lambda r, model, row: f"an image row must count the model's {tokens} vision tokens"))

    def backend(self, backend: str, quantize: str | None, device: str, dtype: str) -> str:
        """The text tower runs on torch; the image tower on OpenVINO under backend="openvino" (a
        CPU, float32) and under "auto" on a CPU in float32 where OpenVINO is installed and its
        compiled tower gives torch's vectors (checked at every start; else torch); on torch
        otherwise, in the dtype asked. int8 quantization covers text transformers only: refused,
        not ignored."""
        if quantize is not None:
            raise ValueError(f"quantize={quantize!r} is not supported for a dual encoder (CLIP, SigLIP)")
        full_precision = dtype in ("auto", "float32")
        if backend != "openvino":
            return "torch" if device == "sim" or not full_precision or cuda_expected(device) else backend
        if device not in ("cpu", "auto") or cuda_expected(device) or not full_precision:
            raise ValueError("backend='openvino' runs a dual encoder's image tower on the CPU in float32: pass "
                             f"device='cpu' and dtype float32 or auto (got device={device!r}, dtype={dtype!r})")
        if not openvino_installed():
            raise ValueError(f"backend='openvino' needs the openvino package: {INSTALL_HINT}")
        return "openvino"

    def runner(self, cfg, **device_steps: Any):
        from pooling_pipeline.core.engine.dual_encoder_runner import DualEncoderRunner
        from pooling_pipeline.core.engine.model_runner import resolve_device, resolve_dtype

        device = resolve_device(cfg.device)
        return DualEncoderRunner(cfg.model, device, resolve_dtype(cfg.dtype, device, "float32"), backend=cfg.backend,
                                 threads=cfg.torch_threads)
