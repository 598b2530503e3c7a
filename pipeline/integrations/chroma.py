"""A chromadb embedding function over a `SentenceEncoder`.

chromadb takes an `EmbeddingFunction` (its own class, whose `__call__(input)` signature it checks)
and asks it for a name and a config to store with a collection, so the encoder travels in that
class:

    import chromadb
    from pooling_pipeline.integrations.chroma import chroma_embedding_function

    collection = chromadb.EphemeralClient().create_collection("docs",
        embedding_function=chroma_embedding_function(model))        # model: a SentenceEncoder
    collection.add(ids=ids, documents=docs)                          # one call embeds them all
    collection.query(query_texts=["..."], n_results=5)               # queries take the query prompt

Documents take the model's document prompt and queries its query prompt (`encode_document` /
`encode_query`), as chromadb's own sentence-transformers function does with such models. chromadb
is imported only when this is called.
"""

from __future__ import annotations

NAME = "pooling_pipeline"


def chroma_embedding_function(encoder):
    """A `chromadb.EmbeddingFunction` that embeds with `encoder` (a SentenceEncoder)."""
    from chromadb.api.types import EmbeddingFunction

    class PoolingPipelineEmbeddingFunction(EmbeddingFunction):
        def __init__(self) -> None:
            self.encoder = encoder

        def __call__(self, input):
            return list(encoder.encode_document(list(input)))

        def embed_query(self, input):
            return list(encoder.encode_query(list(input)))

        @staticmethod
        def name() -> str:
            return NAME

        def default_space(self) -> str:
            return {"cosine": "cosine", "dot": "ip"}.get(encoder.similarity_fn_name, "l2")

        def get_config(self) -> dict:
            return {"model": encoder.pipeline.model_spec.path}

        @staticmethod
        def build_from_config(config: dict):
            from pooling_pipeline.integrations.sentence_encoder import SentenceEncoder

            return chroma_embedding_function(SentenceEncoder(config["model"]))

    return PoolingPipelineEmbeddingFunction()
