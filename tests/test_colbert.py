"""ColBERT models (issue 24) equal sentence-transformers 6.2's MultiVectorEncoder: its own saves and
PyLate v3's layout (model_type "ColBERT", modules.json [Transformer, Dense], prefixes and lengths at
the top of config_sentence_transformers.json), BERT and ModernBERT.

Each test encodes real texts of mixed lengths on each route -- queries shorter and longer than the
query expansion length, documents beyond document_length, punctuation-heavy documents (the
skiplist) -- and compares every token vector (the same count of vectors per text) and the MaxSim
scores with ST within 1e-5 (float32, CPU). Each reference is first checked to depend on the route.
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
MATTERS = 1e-3

PUNCTUATION_HEAVY = [
    "Wait... what?! (Really) -- yes: [1], {2}; <3> & 'four' \"five\" #6 @7 $8 %9 ^10 *11 +12 =13 |14 ~15 `16`.",
    "def f(x): return x ** 2 + (y - 1) / 3;  # a comment, with punctuation!",
    "!!!???...,,,;;;:::",
]


@pytest.fixture(scope="module")
def queries() -> list[str]:
    """Short queries, queries longer than the 16-token expansion length, the empty one."""
    out = corpus.sentences(6, seed=61) + [s[:200] for s in corpus.medium_texts(3, seed=62)]
    out += ["", "what is ColBERT?", "Émile's café: naïve façade — 東京?"]
    return out


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """Sentences, texts far beyond document_length (48), punctuation-heavy ones."""
    out = corpus.sentences(5, seed=63) + corpus.medium_texts(3, seed=64) + corpus.long_documents(1, 5_000, 9_000, seed=65)
    return out + PUNCTUATION_HEAVY + ["a"]


def mve(path: str):
    from sentence_transformers import MultiVectorEncoder

    return MultiVectorEncoder(path, device="cpu")


def st_vectors(st, texts: list[str], route: str | None, **kwargs) -> list[np.ndarray]:
    encode = {"query": st.encode_query, "document": st.encode_document, None: st.encode}[route]
    return [np.asarray(v) for v in encode(texts, convert_to_numpy=True, **kwargs)]


def token_vectors(pipe, texts: list[str], route, **kwargs) -> list[np.ndarray]:
    outs = pipe.encode(texts, task="token_embed", route=route, use_tqdm=False, **kwargs)
    assert [o.index for o in outs] == list(range(len(texts)))
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    return [o.data for o in outs]


def assert_close_each(got: list[np.ndarray], ref: list[np.ndarray], what: str) -> float:
    """Every text: the same count of vectors, each within TOL; returns the worst |diff|."""
    worst = 0.0
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g.shape == r.shape, f"{what}, text {i}: {g.shape[0]} vectors, sentence-transformers gives {r.shape[0]}"
        assert g.dtype == np.float32, f"{what}, text {i}: dtype {g.dtype}"
        diff = float(np.abs(g.astype(np.float64) - r).max()) if g.size else 0.0
        assert diff <= TOL, f"{what}, text {i}: max |diff| {diff:.3g} vs sentence-transformers"
        worst = max(worst, diff)
    return worst


def assert_differs_each(a: list[np.ndarray], b: list[np.ndarray], what: str) -> None:
    """Some text's vectors differ in count or by more than MATTERS."""
    differs = any(x.shape != y.shape or np.abs(x - y).max() > MATTERS for x, y in zip(a, b))
    assert differs, f"{what} does not change the reference"


def assert_scores_close(got: list[float], ref, what: str) -> None:
    ref = np.asarray(ref, dtype=np.float64).reshape(-1)
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, what
    assert np.abs(got - ref).max() <= TOL * max(1.0, np.abs(ref).max()), f"{what}: {got} vs {ref}"


MODELS = {
    "st-bert": lambda t: zoo.build_colbert(t, "bert"),
    "st-modernbert": lambda t: zoo.build_colbert(t, "modernbert"),
    "pylate-bert": lambda t: zoo.build_pylate_colbert(t, "bert"),
    "pylate-modernbert": lambda t: zoo.build_pylate_colbert(t, "modernbert"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MODELS))
def test_token_vectors_and_maxsim_equal_sentence_transformers(kind, tmp_path, queries, documents):
    path = MODELS[kind](tmp_path)
    st = mve(path)
    refs = {"query": st_vectors(st, queries, "query"), "document": st_vectors(st, documents, "document"),
            None: st_vectors(st, documents, None)}
    # The route decides the prompt, the length, the expansion and the skiplist.
    assert_differs_each(st_vectors(st, documents, "query"), refs["document"], "the query route (vs document)")
    assert_differs_each(refs[None], refs["document"], "no route (vs document)")
    assert_differs_each(st_vectors(st, queries, None), refs["query"], "no route (vs query)")
    assert all(len(v) == 16 for v in refs["query"][:6]), "short queries are expanded to 16 vectors"
    pairs = st.similarity(st.encode_query(queries[:4]), st.encode_document(documents[:6]))
    pairwise = st.similarity_pairwise(st.encode_query(queries[:6]), st.encode_document(documents[:6]))
    with Pipeline(model=path, num_render_workers=1) as pipe:
        for route, texts in (("query", queries), ("document", documents), (None, documents)):
            assert_close_each(token_vectors(pipe, texts, route), refs[route], f"{kind}, route {route}")
        # One call, a route per request, interleaved.
        mixed = [t for pair in zip(queries[:6], documents[:6]) for t in pair]
        routes = ["query", "document"] * 6
        mixed_refs = [v for pair in zip(refs["query"][:6], refs["document"][:6]) for v in pair]
        assert_close_each(token_vectors(pipe, mixed, routes), mixed_refs, f"{kind}, routes per request")
        for q in range(4):  # 1:N against the same documents
            got = [s.score for s in pipe.score(queries[q], documents[:6], use_tqdm=False)]
            assert_scores_close(got, pairs[q], f"{kind}: MaxSim of query {q}")
        got = [s.score for s in pipe.score(queries[:6], documents[:6], use_tqdm=False)]
        assert_scores_close(got, pairwise, f"{kind}: MaxSim pairwise")
        with pytest.raises(ValueError, match="routes queries and documents itself"):
            pipe.score(queries[:1], documents[:1], route="query")
        with pytest.raises(ValueError, match="unsupported task 'embed'"):
            pipe.embed(queries[:1])


# Each variant of ST's own layout changes one thing: expansion attended to, the "min" strategy, no
# expansion (query_length cuts), the skiplist on queries too, no MultiVectorMask, no Normalize,
# meanmaxsim scoring.
VARIANTS = {
    "attend": dict(query_expansion={"strategy": "fixed", "attend": True, "length": 16}),
    "min": dict(query_expansion={"strategy": "min", "length": 12}, query_length=24),
    "no-expansion": dict(query_expansion={}, query_length=12),
    "skiplist-queries": dict(skiplist_tasks=["query", "document"], skiplist_words=[".", ",", "?", "'", "the"]),
    "no-mask": dict(mask=False),
    "no-normalize": dict(normalize=False),
    "meanmaxsim": dict(similarity_fn_name="meanmaxsim"),
    # Documents keep only "the", "a" and "." (BERT ids): one without them has no vector (scores -1e9).
    "keep-only": dict(keep_only_token_ids=[1996, 1037, 1012]),
}
BASELINE = {"attend": "query", "min": "query", "no-expansion": "query", "skiplist-queries": "query",
            "no-mask": "document", "no-normalize": "document", "meanmaxsim": None, "keep-only": "document"}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layout_variants_equal_sentence_transformers(variant, tmp_path, queries, documents):
    base = mve(zoo.build_colbert(tmp_path, "bert", name="base"))
    path = zoo.build_colbert(tmp_path, "bert", name=variant, **VARIANTS[variant])
    st = mve(path)
    refs = {"query": st_vectors(st, queries, "query"), "document": st_vectors(st, documents, "document")}
    changed = BASELINE[variant]
    if changed is not None:  # the variant really changes that route's reference
        texts = queries if changed == "query" else documents
        assert_differs_each(refs[changed], st_vectors(base, texts, changed), f"variant {variant}")
    scored = documents[:5] + PUNCTUATION_HEAVY[2:]
    pairs = st.similarity(st.encode_query(queries[:3]), st.encode_document(scored))
    if variant == "meanmaxsim":
        assert_differs_each([pairs.numpy()], [base.similarity(base.encode_query(queries[:3]),
                                                              base.encode_document(scored)).numpy()], variant)
    if variant == "keep-only":
        assert len(refs["document"][-4]) == 0 and float(pairs[0, -1]) == -1e9, "a document without vectors"
    with Pipeline(model=path, num_render_workers=1) as pipe:
        for route, texts in (("query", queries), ("document", documents)):
            assert_close_each(token_vectors(pipe, texts, route), refs[route], f"{variant}, route {route}")
        for q in range(3):
            got = [s.score for s in pipe.score(queries[q], scored, use_tqdm=False)]
            assert_scores_close(got, pairs[q], f"{variant}: MaxSim of query {q}")


@pytest.mark.slow
def test_prompts_a_call_names_replace_the_routes(tmp_path, queries, documents):
    """ST's encode_query(prompt=...) / (prompt_name=...): a named prompt replaces the route's own
    ("" means none); the route still decides the length, the expansion and the skiplist."""
    path = zoo.build_colbert(tmp_path, "bert", prompts={"query": "[Q] ", "document": "[D] ", "other": "note: "})
    st = mve(path)
    calls = [("query", {"prompt": ""}), ("query", {"prompt_name": "other"}), ("document", {"prompt": "[Q] "})]
    with Pipeline(model=path, num_render_workers=1) as pipe:
        for route, kwargs in calls:
            texts = queries if route == "query" else documents
            ref = st_vectors(st, texts, route, **kwargs)
            assert_differs_each(ref, st_vectors(st, texts, route), f"{kwargs} on route {route}")
            assert_close_each(token_vectors(pipe, texts, route, **kwargs), ref, f"{kwargs} on route {route}")


# ---- what is refused at load, naming the module or key ---------------------------------------------


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


def test_what_is_not_supported_is_refused_at_load(tmp_path):
    native = Path(zoo.build_colbert(tmp_path, "bert", name="native"))
    spec = load_model_spec(native)
    assert spec.tasks == ["token_embed", "score"] and spec.routes == ["query", "document"] and spec.normalize

    modules = json.loads((native / "modules.json").read_text())
    pooled = modules[:2] + [{"idx": 2, "name": "p", "path": "p", "type": "sentence_transformers.models.Pooling"}]
    (native / "modules.json").write_text(json.dumps(pooled))
    with pytest.raises(ValueError, match="Pooling.* in a multi-vector model is not supported"):
        load_model_spec(native)
    token_pooling = "sentence_transformers.multi_vector_encoder.modules.token_pooling.HierarchicalTokenPooling"
    pooling = modules[:2] + [{"idx": 2, "name": "t", "path": "t", "type": token_pooling}]
    (native / "modules.json").write_text(json.dumps(pooling))
    with pytest.raises(ValueError, match="HierarchicalTokenPooling.* in a multi-vector model is not supported"):
        load_model_spec(native)
    (native / "modules.json").write_text(json.dumps(modules))

    _edit_json(native / "sentence_bert_config.json", query_length=8)
    with pytest.raises(ValueError, match="query_length=8 is smaller than query_expansion length 16"):
        load_model_spec(native)
    _edit_json(native / "sentence_bert_config.json", query_length=None, document_length=4096)
    with pytest.raises(ValueError, match="document_length=4096 is more than the model's 512 positions"):
        load_model_spec(native)
    _edit_json(native / "sentence_bert_config.json", document_length=48, query_expansion={"strategy": "all", "length": 4})
    with pytest.raises(ValueError, match="query_expansion .* is not valid"):
        load_model_spec(native)

    pylate = Path(zoo.build_pylate_colbert(tmp_path, "bert", name="pylate"))
    _edit_json(pylate / "config.json", architectures=["HF_ColBERT"])
    with pytest.raises(ValueError, match="Stanford-NLP ColBERT"):
        load_model_spec(pylate)
    _edit_json(pylate / "config.json", architectures=["BertModel"])
    _edit_json(pylate / "1_Dense" / "config.json", module_input_name="sentence_embedding")
    with pytest.raises(ValueError, match="a Dense module on 'sentence_embedding' in a multi-vector model"):
        load_model_spec(pylate)
