"""An audio model's inputs (CLAP): which prompts are audio, decided as sentence-transformers 6 decides a
sample's modality, and each clip as the `MediaData` a render worker decodes.

ST's rule (`sentence_transformers.base.modality.infer_modality`, for a model that takes audio): a
numpy array or torch tensor of numbers is one input, audio when it is 1-D or 2-D (image when 3-D,
video when 4-D or 5-D, which these models do not take); `{"array": ..., "sampling_rate": ...}` is a
clip at that rate; a string is audio when it is an existing file (or an http(s) URL) whose name
ends in .mp3, .wav, .ogg, .flac or .aac; `{"audio": x}` is x, where a string is a file, a data URI
or raw base64 (transformers' `load_audio`). Everything else a text model takes stays text.

Where the pipeline differs, it refuses or says so:
- a bare `data:audio/...` string is audio here (ST reads it as text: nothing a user means);
- a 2-D (multi-channel) array is refused: ST's feature extractor reads it as a batch of clips and
  fails; average its channels first (as `load_audio` does for a file);
- a URL is refused (nothing is fetched); so is a clip at another rate than the model's, as the
  feature extractor refuses it, and one longer than the model's window, which the extractor would
  crop at random (checked here for an array, from its header in the worker for a file);
- a 1-D torch tensor is taken as its numpy values (ST's feature extractor fails on one);
- `{"array"}` without its rate is refused, as ST refuses it (inside `{"audio": ...}` it takes the
  model's rate, as ST's `_unwrap_audio` does); a torchcodec `AudioDecoder` is refused by name.
"""

from __future__ import annotations

import os

import numpy as np

from pooling_pipeline.core.shared.messages import MediaData
from pooling_pipeline.image_inputs import (  # (ST's rules, shared with images)
    BASE64_TEXT,
    MIN_IMAGE_BYTES,
    MODALITY_KEYS,
    _is_tensor,
    _looks_like_url,
    is_media_string,
    is_pil_image,
)

AUDIO_EXTENSIONS = (".mp3", ".wav", ".ogg", ".flac", ".aac")


def is_audio_string(text: str) -> bool:
    """ST's `is_audio_url_or_path` (a URL or existing file with an audio extension), and a
    `data:audio/` URI."""
    return is_media_string(text, "audio", AUDIO_EXTENSIONS)


def audio_input(prompt: object, index: int, spec) -> MediaData | None:
    """The prompt as a clip, None when it is not audio (a text, token ids, a pair); ValueError or
    TypeError naming the request when it is an input the model cannot take."""
    if isinstance(prompt, str):
        return _audio_string(prompt, index) if is_audio_string(prompt) else None
    if isinstance(prompt, dict):
        return _audio_dict(prompt, index, spec)
    if is_pil_image(prompt):
        raise ValueError(f"request {index}: an image, but model {spec.path!r} takes text and audio only")
    if isinstance(prompt, np.ndarray) and prompt.dtype.kind in "OUSV":
        return None  # (strings or objects: not one input)
    if isinstance(prompt, np.ndarray) or _is_tensor(prompt):
        return _array_clip(prompt, index, spec, None)
    if type(prompt).__name__ == "AudioDecoder":  # torchcodec's (a `datasets` 4 Audio column's values)
        raise TypeError(f"request {index}: a torchcodec AudioDecoder is not supported yet: pass its samples, "
                        "{'array': decoder.get_all_samples().data.mean(0).numpy(), 'sampling_rate': ...}")
    return None


def _audio_string(text: str, index: int) -> MediaData:
    if text.startswith("data:"):
        if "," not in text:
            raise ValueError(f"request {index}: a data:audio/ URI without ',' before its base64 data")
        return MediaData(modality="audio", uri=text, nbytes=max(len(text), MIN_IMAGE_BYTES))
    if _looks_like_url(text):
        raise ValueError(f"request {index}: audio URL {text[:200]!r} is not fetched (the pipeline reads local files "
                         "only): download it and pass its path")
    try:
        size = os.path.getsize(text)
    except OSError as e:
        raise ValueError(f"request {index}: audio file {text!r} cannot be read: {e}") from None
    return MediaData(modality="audio", path=os.path.abspath(text), nbytes=max(size, MIN_IMAGE_BYTES))


def _audio_dict(prompt: dict, index: int, spec) -> MediaData | None:
    keys = set(prompt)
    if "role" in keys and "content" in keys:
        raise ValueError(f"request {index}: chat-style message inputs (dicts with 'role' and 'content') are not "
                         "supported by a CLAP model (it has no chat template; ST refuses them too)")
    if "array" in keys:
        if "sampling_rate" not in keys:
            raise ValueError(f"request {index}: a dict with 'array' must also hold 'sampling_rate' (for audio), as "
                             f"sentence-transformers requires; got keys {sorted(map(str, keys))}")
        return _array_clip(prompt["array"], index, spec, prompt["sampling_rate"])
    if not keys or keys - MODALITY_KEYS:
        return None  # not a modality dict: parse_prompt names what is wrong with it
    if keys == {"text"}:
        return None
    if len(keys) == 1 and keys != {"audio"}:  # {"image": ...}, {"video": ...}
        kind = next(iter(keys))
        raise ValueError(f"request {index}: {'an' if kind[0] in 'aeiou' else 'a'} {kind} input, but model "
                         f"{spec.path!r} takes texts and audio only")
    if keys != {"audio"}:
        raise ValueError(f"request {index}: a dict with {sorted(keys)} fuses modalities in one input, which model "
                         f"{spec.path!r} cannot encode (ST refuses it too): encode each separately")
    value = prompt["audio"]
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        if not data:
            raise ValueError(f"request {index}: the audio's bytes are empty")
        return MediaData(modality="audio", encoded=data, nbytes=max(len(data), MIN_IMAGE_BYTES))
    if isinstance(value, str):
        if is_audio_string(value) or os.path.isfile(value) or _looks_like_url(value):
            return _audio_string(value, index)
        if not value or BASE64_TEXT.fullmatch(value) is None:
            raise ValueError(f"request {index}: audio {value[:200]!r} is neither an existing file, a data:audio/ URI "
                             "nor base64 data")
        return MediaData(modality="audio", uri=value, nbytes=max(len(value) * 3 // 4, MIN_IMAGE_BYTES))
    if isinstance(value, dict) and "array" in value:  # (ST's _unwrap_audio: its rate, else the model's)
        return _array_clip(value["array"], index, spec, value.get("sampling_rate"))
    if isinstance(value, np.ndarray) or _is_tensor(value):
        return _array_clip(value, index, spec, None)
    raise TypeError(f"request {index}: {{'audio': ...}} must hold a path, bytes, a data:audio/ URI, base64 data, a "
                    f"1-D array or {{'array', 'sampling_rate'}}, got {type(value).__name__}")


def _array_clip(array, index: int, spec, sampling_rate) -> MediaData:
    """A numpy array or torch tensor of samples, at `sampling_rate` (None: the model's, as ST
    assumes for a bare array)."""
    audio = spec.audio
    if _is_tensor(array):
        if array.ndim == 1 and array.numel() > audio.max_samples:  # (refused before it is copied off its device)
            raise ValueError(_too_long(index, array.numel(), audio))
        try:
            array = array.detach().cpu().numpy()
        except (TypeError, RuntimeError) as e:  # torch.bfloat16, ...: numpy has no such type
            raise TypeError(f"request {index}: a {array.dtype} tensor cannot be read as audio ({e}): convert it, "
                            "e.g. with .float()") from None
    if isinstance(array, (list, tuple)):
        array = np.asarray(array)
    if not isinstance(array, np.ndarray):
        raise TypeError(f"request {index}: audio samples must be a numpy array or torch tensor, got "
                        f"{type(array).__name__}")
    if array.ndim != 1:
        kind = ("a multi-channel clip (sentence-transformers' feature extractor reads its rows as separate clips "
                "and fails): average its channels first" if array.ndim == 2 else
                "an image to sentence-transformers, which this model does not take" if array.ndim == 3 else
                "video to sentence-transformers, which this model does not take" if array.ndim in (4, 5) else
                "no modality")
        raise ValueError(f"request {index}: a {array.ndim}-D array (shape {tuple(array.shape)}) is {kind}; a clip is "
                         "a 1-D array of samples")
    if array.dtype.kind not in "biuf":
        raise TypeError(f"request {index}: audio samples must be numbers, got an array of dtype {array.dtype}")
    if sampling_rate is not None:  # (ST compares it with the extractor's: 48000.0 is 48000)
        if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, float, np.integer, np.floating)):
            raise TypeError(f"request {index}: sampling_rate must be a number, got {type(sampling_rate).__name__}")
        if sampling_rate != audio.sampling_rate:
            raise ValueError(f"request {index}: the clip's sampling rate is {sampling_rate:g} Hz; the model's "
                             f"feature extractor takes {audio.sampling_rate} Hz (sentence-transformers never "
                             "resamples an array: resample it first)")
        sampling_rate = audio.sampling_rate
    if array.size == 0:
        raise ValueError(f"request {index}: the clip is empty")
    if array.size > audio.max_samples:
        raise ValueError(_too_long(index, array.size, audio))
    if array.dtype.kind == "b":
        array = array.view(np.uint8)
    data = np.array(array, order="C", copy=True)  # (one copy: the caller may change its array later)
    return MediaData(modality="audio", values=data.view(np.uint8).reshape(-1), dtype=data.dtype.str,
                     shape=list(data.shape), sampling_rate=None if sampling_rate is None else int(sampling_rate),
                     nbytes=data.nbytes)


def _too_long(index: int, samples: int, audio) -> str:
    return (f"request {index}: the clip is {samples / audio.sampling_rate:.2f} s long, more than the model's "
            f"{audio.max_samples / audio.sampling_rate:g} s window: its feature extractor would crop a random window "
            f"of it (truncation {audio.truncation!r}), so its vector would not be reproducible; cut it into clips of "
            "at most that length")
