"""SigLIP2 with its NaFlex processor in the engine: the dual encoder's text path as SigLIP's, and
images of their own number of patches. Each image row carries the processor's float patches
("patches": [its patches, 3 x patch x patch], normalized in the render worker exactly as the
processor computes them) and its grid ("spatial_shape": [1, 2], patch rows and columns); a step's
images are padded to its longest with the patch attention mask, which makes an image's vector
independent of what it is padded to (within 1e-6: measured against ST's 256-patch padding), and
run through `get_image_features` as ST runs them."""

from __future__ import annotations

import numpy as np
import torch

from pooling_pipeline.core.engine.columns import Requests
from pooling_pipeline.core.engine.device_copies import to_device
from pooling_pipeline.core.engine.dual_encoder_runner import DualEncoderRunner, _pooled
from pooling_pipeline.core.shared.config import ModelSpec


class NaFlexRunner(DualEncoderRunner):
    """A StepRunner (core/engine/step_runner.py) for a SigLIP2 NaFlex dual encoder (torch only)."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype, threads: int = 1) -> None:
        super().__init__(spec, device, dtype, backend="torch", threads=threads)
        self.backend_info["model"] = f"dual encoder ({spec.model_type}, NaFlex images: text and image towers)"

    def _media_vectors(self, batch: Requests) -> tuple[torch.Tensor, int]:
        patches, grids = batch.payloads["patches"], batch.payloads["spatial_shape"]
        counts = patches.counts[patches.counts > 0]  # (one entry per image row, in the rows' order)
        longest = int(counts.max())
        real = np.arange(longest)[None, :] < counts[:, None]
        values = np.zeros((len(counts), longest, patches.data.shape[1]), np.float32)
        values[real] = patches.data  # (one masked assignment: no copy per image)
        grid = np.array(grids.data)  # (a copy: the wire's arrays are read-only)
        out = self.model.get_image_features(pixel_values=to_device(values, self.device).to(self.dtype),
                                            pixel_attention_mask=to_device(real.astype(np.int64), self.device),
                                            spatial_shapes=to_device(grid, self.device))
        return _pooled(out).float(), values.shape[0] * longest
