"""A LlamaIndex embedding model (`llama_index.core.embeddings.BaseEmbedding`) over a `SentenceEncoder`.

LlamaIndex takes an embedding model only as an instance of its own pydantic class, so the encoder
travels in one:

    from llama_index.core import VectorStoreIndex
    from pooling_pipeline.integrations.llama_index import llama_index_embedding

    index = VectorStoreIndex(nodes, embed_model=llama_index_embedding(model))   # model: a SentenceEncoder

It embeds as LlamaIndex's own sentence-transformers model (`HuggingFaceEmbedding` of
llama-index-embeddings-huggingface) does: queries with the model's query prompt, texts with its
document prompt (or the `query_instruction` / `text_instruction` given), normalized unless
`normalize=False`. LlamaIndex hands texts over in lists of `embed_batch_size`, 10 by default;
here the default is LlamaIndex's largest, 2048, so the pipeline gets them in large calls and forms
its own batches. The async methods run on the pipeline's async API. LlamaIndex is imported only
here, when this is called (the `integrations` extra).
"""

from __future__ import annotations

import numpy as np

MAX_EMBED_BATCH_SIZE = 2048  # BaseEmbedding's own upper bound on embed_batch_size


def llama_index_embedding(encoder, *, normalize: bool = True, query_instruction: str | None = None,
                          text_instruction: str | None = None, embed_batch_size: int = MAX_EMBED_BATCH_SIZE,
                          model_name: str | None = None):
    """A `BaseEmbedding` that embeds with `encoder` (a SentenceEncoder, which stays its caller's to close)."""
    from llama_index.core.base.embeddings.base import BaseEmbedding

    class PipelineEmbedding(BaseEmbedding):
        """Embeds queries and texts with a pooling-pipeline SentenceEncoder (held by the closure:
        LlamaIndex's pydantic model copies and serialises its fields, never this)."""

        @classmethod
        def class_name(cls) -> str:
            return "PoolingPipelineEmbedding"

        def _get_query_embedding(self, query: str) -> list[float]:
            return self._get_embeddings([query], "query")[0]

        def _get_text_embedding(self, text: str) -> list[float]:
            return self._get_embeddings([text], "document")[0]

        def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
            return self._get_embeddings(texts, "document")

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return (await self._aget_embeddings([query], "query"))[0]

        async def _aget_text_embedding(self, text: str) -> list[float]:
            return (await self._aget_embeddings([text], "document"))[0]

        async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
            return await self._aget_embeddings(texts, "document")

        def _get_embeddings(self, texts: list[str], kind: str) -> list[list[float]]:
            if not texts:
                return []
            instruction = query_instruction if kind == "query" else text_instruction
            encode = encoder.encode_query if kind == "query" else encoder.encode_document
            return encode(list(texts), prompt=instruction, normalize_embeddings=normalize).tolist()

        async def _aget_embeddings(self, texts: list[str], kind: str) -> list[list[float]]:
            if not texts:
                return []
            options = encoder._async_options(kind)
            instruction = query_instruction if kind == "query" else text_instruction
            if instruction is not None:
                options.update(prompt=instruction, prompt_name=None)
            outs = await encoder.pipeline.aembed(list(texts), **options)
            vectors = np.stack([o.embedding for o in outs])
            if normalize:
                vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
            return vectors.tolist()

    name = model_name or encoder.model_card_data.model_id or encoder.model_card_data.model_name or "unknown"
    return PipelineEmbedding(model_name=name, embed_batch_size=embed_batch_size)
