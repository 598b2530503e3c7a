"""CLAP in the engine: the dual encoder's text path, and audio rows through `get_audio_features` as
sentence-transformers 6 runs them. Each audio row carries the feature extractor's log-mel features
("features": one [channels, frames, mel bins] float32 item, made in the render worker by the
extractor itself), so a step stacks them without a copy per clip. `is_longer` is False for every
clip: a clip longer than the extractor's window is refused before it gets here (its crop would be
random), and a model with fusion, the one that reads the flag, is refused at load
(core/shared/model_folder/dual_encoder.py)."""

from __future__ import annotations

import torch

from pooling_pipeline.core.engine.columns import Requests
from pooling_pipeline.core.engine.device_copies import to_device
from pooling_pipeline.core.engine.dual_encoder_runner import DualEncoderRunner, _pooled
from pooling_pipeline.core.shared.config import ModelSpec


class ClapRunner(DualEncoderRunner):
    """A StepRunner (core/engine/step_runner.py) for a CLAP model (torch only)."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(spec, device, dtype, backend="torch")
        self.backend_info["model"] = f"CLAP ({spec.model_type}: text and audio towers)"

    def _prepare_second_tower(self, backend: str, threads: int) -> None:
        """Nothing: the features arrive as the audio tower takes them."""

    def _media_vectors(self, batch: Requests) -> tuple[torch.Tensor, int]:
        """The audio rows' embeddings (float32, in the rows' order) and the patches their tower computed."""
        features = batch.payloads["features"].data  # (an audio row's one item; its family's rules hold it)
        values = to_device(features, self.device).to(self.dtype)
        is_longer = torch.zeros((len(features), 1), dtype=torch.bool, device=self.device)
        out = self.model.get_audio_features(input_features=values, is_longer=is_longer)
        return _pooled(out).float(), len(features) * self.spec.audio.tokens
