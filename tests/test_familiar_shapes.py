"""The shapes users bring from elsewhere: sentence-transformers' encode (SentenceEncoder), vLLM's
output attributes, and the columns people hold (numpy, pandas, pyarrow)."""

import corpus
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from helpers import wait_gone
from sentence_transformers import SentenceTransformer
from sentence_transformers.util import quantize_embeddings as st_quantize

from pooling_pipeline import PoolingParams, SentenceEncoder, quantize_embeddings

TOL = 1e-5
TEXTS = corpus.sentences(24, seed=71) + corpus.medium_texts(4, seed=72) + [corpus.long_document(4000, seed=73)]


@pytest.fixture(scope="module")
def encoder(pipe):
    return SentenceEncoder(pipeline=pipe)


def test_encode_returns_what_sentence_transformers_returns(encoder, st_model):
    ref = st_model.encode(TEXTS)
    got = encoder.encode(TEXTS, batch_size=7)
    assert isinstance(got, np.ndarray) and got.shape == ref.shape and got.dtype == np.float32
    assert np.abs(got - ref).max() <= TOL
    one = encoder.encode(TEXTS[0])
    assert one.shape == (384,) and np.abs(one - ref[0]).max() <= TOL
    tensor = encoder.encode(TEXTS[:3], convert_to_tensor=True)
    assert isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == (3, 384)
    as_list = encoder.encode(TEXTS[:3], convert_to_numpy=False)
    assert isinstance(as_list, list) and all(isinstance(t, torch.Tensor) for t in as_list)
    assert encoder.get_sentence_embedding_dimension() == 384



@pytest.mark.parametrize("kwargs", [{}, {"precision": "int8"}, {"precision": "binary"}, {"truncate_dim": 8},
                                    {"convert_to_tensor": True}, {"convert_to_numpy": False},
                                    {"output_value": "token_embeddings"}], ids=str)
def test_encode_of_no_sentences_is_what_sentence_transformers_returns(encoder, st_model, kwargs):
    """ST returns an empty 1-D array (float64) for [], whatever the precision: not (0, 384), and not
    an error from quantizing nothing; an empty tensor or list for the other return types."""
    ref, got = st_model.encode([], **kwargs), encoder.encode([], **kwargs)
    assert type(got) is type(ref)
    if isinstance(ref, list):
        assert got == ref == []
    else:
        assert tuple(got.shape) == tuple(ref.shape) and got.dtype == ref.dtype


@pytest.mark.parametrize("truncate_dim,normalize", [(64, False), (64, True), (None, True)])
def test_truncate_dim_and_normalize_as_sentence_transformers(encoder, st_model, truncate_dim, normalize):
    ref = st_model.encode(TEXTS, truncate_dim=truncate_dim, normalize_embeddings=normalize)
    got = encoder.encode(TEXTS, truncate_dim=truncate_dim, normalize_embeddings=normalize)
    assert got.shape == ref.shape and np.abs(got - ref).max() <= TOL


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
def test_precisions_equal_quantize_embeddings(encoder, st_model, precision):
    floats = st_model.encode(TEXTS)
    got = encoder.encode(TEXTS, precision=precision)
    want = st_quantize(floats, precision=precision)
    assert got.dtype == want.dtype and got.shape == want.shape
    # A float within 1e-6 of a bucket edge may land one bucket over: count, do not require bitwise.
    if precision.endswith("int8"):
        assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1
        assert (got == want).mean() > 0.99
    else:
        assert (got == want).mean() > 0.99
    ranges = np.vstack((floats.min(0), floats.max(0)))
    assert np.array_equal(quantize_embeddings(floats, precision, ranges=ranges),
                          st_quantize(floats, precision=precision, ranges=ranges))


@pytest.mark.slow
def test_similarity_and_prompts_follow_the_model(tmp_path):
    import model_zoo

    path = model_zoo.build_st(tmp_path, "bert", prompts={"query": "query: ", "passage": "passage: "},
                              normalize=True)
    st = SentenceTransformer(path, device="cpu")
    with SentenceEncoder(path) as enc:
        pids = [enc.pipeline.pids["engine"], *enc.pipeline.pids["workers"]]
        q, d = enc.encode_query(TEXTS[:3]), enc.encode_document(TEXTS[3:8])
        assert np.abs(q - st.encode_query(TEXTS[:3])).max() <= TOL
        assert np.abs(d - st.encode_document(TEXTS[3:8])).max() <= TOL
        assert np.abs(enc.encode(TEXTS[:2], prompt="custom: ") - st.encode(TEXTS[:2], prompt="custom: ")).max() <= TOL
        sims = enc.similarity(q, d)
        assert tuple(sims.shape) == (3, 5)
        assert torch.allclose(sims, st.similarity(torch.from_numpy(q), torch.from_numpy(d)), atol=TOL)
        assert torch.allclose(enc.similarity_pairwise(q, d[:3]),
                              st.similarity_pairwise(torch.from_numpy(q), torch.from_numpy(d[:3])), atol=TOL)
        with pytest.raises(ValueError, match="not among the model's prompts"):
            enc.encode(TEXTS[:1], prompt_name="nope")
    assert wait_gone(pids, 5.0) == []  # the encoder owned its pipeline and closed it


@pytest.mark.parametrize("name", ["cosine", "dot", "euclidean", "manhattan"])
def test_similarity_matrices_equal_sentence_transformers(name):
    """similarity / similarity_pairwise are ST's matrix operations (issue 37, item 2): equal within
    1e-6 on arrays, tensors and single vectors, for every similarity function."""
    from sentence_transformers import util

    from pooling_pipeline.similarity import similarity_matrix, similarity_pairwise

    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((40, 64)).astype(np.float32), rng.standard_normal((70, 64)).astype(np.float32)
    st_matrix = {"cosine": util.cos_sim, "dot": util.dot_score, "euclidean": util.euclidean_sim,
                 "manhattan": util.manhattan_sim}[name]
    st_pairs = {"cosine": util.pairwise_cos_sim, "dot": util.pairwise_dot_score,
                "euclidean": util.pairwise_euclidean_sim, "manhattan": util.pairwise_manhattan_sim}[name]
    for x, y in ((a, b), (torch.from_numpy(a), torch.from_numpy(b)), (a[0], b), (a.tolist(), b.tolist())):
        got, want = similarity_matrix(name, x, y), st_matrix(x, y)
        assert isinstance(got, torch.Tensor) and got.shape == want.shape
        assert float((got - want).abs().max()) <= 1e-6 * max(1.0, float(want.abs().max()))
    got, want = similarity_pairwise(name, a, b[:40]), st_pairs(a, b[:40])
    assert got.shape == want.shape and float((got - want).abs().max()) <= 1e-6 * max(1.0, float(want.abs().max()))


def test_the_sentence_transformers_surface_libraries_reach_for(encoder, st_model):
    """ST 6.3's names (issue 37, item 3): get_embedding_dimension (and its deprecated name),
    get_max_seq_length, device, tokenizer, model_card_data, truncate_dim; max_seq_length is settable
    and truncates as ST's does."""
    assert encoder.get_embedding_dimension() == st_model.get_embedding_dimension() == 384
    assert encoder.get_sentence_embedding_dimension() == 384
    assert encoder.get_max_seq_length() == encoder.max_seq_length == st_model.max_seq_length
    assert encoder.device == torch.device("cpu") and encoder.truncate_dim is None
    assert encoder.tokenizer("a text")["input_ids"] == st_model.tokenizer("a text")["input_ids"]
    assert encoder.model_card_data.model_name
    long_text = TEXTS[-1]
    encoder.max_seq_length = st_model.max_seq_length = 32
    try:
        got, want = encoder.encode([long_text, TEXTS[0]]), st_model.encode([long_text, TEXTS[0]])
        assert np.abs(got - want).max() <= TOL
    finally:
        encoder.max_seq_length = st_model.max_seq_length = 256
    assert np.abs(encoder.encode([long_text]) - st_model.encode([long_text])).max() <= TOL


def test_calling_the_encoder_is_sentence_transformers_forward(encoder, st_model):
    """ST's model(features): the tokenizer's padded batch in, the dict with sentence_embedding out."""
    import torch

    texts = corpus.sentences(5, seed=131) + ["short"]
    features = dict(encoder.tokenizer(texts, padding=True, truncation=True, return_tensors="pt"))
    got = encoder(features)
    with torch.no_grad():
        want = st_model(st_model.tokenize(texts))
    assert set(got) == set(features) | {"sentence_embedding"}
    assert float((got["sentence_embedding"] - want["sentence_embedding"]).abs().max()) <= TOL
    pair = dict(features, token_type_ids=torch.ones_like(features["input_ids"]))
    with pytest.raises(ValueError, match="token_type_ids"):
        encoder(pair)
    with pytest.raises(TypeError, match="input_ids and attention_mask"):
        encoder(texts)


def test_encode_refuses_what_it_cannot_honour(encoder):
    with pytest.raises(ValueError, match="precision"):
        encoder.encode(TEXTS[:1], precision="int4")
    with pytest.raises(ValueError, match="device"):
        encoder.encode(TEXTS[:1], device="cuda:3")
    with pytest.raises(TypeError, match="unexpected keyword"):
        encoder.encode(TEXTS[:1], not_an_option=1)
    with pytest.raises(ValueError, match="give either a pipeline"):
        SentenceEncoder("some-model", pipeline=encoder.pipeline)


def test_vllm_style_output_attributes(pipe):
    out = pipe.embed(TEXTS[:2], use_tqdm=False)[0]
    assert out.outputs.embedding is out.embedding and out.outputs.data is out.data
    score = pipe.score(TEXTS[0], TEXTS[1:3], use_tqdm=False)[0]
    assert score.outputs.score == score.score


@pytest.mark.parametrize("column", [
    lambda t: np.array(t, dtype=object),  # df.text.values
    lambda t: np.array(t),  # a numpy str array
    lambda t: pd.Series(t),
    lambda t: pa.array(t),
    lambda t: pa.chunked_array([t[:5], t[5:]]),
], ids=["numpy-object", "numpy-str", "pandas", "pyarrow", "pyarrow-chunked"])
def test_columns_people_hold(pipe, column):
    ref = np.stack([o.embedding for o in pipe.embed(TEXTS, use_tqdm=False)])
    got = np.stack([o.embedding for o in pipe.embed(column(TEXTS), use_tqdm=False)])
    assert got.shape == ref.shape and np.abs(got - ref).max() <= TOL
    streamed = np.stack([o.embedding for o in pipe.embed_stream(column(TEXTS))])
    assert np.abs(streamed - ref).max() <= TOL


def test_integer_matrix_is_one_token_id_list_per_row(pipe):
    ids = np.array([[101, 7592, 2088, 102], [101, 2088, 7592, 102]])
    outs = pipe.embed(ids, use_tqdm=False)
    assert len(outs) == 2 and outs[0].num_prompt_tokens == 4
    with pytest.raises(TypeError, match="request 1"):
        pipe.embed(np.array(["fine", None], dtype=object), use_tqdm=False)
    assert pipe.embed(pd.Series(["x"]), pooling_params=PoolingParams(dimensions=8), use_tqdm=False)[0].data.shape == (8,)
