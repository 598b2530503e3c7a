"""The image processor's resize and center crop, computed for the crop alone -- the same bytes Pillow
gives when it resizes the whole image and the processor then crops it.

Why: CLIP's processor resizes an image's shortest edge to 224 pixels and only then cuts the middle
224 x 224 out. For an image of extreme aspect ratio that first resize is enormous: a 10 x 50,000
PNG (1 kB on disk, half a megapixel) becomes 224 x 1,120,000 pixels, and the processor's copies of
it took a render worker from ~100 MB to ~2.5 GB (a 2 x 200,000 one asked for ~20 GB). Every output
pixel of Pillow's resize depends only on its own row's and column's filter coefficients, so the
crop's pixels can be computed alone, from the few source rows and columns they read.

Pillow's `box` argument cannot do it exactly: it takes the box as 32-bit floats and may run the two
passes in the other order, which moved ~90% of the crop's pixels by up to 27 levels in a trial. So
this module runs Pillow's own 8-bit resampling arithmetic (libImaging/Resample.c: coefficients in
double precision, normalized to 22-bit fixed point, the horizontal pass first, each pass rounded to
8 bits) for the crop's rows and columns only. Whether it matches the Pillow at hand is checked on
probe images when a worker starts (`CropWindow.usable`), and the tests compare it with the
processor on many shapes and with sentence-transformers on extreme ones.
"""

from __future__ import annotations

import math

import numpy as np

PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed-point coefficients
_HAMMING_A, _HAMMING_B = float(np.float32(0.54)), float(np.float32(0.46))  # (C float literals 0.54f, 0.46f)


def _box(x: float) -> float:
    return 1.0 if -0.5 < x <= 0.5 else 0.0


def _bilinear(x: float) -> float:
    x = -x if x < 0.0 else x
    return 1.0 - x if x < 1.0 else 0.0


def _hamming(x: float) -> float:
    x = -x if x < 0.0 else x
    if x == 0.0:
        return 1.0
    if x >= 1.0:
        return 0.0
    x = x * math.pi
    return math.sin(x) / x * (_HAMMING_A + _HAMMING_B * math.cos(x))


def _bicubic(x: float) -> float:
    a = -0.5
    x = -x if x < 0.0 else x
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x = x * math.pi
    return math.sin(x) / x


def _lanczos(x: float) -> float:
    return _sinc(x) * _sinc(x / 3) if -3.0 <= x < 3.0 else 0.0


# Pillow's resampling filters by their `Image.Resampling` value, with their support. (NEAREST takes
# another path in Pillow: not reproduced, so a processor resampling with it gets no crop window.)
FILTERS = {4: (_box, 0.5), 2: (_bilinear, 1.0), 5: (_hamming, 1.0), 3: (_bicubic, 2.0), 1: (_lanczos, 3.0)}


class AxisCoefficients:
    """One axis of a resize from `in_size` to `out_size` pixels, for output positions lo..hi-1:
    where each reads its input (`first`, `count`) and its fixed-point weights (`weights`, one row
    per position, zero past `count`) -- Pillow's `precompute_coeffs` and `normalize_coeffs_8bpc`."""

    def __init__(self, in_size: int, out_size: int, lo: int, hi: int, resample: int) -> None:
        kernel, kernel_support = FILTERS[resample]
        scale = in_size / out_size
        filterscale = max(scale, 1.0)
        support = kernel_support * filterscale
        ksize = int(math.ceil(support)) * 2 + 1
        ss = 1.0 / filterscale
        self.first = np.zeros(hi - lo, np.int64)
        self.count = np.zeros(hi - lo, np.int64)
        self.weights = np.zeros((hi - lo, ksize), np.int64)
        one = 1 << PRECISION_BITS
        for row, xx in enumerate(range(lo, hi)):
            center = (xx + 0.5) * scale
            xmin = max(int(center - support + 0.5), 0)
            xmax = min(int(center + support + 0.5), in_size) - xmin
            ws = [kernel((x + xmin - center + 0.5) * ss) for x in range(xmax)]
            total = 0.0
            for w in ws:  # (summed in Pillow's order: the normalization must round as its does)
                total += w
            if total != 0.0:
                ws = [w / total for w in ws]
            self.weights[row, :xmax] = [int(-0.5 + w * one) if w < 0 else int(0.5 + w * one) for w in ws]
            self.first[row], self.count[row] = xmin, xmax

    def inputs(self) -> tuple[int, int]:
        """The input positions [start, stop) these output positions read."""
        return int(self.first.min()), int((self.first + self.count).max())

    def apply(self, pixels: np.ndarray, axis: int, offset: int) -> np.ndarray:
        """The output positions along `axis` of uint8 `pixels`, whose index 0 on that axis is input
        position `offset`: Pillow's 8-bit pass (a rounding half, the sum, then clip8)."""
        moved = np.moveaxis(pixels, axis, 0)
        acc = np.full((len(self.first),) + moved.shape[1:], 1 << (PRECISION_BITS - 1), np.int64)
        last = moved.shape[0] - 1
        for tap in range(self.weights.shape[1]):
            index = np.minimum(self.first - offset + tap, last)  # (a tap past `count` has weight 0)
            weight = self.weights[:, tap].reshape((-1,) + (1,) * (moved.ndim - 1))
            acc += moved[index].astype(np.int64) * weight
        out = np.clip(acc >> PRECISION_BITS, 0, 255).astype(np.uint8)
        return np.moveaxis(out, 0, axis)


def resized_crop(rgb: np.ndarray, new_size: tuple[int, int], crop: tuple[int, int], resample: int) -> np.ndarray:
    """uint8 [height, width, 3] resized by Pillow to `new_size` (height, width), then the middle
    `crop` (height, width) cut out as transformers' center_crop cuts it: computed for the crop alone.
    The crop must fit inside the resized image."""
    (height, width), (new_height, new_width), (crop_height, crop_width) = rgb.shape[:2], new_size, crop
    top, left = (new_height - crop_height) // 2, (new_width - crop_width) // 2
    if top < 0 or left < 0:
        raise ValueError(f"a {crop} crop does not fit in a {new_size} image: this is a bug")
    rows = AxisCoefficients(height, new_height, top, top + crop_height, resample) if new_height != height else None
    row_lo, row_hi = rows.inputs() if rows is not None else (top, top + crop_height)
    if new_width != width:  # Pillow's horizontal pass first, on the rows the vertical pass reads
        columns = AxisCoefficients(width, new_width, left, left + crop_width, resample)
        band = columns.apply(rgb[row_lo:row_hi], axis=1, offset=0)
    else:
        band = rgb[row_lo:row_hi, left:left + crop_width]
    return rows.apply(band, axis=0, offset=row_lo) if rows is not None else np.ascontiguousarray(band)


# The resize is computed for the crop alone when it would make more pixels than this: an image more
# than ~20 times as long as it is wide (shortest edge 224). Below it the processor's own resize is as
# cheap in memory (~20 bytes a resized pixel across its copies) and faster (Pillow's C loops).
WINDOW_ABOVE_PIXELS = 1 << 20
# Where the crop window cannot serve (a torchvision processor, a NEAREST resample, a Pillow this
# module does not match), an image whose resize would make more pixels than this is refused: ~160 MB
# of the processor's copies, against 2.5 GB for a 10 x 50,000 image.
MAX_RESIZED_PIXELS = 8 << 20


class CropWindow:
    """A shortest-edge processor's resize and center crop (CLIP's), computed for the crop alone
    where the resize enlarges the image (the case that grows without bound: a 2 x 200,000 image's
    resize is 20 GB); equal to the processor's bytes, checked on probe images when it is made
    (`usable`). Other resizes are bounded by the decoded image's own size, which the workers cap."""

    PROBE_SHAPES = ((9, 60), (60, 9), (13, 100), (150, 211), (31, 47), (223, 224))  # (each enlarged)

    def __init__(self, processor) -> None:
        from transformers.image_transforms import get_resize_output_image_size
        from transformers.image_utils import ChannelDimension, get_image_size, infer_channel_dimension_format

        self.processor = processor
        self._output_size, self._first = get_resize_output_image_size, ChannelDimension.FIRST
        self._image_size, self._channels = get_image_size, infer_channel_dimension_format
        size, crop = processor.size, getattr(processor, "crop_size", None)
        self.resample = int(processor.resample) if processor.resample is not None else None
        self.usable = bool(getattr(processor, "backend", "pil") == "pil" and processor.do_resize
                           and size.shortest_edge and not size.longest_edge and processor.do_center_crop
                           and crop is not None and crop.height <= size.shortest_edge and crop.width <= size.shortest_edge
                           and self.resample in FILTERS)
        self.usable = self.usable and all(gives_processors_bytes(self, processor, shape) for shape in self.PROBE_SHAPES)

    def resized_size(self, image) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """(height, width) of the image and of its resize, or None where the processor does not
        resize by its shortest edge."""
        size = self.processor.size
        if not (self.processor.do_resize and size.shortest_edge and not size.longest_edge):
            return None
        if hasattr(image, "ndim"):  # an array, or the tensor a torchvision processor decoded
            if image.ndim != 3:
                return None
            height, width = self._image_size(image, self._channels(image, num_channels=(1, 3, 4)))
        else:
            width, height = image.size
        new = self._output_size(np.empty((3, height, width), np.uint8), size=size.shortest_edge,
                                default_to_square=False, input_data_format=self._first)
        return (height, width), (int(new[0]), int(new[1]))

    def takes(self, sizes) -> bool:
        """Whether this image's resize is computed for its crop alone."""
        (height, width), (new_height, new_width) = sizes
        return self.usable and new_height * new_width > WINDOW_ABOVE_PIXELS and new_height >= height \
            and new_width >= width

    def __call__(self, image) -> np.ndarray:
        """The processor's uint8 [3, crop height, crop width] pixels for `image` (a PIL image or an
        array, as the processor takes it)."""
        from transformers.image_transforms import _rescale_for_pil_conversion

        processor = self.processor
        chw = processor.process_image(image, do_convert_rgb=processor.do_convert_rgb)
        new = self._output_size(chw, size=processor.size.shortest_edge, default_to_square=False,
                                input_data_format=self._first)
        hwc = np.moveaxis(chw, 0, -1)
        if _rescale_for_pil_conversion(hwc):  # floats in [0, 1]: the processor would give float pixels
            raise ValueError(f"an image array of dtype {hwc.dtype} with values in [0, 1] gives float pixels; pass "
                             "uint8 values (or a PIL image)")
        crop = processor.crop_size
        out = resized_crop(hwc.astype(np.uint8), (int(new[0]), int(new[1])), (crop.height, crop.width), self.resample)
        return np.ascontiguousarray(out.transpose(2, 0, 1))


def gives_processors_bytes(shortcut, processor, shape: tuple[int, int]) -> bool:
    """Whether `shortcut` (a callable on a PIL image) gives the processor's very uint8 pixels for a
    random RGB image of `shape` (width, height): how each of a worker's shortcuts past the
    processor is checked when the worker starts."""
    from PIL import Image

    rng = np.random.default_rng(sum(shape))
    image = Image.fromarray(rng.integers(0, 256, (shape[1], shape[0], 3), dtype=np.uint8))
    expected = processor([image], do_rescale=False, do_normalize=False, return_tensors="np")["pixel_values"][0]
    got = shortcut(image)
    return got.shape == expected.shape and got.dtype == expected.dtype and bool((got == expected).all())
