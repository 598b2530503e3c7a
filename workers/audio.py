"""A render worker's audio clips (CLAP): decode and process each as sentence-transformers 6 would, with
the model's own feature extractor, and hand on its log-mel features (the engine runs the tower only).

What ST hands the processor decides each step:
- an array (a caller's numpy array or tensor, or `{"array", "sampling_rate"}`) goes to the feature
  extractor as it is -- never resampled: a rate other than the extractor's is refused (in the
  caller, as the extractor refuses it);
- a file, a data URI, raw base64 or a file's bytes are decoded by transformers' `load_audio` (mono by
  averaging the channels, resampled to the extractor's rate: soundfile and soxr, the `audio` extra,
  or torchcodec where it is installed, as in ST's process).

Memory stays bounded by the clip the model can take: a file's header says how many samples it will
give at the extractor's rate, and one longer than the extractor's window (`AudioSpec.max_samples`:
10 s for CLAP) is refused before it is decoded -- the extractor would crop a random window of it, so
its vector would not be reproducible. A bad clip is that request's error, naming why.
"""

from __future__ import annotations

import base64
import io
import math
import os

import numpy as np

from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.messages import MediaData

AUDIO_EXTRA_HINT = "pip install 'pooling-pipeline[audio]' (soundfile and soxr, as transformers' load_audio needs)"


class AudioError(ValueError):
    """A clip that cannot be turned into features: the request's error."""


class AudioRenderer:
    """A CLAP model's clips: its feature extractor, loaded as ST loads the model's processor, and its
    call as ST makes it (padding=True, the extractor's own truncation)."""

    def __init__(self, spec: ModelSpec, **image_options) -> None:
        """(`image_options`: the caller's image settings, which do not apply to audio.)"""
        from transformers import AutoFeatureExtractor

        self.spec, self.audio = spec, spec.audio
        self.extractor = AutoFeatureExtractor.from_pretrained(spec.path)
        name, rate = type(self.extractor).__name__, int(self.extractor.sampling_rate)
        if name != self.audio.feature_extractor_class or rate != self.audio.sampling_rate:
            raise ValueError(f"{spec.path}: transformers loads {name} at {rate} Hz here, the frontend read "
                             f"{self.audio.feature_extractor_class} at {self.audio.sampling_rate} Hz: this environment "
                             "differs from the caller's")
        probe = self.features(np.zeros(self.audio.sampling_rate // 10, np.float32))
        expected = (self.audio.channels, self.audio.frames, self.audio.mel_bins)
        if probe.shape != expected:
            raise ValueError(f"{spec.path}: the feature extractor makes {probe.shape} features, the frontend expected "
                             f"{expected}: this is a bug")

    def render(self, clip: MediaData) -> tuple[int, dict[str, np.ndarray]]:
        """(the patches its audio tower counts, its payloads): one "features" item."""
        return self.audio.tokens, {"features": self.features(self.waveform(clip))[None]}

    def waveform(self, clip: MediaData) -> np.ndarray:
        """The clip as ST hands it to the feature extractor: the caller's array, or a file decoded
        and resampled to the extractor's rate."""
        if clip.values is not None:
            samples = np.frombuffer(clip.values, dtype=np.dtype(clip.dtype)).reshape(clip.shape)
            if clip.sampling_rate is not None and clip.sampling_rate != self.audio.sampling_rate:
                raise AudioError(f"the clip's sampling rate is {clip.sampling_rate} Hz; the model's feature extractor "
                                 f"takes {self.audio.sampling_rate} Hz (resample it first)")
            self._check_length(len(samples), "the clip")
            return samples
        source, what = _load_audio_source(clip)
        self._check_header(clip, what)
        from transformers.audio_utils import load_audio

        try:
            samples = load_audio(source, sampling_rate=self.audio.sampling_rate)
        except ImportError as e:
            raise AudioError(f"{what} cannot be decoded here ({e}): {AUDIO_EXTRA_HINT}") from None
        except Exception as e:
            raise AudioError(f"{what} cannot be decoded: {type(e).__name__}: {e}") from None
        self._check_length(len(samples), what)  # (a decoder may give more samples than the header said)
        return samples

    def _check_header(self, clip: MediaData, what: str) -> None:
        """How many samples the file gives at the extractor's rate, read from its header before it
        is decoded: a clip longer than the model's window is refused."""
        try:
            import soundfile
        except ImportError:
            raise AudioError(f"{what} cannot be decoded here (no soundfile): {AUDIO_EXTRA_HINT}") from None
        if clip.path is not None and not os.path.isfile(clip.path):
            raise AudioError(f"{what} does not exist")
        try:
            if clip.path is not None:
                info = soundfile.info(clip.path)
            elif clip.encoded is not None:
                info = soundfile.info(io.BytesIO(clip.encoded))
            else:  # a data URI or raw base64, as load_audio decodes it
                uri = clip.uri
                info = soundfile.info(io.BytesIO(base64.b64decode(uri.split(",", 1)[1] if uri.startswith("data:") else uri)))
        except Exception as e:  # not audio, or a format libsndfile cannot read
            raise AudioError(f"{what} cannot be decoded: {type(e).__name__}: {e} (libsndfile reads WAV, FLAC, OGG and "
                             "MP3; AAC and M4A, which ST decodes with torchcodec, are not supported here)") from None
        if info.frames <= 0 or info.samplerate <= 0:
            raise AudioError(f"{what} holds no samples")
        self._check_length(math.ceil(info.frames * self.audio.sampling_rate / info.samplerate), what)

    def _check_length(self, samples: int, what: str) -> None:
        audio = self.audio
        if samples == 0:
            raise AudioError(f"{what} is empty")
        if samples > audio.max_samples:
            raise AudioError(f"{what} is {samples / audio.sampling_rate:.2f} s long, more than the model's "
                             f"{audio.max_samples / audio.sampling_rate:g} s window: its feature extractor would crop a "
                             f"random window of it (truncation {audio.truncation!r}), so its vector would not be "
                             "reproducible; cut it into clips of at most that length")

    def features(self, samples: np.ndarray) -> np.ndarray:
        """The feature extractor's log-mel features of one clip, float32 [channels, frames, mel bins],
        called as ST calls it (its processor's audio kwargs: padding=True)."""
        try:
            out = self.extractor([samples], sampling_rate=self.audio.sampling_rate, padding=True, return_tensors="np")
        except Exception as e:
            raise AudioError(f"the feature extractor cannot take this clip: {type(e).__name__}: {e}") from None
        return np.ascontiguousarray(out["input_features"][0], dtype=np.float32)


def _load_audio_source(clip: MediaData) -> tuple[str, str]:
    """The string transformers' `load_audio` takes for the clip -- its path, its data URI or raw
    base64 (a file's bytes as base64, which it decodes to the very bytes) -- and how to name it."""
    if clip.path is not None:
        return clip.path, f"audio file {clip.path!r}"
    if clip.uri is not None:
        return clip.uri, "the data URI's audio" if clip.uri.startswith("data:") else "the base64 data's audio"
    return base64.b64encode(clip.encoded).decode(), "the audio bytes"
