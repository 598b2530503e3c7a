"""ColQwen2 page retrieval: one vector per token for text queries and page images of any size (Qwen2-VL's
dynamic resolution), scored by MaxSim, as sentence-transformers 6's MultiVectorEncoder runs
transformers' `ColQwen2ForRetrieval`.

Its pieces: the model folder read into a spec (core/shared/model_folder/retrieval.py, its "colqwen2"
entry, with the image facts of core/shared/model_folder/vlm_embedder.py); the render worker's
queries (workers/page_retriever.py `QueryTexts`, as ColPali's) and pages (`QwenPages`: the
processor's image call, its float patches and grid as the row's payloads); the engine's runner
(core/engine/page_retriever_runner.py `QwenPageRetrieverRunner`)."""

from __future__ import annotations

from typing import Any

from pooling_pipeline.core.families.page_retriever import PageRetrieverFamily
from pooling_pipeline.core.families.vlm_embedder import qwen_image_row_rules
from pooling_pipeline.core.shared.config import PayloadSpec


class QwenPageRetrieverFamily(PageRetrieverFamily):
    name = "qwen_page_retriever"
    media_renderers = {"image": "pooling_pipeline.workers.page_retriever:QwenPages"}

    def longest_input(self, spec) -> int:
        return spec.max_model_len

    def worker_imports(self) -> tuple[str, ...]:
        """PIL, torch and torchvision: transformers 5's Qwen-VL image processor loads with them."""
        return ("PIL", "torch", "torchvision")

    def payloads(self, spec) -> dict[str, PayloadSpec]:
        """A page row's patches (float32, the processor's normalized values, at most max_patches) and
        its (t, h, w) grid."""
        image = spec.image
        return {"patches": PayloadSpec(dtype="<f4", item_shape=(image.channels * image.patch_size ** 2,),
                                       max_items=image.max_patches),
                "grid_thw": PayloadSpec(dtype="<i8", item_shape=(3,), max_items=1)}

    def row_rules(self, spec) -> tuple:
        return qwen_image_row_rules(spec)

    def check_options(self, spec, image_decode: str) -> None:
        if image_decode != "exact":
            raise ValueError(f"image_decode={image_decode!r} applies to CLIP and SigLIP's fixed image size; a ColQwen2 "
                             f"page retriever ({spec.path!r}) decodes its pages exactly")

    def backend(self, backend: str, quantize: str | None, device: str, dtype: str) -> str:
        if quantize is not None:
            raise ValueError(f"quantize={quantize!r} is not supported for a page retriever (ColQwen2)")
        if backend == "openvino":
            raise ValueError("backend='openvino' cannot run a page retriever (ColQwen2): use backend='torch' or 'auto'")
        return "torch"

    def runner(self, cfg, **device_steps: Any):
        from pooling_pipeline.core.engine.model_runner import resolve_device, resolve_dtype
        from pooling_pipeline.core.engine.page_retriever_runner import QwenPageRetrieverRunner

        device = resolve_device(cfg.device)
        return QwenPageRetrieverRunner(cfg.model, device, resolve_dtype(cfg.dtype, device, "float32"))
