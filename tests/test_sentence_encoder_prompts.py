"""SentenceEncoder resolves prompts exactly as sentence-transformers 6.2 does (issue 24).

ST's SentenceTransformer starts every model from the empty placeholder prompts {"query": "",
"document": ""} and fills them from config_sentence_transformers.json, so `encode_query` always finds
"query" and `encode_document` always finds "document" before "passage" / "corpus": on an e5 model
(prompts "query: " / "passage: ") encode_document embeds the text with no prompt, and
prompt_name="document" is valid on any model. (ST 6 saves the placeholders with a model's prompts;
models saved by ST 5 and before, the published e5 ones among them, carry only their own.) MTEB's
`prompt_type` selects what encode_query / encode_document would. Each case is compared with ST on the
same texts within 1e-5.
"""

from __future__ import annotations

import enum

import corpus
import model_zoo as zoo
import numpy as np
import pytest
from test_fidelity import assert_close, assert_differs

from pooling_pipeline import SentenceEncoder

# name: (prompts, default_prompt_name, saved as ST 5 saved them: without ST 6's placeholders)
MODELS = {
    "e5": (dict(zoo.E5_PROMPTS), "query", True),
    "query-document": ({"query": "Q: ", "document": "D: "}, None, False),
    "query-default": ({"query": "query: "}, "query", True),
    "none": (None, None, True),
}


class PromptType(str, enum.Enum):
    """MTEB's prompt types (mteb.types.PromptType), as MTEB passes them to a model's encode."""

    query = "query"
    document = "document"


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return corpus.sentences(10, seed=24) + ["", "a short one"]


@pytest.fixture(scope="module", params=sorted(MODELS))
def models(request, tmp_path_factory):
    """(name, ST's model, a SentenceEncoder over the same directory)."""
    from sentence_transformers import SentenceTransformer

    prompts, default, as_st5 = MODELS[request.param]
    path = zoo.build_st(tmp_path_factory.mktemp(request.param), "bert", name=f"st-prompts-{request.param}",
                        normalize=True, prompts=prompts, default_prompt_name=default)
    if as_st5:
        zoo.save_prompts_as_st5(path, prompts)
    st = SentenceTransformer(path, device="cpu")
    with SentenceEncoder(path, num_render_workers=1) as encoder:
        yield request.param, st, encoder


@pytest.mark.slow
def test_prompts_are_sentence_transformers_prompts(models):
    _, st, encoder = models
    assert encoder.prompts == st.prompts
    assert encoder.default_prompt_name == st.default_prompt_name


def test_encode_query_and_encode_document(models, texts):
    name, st, encoder = models
    assert_close(encoder.encode_query(texts), st.encode_query(texts), f"{name} encode_query")
    assert_close(encoder.encode_document(texts), st.encode_document(texts), f"{name} encode_document")
    assert_close(encoder.encode_query(texts[0]), st.encode_query(texts[0]), f"{name} encode_query one text")
    if name == "e5":  # ST takes the empty "document" placeholder, not "passage: "
        assert_differs(st.encode_document(texts), st.encode(texts, prompt_name="passage"), "the document placeholder")
    if name == "query-default":  # the placeholder, not the default prompt
        assert_differs(st.encode_document(texts), st.encode(texts), "encode_document's empty prompt")


def test_encode_with_the_default_prompt_name_and_named_prompts(models, texts):
    name, st, encoder = models
    assert_close(encoder.encode(texts), st.encode(texts), f"{name} encode (default prompt)")
    for prompt_name in st.prompts:
        assert_close(encoder.encode(texts, prompt_name=prompt_name), st.encode(texts, prompt_name=prompt_name),
                     f"{name} prompt_name={prompt_name!r}")
    assert_close(encoder.encode_document(texts, prompt="custom: "), st.encode_document(texts, prompt="custom: "),
                 f"{name} encode_document(prompt=...)")
    with pytest.raises(ValueError, match="no_such_prompt"):
        encoder.encode(texts, prompt_name="no_such_prompt")


@pytest.mark.parametrize("as_enum", [True, False], ids=["enum", "str"])
def test_mteb_prompt_type_selects_what_encode_query_and_encode_document_would(models, texts, as_enum):
    name, st, encoder = models
    query, document = (PromptType.query, PromptType.document) if as_enum else ("query", "document")
    assert_close(encoder.encode(texts, task_name="STSBenchmark", prompt_type=query), st.encode_query(texts),
                 f"{name} prompt_type=query")
    assert_close(encoder.encode(texts, task_name="STSBenchmark", prompt_type=document), st.encode_document(texts),
                 f"{name} prompt_type=document")
    assert_close(encoder.encode(texts, task_name="STSBenchmark", prompt_type=None), st.encode(texts),
                 f"{name} prompt_type=None")


def test_similarity_of_queries_and_documents(models, texts):
    name, st, encoder = models
    got = encoder.similarity(encoder.encode_query(texts[:4]), encoder.encode_document(texts))
    want = st.similarity(st.encode_query(texts[:4]), st.encode_document(texts))
    assert_close(got.numpy(), want.numpy(), f"{name} similarity")


def test_pipeline_embed_takes_the_placeholder_prompt_names(models, texts):
    """Pipeline.embed(prompt_name="query" / "document") on a model that declares neither: ST's empty
    placeholders, as ST's encode(prompt_name=...) takes them."""
    name, st, encoder = models
    for prompt_name in ("query", "document"):
        outs = encoder.pipeline.embed(texts, prompt_name=prompt_name, use_tqdm=False)
        assert_close(np.stack([o.embedding for o in outs]), st.encode(texts, prompt_name=prompt_name),
                     f"{name} Pipeline.embed(prompt_name={prompt_name!r})")
