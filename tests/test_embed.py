"""End-to-end embeddings through the real process group, checked against sentence-transformers."""

import itertools

import corpus
import numpy as np
import pytest

from pooling_pipeline import EmbeddingOutput, PoolingParams

TOL = 1e-5


def test_equals_sentence_transformers_on_mixed_real_text(pipe, st_model, mixed_texts, reference):
    outs = pipe.embed(mixed_texts, use_tqdm=False)
    assert len(outs) == len(mixed_texts)
    got = np.stack([o.embedding for o in outs])
    assert got.dtype == np.float32 and got.shape == reference.shape
    assert np.abs(got - reference).max() <= TOL
    # Token counts after truncation equal the reference tokenizer's (max_seq_length = 256).
    ref_ids = st_model.tokenizer(mixed_texts, truncation=True, max_length=st_model.max_seq_length)["input_ids"]
    assert [o.num_prompt_tokens for o in outs] == [len(ids) for ids in ref_ids]
    assert max(o.num_prompt_tokens for o in outs) == 256


@pytest.mark.slow
def test_results_come_back_in_input_order(pipe, mixed_texts, reference):
    outs = pipe.embed(mixed_texts, use_tqdm=False)
    assert [o.index for o in outs] == list(range(len(mixed_texts)))
    assert len({o.request_id for o in outs}) == len(outs)
    # Reversing the input reverses the output exactly.
    rev = pipe.embed(mixed_texts[::-1], use_tqdm=False)
    np.testing.assert_allclose(np.stack([o.embedding for o in rev]), reference[::-1], atol=TOL, rtol=0)


def test_str_token_ids_and_dict_prompts_agree(pipe, st_model):
    texts = ["The quick brown fox jumps over the lazy dog.", "Tokenization happens in a render worker."]
    ids = st_model.tokenizer(texts)["input_ids"]
    by_text = pipe.embed(texts, use_tqdm=False)
    by_ids = pipe.embed(ids, use_tqdm=False)
    by_dict = pipe.embed([{"prompt_token_ids": ids[0]}, {"prompt": texts[1]}], use_tqdm=False)
    by_array = pipe.embed([np.asarray(i, dtype=np.int64) for i in ids], use_tqdm=False)
    ref = st_model.encode(texts)
    for outs in (by_text, by_ids, by_dict, by_array):
        np.testing.assert_allclose(np.stack([o.embedding for o in outs]), ref, atol=TOL, rtol=0)
    assert [o.num_prompt_tokens for o in by_ids] == [len(i) for i in ids]


def test_single_prompt_and_empty_list(pipe, st_model):
    one = pipe.embed("a single prompt", use_tqdm=False)
    assert isinstance(one, list) and len(one) == 1 and isinstance(one[0], EmbeddingOutput)
    np.testing.assert_allclose(one[0].embedding, st_model.encode("a single prompt"), atol=TOL, rtol=0)
    ids = st_model.tokenizer("a single prompt")["input_ids"]
    assert len(pipe.embed(ids, use_tqdm=False)) == 1  # a flat list of ints is one prompt
    assert pipe.embed([], use_tqdm=False) == []
    assert list(pipe.embed_stream(iter([]))) == []


def test_truncate_prompt_tokens_and_dimensions(pipe, st_model):
    text = corpus.long_document(20_000, seed=3)
    out = pipe.embed(text, truncate_prompt_tokens=32, use_tqdm=False)[0]
    assert out.num_prompt_tokens == 32
    ids = st_model.tokenizer(text, truncation=True, max_length=32)["input_ids"]
    np.testing.assert_allclose(out.embedding, pipe.embed([ids], use_tqdm=False)[0].embedding, atol=TOL, rtol=0)
    # Per-request params: truncation, Matryoshka dimensions (renormalized) and no normalization.
    params = [PoolingParams(truncate_prompt_tokens=16), PoolingParams(dimensions=64), PoolingParams(normalize=False)]
    outs = pipe.embed([text, text, text], pooling_params=params, use_tqdm=False)
    assert outs[0].num_prompt_tokens == 16
    full = pipe.embed(text, use_tqdm=False)[0].embedding
    # The reference without its Normalize module gives the raw mean-pooled vector.
    from sentence_transformers import SentenceTransformer

    raw = SentenceTransformer(modules=[st_model[0], st_model[1]], device="cpu").encode(text)
    assert outs[1].embedding.shape == (64,)
    np.testing.assert_allclose(outs[1].embedding, _renorm(raw[:64]), atol=TOL, rtol=0)
    np.testing.assert_allclose(outs[2].embedding, raw, atol=TOL, rtol=0)
    assert abs(np.linalg.norm(full) - 1) < 1e-5 and abs(np.linalg.norm(outs[2].embedding) - 1) > 1e-3
    # The caller's params are not changed.
    assert params[1] == PoolingParams(dimensions=64)


def _renorm(v):
    return v / np.linalg.norm(v)


@pytest.mark.slow
def test_stream_of_10k_prompts_from_a_generator(pipe, st_model):
    pool = corpus.sentences(500, seed=21)
    produced = []

    def source():
        for i in range(10_000):
            produced.append(i)
            yield pool[i % len(pool)]

    seen = 0
    max_ahead = 0
    for out in pipe.embed_stream(source()):
        assert out.index == seen
        seen += 1
        max_ahead = max(max_ahead, len(produced) - seen)
        if seen <= len(pool):
            ref_row = out.index
            if ref_row % 97 == 0:
                np.testing.assert_allclose(out.embedding, st_model.encode(pool[ref_row]), atol=TOL, rtol=0)
    assert seen == 10_000
    stats = pipe.stats()
    # Lazy and bounded: the source is never read more than the in-flight window ahead.
    assert max_ahead <= pipe.max_inflight
    assert stats["max_inflight_seen"] <= pipe.max_inflight
    assert stats["max_in_core_seen"] <= pipe.engine_window
    assert stats["requests"] == 10_000


def test_stats_report_the_run(pipe, mixed_texts):
    pipe.embed(mixed_texts, use_tqdm=False)
    stats = pipe.stats()
    for key in ("wall_s", "engine_busy_s", "requests", "prompt_tokens", "padded_tokens", "max_inflight_seen",
                "max_in_core_seen", "cpu_plan"):
        assert key in stats
    assert stats["requests"] == len(mixed_texts)
    assert 0 < stats["engine_busy_s"] <= stats["wall_s"]
    assert stats["padded_tokens"] >= stats["prompt_tokens"] > 0
    plan = stats["cpu_plan"]
    assert plan["render_workers"] == len(pipe.pids["workers"]) >= 1
    assert stats["engine"]["torch_threads"] == plan["engine_threads"]


@pytest.mark.slow
def test_abandoned_stream_leaves_the_group_usable(pipe, st_model):
    texts = corpus.sentences(400, seed=31)
    stream = pipe.embed_stream(itertools.cycle(texts))
    first = [next(stream) for _ in range(5)]
    stream.close()  # stops early: in-flight requests are aborted by id
    assert [o.index for o in first] == list(range(5))
    outs = pipe.embed(texts[:50], use_tqdm=False)
    np.testing.assert_allclose(np.stack([o.embedding for o in outs]), st_model.encode(texts[:50]), atol=TOL, rtol=0)
    # A stream left open does not block a newer call, and goes on afterwards (calls run concurrently).
    dangling = pipe.embed_stream(texts)
    next(dangling)
    assert len(pipe.embed(texts[:3], use_tqdm=False)) == 3
    later = next(dangling)
    assert later.index == 1
    np.testing.assert_allclose(later.embedding, st_model.encode(texts[1]), atol=TOL, rtol=0)
    dangling.close()
