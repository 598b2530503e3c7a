"""A render worker's queries and pages for a page retriever (ColPali; ColQwen2's pages: `QwenPages`), as sentence-transformers 6's
MultiVectorEncoder hands them to the model's processor: every text through the processor's text
path (a query: `<bos>`, the `query_prefix`, the text, ten augmentation tokens and a newline) -- a
call's prompt goes in front of the text, as ST prepends it; every image through the image processor
(its fixed-size resize: uint8 pixels, the engine rescales and normalizes on the device, as for CLIP)
with the processor's image row (`<image>` x image_seq_length, `<bos>`, the visual prompt, a newline),
the same for every page and computed once here."""

from __future__ import annotations

import numpy as np

from pooling_pipeline.core.shared.config import DEFAULT_MAX_IMAGE_PIXELS, ModelSpec
from pooling_pipeline.core.shared.messages import MediaData
from pooling_pipeline.core.shared.options import too_long
from pooling_pipeline.workers.images import ImageError, ImageOpener, ImageRenderer


def _processor(spec: ModelSpec):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(spec.path)


class QueryTexts:
    """A page retriever's texts: the processor's own text call, as ST makes it."""

    def __init__(self, spec: ModelSpec, draft: bool = False, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.spec, self.processor = spec, _processor(spec)  # (as every renderer, built with the image options)

    def render(self, text: str, max_tokens: int, long_inputs: str, truncate_left: bool) -> np.ndarray:
        out = self.processor(text=[text], text_kwargs={"padding": True, "truncation": "longest_first"},
                             return_tensors="pt")  # (its query path works on torch tensors only)
        ids = out["input_ids"][0].numpy().astype(np.int64)
        if len(ids) > max_tokens:
            if long_inputs == "error" or max_tokens >= self.spec.max_model_len:
                raise ValueError(too_long("prompt", len(ids), True, max_tokens))
            ids = ids[-max_tokens:] if truncate_left else ids[:max_tokens]
        return ids


class PageImages(ImageRenderer):
    """A page retriever's images: resized by its image processor as for CLIP, with the processor's
    image row as their ids. As ST's retrieval path: a file, data URI or bytes is opened by
    transformers' `load_image` (PIL) before the processor sees it, whatever its backend, and
    ColPaliProcessor converts every image to RGB (its `images_kwargs`: do_convert_rgb=True, which
    the saved image processor config may leave unset)."""

    processor_decodes_files = False
    processor_call = {"do_convert_rgb": True}

    def __init__(self, spec: ModelSpec, draft: bool = False, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        from PIL import Image

        super().__init__(spec, draft=draft, max_pixels=max_pixels)
        probe = _processor(spec)(images=[Image.new("RGB", (spec.image.width, spec.image.height))], return_tensors="pt")
        self.page_ids = probe["input_ids"][0].numpy().astype(np.int64)
        image_tokens = int((self.page_ids == self.page_ids[0]).sum())
        if image_tokens != spec.image.tokens or len(self.page_ids) <= image_tokens:
            raise ValueError(f"{spec.path}: the processor's image row has {image_tokens} image tokens in "
                             f"{len(self.page_ids)}, the frontend read {spec.image.tokens}: this is a bug")
        if len(self.page_ids) > spec.max_model_len:
            raise ValueError(f"{spec.path}: a page's row has {len(self.page_ids)} tokens, more than the text model's "
                             f"{spec.max_model_len} positions")

    def render(self, image: MediaData) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return self.page_ids, {"pixels": self.pixels(image)[None]}


class QwenPages(ImageOpener):
    """A ColQwen2 page retriever's images: opened as ST's retrieval path opens them (a file, data URI
    or bytes by transformers' `load_image`, PIL, RGB; an in-memory image as it is), then the
    processor's image call: the visual prompt's ids (one image token per merged group of patches,
    as many as its dynamic resolution gives), the float patches and the (t, h, w) grid."""

    processor_decodes_files = False

    def __init__(self, spec: ModelSpec, draft: bool = False, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.spec, self.call = spec, _processor(spec)
        super().__init__(self.call.image_processor, max_pixels)
        ids, payloads = self.render(MediaData(values=np.zeros(48 * 64 * 3, np.uint8), dtype="|u1", shape=[48, 64, 3]))
        image = spec.image
        if payloads["patches"].shape[1] != image.channels * image.patch_size ** 2 \
                or int((ids == image.image_token_id).sum()) * image.merge_size ** 2 != len(payloads["patches"]):
            raise ValueError(f"{spec.path}: the processor's page row does not hold one image token (id "
                             f"{image.image_token_id}) per {image.merge_size ** 2} of its {len(payloads['patches'])} "
                             "patches: this is a bug")

    def render(self, image: MediaData) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        opened = self.open(image)
        try:
            out = self.call(images=[opened], return_tensors="pt")
        except Exception as e:
            raise ImageError(f"the processor cannot take this image: {type(e).__name__}: {e}") from None
        grid = out["image_grid_thw"].numpy().astype(np.int64)
        ids = out["input_ids"][0].numpy().astype(np.int64)
        if len(ids) > self.spec.max_model_len:
            raise ValueError(too_long("prompt", len(ids), True, self.spec.max_model_len))
        patches = out["pixel_values"][0, :int(grid[0].prod())].numpy()  # (its own patches: the rest is padding)
        return ids, {"patches": np.ascontiguousarray(patches, dtype=np.float32), "grid_thw": grid}
