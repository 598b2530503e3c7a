"""A render worker's images for SigLIP2's NaFlex processor: each opened as for every image model
(workers/images.py, `ImageOpener`: what ST hands the processor), then through the processor's own
call as sentence-transformers makes it -- the processor, not its image processor, whose call
settings (max_num_patches, patch_size) override the saved ones -- and handed on as its float
patches (normalized here: their count is the image's own, so the engine cannot redo the resize)
and their grid."""

from __future__ import annotations

import numpy as np

from pooling_pipeline.core.shared.config import DEFAULT_MAX_IMAGE_PIXELS, ModelSpec
from pooling_pipeline.core.shared.messages import MediaData
from pooling_pipeline.workers.images import ImageError, ImageOpener, check_processor


class NaFlexImages(ImageOpener):
    def __init__(self, spec: ModelSpec, draft: bool = False, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        """`draft` is refused in the caller (NaFlexDualEncoderFamily.check_options): an image keeps
        its size up to the patches it may have, so it is decoded exactly."""
        from transformers import AutoProcessor

        self.call = AutoProcessor.from_pretrained(spec.path)
        super().__init__(self.call.image_processor, max_pixels)
        self.spec = spec.image
        check_processor(self.processor, spec)
        tokens, payloads = self.render(MediaData(values=np.zeros(48 * 64 * 3, np.uint8), dtype="|u1", shape=[48, 64, 3]))
        width = 3 * self.spec.patch_size ** 2
        if payloads["patches"].shape[1] != width or not 0 < tokens <= self.spec.max_patches:
            raise ValueError(f"{spec.path}: the processor makes {tokens} patches of {payloads['patches'].shape[1]} values, "
                             f"the frontend expected at most {self.spec.max_patches} of {width}: this is a bug")

    def render(self, image: MediaData) -> tuple[int, dict[str, np.ndarray]]:
        """(its patches, {"patches": [n, 3 x patch x patch] float32, "spatial_shape": [1, 2] int64})."""
        opened = self.open(image)
        # (a file a torchvision processor decoded itself is an RGB tensor; an array has no mode)
        mode = opened.mode if isinstance(opened, self._image.Image) else "RGB"
        if mode != "RGB" and not getattr(self.processor, "do_convert_rgb", None):
            # (sentence-transformers hands it to the processor as it is, which fails on it)
            raise ImageError(f"a {mode} image: SigLIP2's image processor does not convert images to RGB (its "
                             "do_convert_rgb is off), and sentence-transformers fails on it; convert it to RGB first")
        try:
            out = self.call(images=[opened], return_tensors="np")
        except Exception as e:
            raise ImageError(f"the image processor cannot take this image: {type(e).__name__}: {e}") from None
        count = int(out["pixel_attention_mask"][0].sum())
        return count, {"patches": np.ascontiguousarray(out["pixel_values"][0, :count], dtype=np.float32),
                       "spatial_shape": np.asarray(out["spatial_shapes"][:1], dtype=np.int64)}
