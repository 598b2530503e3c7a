"""Bad input gets a ValueError/TypeError naming the request and the problem; the group stays usable."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pooling_pipeline import Pipeline, PoolingParams

OK = "a perfectly fine sentence"

BAD_PROMPTS = [
    # (prompts, exception, text the message must contain)
    ([OK, 3.5], TypeError, "request 1"),
    ([OK, OK, None], TypeError, "request 2: prompt is None"),
    ([OK, object()], TypeError, "request 1"),
    ([[[1, 2], [3, 4]]], TypeError, "request 0: token ids must be a flat list"),
    ([[101, [2, 3], 102]], TypeError, "request 0"),
    ([OK, [101, -5, 102]], ValueError, "request 1: token id -5 at position 1"),
    ([[101, 30522, 102]], ValueError, "request 0: token id 30522 at position 1 is outside the vocabulary"),
    ([OK, []], ValueError, "request 1: the prompt's token id list is empty"),
    ([[101, 2.5, 102]], TypeError, "request 0: token ids must be integers, got float 2.5 at position 1"),
    ([[True, False]], TypeError, "request 0: token ids must be integers, not bools"),
    # one prompt's token ids with a bad one among them: not two prompts, the first "an int"
    ([101, 2.5], TypeError, "request 0: token ids must be integers, got float 2.5 at position 1"),
    ([101, True], TypeError, "request 0: token ids must be integers, not bools"),
    ([{"prompt_token_ids": []}], ValueError, "request 0"),
    ([{"tokens": [1, 2]}], ValueError, "request 0: a dict prompt must have exactly one key"),
    ([{"prompt": 5}], TypeError, "request 0: 'prompt' must be a str"),
    ([OK, "bad \ud800 surrogate"], ValueError, "request 1: text is not valid Unicode"),
    ([np.array([101, 102]), np.array(5)], TypeError, "request 1: token ids must be a flat list of integers, got an "
     "array of 0 dimensions"),
    ([OK, np.array(5), OK], TypeError, "request 1: token ids must be a flat list of integers"),
    (b"bytes are not text", TypeError, "bytes"),
    (None, TypeError, "None"),
    (12, TypeError, "int"),
]


@pytest.mark.parametrize("prompts,exc,message", BAD_PROMPTS, ids=[repr(p[0])[:40] for p in BAD_PROMPTS])
def test_bad_prompt_gets_a_clear_error(pipe, prompts, exc, message):
    with pytest.raises(exc, match=_re(message)):
        pipe.embed(prompts, use_tqdm=False)
    assert len(pipe.embed([OK], use_tqdm=False)) == 1  # still usable


BAD_OPTIONS = [
    (dict(pooling_params=[PoolingParams()] * 2), ValueError, "pooling_params has 2 entries but there are 3 prompts"),
    (dict(pooling_params="embed"), TypeError, "pooling_params must be a PoolingParams"),
    (dict(pooling_params=[PoolingParams(), None, PoolingParams()]), TypeError, "pooling_params[1]"),
    (dict(pooling_params=PoolingParams(task="classify")), ValueError, "conflicts with the call's task"),
    (dict(pooling_params=PoolingParams(dimensions=0)), ValueError,
     "pooling_params.dimensions must be a positive int or None, got 0"),
    (dict(pooling_params=PoolingParams(dimensions=385)), ValueError, "dimensions=385"),
    (dict(pooling_params=PoolingParams(dimensions=float("nan"))), TypeError, "dimensions must be a positive int or None"),
    (dict(pooling_params=PoolingParams(normalize="yes")), TypeError, "normalize must be a bool"),
    (dict(pooling_params=PoolingParams(dimensions=float("inf"))), TypeError, "dimensions must be a positive int or None"),
    (dict(truncate_prompt_tokens=float("nan")), TypeError, "truncate_prompt_tokens must be an int"),
    (dict(priority=float("inf")), TypeError, "priority must be an int"),
    (dict(errors="ignore"), ValueError, "errors must be one of 'raise', 'return', got 'ignore'"),
    (dict(truncate_prompt_tokens=0), ValueError, "request 0: truncate_prompt_tokens=0"),
    (dict(truncate_prompt_tokens=1), ValueError, "truncate_prompt_tokens=1 must be -1 or in [2, 512]"),
    (dict(truncate_prompt_tokens=513), ValueError, "truncate_prompt_tokens=513"),
    (dict(truncate_prompt_tokens=2.5), TypeError, "truncate_prompt_tokens must be an int"),
    (dict(pooling_params=PoolingParams(truncate_prompt_tokens=10_000)), ValueError, "request 0"),
    (dict(route="query"), ValueError, "route='query': this model has no routes"),
    (dict(route=[None, 3, None]), TypeError, "request 1: route[1] must be a str or None"),
    (dict(route=[None, None]), ValueError, "route has 2 entries but there are 3 prompts"),
]


@pytest.mark.parametrize("kwargs,exc,message", BAD_OPTIONS, ids=[str(o[0])[:50] for o in BAD_OPTIONS])
def test_bad_option_gets_a_clear_error(pipe, kwargs, exc, message):
    with pytest.raises(exc, match=_re(message)):
        pipe.embed([OK, OK, OK], use_tqdm=False, **kwargs)
    assert len(pipe.embed([OK], use_tqdm=False)) == 1


def test_a_zero_dimensional_array_fails_its_request_only_with_errors_return(pipe):
    """A 0-d array has no len(): it is named as its request's error, and the others are embedded."""
    outs = pipe.embed([np.array([101, 102]), np.array(5), OK], use_tqdm=False, errors="return")
    assert outs[0].error is None and outs[2].error is None
    assert "request 1" in outs[1].error and "0 dimensions" in outs[1].error


def test_bad_prompt_deep_in_a_stream_aborts_cleanly(pipe):
    def source():
        for i in range(3000):
            yield OK if i != 2500 else None

    seen = 0
    with pytest.raises(TypeError, match="request 2500: prompt is None"):
        for _ in pipe.embed_stream(source()):
            seen += 1
    assert seen <= 2500
    outs = pipe.embed([OK] * 20, use_tqdm=False)
    assert [o.index for o in outs] == list(range(20))


def test_stream_with_params_list_of_other_length(pipe):
    with pytest.raises(ValueError, match="pooling_params has 2 entries but there are more prompts"):
        list(pipe.embed_stream(iter([OK] * 3), pooling_params=[PoolingParams()] * 2))
    with pytest.raises(ValueError, match="pooling_params has 4 entries but there are 3 prompts"):
        list(pipe.embed_stream(iter([OK] * 3), pooling_params=[PoolingParams()] * 4))


def test_huge_string_is_truncated_not_an_error(pipe):
    text = ("lorem ipsum dolor sit amet " * 2_000_000)[:50_000_000]  # 50 MB
    out = pipe.embed([text, OK], use_tqdm=False)
    assert out[0].num_prompt_tokens == 256 and out[1].num_prompt_tokens > 2


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(model="/no/such/model/dir"), ValueError, "does not exist"),
    (dict(model=42), TypeError, "model must be a local directory, a hub id or None"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs must be an int in [1, "),
    (dict(max_inflight=-1), ValueError, "max_inflight"),
    (dict(device="tpu"), ValueError, "device must be"),
    (dict(dtype="float8"), ValueError, "dtype must be one of"),
    (dict(max_num_batched_tokens=100), ValueError, "below the model's max length"),
])
def test_bad_constructor_arguments(kwargs, exc, message):
    with pytest.raises(exc, match=_re(message)):
        Pipeline(**kwargs)


def test_model_dir_without_tokenizer_or_config(tmp_path, model_path):
    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    (no_tok / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8, "vocab_size": 10}))
    with pytest.raises(ValueError, match="has no tokenizer"):
        Pipeline(model=str(no_tok))
    no_cfg = tmp_path / "no-config"
    no_cfg.mkdir()
    (no_cfg / "vocab.txt").write_text("[PAD]\n")
    with pytest.raises(ValueError, match="has no config.json"):
        Pipeline(model=str(no_cfg))
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        Pipeline(model=str(a_file))


def _sentencepiece_only_copy(model_path, target):
    """The bundled model with its vocabulary replaced by a SentencePiece model alone (a protobuf built with
    transformers' own copy of sentencepiece's schema), as a T5 / XLM-R folder saved without tokenizer.json."""
    from transformers.utils import sentencepiece_model_pb2_new as spm

    shutil.copytree(model_path, target)
    for name in ("tokenizer.json", "vocab.txt"):
        (target / name).unlink(missing_ok=True)
    proto = spm.ModelProto()
    for piece in ("<pad>", "</s>", "<unk>", "\u2581a", "\u2581cat"):
        proto.pieces.add(piece=piece, score=-1.0)
    (target / "spiece.model").write_bytes(proto.SerializeToString())
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "T5Tokenizer"}))
    return target


def test_sentencepiece_only_tokenizer_without_the_package_names_it(tmp_path, model_path, monkeypatch):
    """Without sentencepiece, transformers hands spiece.model to tiktoken, whose error ("Error parsing line
    b'\\x0e' in .../spiece.model") came from a render worker: the caller names the package instead."""
    import importlib.util

    folder = _sentencepiece_only_copy(model_path, tmp_path / "spm-only")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sentencepiece" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"only a SentencePiece model \(spiece.model, no tokenizer.json\).*"
                                         r"pip install sentencepiece"):
        Pipeline(model=str(folder))


def test_sentencepiece_check_spares_other_tokenizer_folders(tmp_path, model_path, monkeypatch):
    """A tokenizer.json beside the SentencePiece file, the package present, or a tiktoken tokenizer.model
    (text: Llama 3's) are not refused by the check."""
    import importlib.util

    from pooling_pipeline.core.shared.model_folder.transformer_config import check_tokenizer_files

    folder = _sentencepiece_only_copy(model_path, tmp_path / "spm-only")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    check_tokenizer_files(folder, "present")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="sentencepiece"):
        check_tokenizer_files(folder, "absent")
    shutil.copy(Path(model_path) / "tokenizer.json", folder / "tokenizer.json")
    check_tokenizer_files(folder, "with tokenizer.json")
    tiktoken = tmp_path / "tiktoken"
    tiktoken.mkdir()
    (tiktoken / "tokenizer.model").write_text("IQ== 0\nIg== 1\n")
    check_tokenizer_files(tiktoken, "tiktoken")


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_no_numpy_float_ids(pipe):
    with pytest.raises(TypeError, match="request 0: token ids must be integers, got float64"):
        pipe.embed([np.array([101.0, 102.0])], use_tqdm=False)


def test_out_of_range_priority_is_a_value_error_naming_the_request(pipe):
    """Priorities travel as int64: 10**30 used to fail the whole call with an OverflowError."""
    with pytest.raises(ValueError, match=_re("priority must be in [")):
        pipe.embed([OK, OK], priority=10**30, use_tqdm=False)
    for bad in (10**30, -(10**30), 2**63):
        with pytest.raises(ValueError, match=_re("request 1: priority[1] must be in [")):
            pipe.embed([OK, OK, OK], priority=[0, bad, 0], use_tqdm=False)
    with pytest.raises(TypeError, match=_re("request 2: priority[2] must be an int")):
        pipe.embed([OK, OK, OK], priority=[0, 0, "high"], use_tqdm=False)
    assert len(pipe.embed([OK], priority=2**63 - 1, use_tqdm=False)) == 1  # the edges are fine


def test_out_of_range_priority_with_errors_return_fails_that_request_only(pipe):
    outs = pipe.embed([OK, "second", "third"], priority=[1, 10**30, -(2**63)], errors="return", use_tqdm=False)
    assert [o.index for o in outs] == [0, 1, 2]
    assert outs[1].error.startswith("request 1: priority[1] must be in [") and outs[1].embedding is None
    assert outs[0].error is None and outs[2].error is None
    np.testing.assert_allclose(outs[0].embedding, pipe.embed(OK, use_tqdm=False)[0].embedding, atol=1e-5, rtol=0)
    streamed = list(pipe.embed_stream(iter([OK, OK]), priority=[10**30, 0], errors="return"))
    assert streamed[0].error.startswith("request 0: ") and streamed[1].error is None



def test_a_priority_per_pair_of_an_embedding_models_score_is_refused_not_dropped(pipe):
    """score() / rank() of a bi-encoder embed each text once (a query shared by its pairs), so a
    priority per pair has no request to go to: a ValueError naming it, where it used to be dropped
    without a word (issue 50, item 8). One priority for the call is honoured as everywhere."""
    docs = ["a cat is a feline", "a dog"]
    with pytest.raises(ValueError, match="per-pair priority applies to cross-encoders only"):
        pipe.score("what is a cat?", docs, priority=[0, 1], use_tqdm=False)
    with pytest.raises(ValueError, match="per-pair priority"):
        pipe.rank("what is a cat?", docs, priority=(5, 0))
    with pytest.raises(ValueError, match="per-pair priority"):
        pipe.score(["q1", "q2"], docs, priority=[0, 1], errors="return", use_tqdm=False)
    plain = pipe.score("what is a cat?", docs, use_tqdm=False)
    urgent = pipe.score("what is a cat?", docs, priority=-3, use_tqdm=False)
    assert [s.score for s in urgent] == pytest.approx([s.score for s in plain], abs=1e-6)

@pytest.mark.slow
def test_token_id_arrays_checked_by_block_name_the_bad_request(pipe):
    """A list of id arrays is range-checked a block at a time (one reduction for a thousand
    prompts); a bad id anywhere in a block still fails with its own request's index and
    position, whatever the arrays' integer types, and errors="return" fails that request only."""
    rng = np.random.default_rng(0)
    good = [rng.integers(1000, 2000, size=rng.integers(3, 12)).astype(dtype)
            for dtype in (np.int32, np.int64, np.uint16, np.int16) for _ in range(300)]
    reference = pipe.embed([a.tolist() for a in good], use_tqdm=False)  # plain lists: the per-request check
    fast = pipe.embed(good, use_tqdm=False)
    assert [o.num_prompt_tokens for o in fast] == [len(a) for a in good]
    for ours, ref in zip(fast, reference):
        np.testing.assert_allclose(ours.embedding, ref.embedding, atol=1e-5)
    for bad_id, dtype in ((30522, np.int64), (-3, np.int32), (2**64 - 1, np.uint64), (2**63, np.uint64)):
        prompts = list(good)
        prompts[1100] = np.array([101, 7, bad_id, 102], dtype=dtype)
        with pytest.raises(ValueError, match=rf"request 1100: token id {bad_id} at position 2 is outside"):
            pipe.embed(prompts, use_tqdm=False)
        outs = pipe.embed(prompts, errors="return", use_tqdm=False)
        assert [o.index for o in outs if o.error] == [1100]
        assert "token id" in outs[1100].error
        np.testing.assert_allclose(outs[1101].embedding, reference[1101].embedding, atol=1e-5)


def test_token_ids_are_copied_when_the_call_reads_them(pipe):
    """The caller's arrays are not shared with requests in flight: changing them after the call
    has read them changes nothing."""
    ids = [np.array([101, 2000 + i, 2001 + i, 102], dtype=np.int32) for i in range(200)]
    expected = pipe.embed([a.copy() for a in ids], use_tqdm=False)
    stream = pipe.embed_stream(ids, use_tqdm=False)
    first = next(stream)
    for a in ids:
        a[1:3] = 5  # too late: every request of this list was read when the call started its block
    rest = [first, *stream]
    for ours, ref in zip(rest, expected):
        np.testing.assert_allclose(ours.embedding, ref.embedding, atol=1e-5)


@pytest.mark.parametrize("bad_id,dtype", [(30522, np.int32), (-1, np.int64), (2**32 + 5, np.int64),
                                          (2**32 - 1, np.uint32), (2**64 - 1, np.uint64)])
def test_token_ids_from_a_generator_are_range_checked_when_sent(pipe, bad_id, dtype):
    """A stream of id arrays is range-checked a message at a time, just before it is sent: a bad
    id (a wide one too, which a cast to int32 would wrap into the vocabulary) still fails its own
    request by index and position; errors="return" fails that request only."""
    good = [np.array([101, 2000 + i, 102], dtype=dtype) for i in range(150)]
    reference = pipe.embed([a.tolist() for a in good], use_tqdm=False)
    prompts = list(good)
    prompts[77] = np.array([101, 7, bad_id, 102], dtype=dtype)
    with pytest.raises(ValueError, match=rf"request 77: token id {bad_id} at position 2 is outside"):
        list(pipe.embed_stream(iter(prompts), use_tqdm=False))
    outs = list(pipe.embed_stream(iter(prompts), errors="return", use_tqdm=False))
    assert [o.index for o in outs] == list(range(150))
    assert [o.index for o in outs if o.error] == [77] and "token id" in outs[77].error
    for i in (0, 76, 78, 149):
        np.testing.assert_allclose(outs[i].embedding, reference[i].embedding, atol=1e-5)


@pytest.mark.slow
def test_numpy_string_items_are_texts_everywhere(pipe, tmp_path):
    """numpy string scalars (`list(arr)`, `iter(arr)`, `zip(df.a.values, df.b.values)`) are str
    subclasses: they are texts wherever a str is -- prompts, a prompt option, pairs, documents,
    queries -- not a wire-encoding failure (issue 35, item 6); another non-encodable item is a
    TypeError naming the request."""
    import model_zoo as zoo

    texts = ["Python is a programming language.", "The cat sat on the mat.", "Ünïcode façade 東京"]
    arr = np.array(texts)
    want = np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False)])
    for form in (list(arr), iter(arr), (t for t in arr), [{"prompt": t} for t in arr]):
        got = np.stack([o.embedding for o in pipe.embed(form, use_tqdm=False)])
        assert np.array_equal(got, want)
    prompted = pipe.embed(list(arr), prompt=np.str_("query: "), use_tqdm=False)
    assert np.array_equal(np.stack([o.embedding for o in prompted]),
                          np.stack([o.embedding for o in pipe.embed(texts, prompt="query: ", use_tqdm=False)]))
    scores = [o.score for o in pipe.score(arr[0], list(arr[1:]), use_tqdm=False)]
    assert scores == [o.score for o in pipe.score(texts[0], texts[1:], use_tqdm=False)]
    ranked = pipe.rank(np.str_("programming"), list(arr), use_tqdm=False)
    assert ranked == pipe.rank("programming", texts, use_tqdm=False)
    with pytest.raises(TypeError, match="request 1"):
        pipe.embed([texts[0], np.float64(1.5)], use_tqdm=False)
    cross = zoo.build_cross_encoder(tmp_path, num_labels=3)
    with Pipeline(model=cross, num_render_workers=1) as ce:
        pairs = list(zip(np.array(texts), np.array(texts[::-1])))
        got = [o.probs for o in ce.classify(pairs, use_tqdm=False)]
        plain = [o.probs for o in ce.classify([(a, b) for a, b in zip(texts, texts[::-1])], use_tqdm=False)]
        assert all(np.array_equal(a, b) for a, b in zip(got, plain))
