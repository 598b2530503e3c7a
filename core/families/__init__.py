"""Model families: what one kind of model is to each process, decided once from the model folder.

A family says what the engine runs (`runner`), what the caller may ask of it (`backend`, the
options it takes), what a render worker renders (`modalities`, `tokenizer_from_json`) and how long
one request's input to its transformer can be (`longest_input`). The engine, the render workers
and the API ask the model's family (`family_of(spec)`) instead of testing the spec, so a new kind
of model is a new module here, its runner and renderer, and its tests:

- `transformer.py`: encoders, decoders, cross-encoders, SPLADE, ColBERT, LLM rerankers, Routers;
  the engine runs `model_runner.ModelRunner`; a worker renders texts, pairs, conversations, ids.
- `static_embedding.py`: ST's StaticEmbedding (model2vec); `static_runner.StaticEmbeddingRunner`;
  texts, with the model's tokenizer.json as it is.
- `dual_encoder.py`: CLIP, SigLIP; `dual_encoder_runner.DualEncoderRunner`; texts, and images
  (`workers/images.py`).
- `clap.py`: CLAP; `clap_runner.ClapRunner`; texts, and audio clips (`workers/audio.py`).
- `page_retriever.py`: ColPali; `page_retriever_runner.PageRetrieverRunner`; text queries and page
  images (`workers/page_retriever.py`), one vector per token.
- `naflex_dual_encoder.py`: SigLIP2 with its NaFlex processor; `naflex_runner.NaFlexRunner`; texts,
  and images of any aspect ratio (`workers/naflex_images.py`).
- `qwen_page_retriever.py`: ColQwen2; `page_retriever_runner.QwenPageRetrieverRunner`; text queries
  and page images of any size (`workers/page_retriever.py`), one vector per token.
- `vlm_reranker.py`: Qwen3-VL-Reranker's kind; `vlm_reranker_runner.VlmRerankerRunner`; (query,
  document) pairs of texts and images as chat messages (`workers/vlm_messages.py`), LogitScore.
- `vlm_embedder.py`: Qwen3-VL-Embedding and others on Qwen2-VL / Qwen3-VL;
  `vlm_embedder_runner.VlmEmbedderRunner`; texts and images of any size as chat messages
  (`workers/vlm_messages.py`).

The model folder reader (core/shared/model_folder/) names the family in `ModelSpec.input_module`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pooling_pipeline.core.families.base import ModelFamily
from pooling_pipeline.core.families.clap import ClapFamily
from pooling_pipeline.core.families.dual_encoder import DualEncoderFamily
from pooling_pipeline.core.families.naflex_dual_encoder import NaFlexDualEncoderFamily
from pooling_pipeline.core.families.page_retriever import PageRetrieverFamily
from pooling_pipeline.core.families.qwen_page_retriever import QwenPageRetrieverFamily
from pooling_pipeline.core.families.static_embedding import StaticEmbeddingFamily
from pooling_pipeline.core.families.transformer import TransformerFamily
from pooling_pipeline.core.families.vlm_embedder import VlmEmbedderFamily
from pooling_pipeline.core.families.vlm_reranker import VlmRerankerFamily

if TYPE_CHECKING:
    from pooling_pipeline.core.shared.config import ModelSpec

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in
                                    (TransformerFamily(), StaticEmbeddingFamily(), DualEncoderFamily(),
                                     NaFlexDualEncoderFamily(), ClapFamily(), PageRetrieverFamily(),
                                     VlmEmbedderFamily(), QwenPageRetrieverFamily(), VlmRerankerFamily())}


def family_of(spec: ModelSpec) -> ModelFamily:
    """The model's family (a Router's is its routes' transformer family: the model runner runs each
    route, static ones included)."""
    name = "transformer" if spec.input_module == "sparse_static_embedding" else spec.input_module
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"model {spec.path!r}: no model family {spec.input_module!r}: this is a bug")
    return family


__all__ = ["FAMILIES", "ModelFamily", "family_of"]
