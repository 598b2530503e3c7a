"""Calls a type checker must flag, type-checked (never run) by tests/test_type_stubs.py: each line whose
comment starts with "E:" must get a mypy error containing the comment's text, and no other line an error."""

from __future__ import annotations

from pooling_pipeline import Pipeline, PoolingParams, SentenceEncoder


def calls(pipe: Pipeline, texts: list[str]) -> None:
    pipe.embed(texts, pooling_param=PoolingParams())  # E: Unexpected keyword argument "pooling_param" for "embed"
    pipe.embed(texts, priority="high")  # E: Argument "priority" to "embed" of "Pipeline" has incompatible type "str"
    pipe.embed(texts, long_inputs="chop")  # E: Argument "long_inputs" to "embed" of "Pipeline" has incompatible type
    pipe.classify(texts, chunk_overlap=8)  # E: Unexpected keyword argument "chunk_overlap" for "classify"
    pipe.score("q", texts, chat_template="{{ x }}")  # E: Unexpected keyword argument "chat_template" for "score"
    pipe.rank("q", texts, 3, None)  # E: Too many positional arguments for "rank"
    pipe.encode(texts, task="embed", prompt_nmae="query")  # E: Unexpected keyword argument "prompt_nmae" for "encode"
    for out in pipe.embed_stream(texts, use_tqmd=False):  # E: Unexpected keyword argument "use_tqmd" for "embed_stream"
        print(out)
    Pipeline(devcie="cpu")  # E: Unexpected keyword argument "devcie" for "Pipeline"
    Pipeline("model", dtype="fp64")  # E: Argument "dtype" to "Pipeline" has incompatible type


async def async_calls(pipe: Pipeline, texts: list[str]) -> None:
    await pipe.aembed(texts, pooling_param=None)  # E: Unexpected keyword argument "pooling_param" for "aembed"


def sentence_encoder(model: SentenceEncoder, texts: list[str]) -> None:
    model.encode(texts, normalise_embeddings=True)  # E: Unexpected keyword argument "normalise_embeddings" for "encode"
    model.encode_query(texts, truncate_dims=64)  # E: Unexpected keyword argument "truncate_dims" for "encode_query"
    SentenceEncoder("model", max_num_seq=8)  # E: Unexpected keyword argument "max_num_seq" for "SentenceEncoder"
