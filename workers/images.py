"""A render worker's images: open, decode, convert and resize each as sentence-transformers 6 would,
with the model's own image processor, and hand on the smallest exact form -- the processor's uint8
pixels after its resize and crop, before its rescale and normalize, which the engine does on the
device (core/engine/dual_encoder_runner.py; equal to the processor's float output within 1e-6).

How each input is opened follows what ST hands the processor: a path, a data URI or an image file's
bytes go through transformers' `load_image` (EXIF orientation applied, then `convert("RGB")`); an
in-memory PIL image (rebuilt here from its raw pixels) or array goes to the processor as it is
(which composites transparency on white). A bad image is that request's error, naming why.
"""

from __future__ import annotations

import base64
import io
import warnings

import numpy as np

from pooling_pipeline.core.shared.config import DEFAULT_MAX_IMAGE_PIXELS, ModelSpec
from pooling_pipeline.core.shared.messages import MediaData
from pooling_pipeline.workers.crop_window import MAX_RESIZED_PIXELS, CropWindow, gives_processors_bytes

# glibc's malloc hands a freed block over 128 kB back to the kernel, and trims the heap's free top
# past a threshold that grows only as far as the largest freed block, so a stream of images maps
# fresh pages for each decode, resize and message and faults them in again: ~70 page faults and
# ~0.2 ms of system time per 0.2-megapixel JPEG, a tenth of its cost. An image worker keeps what
# it freed for the next image instead, up to these bounds: blocks under MMAP_BELOW come from the
# heap, and the heap keeps up to KEEP_FREE_TOP of free memory at its top. (PIL allocates a large
# image in 16 MB blocks, so a 12-megapixel photo's 48 MB decode still goes back to the kernel: a
# worker holds ~85 MB RSS after a stream of them, not their peak.)
MALLOC_MMAP_BELOW = 16 << 20
MALLOC_KEEP_FREE_TOP = 32 << 20


class ImageError(ValueError):
    """An image that cannot be turned into pixels: the request's error."""


class ImageOpener:
    """The opening rules above, for any model family's images: `open` gives what ST hands the
    processor. `processor` is the model's image processor (its backend decides who decodes a
    file); `draft_side`: JPEGs decoded at a reduced DCT scale that still covers it (None: exact);
    `max_pixels`: the most pixels an image may have before it is decoded."""

    # A torchvision processor decodes files itself where ST hands it paths (a dual encoder's call);
    # False where ST opens them with transformers' load_image first (a *ForRetrieval model's path).
    processor_decodes_files = True

    def __init__(self, processor, max_pixels: int, draft_side: int | None = None) -> None:
        from PIL import Image, ImageOps  # (a worker of a text model never imports PIL)

        self._image, self._exif_transpose = Image, ImageOps.exif_transpose
        self.malloc_tuned = keep_freed_memory()
        self.processor, self.backend = processor, processor_backend(processor)
        self.max_pixels, self.draft, self.draft_side = max_pixels, draft_side is not None, draft_side or 0

    def open(self, image: MediaData):
        """The image as ST hands it to the processor: a PIL image (loaded) or a numpy array."""
        if image.values is not None:
            return self._in_memory(image)
        if image.path is not None:
            source, what = image.path, f"image file {image.path!r}"
        elif image.uri is not None:  # a data:image/ URI, or raw base64: load_image's reading of either
            data_uri = image.uri.startswith("data:image/")
            what = "the data URI's image" if data_uri else "the base64 data's image"
            try:
                source = io.BytesIO(base64.decodebytes((image.uri.split(",")[1] if data_uri else image.uri).encode()))
            except Exception as e:
                raise ImageError(f"{what} cannot be decoded from base64: {e}") from None
        else:
            source, what = io.BytesIO(image.encoded), "the image bytes"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", self._image.DecompressionBombWarning)
                opened = self._image.open(source)
                width, height = opened.size
                if width * height > self.max_pixels:
                    raise ImageError(f"{what} has {width}x{height} pixels, more than the limit of {self.max_pixels} "
                                     "(a decompression bomb?)")
                if width == 0 or height == 0:
                    raise ImageError(f"{what} is empty ({width}x{height})")
                if self.draft and opened.format == "JPEG":
                    opened.draft("RGB", (self.draft_side, self.draft_side))  # (both sides stay >= the model's input)
                elif self.backend != "pil" and self.processor_decodes_files:
                    opened.close()  # (read for its size only)
                    return self.processor.fetch_images(_as_load_image_source(image))
                return self.upright_rgb(opened)
        except ImageError:
            raise
        except FileNotFoundError:
            raise ImageError(f"{what} does not exist") from None
        except Exception as e:  # not an image, truncated, an unsupported mode, ...
            raise ImageError(f"{what} cannot be decoded: {type(e).__name__}: {e}") from None

    # A file, a data URI or an image's bytes reach the processor as ST hands them (a path or a
    # string): a PIL processor's caller opens them with transformers' `load_image` (`upright_rgb`
    # below does the same, without its copies); a torchvision processor decodes them itself, with
    # its own decoder (`fetch_images`: torchcodec or torchvision, the EXIF orientation applied), so
    # a worker hands them to it after checking the size in the file's header.

    def upright_rgb(self, opened):
        """transformers' `load_image` on an opened file -- EXIF orientation applied, then
        `convert("RGB")` -- without its two whole-image copies (`exif_transpose` copies an image it
        does not turn, and `convert` to the image's own mode copies it): the same pixels and info,
        ~25 ms less for a 12-megapixel photo. (tests/test_images.py compares it with load_image.)"""
        self._exif_transpose(opened, in_place=True)
        return opened if opened.mode == "RGB" else opened.convert("RGB")

    def _in_memory(self, image: MediaData):
        """A caller's PIL image (rebuilt from its raw pixels) or numpy array."""
        try:
            if image.mode is None:
                return np.frombuffer(image.values, dtype=np.dtype(image.dtype)).reshape(image.shape)
            rebuilt = self._image.frombytes(image.mode, tuple(image.shape), image.values.tobytes())
            if image.palette is not None:
                rebuilt.putpalette(image.palette, rawmode=image.palette_mode or "RGB")
            if image.transparency is not None:
                transparency = image.transparency
                rebuilt.info["transparency"] = tuple(transparency) if isinstance(transparency, list) else transparency
            return rebuilt
        except Exception as e:
            raise ImageError(f"the in-memory image cannot be rebuilt: {type(e).__name__}: {e}") from None


class ImageRenderer(ImageOpener):
    """A CLIP / SigLIP image: the model's image processor, loaded as ST loads it -- the class the
    frontend read from the model's files, on the backend transformers picks in this environment
    (PIL, or torchvision where it is installed, as in ST's own process) -- and its resize and crop
    to uint8 pixels of the model's one size."""

    # Settings the model's processor passes its image processor on every call, whatever the saved
    # config says (its class's `images_kwargs` defaults; none for CLIPProcessor / SiglipProcessor).
    processor_call: dict = {}

    def __init__(self, spec: ModelSpec, draft: bool = False, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        """`draft`: JPEGs decoded at a reduced DCT scale that still covers the model's input (opt-in);
        `max_pixels`: the most pixels an image may have before it is decoded (the caller's options)."""
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(spec.path)
        for key, value in self.processor_call.items():  # (what the model's processor passes on every call)
            setattr(processor, key, value)
        size = processor.size  # (draft decoding never shrinks an image below what the resize needs)
        super().__init__(processor, max_pixels,
                         max(getattr(size, k) or 0 for k in ("shortest_edge", "height", "width")) if draft else None)
        self.spec = spec.image
        check_processor(self.processor, spec)
        # The shortcuts reproduce Pillow's resize, each checked against the processor here: a
        # torchvision processor runs every image itself.
        self.direct = DirectResize(self.processor) if self.backend == "pil" else None
        self.window = CropWindow(self.processor)
        probe = self.pixels(MediaData(values=np.zeros(48 * 64 * 3, np.uint8), dtype="|u1", shape=[48, 64, 3]))
        if probe.shape != (self.spec.channels, self.spec.height, self.spec.width):
            raise ValueError(f"{spec.path}: the image processor makes {probe.shape} pixels, the frontend expected "
                             f"{(self.spec.channels, self.spec.height, self.spec.width)}: this is a bug")

    def render(self, image: MediaData) -> tuple[int, dict[str, np.ndarray]]:
        """(the tokens its vision sequence counts, its payloads): one "pixels" item."""
        return self.spec.tokens, {"pixels": self.pixels(image)[None]}

    def pixels(self, image: MediaData) -> np.ndarray:
        """The image as uint8 [channels, height, width], resized and cropped by the processor."""
        opened = self.open(image)
        try:
            sizes = self.window.resized_size(opened)
            if sizes is not None and self.window.takes(sizes):
                return self.window(opened)  # an extreme aspect ratio: the crop alone, in bounded memory
            self._check_resized_size(sizes)
            if self.direct is not None and self.direct.takes(opened):
                return self.direct(opened)
            out = self.processor([opened], do_rescale=False, do_normalize=False, return_tensors="np")["pixel_values"]
        except ImageError:
            raise
        except Exception as e:
            raise ImageError(f"the image processor cannot take this image: {type(e).__name__}: {e}") from None
        if out.dtype != np.uint8:  # (an array input of floats: rescaled by its caller, say)
            if image.values is None:  # (a 16-bit file, which torchvision decodes as it is)
                raise ImageError(f"the image file decodes to {out.dtype} pixels here (torchvision's decoder keeps "
                                 "16 bits); the pipeline carries 8-bit pixels: convert it to 8-bit RGB first")
            raise ImageError(f"an image array of dtype {image.dtype} gives {out.dtype} pixels{_beyond_8_bits(out)}; "
                             "pass uint8 values (or a PIL image)")
        return out[0]

    @staticmethod
    def _check_resized_size(sizes) -> None:
        """An image whose resize the crop window does not compute is refused where that resize
        would take more memory than MAX_RESIZED_PIXELS allows."""
        if sizes is not None and sizes[1][0] * sizes[1][1] > MAX_RESIZED_PIXELS:
            (height, width), (new_height, new_width) = sizes
            raise ImageError(f"an image of {width}x{height} pixels would be resized to {new_width}x{new_height} "
                             f"before its crop, more than the {MAX_RESIZED_PIXELS} pixels a worker resizes at once "
                             "(an extreme aspect ratio); crop or pad it first")

def _beyond_8_bits(pixels: np.ndarray) -> str:
    """Why resized pixels of another dtype do not fit the wire's uint8 (a torchvision processor
    resizes an array in its own dtype, neither rounding nor clamping, and ST rescales what it gives)."""
    if pixels.dtype.kind not in "iu" or not pixels.size:
        return ""
    return f" from {pixels.min()} to {pixels.max()} (the processor's resize keeps the array's dtype)"


def _as_load_image_source(image: MediaData) -> str:
    """The string transformers' loaders take for an image file: its path, its data URI or raw base64
    (an image's bytes as base64, which they decode to the very bytes)."""
    if image.path is not None:
        return image.path
    if image.uri is not None:
        return image.uri
    return base64.b64encode(image.encoded).decode()


def processor_backend(processor) -> str:
    """"pil" or "torchvision": which library an image processor resizes with (transformers 5 says
    so; before it, a torchvision processor's class ends in "Fast")."""
    backend = getattr(processor, "backend", None)
    if backend is None:
        backend = "torchvision" if type(processor).__name__.endswith("Fast") else "pil"
    return str(backend)


def check_processor(processor, spec: ModelSpec) -> None:
    """The processor transformers loads here is the one the frontend read from the model's files,
    and rescales and normalizes as the engine will (the engine does those two steps itself)."""
    name = type(processor).__name__.removesuffix("Pil").removesuffix("Fast")
    image = spec.image
    if name != image.processor_class:
        raise ValueError(f"{spec.path}: transformers loads image processor {type(processor).__name__} here, the "
                         f"frontend read {image.processor_class}: this environment differs from the caller's")
    mean, std = processor.image_mean, processor.image_std
    loaded = (bool(processor.do_rescale), float(processor.rescale_factor), bool(processor.do_normalize),
              [float(v) for v in (mean if isinstance(mean, (list, tuple)) else [mean] * 3)],
              [float(v) for v in (std if isinstance(std, (list, tuple)) else [std] * 3)])
    read = (image.do_rescale, image.rescale_factor, image.do_normalize, image.mean, image.std)
    if not np.allclose(np.array(loaded[3] + loaded[4] + [loaded[1]]), np.array(read[3] + read[4] + [read[1]]),
                       rtol=1e-7, atol=0) or loaded[0] != read[0] or loaded[2] != read[2]:
        raise ValueError(f"{spec.path}: the image processor rescales and normalizes with {loaded}, the frontend read "
                         f"{read} from the model's files: this is a bug")


def keep_freed_memory() -> bool:
    """glibc's malloc set to keep freed memory for the next image (see MALLOC_MMAP_BELOW); False
    where the C library is not glibc (nothing to tune there) or refuses a value."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    m_trim_threshold, m_mmap_threshold = -1, -3  # (malloc.h)
    return bool(mallopt(m_mmap_threshold, MALLOC_MMAP_BELOW)) and bool(mallopt(m_trim_threshold, MALLOC_KEEP_FREE_TOP))


class DirectResize:
    """The processor's own resize and crop for the usual image -- a PIL image in RGB mode, which is
    what `load_image` gives for every file -- called on the PIL image directly: the output size from
    transformers' `get_resize_output_image_size`, PIL's resize with the processor's filter, and
    transformers' `center_crop`. It skips the processor's per-call checks and its PIL -> numpy ->
    PIL round trip (a third of a web image's cost). Used only when it gives the processor's very
    bytes on probe images of many shapes (checked when the worker starts); otherwise every image
    goes through the processor."""

    PROBE_SHAPES = ((500, 400), (401, 299), (224, 224), (1000, 50), (50, 1000), (233, 1024), (3, 2), (225, 224))

    def __init__(self, processor) -> None:
        from transformers.image_transforms import center_crop, get_resize_output_image_size
        from transformers.image_utils import ChannelDimension

        self.processor = processor
        self._center_crop, self._output_size, self._channels = center_crop, get_resize_output_image_size, ChannelDimension
        size = processor.size
        self.usable = bool(processor.do_resize and processor.do_convert_rgb and not getattr(processor, "do_pad", False)
                           and (size.shortest_edge and not size.longest_edge or size.height and size.width))
        self.usable = self.usable and all(gives_processors_bytes(self, processor, shape) for shape in self.PROBE_SHAPES)

    def takes(self, image) -> bool:
        return self.usable and getattr(image, "mode", None) == "RGB" and "transparency" not in image.info

    def __call__(self, image) -> np.ndarray:
        processor, width, height = self.processor, *image.size
        size = processor.size
        if size.shortest_edge:
            new_height, new_width = self._output_size(np.empty((height, width, 3), np.uint8), size=size.shortest_edge,
                                                      default_to_square=False,
                                                      input_data_format=self._channels.LAST)
        else:
            new_height, new_width = size.height, size.width
        resized = np.asarray(image.resize((new_width, new_height), resample=processor.resample))
        if processor.do_center_crop:
            crop = processor.crop_size
            return np.ascontiguousarray(self._center_crop(resized, (crop.height, crop.width),
                                                          data_format=self._channels.FIRST,
                                                          input_data_format=self._channels.LAST))
        return np.ascontiguousarray(resized.transpose(2, 0, 1))
