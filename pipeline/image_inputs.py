"""A dual encoder's inputs: which prompts are images, decided as sentence-transformers 6 decides a
sample's modality, and each image as the `MediaData` a render worker opens.

ST's rule (`sentence_transformers.base.modality.infer_modality`, for a model that takes images): a
PIL image is an image; a numpy array or torch tensor of numbers is one input (never a batch), an
image when it is 3-D and audio (1-D, 2-D) or video (4-D, 5-D) otherwise, which these models do not
take; a string is an image when it is a `data:image/` URI, or an existing file (or an http(s) URL)
whose name ends in an image extension; `{"image": x}` is x, where a string is a file, a data URI or
raw base64 (transformers' `load_image`). Everything else a text model takes stays text. The
pipeline adds `{"image": bytes}` (an image file's bytes). A URL is refused (nothing is fetched), and
so are what ST refuses for these models: chat-style messages and fused {"text", "image"} inputs.

Arrays hold what ST's processor reads as pixel values: booleans are 0/1, an object array its
numbers, a complex array its real part when every imaginary part is 0 (as ST, which drops it);
anything else (a complex image, a dtype numpy has no type for, such as torch.bfloat16) is refused
naming the request.

The frontend reads nothing but a file's size (and the raw pixels of an image already in memory):
opening, decoding and resizing are the render workers' work.
"""

from __future__ import annotations

import os
import re
import sys
from urllib.parse import urlparse

import numpy as np

from pooling_pipeline.core.shared.messages import MediaData

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".tiff", ".webp")
MODALITY_KEYS = frozenset({"text", "image", "audio", "video"})  # ST's multimodal dict keys
# What an image that is not in memory counts in the frontend's message and in-flight budgets when
# its size is unknown (a data URI's share is its length): a message then holds a few images, so a
# worker sends the first ones to the engine while it decodes the rest.
MIN_IMAGE_BYTES = 32 << 10
# What base64 data may hold (`base64.decodebytes`, which load_image uses, skips anything else, so a
# string with other characters is a missing file's name far more often than an image's data).
BASE64_TEXT = re.compile(r"[A-Za-z0-9+/=\s]+")


def _looks_like_url(text: str) -> bool:
    return text.startswith(("http://", "https://")) and " " not in text


def is_media_string(text: str, modality: str, extensions: tuple[str, ...]) -> bool:
    """ST's `is_*_url_or_path` for a modality: a `data:<modality>/` URI, or a URL or an existing file
    whose name ends in one of its extensions."""
    if text.startswith(f"data:{modality}/"):
        return True
    if _looks_like_url(text):
        try:
            return urlparse(text).path.lower().endswith(extensions)
        except ValueError:
            return False
    return text.lower().endswith(extensions) and os.path.isfile(text)


VIDEO_EXTENSIONS = (".mp4", ".avi", ".mov", ".wmv", ".flv", ".mkv")
VIDEO_HOSTS = frozenset({"www.youtube.com", "youtube.com", "youtu.be", "m.youtube.com"})


def is_video_string(text: str) -> bool:
    """ST's `is_video_url_or_path`: a URL or an existing file whose name ends in a video extension,
    or a YouTube URL (a model that takes images refuses it, as ST does, rather than embed its name)."""
    if not text.startswith("data:video/") and is_media_string(text, "video", VIDEO_EXTENSIONS):
        return True
    if not _looks_like_url(text):
        return False
    try:
        return urlparse(text).netloc in VIDEO_HOSTS
    except ValueError:
        return False


def is_image_string(text: str) -> bool:
    """ST's `is_image_url_or_path`: a `data:image/` URI, or a URL or existing file with an image
    extension."""
    return is_media_string(text, "image", IMAGE_EXTENSIONS)


def is_pil_image(value: object) -> bool:
    image_module = sys.modules.get("PIL.Image")  # (no PIL image exists unless PIL was imported)
    return image_module is not None and isinstance(value, image_module.Image)


def _is_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def image_input(prompt: object, index: int, spec=None) -> MediaData | None:
    """The prompt as an image, None when it is not one (a text, token ids, a pair); ValueError or
    TypeError naming the request when it is an image input the pipeline cannot take. (`spec`: the
    model's, as every family's input reader takes it: core/families/base.py.)"""
    if isinstance(prompt, str):
        return _image_string(prompt, index) if is_image_string(prompt) else None
    if isinstance(prompt, dict):
        return _image_dict(prompt, index)
    if is_pil_image(prompt):
        return _pil_image(prompt, index)
    if isinstance(prompt, np.ndarray) or _is_tensor(prompt):  # (its dimensions decide, whatever it holds)
        return _array_image(prompt, index)
    return None


def is_numeric_array(value: object) -> bool:
    """A torch tensor, or a numpy array that is not of strings or objects: one input to ST, which
    decides its modality by its dimensions (an array of strings or objects is a batch to it)."""
    return _is_tensor(value) or (isinstance(value, np.ndarray) and value.dtype.kind not in "OUSV")


def _image_string(text: str, index: int) -> MediaData:
    if text.startswith("data:image/"):
        if "," not in text:
            raise ValueError(f"request {index}: a data:image/ URI without ',' before its base64 data")
        return MediaData(uri=text, nbytes=max(len(text), MIN_IMAGE_BYTES))
    if _looks_like_url(text):
        raise ValueError(f"request {index}: image URL {text[:200]!r} is not fetched (the pipeline reads local files "
                         "only): download it and pass its path")
    try:
        size = os.path.getsize(text)
    except OSError as e:
        raise ValueError(f"request {index}: image file {text!r} cannot be read: {e}") from None
    return MediaData(path=os.path.abspath(text), nbytes=max(size, MIN_IMAGE_BYTES))


def _image_dict(prompt: dict, index: int) -> MediaData | None:
    keys = set(prompt)
    if "role" in keys and "content" in keys:
        raise ValueError(f"request {index}: chat-style message inputs (dicts with 'role' and 'content') are not "
                         "supported by a dual encoder (it has no chat template; ST refuses them too)")
    if not keys or keys - MODALITY_KEYS:
        return None  # not a modality dict: parse_prompt names what is wrong with it
    if keys == {"text"}:
        return None  # {"text": ...} is a text (parse_prompt reads it)
    if len(keys) == 1 and keys != {"image"}:  # {"audio": ...}, {"video": ...}
        kind = next(iter(keys))
        raise ValueError(f"request {index}: {'an' if kind[0] in 'aeiou' else 'a'} {kind} input, but this model takes "
                         "texts and images only")
    if keys != {"image"}:
        raise ValueError(f"request {index}: a dict with {sorted(keys)} fuses modalities in one input, which a dual "
                         "encoder cannot encode (ST refuses it too): encode each separately")
    return image_dict_input(prompt["image"], index)


def image_dict_input(value: object, index: int) -> MediaData:
    """What `{"image": value}` holds (a chat message's image part too): a path, bytes, a data URI,
    base64 data, a PIL image or a 3-D array."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        if not data:
            raise ValueError(f"request {index}: the image's bytes are empty")
        return MediaData(encoded=data, nbytes=max(len(data), MIN_IMAGE_BYTES))
    if isinstance(value, str):
        if is_image_string(value) or os.path.isfile(value) or _looks_like_url(value):
            return _image_string(value, index)
        return _base64_image(value, index)
    image = image_input(value, index) if not isinstance(value, dict) else None
    if image is None:
        raise TypeError(f"request {index}: {{'image': ...}} must hold a path, bytes, a data:image/ URI, base64 data, a "
                        f"PIL image or a 3-D array, got {type(value).__name__}")
    return image


def _base64_image(text: str, index: int) -> MediaData:
    """`{"image": "<base64>"}`: an image file's bytes in base64, without a `data:` prefix, as
    transformers' load_image takes a string that is neither a URL nor a file. The worker decodes it."""
    if not text or BASE64_TEXT.fullmatch(text) is None:
        raise ValueError(f"request {index}: image {text[:200]!r} is neither an existing file, a data:image/ URI nor "
                         "base64 data")
    return MediaData(uri=text, nbytes=max(len(text) * 3 // 4, MIN_IMAGE_BYTES))


def _pil_image(image, index: int) -> MediaData:
    """An in-memory PIL image as its raw pixels (and palette, transparency): the worker rebuilds
    the same image and the processor converts it as ST's call would."""
    try:
        data = image.tobytes()
    except Exception as e:  # a lazily opened file that cannot be decoded
        raise ValueError(f"request {index}: the PIL image cannot be read: {type(e).__name__}: {e}") from None
    palette = palette_mode = None
    if image.mode in ("P", "PA") and image.palette is not None:
        palette_mode = image.palette.mode
        palette = bytes(image.getpalette(palette_mode) or [])
    transparency = image.info.get("transparency")
    if isinstance(transparency, tuple):
        transparency = list(transparency)
    if transparency is not None and not isinstance(transparency, (int, bytes, list)):
        raise ValueError(f"request {index}: the PIL image's transparency {transparency!r} is not supported")
    return MediaData(values=np.frombuffer(data, dtype=np.uint8), mode=image.mode, shape=list(image.size),
                     palette=palette, palette_mode=palette_mode, transparency=transparency, nbytes=len(data))


def _array_image(array, index: int) -> MediaData:
    """A numpy array or torch tensor: an image when it is 3-D, as ST decides (its other shapes are
    audio or video); its values as ST's processor reads them (see the module's docstring)."""
    if array.ndim != 3:
        kind = "audio" if array.ndim in (1, 2) else "video" if array.ndim in (4, 5) else "no modality"
        raise ValueError(f"request {index}: a {array.ndim}-D array (shape {tuple(array.shape)}) is {kind} to "
                         "sentence-transformers, which this model does not take: an image is a 3-D array, (H, W, C) or "
                         "(C, H, W) (a grey image as img[..., None]), a PIL image, a file or its bytes")
    array = _pixel_values(_as_numpy(array, index), index)
    if array.size == 0:
        raise ValueError(f"request {index}: the image array is empty (shape {array.shape})")
    data = np.ascontiguousarray(array)  # (a copy where needed: the caller may change its array later)
    return MediaData(values=data.view(np.uint8).reshape(-1).copy(), dtype=data.dtype.str, shape=list(data.shape),
                     nbytes=data.nbytes)


def _as_numpy(array, index: int) -> np.ndarray:
    """A torch tensor as a numpy array (its own values); one with no numpy dtype is refused."""
    if not _is_tensor(array):
        return array
    try:
        return array.detach().cpu().numpy()
    except (TypeError, RuntimeError) as e:  # torch.bfloat16, float8, ...: numpy has no such type
        raise TypeError(f"request {index}: a {array.dtype} tensor cannot be read as an image ({e}; "
                        "sentence-transformers cannot take it either): convert it, e.g. with .float() or "
                        ".to(torch.uint8)") from None


def _pixel_values(array: np.ndarray, index: int) -> np.ndarray:
    """The array in a dtype the worker takes, with the values ST's processor reads from it."""
    kind = array.dtype.kind
    if kind == "b":
        return array  # (a PIL processor reads them as 0/1, a near-black image; the worker's processor decides)
    if kind == "O":  # numbers in objects: the processor reads their values (ints, floats, bools)
        values = np.array(array.tolist())
        if values.shape != array.shape or values.dtype.kind not in "biufc":
            raise TypeError(f"request {index}: an object array must hold numbers to be an image, got "
                            f"{type(array.flat[0]).__name__ if array.size else 'nothing'}")
        return _pixel_values(values, index)
    if kind == "c":
        if np.any(array.imag):
            raise ValueError(f"request {index}: a complex array with non-zero imaginary parts is not an image")
        return array.real  # (ST's processor drops the imaginary part)
    if kind not in "uif" or array.dtype.itemsize > 8:
        raise TypeError(f"request {index}: an image array must hold numbers, got {array.dtype}")  # (strings, ...)
    return array


def prompt_size(prompt: object) -> int:
    """What a prompt of an image model counts in the frontend's message budget before it is
    checked: an in-memory image its pixels, any other non-text a nominal image's share."""
    if isinstance(prompt, str):
        return len(prompt) if not prompt.lower().endswith(IMAGE_EXTENSIONS) else MIN_IMAGE_BYTES
    if is_pil_image(prompt):
        return prompt.width * prompt.height * len(prompt.getbands())
    if isinstance(prompt, np.ndarray):
        return prompt.nbytes
    return MIN_IMAGE_BYTES
