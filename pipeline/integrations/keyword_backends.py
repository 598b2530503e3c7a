"""The embedding backends KeyBERT and BERTopic take, over a `SentenceEncoder`.

Both libraries pick a backend by the object's type: an instance of their own `BaseEmbedder` is used
as it is; anything else is matched by its type's name -- which sends a `SentenceEncoder` to a hub
model (KeyBERT's default) or takes it for a transformers pipeline (BERTopic: this package's name has
"pipeline" in it) -- so the encoder travels in their own base class:

    from keybert import KeyBERT
    from pooling_pipeline.integrations.keyword_backends import keybert_backend, bertopic_backend

    KeyBERT(model=keybert_backend(model))                   # model: a SentenceEncoder
    BERTopic(embedding_model=bertopic_backend(model))

Each call embeds a whole list at once (the pipeline batches it), with `encode`'s arguments as the
library's own sentence-transformers backend passes them. The libraries are imported only here,
when one of these is called (optional extras: `keybert`, `bertopic`).
"""

from __future__ import annotations

from typing import Any


def keybert_backend(encoder, **encode_kwargs: Any):
    """A `keybert.backend.BaseEmbedder` that embeds with `encoder` (`KeyBERT(model=...)`)."""
    from keybert.backend import BaseEmbedder

    return _backend(BaseEmbedder, encoder, encode_kwargs)


def bertopic_backend(encoder, **encode_kwargs: Any):
    """A `bertopic.backend.BaseEmbedder` that embeds with `encoder` (`BERTopic(embedding_model=...)`)."""
    from bertopic.backend import BaseEmbedder

    return _backend(BaseEmbedder, encoder, encode_kwargs)


def _backend(base: type, encoder, encode_kwargs: dict):
    class SentenceEncoderBackend(base):
        """Embeds documents and words with a pooling-pipeline SentenceEncoder."""

        def __init__(self) -> None:
            super().__init__()
            self.embedding_model = encoder

        def embed(self, documents, verbose: bool = False):
            return encoder.encode(list(documents), show_progress_bar=verbose, **encode_kwargs)

    return SentenceEncoderBackend()
