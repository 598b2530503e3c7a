"""CLAP: a text tower and an audio tower that end in one embedding space, as sentence-transformers 6
runs `ClapModel` (its Transformer module: text through `get_text_features`, audio through
`get_audio_features`, each's `pooler_output`), then the modules saved after it.

Its pieces: the model folder read into a spec (core/shared/model_folder/dual_encoder.py, the "clap"
entry: the towers and the feature extractor's facts); which caller inputs are audio
(pipeline/audio_inputs.py); the render worker's clips (workers/audio.py: decoding, resampling a
file, the feature extractor's own call, its log-mel features as the row's payload); the engine's
runner (core/engine/clap_runner.py). Texts go as for any dual encoder."""

from __future__ import annotations

from typing import Any

import numpy as np

from pooling_pipeline.core.families.base import ModelFamily
from pooling_pipeline.core.shared.config import PayloadSpec
from pooling_pipeline.core.shared.schema import MODALITIES


class ClapFamily(ModelFamily):
    name = "clap"
    modalities = frozenset({"text", "audio"})
    media_renderers = {"audio": "pooling_pipeline.workers.audio:AudioRenderer"}
    media_input = "pooling_pipeline.audio_inputs:audio_input"

    # Every clip is one fixed-size sequence of 4,096 patches (HTS-AT), more than a CPU step's 2,048
    # token default: measured on the 2-core CPU (laion/clap-htsat-unfused's shape), 4 clips a step
    # cost 0.139 s a clip, 1 a step 0.198 (and 8 no less than 4).
    longest_inputs_per_step = 4

    def worker_imports(self) -> tuple[str, ...]:
        """torch: transformers' ClapFeatureExtractor requires it (its "fusion" path resizes on torch)."""
        return ("torch",)

    def longest_input(self, spec) -> int:
        return max(spec.max_model_len, spec.audio.tokens)  # a text's, or a clip's patch sequence

    def payloads(self, spec) -> dict[str, PayloadSpec]:
        """An audio row's log-mel features: one float32 [channels, frames, mel bins] item, the
        feature extractor's own output."""
        audio = spec.audio
        return {"features": PayloadSpec(dtype="<f4", item_shape=(audio.channels, audio.frames, audio.mel_bins),
                                        max_items=1)}

    def row_rules(self, spec) -> tuple:
        """An audio row carries its features and as many placeholder ids as the audio tower's patches;
        a text row carries no features."""
        from pooling_pipeline.core.engine.columns import RowRule

        audio_code, tokens = MODALITIES.index("audio"), spec.audio.tokens

        def features_of(r):
            payload = r.payloads.get("features")
            return np.zeros(len(r), np.int64) if payload is None else payload.counts

        return (RowRule(("modality",), lambda r, model, runs: (r.modality == audio_code) & (features_of(r) != 1),
                        lambda r, model, row: "an audio row must carry its features, one clip"),
                RowRule(("modality",), lambda r, model, runs: (r.modality != audio_code) & (features_of(r) != 0),
                        lambda r, model, row: "a text row carries no audio features"),
                RowRule(("modality",), lambda r, model, runs: (r.modality == audio_code) & (r.lengths != tokens),
                        lambda r, model, row: f"an audio row must count the model's {tokens} audio patches"))

    def backend(self, backend: str, quantize: str | None, device: str, dtype: str) -> str:
        """Both towers on torch (neither is converted to OpenVINO yet): backend='openvino' and int8
        quantization are refused, not ignored."""
        if quantize is not None:
            raise ValueError(f"quantize={quantize!r} is not supported for a CLAP model")
        if backend == "openvino":
            raise ValueError("backend='openvino' cannot run a CLAP model (its towers run on torch): use backend='torch' "
                             "or 'auto'")
        return "torch"

    def runner(self, cfg, **device_steps: Any):
        from pooling_pipeline.core.engine.clap_runner import ClapRunner
        from pooling_pipeline.core.engine.model_runner import resolve_device, resolve_dtype

        device = resolve_device(cfg.device)
        return ClapRunner(cfg.model, device, resolve_dtype(cfg.dtype, device, "float32"))
