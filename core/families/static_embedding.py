"""ST's StaticEmbedding (model2vec and the like): no transformer, the mean of the text's token
vectors from a table (core/engine/static_runner.py); its tokenizer is the folder's tokenizer.json as
`tokenizers` loads it."""

from __future__ import annotations

from typing import Any

from pooling_pipeline.core.families.base import ModelFamily


class StaticEmbeddingFamily(ModelFamily):
    name = "static_embedding"
    tokenizer_from_json = True

    def longest_input(self, spec) -> int:
        return 0  # any length, in a step of its own: its bag of tokens costs a gather, not a forward

    def backend(self, backend: str, quantize: str | None, device: str, dtype: str) -> str:
        """No transformer to convert or quantize: torch runs its float32 table (ST's own arithmetic);
        asking for anything else is refused, not ignored."""
        if backend == "openvino" or quantize is not None or dtype not in ("auto", "float32"):
            raise ValueError("a static embedding model (StaticEmbedding, no transformer) runs its float32 table on "
                             f"torch: not backend={backend!r}, quantize={quantize!r}, dtype={dtype!r} (leave them at "
                             "their defaults)")
        return "torch"

    def runner(self, cfg, **device_steps: Any):
        from pooling_pipeline.core.engine.model_runner import resolve_device
        from pooling_pipeline.core.engine.static_runner import StaticEmbeddingRunner

        return StaticEmbeddingRunner(cfg.model, resolve_device(cfg.device))
