"""Page retrievers (ColPali): one vector per token for text queries and page images, scored by MaxSim,
as sentence-transformers 6's MultiVectorEncoder runs transformers' `ColPaliForRetrieval`.

Its pieces: the model folder read into a spec (core/shared/model_folder/retrieval.py); the render
worker's queries and pages (workers/page_retriever.py: the processor renders every text as a query,
and a page as its image tokens and visual prompt, with uint8 pixels as the image processor resizes
them); the engine's runner (core/engine/page_retriever_runner.py: texts and pages in one forward,
the tokens ST's MultiVectorMask keeps)."""

from __future__ import annotations

from typing import Any

import numpy as np

from pooling_pipeline.core.families.base import ModelFamily
from pooling_pipeline.core.shared.config import PayloadSpec
from pooling_pipeline.core.shared.schema import MODALITIES


class PageRetrieverFamily(ModelFamily):
    name = "page_retriever"
    modalities = frozenset({"text", "image"})
    media_renderers = {"image": "pooling_pipeline.workers.page_retriever:PageImages"}
    media_input = "pooling_pipeline.image_inputs:image_input"
    text_renderer = "pooling_pipeline.workers.page_retriever:QueryTexts"

    def longest_input(self, spec) -> int:
        """A query's, or a page's row (its image tokens and prompt: the render worker checks at
        start-up that the row fits the text model's positions)."""
        return max(spec.max_model_len, spec.image.tokens)

    def worker_imports(self) -> tuple[str, ...]:
        """PIL, and torch: transformers' ColPaliProcessor loads only where torch imports."""
        return ("PIL", "torch")

    def payloads(self, spec) -> dict[str, PayloadSpec]:
        """A page row's pixels: one uint8 [C, H, W] item, the image processor's resize."""
        image = spec.image
        return {"pixels": PayloadSpec(dtype="|u1", item_shape=(image.channels, image.height, image.width), max_items=1)}

    def row_rules(self, spec) -> tuple:
        """A page row carries its pixels and at least the model's image tokens; a text row none."""
        from pooling_pipeline.core.engine.columns import RowRule

        image_code, tokens = MODALITIES.index("image"), spec.image.tokens

        def pixels_of(r):
            payload = r.payloads.get("pixels")
            return np.zeros(len(r), np.int64) if payload is None else payload.counts

        return (RowRule(("modality",), lambda r, model, runs: (r.modality == image_code) & (pixels_of(r) != 1),
                        lambda r, model, row: "a page row must carry its pixels, one image"),
                RowRule(("modality",), lambda r, model, runs: (r.modality != image_code) & (pixels_of(r) != 0),
                        lambda r, model, row: "a text row carries no pixels"),
                RowRule(("modality",), lambda r, model, runs: (r.modality == image_code) & (r.lengths <= tokens),
                        lambda r, model, row: f"a page row must hold the model's {tokens} image tokens and its prompt"))

    def backend(self, backend: str, quantize: str | None, device: str, dtype: str) -> str:
        if quantize is not None:
            raise ValueError(f"quantize={quantize!r} is not supported for a page retriever (ColPali)")
        if backend == "openvino":
            raise ValueError("backend='openvino' cannot run a page retriever (ColPali): use backend='torch' or 'auto'")
        return "torch"

    def runner(self, cfg, **device_steps: Any):
        from pooling_pipeline.core.engine.model_runner import resolve_device, resolve_dtype
        from pooling_pipeline.core.engine.page_retriever_runner import PageRetrieverRunner

        device = resolve_device(cfg.device)
        return PageRetrieverRunner(cfg.model, device, resolve_dtype(cfg.dtype, device, "float32"))
