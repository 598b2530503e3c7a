"""LLM rerankers (issue 24): a causal LM + ST's LogitScore (Qwen3-Reranker, mxbai-rerank-v2, zerank)
score and rank pairs as sentence-transformers 6.2's CrossEncoder does.

Each model is a tiny causal LM built with transformers' own classes and saved by ST's own
`CrossEncoder(modules=[Transformer(transformer_task="text-generation"), LogitScore(...)]).save`. The
pipeline's scores must equal `CrossEncoder.predict` / `rank` within 1e-5 (float32, CPU) on real texts
of mixed lengths, some far beyond the max length (ST cuts the rendered conversation there and writes
the template's suffix back). Every reference is first checked to depend on the query, the document,
the prompt or the max length, so a pipeline that ignores one cannot pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import corpus
import model_zoo as zoo
import numpy as np
import pytest

from pooling_pipeline import Pipeline
from pooling_pipeline.core.shared.model_folder.load import load_model_spec

TOL = 1e-5
MATTERS = 1e-3  # a difference this large means the thing tested changes the reference

# (builder kwargs, what it stands for)
RERANKERS = {
    "qwen3-chat": dict(style="qwen3"),  # Qwen3-Reranker: flat messages, "yes" - "no"
    "mxbai-chat": dict(style="mxbai"),  # mxbai-rerank-v2 (Qwen2): structured messages, "1" - "0"
    "qwen3-single-token": dict(style="qwen3", single_token=True),  # zerank-2: the true token's logit alone
}


@pytest.fixture(scope="module")
def pairs() -> tuple[str, str, list[str]]:
    """Queries: a sentence, a docstring (part of the document still fits) and one beyond the max
    length on its own; documents of mixed lengths: sentences, docstrings, documents of thousands of
    tokens, non-ASCII text."""
    docs = corpus.sentences(8, seed=61) + corpus.medium_texts(4, seed=62) + corpus.long_documents(2, 3_000, 9_000, seed=63)
    docs += ["a", "Émile's café: naïve façade — 東京 and emoji 🙂🚀"]
    order = np.random.default_rng(64).permutation(len(docs))
    medium = corpus.medium_texts(1, seed=66)[0]
    return [corpus.sentences(1, seed=65)[0], medium[:400], medium * 4], [docs[i] for i in order]


def assert_close(got, ref, what: str) -> None:
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, sentence-transformers gives {ref.shape}"
    assert got.dtype == np.float32, f"{what}: dtype {got.dtype}"
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    print(f"{what}: max |diff| {diff.max():.3g}")
    assert diff.max() <= TOL, f"{what}: max |diff| {diff.max():.3g} at {int(np.argmax(diff))} vs sentence-transformers"


def assert_differs(a, b, what: str) -> None:
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > MATTERS, f"{what} does not change the reference"


def scores(pipe, query, docs, **kwargs) -> np.ndarray:
    outs = pipe.score(query, docs, use_tqdm=False, **kwargs)
    assert [o.error for o in outs] == [None] * len(docs)
    return np.array([o.score for o in outs], dtype=np.float32)


def cross_encoder(path: str):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(path, device="cpu")


def _token_lengths(ce, query: str, docs: list[str]) -> list[int]:
    features = ce.preprocess([(query, d) for d in docs])
    return features["attention_mask"].sum(dim=1).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(RERANKERS))
def test_llm_reranker_scores_and_ranks_as_st(tmp_path, pairs, kind):
    """score / rank equal CrossEncoder.predict / rank: the pair through the chat template, the
    conversation cut at the max length with the template's suffix restored, LogitScore at the last
    real token, Sigmoid (the saved activation_fn)."""
    path = zoo.build_llm_reranker(tmp_path, **RERANKERS[kind])
    ce = cross_encoder(path)
    queries, docs = pairs
    query = queries[0]
    lengths = _token_lengths(ce, query, docs)
    assert min(lengths) < ce.max_seq_length and max(lengths) == ce.max_seq_length  # short pairs and cut ones
    refs = {q: ce.predict([(q, d) for d in docs], batch_size=4) for q in queries}
    assert_differs(refs[query], refs[query][::-1], "the document")
    assert_differs(refs[query], refs[queries[1]], "the query")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        for q, ref in refs.items():
            assert_close(scores(pipe, q, docs), ref, f"{kind} scores (query of {len(q)} chars)")
        ranked = pipe.rank(query, docs)
        ref_rank = ce.rank(query, docs)
        assert [r.index for r in ranked] == [r["corpus_id"] for r in ref_rank]
        assert_close(np.array([r.score for r in ranked], dtype=np.float32),
                     np.array([r["score"] for r in ref_rank], dtype=np.float32), f"{kind} rank scores")
        top = pipe.rank(query, docs, top_k=3)
        # Floats depend on the batch a pair was scored in: the same pairs, within the tolerance.
        assert [r.index for r in top] == [r.index for r in ranked[:3]]
        assert_close(np.array([r.score for r in top], dtype=np.float32),
                     np.array([r.score for r in ranked[:3]], dtype=np.float32), f"{kind} top_k scores")


@pytest.mark.slow
def test_text_pair_llm_reranker(tmp_path, pairs):
    """A causal reranker without a chat template ("text" modality only): ST tokenizes the pair as a
    tokenizer text pair, longest-first truncation, left padding; the last real token is read."""
    path = zoo.build_causal_reranker(tmp_path)
    ce = cross_encoder(path)
    queries, docs = pairs
    query = queries[0]
    refs = {q: ce.predict([(q, d) for d in docs], batch_size=4) for q in queries}
    assert_differs(refs[query], refs[query][::-1], "the document")
    assert_differs(refs[query], refs[queries[1]], "the query")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        for q, ref in refs.items():
            assert_close(scores(pipe, q, docs), ref, f"text-pair causal reranker (query of {len(q)} chars)")


@pytest.mark.slow
def test_llm_reranker_prompt_and_max_length(tmp_path, pairs):
    """A prompt becomes a system message (ST's prompt_name / prompt); a smaller max length cuts the
    conversation there, the suffix restored (ST: processing_kwargs text max_length)."""
    prompts = {"web": "Given a question, find the passage that answers it"}
    path = zoo.build_llm_reranker(tmp_path, "mxbai", prompts=prompts)
    ce = cross_encoder(path)
    query, docs = pairs[0][0], pairs[1]
    plain = ce.predict([(query, d) for d in docs])
    unrestored = ce.predict([(query, d) for d in docs], processing_kwargs={"chat_template": {"restore_suffix": False}})
    prompted = ce.predict([(query, d) for d in docs], prompt_name="web")
    custom = ce.predict([(query, d) for d in docs], prompt="Rank recipes")
    short = ce.predict([(query, d) for d in docs], processing_kwargs={"text": {"max_length": 96}})
    assert_differs(plain, prompted, "the prompt")
    assert_differs(plain, short, "the max length")
    assert_differs(plain, unrestored, "restoring the template's suffix on cut rows")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        assert_close(scores(pipe, query, docs, prompt_name="web"), prompted, "prompt_name as a system message")
        assert_close(scores(pipe, query, docs, prompt="Rank recipes"), custom, "a prompt as a system message")
        assert_close(scores(pipe, query, docs, truncate_prompt_tokens=96), short, "max length 96, suffix restored")
        assert_close(scores(pipe, query, docs), plain, "no prompt")


@pytest.mark.slow
def test_llm_reranker_scores_only(tmp_path):
    """An LLM reranker has no embeddings or classes: embed / classify are a ValueError naming the task."""
    path = zoo.build_llm_reranker(tmp_path, "qwen3")
    spec = load_model_spec(path)
    assert spec.tasks == ["score"] and spec.logit_score is not None and spec.chat_pairs is not None
    with Pipeline(model=path, num_render_workers=1) as pipe:
        for method in (pipe.embed, pipe.classify):
            with pytest.raises(ValueError, match="score"):
                method(["a text"])


@pytest.mark.slow
def test_long_inputs_error_refuses_a_pair_whose_render_is_over_the_max_length(tmp_path):
    """score / rank with long_inputs='error' refuse a pair whose chat-template render is over the model's
    256 tokens, naming ST's count of it: the template's own text counts (100 "cat"s render to 336 tokens,
    the bare pair would fit). A pair that fits is ST's score; the default still cuts as ST does."""
    path = zoo.build_llm_reranker(tmp_path, "qwen3")
    ce = cross_encoder(path)
    query, doc = "what is a cat", " ".join(["cat"] * 100)
    ce.max_seq_length = 4096  # (the whole render, as ST tokenizes it)
    whole = int(ce.preprocess([(query, doc)])["attention_mask"].sum())
    ce.max_seq_length = 256
    assert whole > 256
    with Pipeline(model=path, num_render_workers=1) as pipe:
        with pytest.raises(ValueError, match=rf"request 1: .*pair \(as the model's chat template renders it\) has "
                                             rf"{whole} tokens, more than the 256"):
            pipe.score(query, ["a cat", doc], long_inputs="error", use_tqdm=False)
        with pytest.raises(ValueError, match=f"request 0: .* has {whole} tokens"):
            pipe.rank(query, [doc], long_inputs="error", use_tqdm=False)
        assert_close(scores(pipe, query, ["a cat"], long_inputs="error"), ce.predict([(query, "a cat")]),
                     "a pair that fits, long_inputs='error'")
        assert_close(scores(pipe, query, ["a cat", doc]), ce.predict([(query, "a cat"), (query, doc)]),
                     "the default: cut as ST cuts")


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("broken, match", [
    ("logit_input", "LogitScore on 'logits'"),
    ("processing_text", "processing_kwargs"),
    ("softcapping", "final_logit_softcapping"),
    ("no_logit_score", "LogitScore"),
    ("auto_format", "message format 'auto'"),
    ("no_template", "chat template"),
], ids=lambda v: v if " " not in v else "")
def test_llm_reranker_refusals(tmp_path, broken, match):
    """What the pipeline cannot honour about an LLM reranker is a ValueError at load naming it."""
    root = Path(zoo.build_llm_reranker(tmp_path, "qwen3"))
    if broken == "logit_input":
        _edit_json(root / "1_LogitScore" / "config.json", lambda c: c.update(module_input_name="logits"))
    elif broken == "processing_text":
        _edit_json(root / "sentence_bert_config.json",
                   lambda c: c["processing_kwargs"].update(text={"max_length": 64}))
    elif broken == "softcapping":
        _edit_json(root / "config.json", lambda c: c.update(final_logit_softcapping=30.0))
    elif broken == "no_logit_score":
        _edit_json(root / "modules.json", lambda m: m.pop())
    elif broken == "auto_format":
        _edit_json(root / "sentence_bert_config.json", lambda c: c["modality_config"]["message"].update(format="auto"))
    elif broken == "no_template":
        (root / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match=match):
        load_model_spec(root)


@pytest.mark.slow
def test_template_without_pair_roles_is_refused_per_request(tmp_path, pairs):
    """A chat template that renders only system/user/assistant turns drops the pair: ST's predict
    raises (its pair-role probe); the pipeline raises it too, naming the request, instead of scoring
    the bare template."""
    from sentence_transformers import CrossEncoder

    root = Path(zoo.build_llm_reranker(tmp_path, "qwen3"))
    (root / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role in ['system', 'user'] %}{{ m.content }}{% endif %}{% endfor %}"
        "<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="query"):
        CrossEncoder(str(root), device="cpu").predict([("a question", "a passage")])
    with Pipeline(model=str(root), num_render_workers=1) as pipe:
        with pytest.raises(ValueError, match="request 0: .*'query' and 'document' content does not reach"):
            pipe.score(pairs[0][0], pairs[1][:3], use_tqdm=False)
