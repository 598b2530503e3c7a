"""Pair classification (issue 24): NLI cross-encoders (a *ForSequenceClassification head with 3
labels, saved by ST's CrossEncoder, e.g. cross-encoder/nli-deberta-v3-base) classify
(text, text_pair) pairs.

What classify gives for a pair: its class probabilities as classify always gives them -- softmax over
the labels (sigmoid for one label or a multi-label head) -- which for a 3-label cross-encoder is ST's
`CrossEncoder.predict(pairs, apply_softmax=True)` (its default activation there is Identity), and with
`use_activation=False` the raw logits, `CrossEncoder.predict(pairs, activation_fn=Identity())`. A
one-label cross-encoder's probability is the sigmoid of its logit, ST's default activation (what
`score` gives too). Pairs are tokenized as ST tokenizes them (text/text_pair, longest-first truncation
at the model's length, token type ids for BERT-style models). Every reference is first checked to
depend on what is tested (the pair's second text, BERT's token types, the truncation).
"""

from __future__ import annotations

import asyncio

import corpus
import model_zoo as zoo
import numpy as np
import pytest
import torch

from pooling_pipeline import Pipeline, PoolingParams

TOL = 1e-5
MATTERS = 1e-3


def assert_close(got, ref, what: str) -> None:
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, sentence-transformers gives {ref.shape}"
    assert got.dtype == np.float32, f"{what}: dtype {got.dtype}"
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    assert diff.max() <= TOL, f"{what}: max |diff| {diff.max():.3g} vs sentence-transformers"
    print(f"{what}: max |diff| {diff.max():.3g}")


def assert_differs(a, b, what: str) -> None:
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > MATTERS, f"{what} does not change the reference"


@pytest.fixture(scope="module")
def pairs() -> list[tuple[str, str]]:
    """Premise/hypothesis pairs of mixed lengths: short sentences, a long premise and a long
    hypothesis (both cut longest-first at 128 tokens), an empty hypothesis, non-ASCII text."""
    short = corpus.sentences(16, seed=51)
    medium = corpus.medium_texts(3, seed=52)
    out = [(short[i], short[i + 1]) for i in range(0, 12, 2)]
    out += [(medium[0], short[12]), (short[13], medium[1]), (medium[1], medium[2]), (short[14], "")]
    out += [("Émile's café — 東京 🙂", "ΟΔΟΣ ΣΑΣ in İstanbul"), (short[15], short[15])]
    return out


def probs(outs) -> np.ndarray:
    assert [o.index for o in outs] == list(range(len(outs)))
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    return np.stack([o.probs for o in outs])


def softmax(x: np.ndarray) -> np.ndarray:
    return torch.softmax(torch.from_numpy(x), dim=-1).numpy()


@pytest.fixture(scope="module", params=["bert", "deberta-v2"])
def nli(request, tmp_path_factory):
    """(family, model path, CrossEncoder) of a 3-label cross-encoder as ST 6 saves it."""
    from sentence_transformers import CrossEncoder

    family = request.param
    path = zoo.build_cross_encoder(tmp_path_factory.mktemp(f"nli-{family}"), 3, family=family)
    return family, path, CrossEncoder(path, device="cpu")


@pytest.mark.slow
def test_nli_pairs_classify_equals_cross_encoder(nli, pairs):
    """classify(pairs) = CrossEncoder.predict(pairs, apply_softmax=True) (= softmax of the logits);
    use_activation=False = predict(pairs, activation_fn=Identity()); the async twin and
    encode(task="classify") the same; a dict {"text", "text_pair"} is a pair too."""
    family, path, ce = nli
    logits = ce.predict(pairs, activation_fn=torch.nn.Identity(), batch_size=8)
    ref = ce.predict(pairs, apply_softmax=True, batch_size=8)
    assert ref.shape == (len(pairs), 3)
    assert np.abs(ref - softmax(logits)).max() <= 1e-6  # ST's default activation for 3 labels: Identity
    assert np.abs(logits - logits.mean(axis=0)).max() > MATTERS
    # The second text matters: the first alone classifies differently.
    assert_differs(ce.predict([(p, "") for p, _ in pairs], activation_fn=torch.nn.Identity()), logits,
                   "the pair's second text")
    if family == "bert":  # token types matter for BERT: without them the logits differ
        features = ce.tokenizer([p for p, _ in pairs[:4]], [h for _, h in pairs[:4]], padding=True,
                                truncation=True, return_tensors="pt")
        features.pop("token_type_ids")
        with torch.no_grad():
            untyped = ce.model(**features).logits.numpy()
        assert_differs(untyped, logits[:4], "BERT's token type ids")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        assert_close(probs(pipe.classify(pairs, use_tqdm=False)), ref, f"{family} NLI classify(pairs) probs")
        raw = pipe.classify(pairs, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        assert_close(probs(raw), logits, f"{family} NLI classify(pairs) logits")
        assert_close(probs(asyncio.run(pipe.aclassify(pairs))), ref, f"{family} NLI aclassify(pairs)")
        assert_close(probs(pipe.encode(pairs, task="classify", use_tqdm=False)), ref, f"{family} encode classify")
        as_dicts = [{"text": p, "text_pair": h} for p, h in pairs]
        assert_close(probs(pipe.classify(as_dicts, use_tqdm=False)), ref, f"{family} dict pairs")
        # Pairs and single texts in one call, each as it would be alone.
        mixed = pipe.classify([pairs[0][0], pairs[0], [pairs[1][0], pairs[1][1]]], use_tqdm=False)
        single = pipe.classify([pairs[0][0]], use_tqdm=False)[0].probs
        assert_close(probs(mixed), np.stack([single, ref[0], ref[1]]), f"{family} mixed texts and pairs")
        # Per-request options (priorities) go the general path, with the same results.
        per_request = pipe.classify(pairs, priority=list(range(len(pairs))), use_tqdm=False)
        assert_close(probs(per_request), ref, f"{family} pairs with per-request priorities")


@pytest.mark.slow
def test_one_label_cross_encoder_classify_pairs_equals_predict(tmp_path, pairs):
    """A 1-label cross-encoder: classify(pairs) = sigmoid(logit) = CrossEncoder.predict(pairs)
    (ST's default Sigmoid), = score(); raw logits = predict(activation_fn=Identity())."""
    from sentence_transformers import CrossEncoder

    path = zoo.build_cross_encoder(tmp_path, 1)
    ce = CrossEncoder(path, device="cpu")
    ref = ce.predict(pairs, batch_size=8)
    logits = ce.predict(pairs, activation_fn=torch.nn.Identity(), batch_size=8)
    assert_differs(ref, logits, "the activation")
    assert np.abs(ref - ref.mean()).max() > MATTERS
    with Pipeline(model=path, num_render_workers=1) as pipe:
        got = probs(pipe.classify(pairs, use_tqdm=False))
        assert_close(got[:, 0], ref, "1-label classify(pairs)")
        raw = probs(pipe.classify(pairs, pooling_params=PoolingParams(use_activation=False), use_tqdm=False))
        assert_close(raw[:, 0], logits, "1-label classify(pairs) logits")
        scores = np.array([pipe.score(p, h, use_tqdm=False)[0].score for p, h in pairs[:3]], dtype=np.float32)
        assert_close(got[:3, 0], scores, "1-label classify(pairs) vs score")


@pytest.fixture(scope="module")
def bert_nli_pipe(tmp_path_factory):
    path = zoo.build_cross_encoder(tmp_path_factory.mktemp("nli-bad"), 3, family="bert")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        yield pipe


@pytest.mark.slow
@pytest.mark.parametrize("bad, error", [
    (("a", None), TypeError), ((None, "b"), TypeError), (("a", 3), TypeError), (("a", "b", "c"), ValueError),
    (["a"], ValueError), ({"text": "a", "text_pair": None}, TypeError), ({"text": "a", "pair": "b"}, ValueError),
    (None, TypeError),
])
def test_bad_pairs_name_their_request(bert_nli_pipe, bad, error):
    """A pair must be two strs: anything else is a TypeError/ValueError naming its request; with
    errors="return" it is that request's error and the others are computed."""
    prompts = [("premise", "hypothesis"), bad, ("x", "y")]
    with pytest.raises(error, match="request 1"):
        bert_nli_pipe.classify(prompts, use_tqdm=False)
    outs = bert_nli_pipe.classify(prompts, errors="return", use_tqdm=False)
    assert outs[1].error is not None and "request 1" in outs[1].error
    assert outs[0].error is None and outs[2].error is None


@pytest.mark.slow
def test_pairs_apply_to_classify_and_unsupported_options_are_refused(bert_nli_pipe, tmp_path):
    """A pair elsewhere than classify on a sequence-classification model, or with an option the
    pair encoding cannot honour (left truncation), is a ValueError naming its request; with
    long_inputs='error' a pair that fits is classified as by default and one over the length is refused
    naming its count; score() on a 3-label model points to classify with pairs."""
    pipe = bert_nli_pipe
    with pytest.raises(ValueError, match="request 0"):
        pipe.classify([("a", "b")], use_tqdm=False, truncation_side="left")
    fits = pipe.classify([("a", "b")], use_tqdm=False, long_inputs="error")
    np.testing.assert_allclose(fits[0].data, pipe.classify([("a", "b")], use_tqdm=False)[0].data, atol=1e-6, rtol=0)
    from transformers import AutoTokenizer

    long, limit = " ".join(["word"] * 200), pipe.model_spec.default_max_tokens  # (short enough to count exactly)
    tokens = len(AutoTokenizer.from_pretrained(pipe.model_spec.path)("a", long)["input_ids"])
    assert tokens > limit
    with pytest.raises(ValueError, match=rf"request 1: .*pair has {tokens} tokens, more than the {limit} "):
        pipe.classify([("a", "b"), ("a", long)], use_tqdm=False, long_inputs="error")
    with pytest.raises(ValueError) as e:
        pipe.score("a premise", ["a hypothesis"], use_tqdm=False)
    assert "classify" in str(e.value) and "pairs" in str(e.value)
    embedder = zoo.build_st(tmp_path, "bert")
    with Pipeline(model=embedder, num_render_workers=1) as emb:
        with pytest.raises(ValueError, match="request 0.*classif"):
            emb.embed([("a", "b")], use_tqdm=False)
