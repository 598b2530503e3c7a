"""classify, score (three kinds), token tasks, params, priorities, chat and plugins, each checked
against transformers' own forward pass on small models built here with transformers' classes."""

import contextlib
import shutil
import sys
import textwrap

import corpus
import numpy as np
import pytest
import torch
from tiny_models import build_bert
from transformers import AutoTokenizer, BertForSequenceClassification, BertForTokenClassification, BertModel

from pooling_pipeline import ClassificationOutput, Pipeline, PoolingParams

TOL = 1e-5
QUERIES = ["what is a generator in python", "how do I open a file", "sort a list of numbers"]
DOCS = corpus.medium_texts(3, seed=61)


@pytest.fixture(scope="module")
def models(tmp_path_factory, bert_task_models):
    root = tmp_path_factory.mktemp("models")
    return {
        **bert_task_models,  # cross, classify3, token_cls: built once for the session (test_ray uses them too)
        "multilabel": build_bert(root / "multilabel", BertForSequenceClassification, num_labels=3,
                             problem_type="multi_label_classification"),
        "colbert": build_bert(root / "colbert", BertModel, late_interaction=True,
                          matryoshka_dimensions=[16, 32]),
    }


def _hf(path, cls):
    return cls.from_pretrained(path, attn_implementation="sdpa").eval(), AutoTokenizer.from_pretrained(path)


@torch.inference_mode()
def _logits(model, tok, text, pair=None, max_length=128, **kw):
    enc = tok(text, pair, truncation=True, max_length=max_length, return_tensors="pt", **kw)
    return model(**enc).logits[0].float().numpy()


@torch.inference_mode()
def _token_vectors(model, tok, text, max_length=128):
    enc = tok(text, truncation=True, max_length=max_length, return_tensors="pt")
    hidden = model(**enc).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden, dim=-1).numpy()


@pytest.mark.slow
def test_classify_softmax_sigmoid_and_raw_logits(models, bert_task_pipe):
    texts = corpus.sentences(20, seed=62) + [corpus.long_document(5000, seed=1)]
    for name, activation in (("classify3", "softmax"), ("multilabel", "sigmoid")):
        model, tok = _hf(models[name], BertForSequenceClassification)
        # classify3's Pipeline is the session's (shared with test_ray); multilabel's is this test's own.
        own = name == "multilabel"
        with Pipeline(model=models[name]) if own else contextlib.nullcontext(bert_task_pipe(name)) as pipe:
            outs = pipe.classify(texts, use_tqdm=False)
            raw = pipe.classify(texts, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
            with pytest.raises(ValueError, match="normalize applies to embedding tasks; use use_activation"):
                pipe.classify(texts, pooling_params=PoolingParams(normalize=True))
            with pytest.raises(ValueError, match="dimensions applies to embedding tasks only"):
                pipe.classify(texts, pooling_params=PoolingParams(dimensions=2))
        assert all(isinstance(o, ClassificationOutput) for o in outs)
        for text, out, out_raw in zip(texts, outs, raw):
            logits = _logits(model, tok, text)
            expected = torch.softmax(torch.tensor(logits), -1) if activation == "softmax" else torch.sigmoid(torch.tensor(logits))
            assert out.probs.shape == (3,) and out.probs.dtype == np.float32
            np.testing.assert_allclose(out.probs, expected.numpy(), atol=TOL, rtol=0)
            np.testing.assert_allclose(out_raw.probs, logits, atol=TOL, rtol=0)


@pytest.mark.slow
def test_cross_encoder_scores_with_token_types_1to1_1toN_NtoN(models, bert_task_pipe):
    model, tok = _hf(models["cross"], BertForSequenceClassification)
    with contextlib.nullcontext(bert_task_pipe("cross")) as pipe:  # the session's (shared with test_ray)
        one = pipe.score(QUERIES[0], DOCS[0], use_tqdm=False)
        one_to_n = pipe.score(QUERIES[0], DOCS, use_tqdm=False)
        n_to_n = pipe.score(QUERIES, DOCS, use_tqdm=False)
        raw = pipe.score(QUERIES, DOCS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        per_side = pipe.score(QUERIES, DOCS, max_tokens_per_query=3, max_tokens_per_doc=7, use_tqdm=False)
        long_doc = corpus.long_document(200_000, seed=9)
        long = pipe.score(QUERIES[0], [long_doc], use_tqdm=False)
        with pytest.raises(ValueError, match="must be 1:1, 1:N or N:N; got 2 and 3"):
            pipe.score(QUERIES[:2], DOCS, use_tqdm=False)
        with pytest.raises(ValueError, match="data_2 is empty"):
            pipe.score(QUERIES[0], [], use_tqdm=False)
        with pytest.raises(ValueError, match="unsupported task 'embed'.*can do \\['classify'\\] and score"):
            pipe.encode(["x"], task="embed")
    assert len(one) == 1 and len(one_to_n) == 3 and len(n_to_n) == 3
    sig = lambda x: float(torch.sigmoid(torch.tensor(x)))  # noqa: E731
    assert abs(one[0].score - sig(_logits(model, tok, QUERIES[0], DOCS[0])[0])) <= TOL
    for i, d in enumerate(DOCS):
        assert abs(one_to_n[i].score - sig(_logits(model, tok, QUERIES[0], d)[0])) <= TOL
        expected = _logits(model, tok, QUERIES[i], d)[0]
        assert abs(n_to_n[i].score - sig(expected)) <= TOL
        assert abs(raw[i].score - expected) <= TOL
        # The token types matter: without them the model gives another score.
        assert abs(expected - _logits(model, tok, QUERIES[i], d, return_token_type_ids=False)[0]) > 1e-4
        # Each side truncated on its own first: [CLS] q[:3] [SEP] d[:7] [SEP].
        q_ids = tok(QUERIES[i], add_special_tokens=False)["input_ids"][:3]
        d_ids = tok(d, add_special_tokens=False)["input_ids"][:7]
        ids = [tok.cls_token_id, *q_ids, tok.sep_token_id, *d_ids, tok.sep_token_id]
        types = [0] * (len(q_ids) + 2) + [1] * (len(d_ids) + 1)
        with torch.inference_mode():
            manual = model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0, 0]
        assert abs(per_side[i].score - sig(manual)) <= TOL
        assert per_side[i].num_prompt_tokens == len(ids)
    # A 200k-character document in a pair: both sides truncated exactly as the tokenizer would.
    assert abs(long[0].score - sig(_logits(model, tok, QUERIES[0], long_doc)[0])) <= TOL
    assert long[0].num_prompt_tokens == 128


@pytest.mark.slow
def test_cross_encoder_without_token_types(models, tmp_path):
    """A tokenizer that gives its model no token type ids (RoBERTa style): no boundary travels."""
    import json

    path = tmp_path / "cross-no-types"
    shutil.copytree(models["cross"], path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["model_input_names"] = ["input_ids", "attention_mask"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    model, tok = _hf(str(path), BertForSequenceClassification)
    assert "token_type_ids" not in tok(QUERIES[0], DOCS[0])
    with Pipeline(model=str(path)) as pipe:
        scores = pipe.score(QUERIES, DOCS, use_tqdm=False)
    for i, d in enumerate(DOCS):
        assert abs(scores[i].score - float(torch.sigmoid(torch.tensor(_logits(model, tok, QUERIES[i], d)[0])))) <= TOL


def test_bi_encoder_score_is_cosine_of_embeddings(pipe, st_model):
    scores = pipe.score(QUERIES[0], DOCS, use_tqdm=False)
    q = st_model.encode(QUERIES[0])
    for i, d in enumerate(DOCS):
        dv = st_model.encode(d)
        assert abs(scores[i].score - float(q @ dv / (np.linalg.norm(q) * np.linalg.norm(dv)))) <= TOL
    n_to_n = pipe.score(QUERIES, DOCS, use_tqdm=False)
    assert len(n_to_n) == 3 and abs(n_to_n[0].score - scores[0].score) <= TOL


@pytest.mark.slow
def test_token_embed_late_interaction_and_dimensions(models):
    model, tok = _hf(models["colbert"], BertModel)
    texts = corpus.sentences(6, seed=63)
    with Pipeline(model=models["colbert"]) as pipe:
        outs = pipe.encode(texts, task="token_embed", use_tqdm=False)
        small = pipe.encode(texts[:2], task="token_embed", pooling_params=PoolingParams(dimensions=16),
                            use_tqdm=False)
        scores = pipe.score(QUERIES, DOCS, use_tqdm=False)
        with pytest.raises(ValueError, match="dimensions=8 is not among the model's declared dimensions"):
            pipe.encode(texts, task="token_embed", pooling_params=PoolingParams(dimensions=8))
        with pytest.raises(ValueError, match="cross-encoders only"):
            pipe.score(QUERIES, DOCS, max_tokens_per_query=4)
    for text, out in zip(texts, outs):
        ref = _token_vectors(model, tok, text)
        assert out.data.shape == ref.shape == (out.num_prompt_tokens, 32)
        np.testing.assert_allclose(out.data, ref, atol=TOL, rtol=0)
    with torch.inference_mode():
        enc = tok(texts[0], return_tensors="pt")
        hidden16 = model(**enc).last_hidden_state[0, :, :16]
    np.testing.assert_allclose(small[0].data, torch.nn.functional.normalize(hidden16, dim=-1).numpy(), atol=TOL, rtol=0)
    for i, d in enumerate(DOCS):
        q, dv = _token_vectors(model, tok, QUERIES[i]), _token_vectors(model, tok, d)
        assert abs(scores[i].score - float((q @ dv.T).max(axis=1).sum())) <= 1e-4


@pytest.mark.slow
def test_token_classify(models, bert_task_pipe):
    model, tok = _hf(models["token_cls"], BertForTokenClassification)
    texts = corpus.sentences(5, seed=64)
    with contextlib.nullcontext(bert_task_pipe("token_cls")) as pipe:  # the session's (shared with test_ray)
        outs = pipe.encode(texts, task="token_classify", use_tqdm=False)
        raw = pipe.encode(texts[:1], task="token_classify", pooling_params=PoolingParams(use_activation=False),
                          use_tqdm=False)
        with pytest.raises(ValueError, match="this model cannot score; it can do \\['token_classify'\\]"):
            pipe.score("a", "b")
        with pytest.raises(ValueError, match="unsupported task 'embed': this model can do \\['token_classify'\\]"):
            pipe.embed(["x"])
    for text, out in zip(texts, outs):
        logits = _logits(model, tok, text)
        assert out.data.shape == (out.num_prompt_tokens, 5)
        np.testing.assert_allclose(out.data, torch.softmax(torch.tensor(logits), -1).numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(raw[0].data, _logits(model, tok, texts[0]), atol=TOL, rtol=0)


def test_params_lists_priorities_and_order(pipe, st_model):
    texts = corpus.sentences(30, seed=65)
    params = [PoolingParams(dimensions=32) if i % 3 == 0 else PoolingParams() for i in range(30)]
    priority = [(-i) % 7 for i in range(30)]
    outs = pipe.embed(texts, pooling_params=params, priority=priority, use_tqdm=False)
    assert [o.index for o in outs] == list(range(30))
    ref = st_model.encode(texts)
    for i, out in enumerate(outs):
        if i % 3 == 0:
            assert out.embedding.shape == (32,)
        else:
            np.testing.assert_allclose(out.embedding, ref[i], atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="priority has 2 entries but there are 30 prompts"):
        pipe.embed(texts, priority=[0, 1])
    with pytest.raises(TypeError, match=r"priority\[1\] must be an int"):
        pipe.embed(texts[:2], priority=[0, "high"])
    with pytest.raises(ValueError, match="task='embed' conflicts with the call's task 'token_embed'"):
        pipe.encode(texts, task="token_embed", pooling_params=PoolingParams(task="embed"))


def test_chat_conversation_equals_the_template_rendered_by_hand(pipe, st_model):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    conversation = [{"role": "user", "content": "How do I read a file?"},
                    {"role": "assistant", "content": "Use open() in a with block."}]
    by_hand = "".join(f"{m['role']}: {m['content']}\n" for m in conversation)
    ids = st_model.tokenizer(by_hand, add_special_tokens=False)["input_ids"]
    chat = pipe.embed([conversation, "plain text too"], chat_template=template, use_tqdm=False)
    ref = pipe.embed([{"prompt_token_ids": ids}], use_tqdm=False)
    np.testing.assert_allclose(chat[0].embedding, ref[0].embedding, atol=TOL, rtol=0)
    assert chat[0].num_prompt_tokens == len(ids)
    np.testing.assert_allclose(chat[1].embedding, st_model.encode("plain text too"), atol=TOL, rtol=0)
    # The bundled tokenizer has no template of its own: a clear per-request error.
    with pytest.raises(ValueError, match="request 0: .*chat"):
        pipe.embed([conversation], use_tqdm=False)
    with pytest.raises(ValueError, match="request 0: conversation message 0 must have exactly the keys"):
        pipe.embed([[{"role": "user", "text": "hi"}]], use_tqdm=False)


PLUGIN = '''
import numpy as np


class TitleBodyPlugin:
    """Renders {"title", "body"} records; returns a small dict per result."""

    task = "embed"

    def render(self, raw):
        if raw.get("fail"):
            raise ValueError("this record is marked to fail")
        return raw["title"].upper() + ". " + raw["body"]

    def post_process(self, output):
        return {"id": output.request_id, "index": output.index, "vector": output.data,
                "norm": float(np.linalg.norm(output.data))}
'''


@pytest.mark.slow
def test_io_processor_plugin(tmp_path, st_model, monkeypatch):
    (tmp_path / "my_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    records = [{"title": "Files", "body": "open() returns a file object."},
               {"title": "Lists", "body": "sorted() returns a new list."}]
    with Pipeline(io_processor="my_plugin:TitleBodyPlugin") as pipe:
        results = pipe.encode(records, task="plugin", use_tqdm=False)
        with pytest.raises(ValueError, match="request 1: .*this record is marked to fail"):
            pipe.encode([records[0], {"fail": True}], task="plugin", use_tqdm=False)
        with pytest.raises(TypeError, match="request 0: plugin input must be plain data"):
            pipe.encode([object()], task="plugin", use_tqdm=False)
        # An integer array is a plugin's raw item like any other, never taken for token ids.
        with pytest.raises(TypeError, match="request 0: plugin input must be plain data"):
            pipe.encode([np.array([101, 102], dtype=np.int32)], task="plugin", use_tqdm=False)
        with pytest.raises(TypeError, match="request 0: plugin input must be plain data"):
            list(pipe.encode_stream(iter([np.array([101, 102], dtype=np.int32)]), task="plugin", use_tqdm=False))
        assert len(pipe.encode(records, task="plugin", use_tqdm=False)) == 2  # still usable
    assert [r["index"] for r in results] == [0, 1]
    expected = st_model.encode(["FILES. open() returns a file object.", "LISTS. sorted() returns a new list."])
    for r, e in zip(results, expected):
        np.testing.assert_allclose(r["vector"], e, atol=TOL, rtol=0)
        assert abs(r["norm"] - 1) < 1e-5
    with pytest.raises(ValueError, match="cannot load io_processor"):
        Pipeline(io_processor="no_such_module:Nothing")
    sys.modules.pop("my_plugin", None)


def test_plugin_task_without_a_plugin_is_a_clear_error(pipe):
    with pytest.raises(ValueError, match=r"task 'plugin' needs Pipeline\(io_processor="):
        pipe.encode([{"a": 1}], task="plugin")
    with pytest.raises(ValueError, match=r"unsupported task 'classify': this model can do \['embed', 'token_embed'\]"):
        pipe.classify(["x"])
