"""Typical calls of the public API, type-checked (never run) by tests/test_type_stubs.py: mypy must
accept every line, as it would in a user's project with the package installed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pooling_pipeline import (
    ClassificationOutput,
    EmbeddingOutput,
    Pipeline,
    PoolingParams,
    RankedDocument,
    ScoringOutput,
    SentenceEncoder,
)


def calls(texts: list[str]) -> None:
    with Pipeline("path/to/model", num_render_workers=2, device="cpu", dtype="fp32", backend="torch",
                  data_parallel_size=1, step_timeout_s=60.0) as pipe:
        outs: list[EmbeddingOutput] = pipe.embed(texts, pooling_params=PoolingParams(dimensions=128), priority=1,
                                                 prompt_name="query")
        first: np.ndarray = outs[0].embedding
        pipe.embed(texts, pooling_params=[PoolingParams(normalize=False)] * len(texts), priority=[0, 1],
                   long_inputs="chunk", chunk_overlap=16, truncate_prompt_tokens=-1, errors="return")
        pipe.embed("one text", None, 128, False)  # options by position too, in the signature's order
        for out in pipe.embed_stream(iter(texts), prompt="query: ", use_tqdm=True):
            print(out.index, out.embedding.shape, first.shape)
        probs: list[ClassificationOutput] = pipe.classify([("a premise", "a hypothesis")], truncation_side="left")
        print(probs[0].probs)
        pipe.encode(texts, task="token_embed", route="query")
        pipe.encode(texts, "sparse_embed")
        scores: list[ScoringOutput] = pipe.score("what is a cat?", ["a cat is a feline", "a dog"],
                                                 max_tokens_per_query=32, max_tokens_per_doc=480)
        ranked: list[RankedDocument] = pipe.rank("what is a cat?", texts, top_k=3, priority=2)
        print(scores[0].score, ranked[0].index, ranked[0].score, pipe.stats()["wall_s"], pipe.pids)


async def async_calls(pipe: Pipeline, texts: list[str]) -> None:
    outs = await pipe.aembed(texts, prompt_name="document")
    print(outs[0].embedding)
    async for out in pipe.aembed_stream(texts, errors="return"):
        print(out.error)
    print(await pipe.ascore("q", texts), await pipe.arank("q", texts, top_k=1), await pipe.aclassify(texts))
    print(await pipe.aencode(texts, task="embed"))
    async for any_out in pipe.aencode_stream(texts, task="classify"):
        print(any_out)


def sentence_encoder(texts: list[str]) -> None:
    with SentenceEncoder("path/to/model", device="cpu", max_num_seqs=32) as model:
        emb = model.encode(texts, normalize_embeddings=True, truncate_dim=256, batch_size=64,
                           show_progress_bar=False, precision="int8")
        queries = model.encode_query(["what is it?"], convert_to_tensor=True)
        docs = model.encode_document(texts, prompt_name="passage", normalize_embeddings=True)
        print(emb.shape, model.similarity(queries, docs), model.get_embedding_dimension())
        model.encode(texts, task="query")  # a Router model's route, as ST's encode(task=...)
    with Pipeline() as pipe:
        shared = SentenceEncoder(pipeline=pipe)
        print(shared.embed_query("a text"), shared.embed_documents(texts), shared.truncate_dim)


def local_folder() -> None:
    with Pipeline(Path("path/to/model")) as pipe:  # a folder as a Path
        print(pipe.model_spec)

