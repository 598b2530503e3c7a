"""The libraries that call an embedding model, driven by this project and by sentence-transformers
side by side (issue 37, item 1), against the real libraries (the `integrations` extra, which CI
installs): LangChain's vector stores take a SentenceEncoder as it is; KeyBERT and BERTopic take it in
their own backend class (pipeline/integrations/keyword_backends.py)."""

from __future__ import annotations

import asyncio

import corpus
import numpy as np
import pytest

from pooling_pipeline import SentenceEncoder

TOL = 1e-5
DOCS = corpus.sentences(60, seed=121) + corpus.medium_texts(10, seed=122)
QUERIES = ["how do I read a file line by line", "compress data with a stream", "format a date as text"]


@pytest.fixture(scope="module")
def encoder(pipe):
    return SentenceEncoder(pipeline=pipe)


class STEmbeddings:
    """What a LangChain user writes around sentence-transformers (langchain_huggingface's shape)."""

    def __init__(self, model) -> None:
        self.model = model

    def embed_documents(self, texts):
        return self.model.encode_document(list(texts)).tolist()

    def embed_query(self, text):
        return self.model.encode_query(text).tolist()


@pytest.mark.slow
def test_langchain_vector_store_takes_the_encoder_as_it_is(encoder, st_model):
    from langchain_core.vectorstores import InMemoryVectorStore

    ours = InMemoryVectorStore.from_texts(DOCS, embedding=encoder)
    theirs = InMemoryVectorStore.from_texts(DOCS, embedding=STEmbeddings(st_model))
    for query in QUERIES:
        got = ours.similarity_search_with_score(query, k=5)
        want = theirs.similarity_search_with_score(query, k=5)
        assert [d.page_content for d, _ in got] == [d.page_content for d, _ in want]
        assert np.allclose([s for _, s in got], [s for _, s in want], atol=1e-5)
    vectors = np.asarray(encoder.embed_documents(DOCS[:8]))
    assert np.abs(vectors - st_model.encode_document(DOCS[:8])).max() <= TOL
    assert np.abs(np.asarray(encoder.embed_query(QUERIES[0])) - st_model.encode_query(QUERIES[0])).max() <= TOL

    async def both():  # the async twins run on the pipeline's async API, with the same values
        return await encoder.aembed_documents(DOCS[:8]), await encoder.aembed_query(QUERIES[0])

    docs_async, query_async = asyncio.run(both())
    assert np.abs(np.asarray(docs_async) - vectors).max() <= TOL
    assert np.abs(np.asarray(query_async) - np.asarray(encoder.embed_query(QUERIES[0]))).max() <= TOL


@pytest.mark.slow
def test_langchain_code_that_checks_types_takes_the_encoder(encoder, st_model):
    """A pydantic field typed `Embeddings`, as LangChain's contextual-compression filter declares its
    own (EmbeddingsFilter), takes the encoder, and the vectors it gets are ST's; an object that only
    has the methods is refused there (the check is real) (issue 48, item 13)."""
    import pydantic
    from langchain_core.embeddings import Embeddings

    class EmbeddingsFilter(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)
        embeddings: Embeddings
        similarity_threshold: float = 0.5

    assert isinstance(encoder, Embeddings)
    kept = EmbeddingsFilter(embeddings=encoder)
    assert kept.embeddings is encoder
    got = np.asarray(kept.embeddings.embed_documents(DOCS[:4]))
    assert np.abs(got - st_model.encode_document(DOCS[:4])).max() <= TOL
    with pytest.raises(pydantic.ValidationError, match="Embeddings"):
        EmbeddingsFilter(embeddings=STEmbeddings(st_model))


# Each in a fresh interpreter: LangChain imported before the encoder, or after it (the encoder then
# imports no LangChain); or LangChain not installed (its import blocked).
IMPORT_ORDERS = {
    "langchain first": "from langchain_core.embeddings import Embeddings\n"
                       "from pooling_pipeline import SentenceEncoder\n"
                       "assert issubclass(SentenceEncoder, Embeddings)\n",
    "pooling_pipeline first": "from pooling_pipeline import SentenceEncoder\n"
                              "assert not [m for m in sys.modules if m.startswith('langchain')]\n"
                              "from langchain_core.embeddings import Embeddings\n"
                              "assert issubclass(SentenceEncoder, Embeddings)\n"
                              "from pooling_pipeline.integrations import langchain_embeddings as hook\n"
                              "assert not [f for f in sys.meta_path if isinstance(f, hook._RegisterOnImport)]\n",
    "no langchain": "sys.modules['langchain_core'] = None\n"
                    "from pooling_pipeline import SentenceEncoder\n"
                    "from pooling_pipeline.integrations import langchain_embeddings as hook\n"
                    "assert not [f for f in sys.meta_path if isinstance(f, hook._RegisterOnImport)]\n",
}


@pytest.mark.parametrize("order", sorted(IMPORT_ORDERS))
def test_the_encoder_is_a_langchain_embeddings_whichever_is_imported_first(order, tmp_path):
    import subprocess
    import sys

    code = "import sys\n" + IMPORT_ORDERS[order] + "print('checked')\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "checked", run.stderr[-2000:]


def test_keybert_gives_sentence_transformers_keywords(encoder, st_model):
    from keybert import KeyBERT

    from pooling_pipeline.integrations.keyword_backends import keybert_backend

    docs = corpus.medium_texts(6, seed=123)
    ours = KeyBERT(model=keybert_backend(encoder)).extract_keywords(docs, top_n=5)
    theirs = KeyBERT(model=st_model).extract_keywords(docs, top_n=5)
    assert [[k for k, _ in doc] for doc in ours] == [[k for k, _ in doc] for doc in theirs]
    assert np.allclose([s for doc in ours for _, s in doc], [s for doc in theirs for _, s in doc], atol=1e-4)


@pytest.mark.slow
def test_bertopic_takes_the_encoder_in_its_backend(encoder, st_model):
    """BERTopic took a SentenceEncoder for a transformers pipeline (its type check matches this
    package's name); in BERTopic's own backend class it is used as it is, embeds documents and words
    as sentence-transformers does, and a topic model fits on them. (The topics themselves are not
    compared: UMAP's layout moves with differences of 1e-7 in its input.)"""
    from bertopic import BERTopic
    from bertopic.backend._utils import select_backend
    from umap import UMAP

    from pooling_pipeline.integrations.keyword_backends import bertopic_backend

    backend = bertopic_backend(encoder)
    assert select_backend(backend) is backend
    docs = corpus.sentences(300, seed=124)
    ours = BERTopic(embedding_model=backend, umap_model=UMAP(n_neighbors=10, n_components=5, random_state=7),
                    min_topic_size=8)
    embeddings = ours._extract_embeddings(docs, method="document")
    reference = st_model.encode(docs)
    assert np.abs(embeddings - reference).max() <= TOL
    topics, _ = ours.fit_transform(docs)
    assert len(topics) == len(docs) and len(set(topics)) > 1
    words = [word for word, _ in ours.get_topic(topics[0] if topics[0] != -1 else max(topics))][:5]
    assert np.abs(ours.embedding_model.embed(words) - st_model.encode(words)).max() <= TOL  # words as ST embeds them


@pytest.mark.slow
def test_chromadb_retrieves_what_sentence_transformers_retrieves(encoder, st_model, model_path):
    import chromadb
    from chromadb.utils.embedding_functions import SentenceTransformerEmbeddingFunction

    from pooling_pipeline.integrations.chroma import chroma_embedding_function

    client = chromadb.EphemeralClient()
    ids = [f"d{i}" for i in range(len(DOCS))]
    ours = client.create_collection("ours", embedding_function=chroma_embedding_function(encoder),
                                    configuration={"hnsw": {"space": "cosine"}})
    theirs = client.create_collection("theirs", embedding_function=SentenceTransformerEmbeddingFunction(
        model_name=model_path, device="cpu"), configuration={"hnsw": {"space": "cosine"}})
    ours.add(ids=ids, documents=DOCS)
    theirs.add(ids=ids, documents=DOCS)
    got = ours.query(query_texts=QUERIES, n_results=5)
    want = theirs.query(query_texts=QUERIES, n_results=5)
    assert got["ids"] == want["ids"]
    assert np.allclose(np.asarray(got["distances"]), np.asarray(want["distances"]), atol=1e-5)


@pytest.mark.slow
def test_llama_index_retrieves_what_its_sentence_transformers_model_retrieves(encoder, model_path):
    """LlamaIndex's vector index with the encoder in its BaseEmbedding, against the same index with
    LlamaIndex's own sentence-transformers model (HuggingFaceEmbedding of the same folder): the same
    nodes, the same scores; the async path gives the same vectors."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from pooling_pipeline.integrations.llama_index import llama_index_embedding

    # Nodes built directly: LlamaIndex's default splitter would fetch a tokenizer file from the network.
    nodes = [TextNode(text=text, id_=f"d{i}") for i, text in enumerate(DOCS)]
    ours_model = llama_index_embedding(encoder)
    theirs_model = HuggingFaceEmbedding(model_name=model_path, device="cpu")
    ours = VectorStoreIndex([n.model_copy() for n in nodes], embed_model=ours_model).as_retriever(similarity_top_k=5)
    theirs = VectorStoreIndex([n.model_copy() for n in nodes], embed_model=theirs_model).as_retriever(similarity_top_k=5)
    for query in QUERIES:
        got, want = ours.retrieve(query), theirs.retrieve(query)
        assert [n.node.node_id for n in got] == [n.node.node_id for n in want]
        assert np.allclose([n.score for n in got], [n.score for n in want], atol=1e-5)
    vectors = np.asarray(ours_model.get_text_embedding_batch(DOCS[:8]))
    assert np.abs(vectors - np.asarray(theirs_model.get_text_embedding_batch(DOCS[:8]))).max() <= TOL
    assert np.abs(np.linalg.norm(vectors, axis=1) - 1).max() <= 1e-6  # normalized, as HuggingFaceEmbedding's default

    async def both():
        return (await ours_model.aget_text_embedding_batch(DOCS[:8]), await ours_model.aget_query_embedding(QUERIES[0]))

    docs_async, query_async = asyncio.run(both())
    assert np.abs(np.asarray(docs_async) - vectors).max() <= TOL
    assert np.abs(np.asarray(query_async) - np.asarray(theirs_model.get_query_embedding(QUERIES[0]))).max() <= TOL


def test_llama_index_embedding_takes_the_instructions_as_prompts(encoder, st_model):
    from pooling_pipeline.integrations.llama_index import llama_index_embedding

    model = llama_index_embedding(encoder, normalize=False, query_instruction="Represent the question: ",
                                  text_instruction="Represent the passage: ")
    query = np.asarray(model.get_query_embedding(QUERIES[1]))
    text = np.asarray(model.get_text_embedding(DOCS[3]))
    assert np.abs(query - st_model.encode(QUERIES[1], prompt="Represent the question: ")).max() <= TOL
    assert np.abs(text - st_model.encode(DOCS[3], prompt="Represent the passage: ")).max() <= TOL
    assert model.embed_batch_size == 2048  # the pipeline gets LlamaIndex's texts in large calls
