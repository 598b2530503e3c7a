"""Results equal sentence-transformers' own (issue 13): every module and pooling mode in both config
generations, prompts, encoder and decoder families, rerankers, SPLADE, hub ids.

Each test builds a tiny model of one family with `model_zoo` (saved by ST's own classes), runs the
pipeline on real texts of mixed lengths (some far beyond the model's 128 tokens) and compares with ST
on the same texts: max |diff| <= 1e-5 in float32 on the CPU. Every reference is first checked to
depend on what the test is about (distinct texts give distinct vectors, a prompt or the max length
changes the result), so a pipeline that ignores it cannot pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import corpus
import model_zoo as zoo
import numpy as np
import pytest

from pooling_pipeline import Pipeline

TOL = 1e-5
# A difference this large means the test's subject really changes the output (see the module doc).
MATTERS = 1e-3


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Real text of mixed lengths: sentences, whole docstrings, a few documents of thousands of
    tokens (truncated at 128), the empty string, non-ASCII text (final sigma, dotted I, CJK, emoji)."""
    out = corpus.sentences(22, seed=41) + corpus.medium_texts(6, seed=42) + corpus.long_documents(2, 5_000, 20_000, seed=43)
    out += ["", "a", "Émile's café: naïve façade — 東京 and emoji 🙂🚀", "ΟΔΟΣ ΣΑΣ in İstanbul, UPPER Case", "word " * 300]
    order = np.random.default_rng(44).permutation(len(out))
    return [out[i] for i in order]


def st_model(path: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu")


def embed(pipe, texts: list[str], **kwargs) -> np.ndarray:
    outs = pipe.embed(texts, use_tqdm=False, **kwargs)
    assert [o.index for o in outs] == list(range(len(texts)))
    return np.stack([o.embedding for o in outs])


def assert_close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, sentence-transformers gives {ref.shape}"
    assert got.dtype == np.float32, f"{what}: dtype {got.dtype}"
    # TOL absolute, or relative to a row's largest value where that exceeds 1 (SPLADE's sum pooling
    # adds up a hundred weights: float32 rounding alone is a few 1e-6 there).
    scale = np.maximum(1.0, np.abs(ref.astype(np.float64)).max(axis=-1, keepdims=True)) if ref.ndim else 1.0
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64)) / scale
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
    assert diff.max() <= TOL, (f"{what}: max |diff| {diff.max():.3g} (relative to the row's largest value where "
                               f"above 1) at {worst} vs sentence-transformers")


def assert_varies(ref: np.ndarray) -> None:
    """The reference vectors of distinct texts differ: a constant output cannot pass."""
    assert np.abs(ref - ref.mean(axis=0)).max() > MATTERS


def assert_differs(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > MATTERS, f"{what} does not change the reference"


def token_counts(st, texts: list[str], prompt: str = "") -> list[int]:
    """What ST feeds the model per text: prompt + text, special tokens, truncated at its max length."""
    return [len(st.tokenizer(prompt + t, truncation=True, max_length=st.max_seq_length)["input_ids"]) for t in texts]


def compare_embed(path: str, texts: list[str], what: str, calls: list[dict] | None = None) -> list[np.ndarray]:
    """One Pipeline start, one ST model: each call's kwargs (prompt_name / prompt) on both sides."""
    st = st_model(path)
    refs = []
    with Pipeline(model=path, num_render_workers=1) as pipe:
        for kwargs in calls or [{}]:
            ref = st.encode(texts, batch_size=16, **kwargs)
            assert_varies(ref)
            assert_close(embed(pipe, texts, **kwargs), ref, f"{what} {kwargs or ''}")
            refs.append(ref)
    return refs


# ---- Pooling: every mode, new layout ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", ("max", "cls")],
                         ids=lambda m: m if isinstance(m, str) else "+".join(m))
def test_pooling_mode_new_layout(tmp_path, texts, mode):
    """ST 6 writes `{"embedding_dimension", "pooling_mode", "include_prompt"}`; a tuple of modes is
    concatenated in the order given (max then cls here: not the old flags' fixed order). Mean is
    tested by test_max_length_from_tokenizer_config and most families."""
    path = zoo.build_bert_pooling(tmp_path, mode)
    cfg = json.loads((tmp_path / os.path.basename(path) / "1_Pooling" / "config.json").read_text())
    assert "pooling_mode" in cfg and not any(k.startswith("pooling_mode_") for k in cfg)
    compare_embed(path, texts, f"pooling {mode}")


@pytest.mark.slow
def test_max_length_from_tokenizer_config(tmp_path, texts):
    """ST 6 keeps the max length as model_max_length in tokenizer_config.json (128 here, the model
    could take 512): the long texts are cut at 128 tokens, counted with the special tokens."""
    path = zoo.build_bert_pooling(tmp_path, "mean")
    st = st_model(path)
    assert st.max_seq_length == zoo.MAX_LEN
    ref = st.encode(texts, batch_size=16)
    st.max_seq_length = 512
    assert_differs(ref, st.encode(texts, batch_size=16), "max length 128 vs 512")
    st.max_seq_length = zoo.MAX_LEN
    with Pipeline(model=path, num_render_workers=1) as pipe:
        outs = pipe.embed(texts, use_tqdm=False)
    assert_close(np.stack([o.embedding for o in outs]), ref, "new layout max length")
    assert [o.num_prompt_tokens for o in outs] == token_counts(st, texts)
    assert max(o.num_prompt_tokens for o in outs) == zoo.MAX_LEN


# ---- The older layout ------------------------------------------------------------------------------

@pytest.mark.slow
def test_old_layout_flags_and_max_seq_length(tmp_path, texts):
    """ST 2.x layout: `sentence_transformers.models.*` types, `pooling_mode_mean_tokens` +
    `pooling_mode_max_tokens` (ST concatenates max before mean, whatever the key order),
    max_seq_length 128 in sentence_bert_config.json while tokenizer_config.json says 512."""
    path = zoo.build_bert_old_layout(tmp_path, ("mean", "max"))
    st = st_model(path)
    assert st.max_seq_length == 128
    ref = st.encode(texts, batch_size=16)
    st.max_seq_length = 512
    assert_differs(ref, st.encode(texts, batch_size=16), "max_seq_length 128 vs 512")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        outs = pipe.embed(texts, use_tqdm=False)
    assert_close(np.stack([o.embedding for o in outs]), ref, "old layout mean+max")
    assert max(o.num_prompt_tokens for o in outs) == 128


@pytest.mark.slow
def test_old_layout_labse_style_dense(tmp_path, texts):
    """LaBSE's shape in the old layout: CLS pooling, Dense with Tanh (weights in pytorch_model.bin),
    an empty Normalize folder."""
    path = zoo.build_bert_old_layout(tmp_path, ("cls",), dense=True, name="st-old-labse")
    compare_embed(path, texts, "old layout cls + Dense(Tanh) + Normalize")


@pytest.mark.slow
def test_old_layout_do_lower_case_cased_tokenizer(tmp_path, texts):
    """An old-layout XLM-R (paraphrase-multilingual's shape) with `do_lower_case: true`: ST puts a
    Lowercase normalizer in front of the cased Unigram tokenizer (char by char: 'ΣΑΣ' -> 'σασ')."""
    upper = [t.upper() for t in texts]
    cased = zoo.to_old_layout(zoo.build_encoder(tmp_path, "xlmr", name="st-old-xlmr-cased"))
    path = zoo.to_old_layout(zoo.build_encoder(tmp_path, "xlmr", name="st-old-xlmr-lower"), do_lower_case=True)
    st = st_model(path)
    assert_differs(st.encode(upper, batch_size=16), st_model(cased).encode(upper, batch_size=16), "do_lower_case")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        assert_close(embed(pipe, upper), st.encode(upper, batch_size=16), "do_lower_case on upper-cased texts")
        assert_close(embed(pipe, texts), st.encode(texts, batch_size=16), "do_lower_case")


# ---- Dense, LayerNorm, Normalize -----------------------------------------------------------------

@pytest.mark.slow
def test_dense_changes_dimension(tmp_path, texts):
    """Dense 32 -> 16 with bias and Tanh: 16-wide vectors, as ST gives."""
    path = zoo.build_bert_dense(tmp_path)
    (ref,) = compare_embed(path, texts, "Dense(32->16, bias, Tanh)")
    assert ref.shape[1] == 16


@pytest.mark.slow
def test_layer_norm_module(tmp_path, texts):
    compare_embed(zoo.build_bert_layer_norm(tmp_path), texts, "LayerNorm + Normalize")


@pytest.mark.slow
def test_dense_residual_is_honoured_or_refused(tmp_path, texts):
    """A Dense with `use_residual` (ST 5.x+) changes the output: equal to ST, or a ValueError at
    start that names the key. Never silently different."""
    path = zoo.build_st(tmp_path, "bert", name="st-bert-dense-residual",
                        dense={"out_features": 16, "bias": True, "activation": "tanh", "use_residual": True})
    assert json.loads((tmp_path / "st-bert-dense-residual" / "2_Dense" / "config.json").read_text())["use_residual"]
    try:
        compare_embed(path, texts, "Dense use_residual")
    except ValueError as e:
        assert "use_residual" in str(e)


@pytest.mark.slow
def test_truncate_dim_is_honoured_or_refused(tmp_path, texts):
    """`truncate_dim` in config_sentence_transformers.json makes ST keep the first k values (after
    Normalize: no renormalisation). Equal to ST, or a ValueError at start that names the key."""
    path = zoo.build_st(tmp_path, "bert", name="st-bert-truncate-dim", normalize=True, truncate_dim=8)
    assert st_model(path).encode(["x"]).shape == (1, 8)
    try:
        compare_embed(path, texts, "truncate_dim 8")
    except ValueError as e:
        assert "truncate_dim" in str(e)


# ---- Prompts ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_prompts_and_default_prompt_name(tmp_path, texts):
    """`prompts` + `default_prompt_name` from config_sentence_transformers.json, applied as ST's
    encode does: the default without arguments, prompt_name, prompt (which wins over prompt_name),
    prompt="" (no prompt at all, not even the default). The prompt's tokens are counted."""
    path = zoo.build_bert_prompts(tmp_path)
    st = st_model(path)
    assert st.default_prompt_name == "query"
    calls = [{}, {"prompt_name": "passage"}, {"prompt": "Represent this sentence: "},
             {"prompt": "custom: ", "prompt_name": "passage"}, {"prompt": ""}]
    refs = {json.dumps(c): st.encode(texts, batch_size=16, **c) for c in calls}
    assert_differs(refs["{}"], refs[json.dumps({"prompt": ""})], "the default prompt")
    assert_differs(refs["{}"], refs[json.dumps({"prompt_name": "passage"})], "prompt_name")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        for c in calls:
            assert_close(embed(pipe, texts, **c), refs[json.dumps(c)], f"prompts {c}")
        outs = pipe.embed(texts, use_tqdm=False)
        assert [o.num_prompt_tokens for o in outs] == token_counts(st, texts, "query: ")
        with pytest.raises(ValueError, match="no_such_prompt"):
            pipe.embed(texts[:2], prompt_name="no_such_prompt", use_tqdm=False)
        # still usable after the refusal
        assert_close(embed(pipe, texts[:4], prompt_name="passage"), refs[json.dumps({"prompt_name": "passage"})][:4],
                     "after a refused prompt_name")


@pytest.mark.slow
def test_include_prompt_false(tmp_path, texts):
    """Pooling `include_prompt: false` (INSTRUCTOR style): ST drops the prompt's tokens ([CLS]
    included) from pooling: cls then takes the first token after the prompt, mean averages the rest,
    weightedmean keeps the original position weights (the three concatenated, one start)."""
    mode = ("cls", "mean", "weightedmean")
    path = zoo.build_bert_prompts(tmp_path, include_prompt=False, pooling_mode=mode)
    st = st_model(path)
    excluded = st.encode(texts, batch_size=16)
    st.set_pooling_include_prompt(True)
    assert_differs(excluded, st.encode(texts, batch_size=16), "include_prompt")
    compare_embed(path, texts, f"include_prompt=False {mode}", calls=[{}, {"prompt_name": "passage"}, {"prompt": "Q: "}])


@pytest.mark.slow
def test_include_prompt_false_unigram_prompt_length(tmp_path, texts):
    """XLM-R (Metaspace Unigram) with include_prompt=False and "query: ": ST counts the prompt's tokens
    on the prompt ALONE ("▁query", ":", "▁"), which is not how the prompt splits inside
    "query: text". The pipeline must exclude the same number of tokens ST does."""
    path = zoo.build_st(tmp_path, "xlmr", name="st-xlmr-excl", include_prompt=False, normalize=True,
                        prompts=dict(zoo.E5_PROMPTS), default_prompt_name="query")
    compare_embed(path, texts, "xlmr include_prompt=False", calls=[{}, {"prompt_name": "passage"}])


@pytest.mark.slow
def test_include_prompt_false_with_a_prompt_longer_than_kept(tmp_path, texts):
    """An old layout (CLS + mean, max_seq_length 16) whose prompt alone is longer than what is kept:
    ST measures the prompt truncated at the kept length (less its trailing [SEP]), so the last kept
    token is still pooled (not a zero vector); the pipeline must measure it the same way (issue 34,
    item 3). A prompt that fits is checked in the same start."""
    long_prompt = ("Represent this long and winding instruction sentence for retrieving the supporting documents "
                   "of a question about the history of science: ")
    path = zoo.build_bert_old_layout(tmp_path, ("cls", "mean"), name="st-old-long-prompt", max_seq_length=16,
                                     normalize=False, include_prompt=False,
                                     prompts={"long": long_prompt, "short": "q: "})
    st = st_model(path)
    assert len(st.tokenizer(long_prompt)["input_ids"]) > 16  # the prompt alone is longer than what is kept
    ref = st.encode(texts, batch_size=16, prompt_name="long")
    assert np.linalg.norm(ref, axis=1).min() > 0.1  # ST pools the last kept token: not a zero vector
    with Pipeline(model=path, num_render_workers=1) as pipe:
        assert_close(embed(pipe, texts, prompt_name="long"), ref, "include_prompt=False, prompt longer than kept")
        assert_close(embed(pipe, texts, prompt_name="short"), st.encode(texts, batch_size=16, prompt_name="short"),
                     "include_prompt=False, short prompt")
        # truncate_prompt_tokens moves the kept length; ST measures the prompt at its own max_seq_length
        # (a fresh model: ST caches a prompt's length without its max_seq_length)
        st12 = st_model(path)
        st12.max_seq_length = 12
        assert_close(embed(pipe, texts, prompt_name="long", truncate_prompt_tokens=12),
                     st12.encode(texts, batch_size=16, prompt_name="long"), "kept 12")


# ---- Encoder families --------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", ["distilbert", "mpnet", "xlmr", "roberta", "deberta-v2", "modernbert"])
def test_encoder_family(tmp_path, texts, family):
    """Each family's own tokenizer shape and position scheme (offset positions for RoBERTa / XLM-R /
    MPNet, relative attention for DeBERTa-v2, local attention for ModernBERT, no token types for
    DistilBERT); MPNet has no SDPA attention."""
    path = zoo.build_encoder(tmp_path, family)
    compare_embed(path, texts, family, calls=[{}, {"prompt": "query: "}])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["t5", "mt5", "umt5"])
def test_sentence_t5(tmp_path, texts, family):
    """sentence-t5 / GTR (and mT5 / UMT5 encoders): ST loads the encoder alone (not the
    encoder-decoder), mean pooling, Dense without bias and Identity activation, Normalize; `</s>`
    appended by the tokenizer."""
    path = zoo.build_sentence_t5(tmp_path, family)
    st = st_model(path)
    assert type(st[0].auto_model).__name__ == {"t5": "T5", "mt5": "MT5", "umt5": "UMT5"}[family] + "EncoderModel"
    (ref,) = compare_embed(path, texts, "sentence-t5")
    assert ref.shape[1] == 16


@pytest.mark.slow
def test_gpt2_left_padding_gives_the_one_text_result(tmp_path, texts):
    """GPT-2 (absolute positions) with a tokenizer that pads on the left: ST passes no position ids,
    so a left-padded row's positions shift with its padding and ST's vector depends on the batch.
    The pipeline gives each text its positions alone: ST's one-text-at-a-time result (issue 34,
    item 6; the README's fidelity section says why)."""
    texts = [t for t in texts if t][:16]
    path = zoo.build_st(tmp_path, "gpt2", name="st-gpt2-left", pooling_mode="mean")
    zoo.set_tokenizer_config(path, padding_side="left")
    st = st_model(path)
    assert st.tokenizer.padding_side == "left"
    batched = st.encode(texts, batch_size=16)
    single = np.stack([st.encode([t])[0] for t in texts])
    assert_differs(batched, single, "ST's batch (left padding shifts absolute positions)")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        assert_close(embed(pipe, texts), single, "gpt2 left padding, ST one text at a time")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "gpt_neo", "gptj"])
def test_gpt_family_embedder(tmp_path, texts, family):
    """SGPT style: a GPT-2 / GPT-Neo / GPT-J backbone with weighted-mean pooling. GPT-2 and GPT-J
    name their sizes n_embd / n_positions (read through the config's attribute_map); their
    tokenizer makes no token_type_ids, so none are sent -- GPT-Neo's forward takes them and would
    add their embedding to every position. (The empty text has no tokens at all here -- no
    special tokens are added -- and is refused by the pipeline, as every empty input is.)"""
    texts = [t for t in texts if t]
    path = zoo.build_st(tmp_path, family, pooling_mode="weightedmean")
    st = st_model(path)
    assert "token_type_ids" not in st.tokenizer("a text")
    ref = st.encode(texts, batch_size=16)
    if family == "gpt_neo":  # zeros as token types would change every vector
        features = st.tokenize(texts[:4])
        with_types = st.forward({**features, "token_type_ids": torch_zeros_like(features["input_ids"])})
        assert_differs(with_types["sentence_embedding"].detach().numpy(), ref[:4], "token type ids (zeros)")
    compare_embed(path, texts, family)


def torch_zeros_like(tensor):
    import torch

    return torch.zeros_like(tensor)


def test_copied_config_aliases_are_transformers_own():
    """The families whose size names the layout reader knows without importing transformers: each
    alias is the one the family's config class declares in its attribute_map."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from pooling_pipeline.core.shared.model_folder.transformer_config import CONFIG_ALIASES

    for model_type, aliases in CONFIG_ALIASES.items():
        declared = CONFIG_MAPPING[model_type].attribute_map
        assert {name: declared.get(name) for name in aliases} == aliases, model_type


# ---- The kept length: ST's rule ----------------------------------------------------------------------

@pytest.mark.slow
def test_old_layout_max_seq_length_above_a_rotary_decoders_positions(tmp_path, texts):
    """An old layout's max_seq_length (128) is kept as it is, even above max_position_embeddings
    (32 here) of a rotary decoder, whose positions have no table to run out of: ST keeps 128."""
    path = zoo.build_decoder_embedder(tmp_path, "qwen2")
    zoo.set_config(path, max_position_embeddings=32)
    zoo.to_old_layout(path, max_seq_length=128)
    st = st_model(path)
    assert st.max_seq_length == 128 and st[0].auto_model.config.max_position_embeddings == 32
    ref = st.encode(texts, batch_size=16)
    st.max_seq_length = 32
    assert_differs(ref, st.encode(texts, batch_size=16), "128 vs 32 tokens")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        outs = pipe.embed(texts, use_tqdm=False)
        assert pipe.model_spec.default_max_tokens == 128
    assert_close(np.stack([o.embedding for o in outs]), ref, "rotary decoder, max_seq_length 128 > 32 positions")
    assert max(o.num_prompt_tokens for o in outs) == 128


@pytest.mark.slow
def test_t5_encoder_keeps_its_tokenizers_model_max_length(tmp_path, texts):
    """T5 has no position table (relative attention) and no max_position_embeddings: ST keeps the
    tokenizer's model_max_length, 1024 here, not 512."""
    path = zoo.build_sentence_t5(tmp_path)
    zoo.set_tokenizer_config(path, model_max_length=1024)
    st = st_model(path)
    assert st.max_seq_length == 1024
    assert max(token_counts(st, texts)) > 512
    ref = st.encode(texts, batch_size=16)
    st.max_seq_length = 512
    assert_differs(ref, st.encode(texts, batch_size=16), "1024 vs 512 tokens")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        outs = pipe.embed(texts, use_tqdm=False)
    assert_close(np.stack([o.embedding for o in outs]), ref, "T5, model_max_length 1024")
    assert max(o.num_prompt_tokens for o in outs) > 512


@pytest.mark.slow
def test_max_seq_length_beyond_an_absolute_position_table_keeps_what_the_table_holds(tmp_path, texts):
    """BERT's position table holds 512; an old layout saying max_seq_length 600 makes ST fail on a
    longer text. The pipeline keeps 512 tokens (documented): equal to ST at 512."""
    path = zoo.build_bert_old_layout(tmp_path, ("mean",), max_seq_length=600)
    st = st_model(path)
    assert st.max_seq_length == 600
    long_text = max(texts, key=len)
    assert token_counts(st, [long_text])[0] > 512
    with pytest.raises((RuntimeError, IndexError)):  # ST runs out of position embeddings
        st.encode([long_text])
    st.max_seq_length = 512
    ref = st.encode(texts, batch_size=16)
    with Pipeline(model=path, num_render_workers=1) as pipe:
        assert pipe.model_spec.default_max_tokens == pipe.model_spec.max_model_len == 512
        outs = pipe.embed(texts, use_tqdm=False)
    assert_close(np.stack([o.embedding for o in outs]), ref, "BERT, max_seq_length 600 > 512 positions")


# ---- Decoder embedders ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral"])
def test_decoder_embedder(tmp_path, texts, family):
    """Qwen3-Embedding style: last-token pooling on the `<|endoftext|>` the post-processor appends,
    left padding declared by the tokenizer (pad id = that same token), the instruction prompt."""
    path = zoo.build_decoder_embedder(tmp_path, family)
    st = st_model(path)
    assert st.tokenizer.padding_side == "left"
    ids = st.tokenizer("hello")["input_ids"]
    assert ids[-1] == st.tokenizer.convert_tokens_to_ids("<|endoftext|>") == st.tokenizer.pad_token_id
    _, with_prompt = compare_embed(path, texts, family, calls=[{}, {"prompt_name": "query"}])
    assert_differs(with_prompt, st.encode(texts, batch_size=16), "the instruction prompt")


def test_decoder_embedder_with_chat_template_is_honoured_or_refused(tmp_path, texts):
    """A tokenizer with a chat_template makes ST 6 save a "message" modality and render every text
    through the template (no `<|endoftext|>` appended, a prompt as a system message): equal to ST,
    or a ValueError at start naming the message modality / chat template. Never silently different."""
    path = zoo.build_decoder_embedder(tmp_path, "qwen3", chat_template=True)
    modality = json.loads((tmp_path / os.path.basename(path) / "sentence_bert_config.json").read_text())["modality_config"]
    assert "message" in modality
    try:
        compare_embed(path, texts, "chat-template decoder", calls=[{}, {"prompt_name": "query"}])
    except ValueError as e:
        assert "message" in str(e) or "chat" in str(e)


# ---- Rerankers ----------------------------------------------------------------------------------------

def _pairs(texts):
    docs = [t for t in texts if t.strip()][:16]
    return corpus.sentences(1, seed=45)[0], corpus.medium_texts(1, seed=46)[0], docs


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "xlmr"])
def test_cross_encoder_one_label(tmp_path, texts, family):
    """ST 6 CrossEncoder layout, 1 label (ms-marco MiniLM: BERT; bge-reranker: XLM-R): predict =
    Sigmoid(logit) (activation_fn from config_sentence_transformers.json); pairs truncated
    longest-first at 128 (a long query too); rank sorted by score, top_k."""
    from sentence_transformers import CrossEncoder

    path = zoo.build_cross_encoder(tmp_path, 1, family=family)
    assert json.loads((tmp_path / f"ce-{family}-1" / "config_sentence_transformers.json").read_text())["activation_fn"] \
        == "torch.nn.modules.activation.Sigmoid"
    ce = CrossEncoder(path, device="cpu")
    query, long_query, docs = _pairs(texts)
    with Pipeline(model=path, num_render_workers=1) as pipe:
        for q in (query, long_query):
            ref = ce.predict([(q, d) for d in docs], batch_size=16)
            assert_varies(ref[:, None])
            got = np.array([o.score for o in pipe.score(q, docs, use_tqdm=False)], dtype=np.float32)
            assert_close(got, ref, f"cross-encoder scores (query of {len(q)} chars)")
        ranked = pipe.rank(query, docs)
        ref_rank = ce.rank(query, docs)
        assert [r.index for r in ranked] == [r["corpus_id"] for r in ref_rank]
        assert_close(np.array([r.score for r in ranked], dtype=np.float32),
                     np.array([r["score"] for r in ref_rank], dtype=np.float32), "rank scores")
        top = pipe.rank(query, docs, top_k=3)
        # A second run may batch the pairs differently, so its floats match within tolerance only.
        assert [r.index for r in top] == [r.index for r in ranked[:3]]
        assert_close(np.array([r.score for r in top], dtype=np.float32),
                     np.array([r.score for r in ranked[:3]], dtype=np.float32), "top_k scores")
        assert all(tuple(r) == (r.index, r.score) for r in top)


@pytest.mark.slow
def test_cross_encoder_three_labels(tmp_path, texts):
    """A 3-label CrossEncoder: ST's default activation is Identity, predict gives the 3 logits;
    rank refuses (ST: only num_labels=1). The pipeline gives the same 3 values per pair, or refuses
    score with a ValueError about the labels."""
    from sentence_transformers import CrossEncoder

    path = zoo.build_cross_encoder(tmp_path, 3)
    ce = CrossEncoder(path, device="cpu")
    query, _, docs = _pairs(texts)
    ref = ce.predict([(query, d) for d in docs], batch_size=16)
    assert ref.shape == (len(docs), 3)
    with Pipeline(model=path, num_render_workers=1) as pipe:
        try:
            outs = pipe.score(query, docs, use_tqdm=False)
        except ValueError as e:
            assert "label" in str(e)
        else:
            got = np.stack([np.atleast_1d(np.asarray(o.score, dtype=np.float32)) for o in outs])
            assert_close(got, ref, "3-label cross-encoder (Identity: raw logits)")
        with pytest.raises(ValueError):
            pipe.rank(query, docs)


@pytest.mark.slow
def test_causal_reranker_is_honoured_or_refused(tmp_path, texts):
    """Qwen3-Reranker's shape (causal LM + LogitScore on " yes" / " no"): equal to CrossEncoder.predict,
    or a ValueError at start naming the LogitScore module (or the text-generation task)."""
    from sentence_transformers import CrossEncoder

    path = zoo.build_causal_reranker(tmp_path)
    ce = CrossEncoder(path, device="cpu")
    query, _, docs = _pairs(texts)
    ref = ce.predict([(query, d) for d in docs], batch_size=16)
    assert_varies(ref[:, None])
    try:
        with Pipeline(model=path, num_render_workers=1) as pipe:
            got = np.array([o.score for o in pipe.score(query, docs, use_tqdm=False)], dtype=np.float32)
    except ValueError as e:
        assert "LogitScore" in str(e) or "text-generation" in str(e), str(e)
    else:
        assert_close(got, ref, "causal reranker")


@pytest.mark.slow
@pytest.mark.parametrize("activation", [None, "torch.nn.modules.linear.Identity"], ids=["default", "legacy-identity"])
def test_plain_hf_reranker(tmp_path, texts, activation):
    """Older rerankers are plain HF dirs (no modules.json): ST uses Sigmoid for 1 label unless
    config.json names another activation (`sbert_ce_default_activation_function`, as ms-marco had)."""
    from sentence_transformers import CrossEncoder

    path = zoo.build_hf_reranker(tmp_path, activation=activation)
    ce = CrossEncoder(path, device="cpu")
    query, long_query, docs = _pairs(texts)
    with Pipeline(model=path, num_render_workers=1) as pipe:
        for q in (query, long_query):
            ref = ce.predict([(q, d) for d in docs], batch_size=16)
            got = np.array([o.score for o in pipe.score(q, docs, use_tqdm=False)], dtype=np.float32)
            assert_close(got, ref, f"plain HF reranker, activation {activation}")
    if activation is not None:
        assert (ref < 0).any(), "raw logits expected (Identity), not probabilities"


# ---- SPLADE -----------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("variant", [{}, {"pooling_strategy": "sum", "old_layout": True, "name": "splade-sum-old"},
                                     {"max_active_dims": 16}],
                         ids=["max", "sum-old-layout", "top16"])
def test_splade(tmp_path, texts, variant):
    """SparseEncoder (Transformer fill-mask / MLMTransformer + SpladePooling): log(1 + relu(logits))
    max- or sum-pooled over the tokens, optional top-k (max_active_dims); as (ascending token ids,
    float32 weights) per text, equal to SparseEncoder.encode made dense."""
    from sentence_transformers import SparseEncoder

    path = zoo.build_splade(tmp_path, **variant)
    se = SparseEncoder(path, device="cpu")
    ref = se.encode(texts, batch_size=16).to_dense().cpu().numpy()
    assert_varies(ref)
    vocab = ref.shape[1]
    with Pipeline(model=path, num_render_workers=1) as pipe:
        outs = pipe.encode(texts, task="sparse_embed", use_tqdm=False)
    got = np.zeros_like(ref)
    for i, o in enumerate(outs):
        idx, val = np.asarray(o.indices), np.asarray(o.values)
        assert np.issubdtype(idx.dtype, np.integer) and val.dtype == np.float32
        assert idx.shape == val.shape and (np.diff(idx) > 0).all(), f"text {i}: indices not ascending and unique"
        assert idx.size == 0 or (idx.min() >= 0 and idx.max() < vocab)
        if variant.get("max_active_dims"):
            assert idx.size <= variant["max_active_dims"]
        got[i, idx] = val
    assert_close(got, ref, f"SPLADE {variant}")


# ---- Models by hub id -------------------------------------------------------------------------------

HUB_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from pooling_pipeline import Pipeline

    texts = json.load(open(sys.argv[1]))
    with Pipeline(model="zoo-org/tiny-model", num_render_workers=1) as pipe:
        np.save(sys.argv[2], np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False)]))
    try:
        with Pipeline(model="zoo-org/broken-model", num_render_workers=1):
            print(json.dumps({"broken": None}))
    except Exception as e:
        print(json.dumps({"broken": f"{type(e).__name__}: {e}"}))
""")


@pytest.mark.slow
def test_model_by_hub_id_from_offline_cache(tmp_path, texts):
    """Pipeline(model="org/name") resolves from the HF cache (HF_HOME, HF_HUB_OFFLINE=1) as ST does; a
    cache repo folder without snapshots/ gets an error that says so. Run as a user would: HF_HOME set
    before Python starts."""
    model = zoo.build_st(tmp_path, "bert", name="st-bert-hub", normalize=True)
    hf_home = tmp_path / "hf_home"
    zoo.lay_out_hf_cache(model, hf_home, "zoo-org/tiny-model")
    zoo.lay_out_broken_hf_cache(hf_home, "zoo-org/broken-model")
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", HUB_SCRIPT, str(tmp_path / "texts.json"), str(tmp_path / "got.npy")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close(np.load(tmp_path / "got.npy"), st_model(model).encode(texts, batch_size=16), "model by hub id")
    broken = json.loads(proc.stdout.strip().splitlines()[-1])["broken"]
    assert broken is not None, "a cache folder without snapshots/ was accepted"
    assert "snapshots" in broken, broken


# ---- What the pipeline cannot honour -------------------------------------------------------------------

def test_model_needing_remote_code_is_a_value_error_in_the_caller(tmp_path, model_path):
    """A family only the model's own code defines (auto_map, a model_type transformers does not
    know) without trust_remote_code: the ValueError itself, raised before any process starts."""
    import psutil

    path = tmp_path / "custom-family"
    shutil.copytree(model_path, path)
    zoo.set_config(path, model_type="my-own-bert",
                   auto_map={"AutoConfig": "configuration_mine.MyConfig", "AutoModel": "modeling_mine.MyModel"})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=r"trust_remote_code=True.*") as raised:
        Pipeline(model=str(path), num_render_workers=1)
    assert "my-own-bert" in str(raised.value) and "modeling_mine.MyModel" in str(raised.value)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_composite_folders_are_refused_naming_what_is_missing(tmp_path):
    """A CLIP folder is a dual encoder (tests/test_images.py), but one without an image processor
    config is refused naming it; another composite model (text_config + vision_config, no
    hidden_size at the top) is refused naming its architecture, not a missing hidden_size."""
    import json

    from transformers import CLIPConfig, CLIPModel

    path = tmp_path / "clip"
    config = CLIPConfig(text_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                     "intermediate_size": 37, "vocab_size": 30522},
                        vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                       "intermediate_size": 37, "image_size": 32, "patch_size": 8},
                        projection_dim=16)
    CLIPModel(config).save_pretrained(path)
    zoo.copy_wordpiece(path)
    with pytest.raises(ValueError, match=r"/clip': a dual encoder without an image processor config"):
        Pipeline(model=str(path), num_render_workers=1)
    blip = tmp_path / "blip"
    blip.mkdir()
    (blip / "config.json").write_text(json.dumps({"model_type": "blip", "architectures": ["BlipModel"],
                                                  "text_config": {"hidden_size": 32}, "vision_config": {}}))
    zoo.copy_wordpiece(blip)
    with pytest.raises(ValueError, match=r"BlipModel \(model_type 'blip'\), a composite model"):
        Pipeline(model=str(blip), num_render_workers=1)
    colsmol = tmp_path / "colidefics3"  # (a page retriever's config nests its VLM's: named, not "lacks hidden_size")
    colsmol.mkdir()
    (colsmol / "config.json").write_text(json.dumps({"model_type": "colidefics3", "architectures": ["ColIdefics3"],
                                                     "vlm_config": {"model_type": "idefics3"}, "embedding_dim": 128}))
    zoo.copy_wordpiece(colsmol)
    with pytest.raises(ValueError, match=r"ColIdefics3 .* a composite model with vlm_config: .*other page "
                                         r"retrievers, multimodal rerankers and video models are not yet"):
        Pipeline(model=str(colsmol), num_render_workers=1)
    colqwen = tmp_path / "colqwen2"  # (ColQwen2 is read, and a folder without its processor named)
    colqwen.mkdir()
    (colqwen / "config.json").write_text(json.dumps({"model_type": "colqwen2", "architectures": ["ColQwen2ForRetrieval"],
                                                     "vlm_config": {"model_type": "qwen2_vl", "image_token_id": 5},
                                                     "embedding_dim": 128}))
    zoo.copy_wordpiece(colqwen)
    with pytest.raises(ValueError, match=r"colqwen2': a Qwen-VL model without an image processor config"):
        Pipeline(model=str(colqwen), num_render_workers=1)
    colpali = tmp_path / "colpali"  # (ColPali is read, and a folder without its processor named)
    colpali.mkdir()
    (colpali / "config.json").write_text(json.dumps({"model_type": "colpali", "architectures": ["ColPaliForRetrieval"],
                                                     "vlm_config": {"model_type": "paligemma"}, "embedding_dim": 128}))
    zoo.copy_wordpiece(colpali)
    with pytest.raises(ValueError, match=r"a page retriever without an image processor config"):
        Pipeline(model=str(colpali), num_render_workers=1)


def test_unknown_module_type_refused_at_start(tmp_path):
    path = zoo.add_unknown_module(zoo.build_bert_pooling(tmp_path, "mean"), "my_pkg.WeirdModule")
    with pytest.raises(ValueError, match=r"my_pkg\.WeirdModule"):
        with Pipeline(model=path, num_render_workers=1):
            pass


# ---- The long-input fast path on the zoo's tokenizers ------------------------------------------------

@pytest.fixture(scope="module")
def long_texts() -> list[str]:
    return corpus.long_documents(2, 20_000, 40_000, seed=47) + corpus.medium_texts(2, seed=48)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(zoo.TOKENIZERS))
def test_truncating_tokenizer_matches_full_tokenization(name, long_texts):
    """The render workers' prefix truncation equals full tokenization then truncation, on each
    family's tokenizer, with and without a prompt in front, and for pairs (longest-first)."""
    from tokenizers import Tokenizer

    from pooling_pipeline.workers.truncation import TruncatingTokenizer

    hf_tok = zoo.TOKENIZERS[name]()
    tt = TruncatingTokenizer(Tokenizer.from_str(hf_tok.backend_tokenizer.to_str()))
    for text in long_texts:
        for max_tokens in (8, 100, 512):
            for prompt in ("", "query: ", zoo.QWEN_QUERY_PROMPT):
                want = hf_tok(prompt + text, truncation=True, max_length=max_tokens)["input_ids"]
                assert tt.encode(prompt + text, max_tokens) == want, (name, max_tokens, prompt, text[:60])
    for first, second in ((long_texts[0], long_texts[1]), (long_texts[1], long_texts[0]), (long_texts[3], long_texts[0])):
        want = hf_tok(first, second, truncation="longest_first", max_length=256)
        ids, type_ids = tt.encode_pair(first, second, 256)
        assert ids == want["input_ids"], name
        if "token_type_ids" in want:
            assert type_ids == want["token_type_ids"], name
    if name in ("qwen-bpe", "roberta-bpe", "deberta-unigram", "mpnet-wordpiece", "bert-wordpiece"):
        # tokenizers the planner vouches for (truncation.py): the long texts took the prefix path
        assert tt.rule.exact, tt.rule
        assert tt.prefix_encodes > 0
