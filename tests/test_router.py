"""ST's Router (issue 24): asymmetric models whose queries and documents take different routes.

Each test builds a tiny Router model with ST 6's own classes (`model_zoo.build_inference_free_splade`,
`build_router_dense`), saved with ST's save, and compares the pipeline with ST's `encode_query` /
`encode_document` / `encode(task=...)` on real texts of mixed lengths: within 1e-5 (sparse: the same
active dimensions, weights within 1e-5 relative). Every reference is first checked to depend on the
route, so a pipeline that ignores the route cannot pass. Batches mixing routes (a per-request route
list) give each request its own route's result. Layouts the pipeline cannot honour are refused at
load, naming the module.
"""

from __future__ import annotations

import json
from pathlib import Path

import corpus
import model_zoo as zoo
import numpy as np
import pytest
from test_fidelity import assert_close, assert_differs, assert_varies

from pooling_pipeline import Pipeline, SentenceEncoder
from pooling_pipeline.core.shared.model_folder.load import load_model_spec

TOL = 1e-5


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Sentences, docstrings, two documents far beyond 128 tokens, the empty string (no token at
    all on a route without special tokens), repeated words, non-ASCII text."""
    out = corpus.sentences(10, seed=51) + corpus.medium_texts(3, seed=52) + corpus.long_documents(2, 3_000, 8_000, seed=53)
    out += ["", "a", "the the the word word", "Émile's café: naïve façade — 東京 🙂", "ΟΔΟΣ ΣΑΣ in İstanbul"]
    order = np.random.default_rng(54).permutation(len(out))
    return [out[i] for i in order]


def _mixed_routes(n: int) -> list[str]:
    return ["query" if i % 3 else "document" for i in range(n)]


# ---- sparse: inference-free SPLADE ------------------------------------------------------------------

def _dense_sparse(outs, vocab: int) -> np.ndarray:
    return np.stack([o.to_dense(vocab) for o in outs])


def assert_sparse_close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    """The same active dimensions, each weight within 1e-5 of ST's (relative to the weight)."""
    assert got.shape == ref.shape, f"{what}: shape {got.shape} vs {ref.shape}"
    active, ref_active = got != 0, ref != 0
    assert (active == ref_active).all(), (f"{what}: active dims differ in {int((active != ref_active).sum())} places "
                                          "from sentence-transformers")
    rel = np.abs(got.astype(np.float64) - ref) / np.maximum(np.abs(ref.astype(np.float64)), 1.0)
    assert rel.max() <= TOL, f"{what}: max relative diff {rel.max():.3g} vs sentence-transformers"


@pytest.mark.slow
@pytest.mark.parametrize("max_active_dims", [None, 6])
def test_inference_free_splade_takes_each_route(tmp_path, texts, max_active_dims):
    """Query route SparseStaticEmbedding (its own tokenizer folder, no special tokens, a weight
    per token present), document route MLMTransformer + SpladePooling; no route = the default
    ("document"); a per-request route list mixes both in one batch; max_active_dims applies to
    both routes (SparseEncoder's)."""
    from sentence_transformers import SparseEncoder

    path = zoo.build_inference_free_splade(tmp_path, max_active_dims=max_active_dims)
    se = SparseEncoder(path, device="cpu")
    query_ref = se.encode_query(texts, convert_to_tensor=True).to_dense().numpy()
    document_ref = se.encode_document(texts, convert_to_tensor=True).to_dense().numpy()
    default_ref = se.encode(texts, convert_to_tensor=True).to_dense().numpy()
    vocab = query_ref.shape[1]
    assert_varies(query_ref)
    assert_varies(document_ref)
    assert_differs(query_ref, document_ref, "the route (query vs document)")
    tokenizer = se[0].sub_modules["query"][0].tokenizer  # ST's query route tokenizes without special tokens
    query_tokens = [len(tokenizer(t, add_special_tokens=False, truncation=True)["input_ids"]) for t in texts]
    mixed = _mixed_routes(len(texts))
    mixed_ref = np.stack([query_ref[i] if r == "query" else document_ref[i] for i, r in enumerate(mixed)])
    with Pipeline(model=path, num_render_workers=1) as pipe:
        query_outs = pipe.encode(texts, task="sparse_embed", route="query", use_tqdm=False)
        assert_sparse_close(_dense_sparse(query_outs, vocab), query_ref, "query route")
        # (an empty text travels as one placeholder token that counts for nothing: it reports 1)
        assert [o.num_prompt_tokens for o in query_outs] == [max(n, 1) for n in query_tokens]
        assert max(query_tokens) == zoo.MAX_LEN and 0 in query_tokens
        assert_sparse_close(_dense_sparse(pipe.encode(texts, task="sparse_embed", route="document", use_tqdm=False),
                                          vocab), document_ref, "document route")
        assert_sparse_close(_dense_sparse(pipe.encode(texts, task="sparse_embed", use_tqdm=False), vocab),
                            default_ref, "no route (the default)")
        assert_sparse_close(_dense_sparse(pipe.encode(texts, task="sparse_embed", route=mixed, use_tqdm=False),
                                          vocab), mixed_ref, "query and document routes in one batch")


# ---- dense: routes with their own Dense, or their own transformer ---------------------------------

@pytest.mark.slow
def test_dense_router_shared_transformer(tmp_path, texts):
    """One BERT + Pooling shared by both routes (saved once by ST), a Dense of each route's own,
    Normalize after the Router: encode_query / encode_document / encode, a mixed batch, score()
    (queries by the query route, documents by the document route) and SentenceEncoder."""
    from sentence_transformers import SentenceTransformer

    path = zoo.build_router_dense(tmp_path)
    st = SentenceTransformer(path, device="cpu")
    query_ref, document_ref = st.encode_query(texts), st.encode_document(texts)
    assert_varies(query_ref)
    assert_differs(query_ref, document_ref, "the route (query vs document)")
    mixed = _mixed_routes(len(texts))
    mixed_ref = np.stack([query_ref[i] if r == "query" else document_ref[i] for i, r in enumerate(mixed)])
    score_ref = st.similarity(st.encode_query(texts[:1]), st.encode_document(texts[1:8])).numpy()[0]
    assert_differs(score_ref, st.similarity(st.encode_document(texts[:1]), st.encode_document(texts[1:8])).numpy()[0],
                   "the query route in score")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        def embed(**kwargs):
            return np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False, **kwargs)])

        assert_close(embed(route="query"), query_ref, "query route")
        assert_close(embed(route="document"), document_ref, "document route")
        assert_close(embed(), st.encode(texts), "no route (the default)")
        assert_close(embed(route=mixed), mixed_ref, "query and document routes in one batch")
        scores = np.asarray([o.score for o in pipe.score(texts[0], texts[1:8], use_tqdm=False)], np.float32)
        assert_close(scores, score_ref, "score: query route vs document route")
        model = SentenceEncoder(pipeline=pipe)
        assert_close(model.encode_query(texts), query_ref, "SentenceEncoder.encode_query")
        assert_close(model.encode_document(texts), document_ref, "SentenceEncoder.encode_document")
        assert_close(model.encode(texts, task="query"), query_ref, "SentenceEncoder.encode(task='query')")


@pytest.mark.slow
def test_dense_router_two_transformers(tmp_path, texts):
    """Routes with transformers of their own (other weights, one tokenizer): both are loaded."""
    from sentence_transformers import SentenceTransformer

    path = zoo.build_router_dense(tmp_path, two_transformers=True)
    spec = load_model_spec(path)
    assert len({route.path for route in spec.route_specs}) == 2
    st = SentenceTransformer(path, device="cpu")
    query_ref, document_ref = st.encode_query(texts), st.encode_document(texts)
    assert_differs(query_ref, document_ref, "the route (query vs document)")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        outs = pipe.embed(texts, route=_mixed_routes(len(texts)), use_tqdm=False)
    for i, (out, route) in enumerate(zip(outs, _mixed_routes(len(texts)))):
        assert_close(out.embedding, (query_ref if route == "query" else document_ref)[i], f"request {i} ({route})")


# ---- ST's route resolution -------------------------------------------------------------------------

@pytest.mark.slow
def test_route_mappings_and_no_default_route(tmp_path, texts):
    """Routes named "q" / "d" reached through route_mappings (("query", None), ("document", "text")),
    or by their own names; without a default route (allow_empty_key=False) a text that names no
    route is refused in the caller, as ST refuses it, naming the routes; a bad entry of a per-request
    list names its request."""
    from sentence_transformers import SentenceTransformer

    path = zoo.build_router_dense(tmp_path, sub_modules_names=("q", "d"), default_route=None, allow_empty_key=False,
                                  route_mappings={("query", None): "q", ("document", "text"): "d"})
    st = SentenceTransformer(path, device="cpu")
    query_ref, document_ref = st.encode_query(texts), st.encode_document(texts)
    assert_differs(query_ref, document_ref, "the route (query vs document)")
    assert_close(st.encode(texts, task="q"), query_ref, "ST itself: task 'q' is the query route")
    with pytest.raises(ValueError, match="Could not determine route"):
        st.encode(texts)
    with Pipeline(model=path, num_render_workers=1) as pipe:
        def embed(route):
            return np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False, route=route)])

        assert_close(embed("query"), query_ref, "task 'query' mapped to route 'q'")
        assert_close(embed("d"), document_ref, "route 'd' by its name")
        with pytest.raises(ValueError, match=r"route=None: no route was named .* no default route; name one of 'q', 'd'"):
            pipe.embed(texts, use_tqdm=False)
        with pytest.raises(ValueError, match=r"request 1: route\[1\]='nope': no route for task 'nope'"):
            pipe.embed(texts[:3], route=["query", "nope", "document"], use_tqdm=False)
        assert_close(embed(["document"] * len(texts)), document_ref, "still usable after a refused call")


def test_allow_empty_key_makes_the_first_route_the_default(tmp_path):
    """Router(default_route=None, allow_empty_key=True): ST's default is the first route."""
    path = zoo.build_router_dense(tmp_path, default_route=None)
    spec = load_model_spec(path)
    assert spec.routes == ["query", "document"] and spec.default_route == "query"


# ---- refused at load, naming the module ------------------------------------------------------------

def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def test_router_layouts_the_pipeline_cannot_honour_are_refused(tmp_path):
    sparse = Path(zoo.build_inference_free_splade(tmp_path))
    dense = Path(zoo.build_router_dense(tmp_path))

    # An unknown module in a route.
    _edit_json(dense / "router_config.json",
               lambda c: c["types"].update({"document_2_Dense": "my_pkg.WeirdModule"}))
    with pytest.raises(ValueError, match=r"route 'document': .*'my_pkg.WeirdModule' is not supported"):
        load_model_spec(dense)
    _edit_json(dense / "router_config.json",
               lambda c: c["types"].update({"document_2_Dense": "sentence_transformers.base.modules.dense.Dense"}))
    load_model_spec(dense)  # (the edit is what was refused)

    # The Router must be the first module (ST's input module).
    _edit_json(dense / "modules.json", lambda modules: [m.update(idx=1 - m["idx"]) for m in modules])
    with pytest.raises(ValueError, match="a Router module must come first"):
        load_model_spec(dense)

    # Modules after a SparseStaticEmbedding; an idf.json path instead of saved weights.
    config = sparse / "router_config.json"
    _edit_json(config, lambda c: c["structure"]["query"].append("document_1_SpladePooling"))
    with pytest.raises(ValueError, match=r"route 'query': modules after SparseStaticEmbedding"):
        load_model_spec(sparse)
    _edit_json(config, lambda c: c["structure"]["query"].pop())
    _edit_json(sparse / "query_0_SparseStaticEmbedding" / "config.json", lambda c: c.update(path="idf.json"))
    with pytest.raises(ValueError, match=r"SparseStaticEmbedding keys \['path'\] are not supported"):
        load_model_spec(sparse)
    _edit_json(sparse / "query_0_SparseStaticEmbedding" / "config.json", lambda c: c.pop("path"))

    # An MLM route without its SpladePooling.
    _edit_json(config, lambda c: c["structure"].update(document=["document_0_MLMTransformer"]))
    with pytest.raises(ValueError, match="route 'document': .*a masked-LM transformer without SpladePooling"):
        load_model_spec(sparse)
