"""Multimodal rerankers (Qwen3-VL-Reranker's kind, on Qwen2-VL / Qwen3-VL): a (query, document) pair
whose sides may be texts or images, scored by the generative model's last-token logits -- logit(yes)
- logit(no) by ST's LogitScore, then its activation -- as sentence-transformers 6's CrossEncoder
runs them.

Its pieces: the model folder read into a spec (core/shared/model_folder/vlm_embedder.py,
`vlm_reranker_spec`); the frontend's pairs as chat messages with roles "query" and "document"
(pipeline/vlm_inputs.py `pair_input`); the render worker's chat template and processor
(workers/vlm_messages.py, as the VLM embedder's); the engine's runner
(core/engine/vlm_reranker_runner.py)."""

from __future__ import annotations

from typing import Any

from pooling_pipeline.core.families.vlm_embedder import VlmEmbedderFamily


class VlmRerankerFamily(VlmEmbedderFamily):
    name = "vlm_reranker"
    # (its inputs are pairs: each side read by `pair_input`, rendered by the text renderer's
    # `render_messages`; one text or image alone is no input of a reranker)
    media_renderers: dict[str, str] = {}
    media_input = None
    message_input = None
    pair_input = "pooling_pipeline.vlm_inputs:pair_input"

    def backend(self, backend: str, quantize: str | None, device: str, dtype: str) -> str:
        if quantize is not None:
            raise ValueError(f"quantize={quantize!r} is not supported for a multimodal reranker")
        if backend == "openvino":
            raise ValueError("backend='openvino' cannot run a multimodal reranker (Qwen2-VL, Qwen3-VL): use "
                             "backend='torch' or 'auto'")
        return "torch"

    def runner(self, cfg, **device_steps: Any):
        from pooling_pipeline.core.engine.model_runner import resolve_device, resolve_dtype
        from pooling_pipeline.core.engine.vlm_reranker_runner import VlmRerankerRunner

        device = resolve_device(cfg.device)
        return VlmRerankerRunner(cfg.model, device, resolve_dtype(cfg.dtype, device, "float32"))
