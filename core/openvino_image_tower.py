"""A dual encoder's image tower (`get_image_features`) compiled by OpenVINO for the CPU, float32:
backend="openvino" for CLIP / SigLIP. Converted from the loaded torch module when the engine starts
(tens of seconds for a ViT-B; nothing is cached) with a dynamic batch, then checked against torch on
a probe batch of real pixel values: a difference above the project's float32 tolerance (1e-5,
relative above 1) refuses the start, naming it, rather than serve different vectors."""

from __future__ import annotations

import numpy as np
import torch

from pooling_pipeline.core.config import ImageSpec

TOLERANCE = 1e-5
PROBE_IMAGES = 4


class _ImageFeatures(torch.nn.Module):
    """get_image_features' pooler_output as a module of one input, for the converter."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.model.get_image_features(pixel_values=pixel_values)
        return out if isinstance(out, torch.Tensor) else out.pooler_output


def compile_image_tower(model, image: ImageSpec, threads: int, normalized) -> tuple[object, float]:
    """(the compiled image tower: called with [n, C, H, W] float32 values, its [0] the vectors; the
    max difference to torch on the probe). `normalized` turns uint8 pixels into the tower's values."""
    import openvino as ov

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (PROBE_IMAGES, image.channels, image.height, image.width), dtype=np.uint8)
    values = normalized(pixels)
    wrapper = _ImageFeatures(model).eval()
    with torch.inference_mode():
        expected = wrapper(values).float().numpy()
    converted = ov.convert_model(wrapper, example_input=(values,),
                                 input=[ov.PartialShape([-1, image.channels, image.height, image.width])])
    compiled = ov.Core().compile_model(converted, "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                          "INFERENCE_PRECISION_HINT": "f32"})
    got = compiled(values.numpy())[0]
    max_diff = float(np.abs(got - expected).max())
    bound = TOLERANCE * max(1.0, float(np.abs(expected).max()))
    if got.shape != expected.shape or not max_diff <= bound:
        raise ValueError(f"the image tower compiled by OpenVINO differs from torch by {max_diff:.2e} on a probe "
                         f"batch (more than {bound:.1e}): use backend='torch'")
    return compiled, max_diff
