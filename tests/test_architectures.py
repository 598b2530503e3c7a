"""Families whose vectors ST itself makes depend on something other than the text (issue 61, items
4-6): what the pipeline gives instead is ST's vector for the text alone, or a clear refusal.

- BigBird with attention_type "block_sparse": transformers switches the model to full attention, for
  good, the first time a batch is too short for block-sparse attention, and the padding at the end
  of a row changes its global blocks' attention; so ST's vector for a text depends on its batch and
  on what the model ran before. The reference is ST's vector for the text alone, in a fresh model.
- Funnel Transformer: its attention pools the padded sequence, so ST's vector for a text depends on
  the batch; the reference is ST's vector for the text alone.
- XLNet with no max length anywhere: ST keeps the whole text; the pipeline keeps it whole up to
  WHOLE_TEXT_MAX_TOKENS and refuses a longer text, naming its length, unless the call gives a length.

Tiny models of each family, built with transformers' own classes and saved by ST (tests/model_zoo.py);
max |diff| <= 1e-5 in float32 on the CPU.
"""

from __future__ import annotations

import json

import corpus
import model_zoo as zoo
import numpy as np
import pytest
from test_fidelity import assert_close, assert_differs, assert_varies, embed, st_model

from pooling_pipeline import Pipeline
from pooling_pipeline.core.shared.model_folder.load import load_model_spec
from pooling_pipeline.core.shared.model_folder.transformer_config import (
    BIG_BIRD_DEFAULTS,
    WHOLE_TEXT_MAX_TOKENS,
    model_lengths,
    padding_rules,
)


def mixed_texts() -> list[str]:
    """Texts from 3 tokens to past the zoo's 128 (cut there), so that batches mix lengths on both
    sides of BigBird's 28-token switch, and some texts share a length."""
    out = corpus.sentences(10, seed=61) + corpus.medium_texts(5, seed=62) + corpus.long_documents(1, 2_000, 4_000, seed=63)
    words = out[-1].split()
    # Lengths between the switch and the cut that no bucket of the accelerator path (multiples of
    # 16) or block (4 tokens) rounds to: padding them changes block-sparse attention.
    out += [" ".join(words[:k]) for k in (27, 33, 45, 61, 83)]
    out += ["a", "two words", "two words", " ".join(["the quick brown fox jumps over the lazy dog"] * 3)]
    order = np.random.default_rng(64).permutation(len(out))
    return [out[i] for i in order]


def one_at_a_time(st, texts: list[str], fresh=None) -> np.ndarray:
    """ST's vector for each text encoded alone (`fresh(st)` first: the model as loaded)."""
    rows = []
    for text in texts:
        if fresh is not None:
            fresh(st)
        rows.append(st.encode([text])[0])
    return np.stack(rows)


# ---- BigBird, block-sparse attention ---------------------------------------------------------------

def fresh_big_bird(st) -> None:
    """The attention type of the model as loaded (config.json's block_sparse): transformers changes it
    to original_full for good on the first batch of 28 tokens or fewer."""
    st[0].auto_model.set_attention_type("block_sparse")


@pytest.mark.slow
@pytest.mark.parametrize("device_path", [False, True], ids=["cpu-steps", "device-steps"])
def test_big_bird_block_sparse_gives_each_text_its_one_text_result(tmp_path, monkeypatch, device_path):
    """device_path: the engine's accelerator path on its CPU stand-in (bucketed shapes, launching
    ahead), which pads rows to bucket shapes: off for these rows."""
    if device_path:
        from pooling_pipeline.core.engine.main import DEVICE_STEPS_ENV, LAUNCH_AHEAD_ENV

        monkeypatch.setenv(DEVICE_STEPS_ENV, "1")
        monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1")
    texts = mixed_texts()
    path = zoo.build_st(tmp_path, "big_bird", name="st-big-bird")
    st = st_model(path)
    lengths = [len(ids) for ids in st.tokenizer(texts, truncation=True, max_length=st.max_seq_length)["input_ids"]]
    assert min(lengths) <= 28 < max(lengths) and len(set(lengths)) < len(lengths)  # both sides of the switch
    single = one_at_a_time(st, texts, fresh_big_bird)
    assert_varies(single)
    fresh_big_bird(st)
    assert_differs(st.encode(texts, batch_size=8), single, "ST's batches (padding in the global blocks)")
    # What ST gives a long text alone after it once ran a short batch: full attention for good.
    long = [t for t, n in zip(texts, lengths) if n > 28]
    assert_differs(one_at_a_time(st, long), single[[n > 28 for n in lengths]], "ST after a short batch")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        # Short texts first (full attention), then everything mixed, then the long ones alone: the
        # same vectors whatever ran before and whatever they are batched with.
        short = [i for i, n in enumerate(lengths) if n <= 28]
        assert_close(embed(pipe, [texts[i] for i in short]), single[short], "big_bird short texts")
        assert_close(embed(pipe, texts), single, "big_bird mixed, after the short ones")
        assert_close(embed(pipe, long), single[[n > 28 for n in lengths]], "big_bird long texts")
        assert "unpadded" in pipe.stats()["engine"]["batching"]  # said at start-up


def test_big_bird_padding_rules_follow_its_config():
    """The switch is transformers' (5 + 2 * num_random_blocks) * block_size, with BigBirdConfig's
    defaults where config.json leaves a value out; full attention has nothing to pin."""
    from transformers import BigBirdConfig

    defaults = BigBirdConfig()
    assert BIG_BIRD_DEFAULTS == {k: getattr(defaults, k) for k in BIG_BIRD_DEFAULTS}
    assert padding_rules({}, "big_bird", None) == {"unpadded_above": 704, "block_sparse_above": 704}
    assert padding_rules({"block_size": 16, "num_random_blocks": 2}, "big_bird", None)["block_sparse_above"] == 144
    assert padding_rules({"attention_type": "original_full"}, "big_bird", None) == {}
    assert padding_rules({}, "bert", None) == {}


# ---- Funnel Transformer --------------------------------------------------------------------------

@pytest.mark.slow
def test_funnel_gives_each_text_its_one_text_result(tmp_path):
    texts = mixed_texts()
    path = zoo.build_st(tmp_path, "funnel", name="st-funnel")
    st = st_model(path)
    assert type(st[0].auto_model).__name__ == "FunnelModel"
    single = one_at_a_time(st, texts)
    assert_varies(single)
    assert_differs(st.encode(texts, batch_size=8), single, "ST's batches (Funnel pools the padding)")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        assert_close(embed(pipe, texts), single, "funnel, ST one text at a time")
        assert_close(embed(pipe, texts[::-1]), single[::-1], "funnel, another order")


@pytest.mark.slow
def test_funnel_base_model_is_refused(tmp_path):
    """A FunnelBaseModel's output is pooled to fewer states than its input has tokens: refused at
    load, naming it, rather than pooled with a mask of another length."""
    path = zoo.build_st(tmp_path, "funnel", name="st-funnel-base")
    config = json.loads((tmp_path / "st-funnel-base" / "config.json").read_text())
    assert padding_rules(config, "funnel", None) == {"unpadded_above": 0}
    zoo.set_config(path, architectures=["FunnelBaseModel"])
    with pytest.raises(ValueError, match="FunnelBaseModel, whose output is pooled"):
        load_model_spec(path)


# ---- XLNet: no max length anywhere ----------------------------------------------------------------

def test_no_length_anywhere_keeps_the_whole_text_up_to_the_bound(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1e30}))
    assert model_lengths(None, {"d_model": 32}, "xlnet", tmp_path) == (WHOLE_TEXT_MAX_TOKENS, WHOLE_TEXT_MAX_TOKENS, True)
    assert model_lengths(300, {"d_model": 32}, "xlnet", tmp_path) == (300, 300, False)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    assert model_lengths(None, {"d_model": 32}, "xlnet", tmp_path) == (256, 256, False)


@pytest.mark.slow
def test_xlnet_without_a_length_keeps_the_whole_text_as_st(tmp_path):
    path = zoo.build_st(tmp_path, "xlnet", name="st-xlnet")
    st = st_model(path)
    assert st.max_seq_length > 1e9  # ST: no length anywhere, the whole text
    docs = corpus.long_documents(6, 2_500, 12_000, seed=65)
    counts = [len(ids) for ids in st.tokenizer(docs)["input_ids"]]
    kept = [d for d, n in zip(docs, counts) if 512 < n <= WHOLE_TEXT_MAX_TOKENS]
    too_long = [(d, n) for d, n in zip(docs, counts) if n > WHOLE_TEXT_MAX_TOKENS]
    assert kept and too_long, counts
    texts = corpus.sentences(4, seed=66) + kept
    ref = st.encode(texts, batch_size=4)
    assert_varies(ref)
    st.max_seq_length = 512
    assert_differs(st.encode(texts, batch_size=4), ref, "a cut at 512 tokens")
    doc, n = too_long[0]
    with Pipeline(model=path, num_render_workers=1) as pipe:
        assert_close(embed(pipe, texts), ref, "xlnet, the whole text")
        outs = pipe.embed(["a short text", doc], errors="return", use_tqdm=False)
        assert outs[0].error is None and outs[1].data is None
        assert "request 1" in outs[1].error and f"{n} tokens" in outs[1].error, outs[1].error
        assert "no max length" in outs[1].error and "truncate_prompt_tokens" in outs[1].error
        with pytest.raises(ValueError, match=f"request 0: .*{n} tokens"):
            pipe.embed([doc], use_tqdm=False)
        # A length from the call is a cut the caller asked for, as ST's max_seq_length.
        st.max_seq_length = 1000
        assert_close(embed(pipe, [doc] + texts, truncate_prompt_tokens=1000), st.encode([doc] + texts, batch_size=4),
                     "xlnet, truncate_prompt_tokens=1000")
