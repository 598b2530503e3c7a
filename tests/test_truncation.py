"""The prefix planner gives exactly the ids of full tokenization + truncation, without tokenizing everything."""

import random

import corpus
import pytest
from helpers import examples
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

import pooling_pipeline.workers.truncation as truncation
from pooling_pipeline.core.shared.model_folder.load import load_model_spec
from pooling_pipeline.workers.render import load_tokenizer
from pooling_pipeline.workers.truncation import TruncatingTokenizer, analyse_tokenizer, find_cut

PIECES = ["the", "quick", "brown", "fox", "naïve", "café", "Ångström", "東京", "日本語のテキスト", "🙂", "🚀🚀",
          "e\u0301", "x" * 150, "supercalifragilisticexpialidocious", "3.14159", "don't", "U.S.A.", "(parens)",
          "a-b_c", "ZZZ", "\u00a0", "ÀÉÎ", "Straße"]
SEPARATORS = [" ", "  ", "\t", "\n", "\n\n", " \t ", "\r\n", "   \n  ", ". ", ".\n\n", ", "]
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _full_ids(tok: Tokenizer, text: str, k: int, left: bool = False) -> list[int]:
    """The reference: tokenize the whole text, then truncate (what transformers does)."""
    tok.no_padding()
    tok.enable_truncation(max_length=k, direction="left" if left else "right")
    try:
        return tok.encode(text).ids
    finally:
        tok.no_truncation()


@pytest.fixture(scope="module")
def wordpiece(model_path):
    """The bundled tokenizer without the padding and truncation its tokenizer.json saves (what the
    render worker's TruncatingTokenizer sets): the references below tokenize texts whole. (Set here,
    not left to whichever test runs first: a tier may run any subset.)"""
    tok = load_tokenizer(load_model_spec(model_path))
    tok.no_padding()
    tok.no_truncation()
    return tok


def _train(kind: str) -> Tokenizer:
    text = corpus.medium_texts(300, seed=7)
    if kind == "bytelevel-bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(text, trainer)
        tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                           special_tokens=[("<s>", 0), ("</s>", 1)])
    elif kind == "split-bpe":  # Llama-3 / Qwen style: GPT-4 regex, then byte-level mapping
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<|begin|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(text, trainer)
        tok.post_processor = processors.TemplateProcessing(single="<|begin|> $A", special_tokens=[("<|begin|>", 0)])
    elif kind == "metaspace-unigram":  # XLM-R / T5 style: runs of spaces become one
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=600, special_tokens=["<unk>", "</s>"], unk_token="<unk>")
        tok.train_from_iterator(text, trainer)
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    else:
        raise ValueError(kind)
    return tok


@pytest.fixture(scope="module", params=["bundled-wordpiece", "bytelevel-bpe", "split-bpe", "metaspace-unigram"])
def tokenizer(request, wordpiece):
    return wordpiece if request.param == "bundled-wordpiece" else _train(request.param)


@pytest.mark.slow
def test_these_tokenizers_are_prefix_safe(tokenizer):
    assert analyse_tokenizer(tokenizer).exact


texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(min_size=1, max_size=12)), min_size=1, max_size=400).flatmap(
    lambda words: st.lists(st.sampled_from(SEPARATORS), min_size=len(words), max_size=len(words)).map(
        lambda seps: "".join(w + s for w, s in zip(words, seps))))


@pytest.mark.slow
@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(text=texts, k=st.integers(min_value=2, max_value=40), lead=st.sampled_from(["", " ", "\n"]),
       left=st.booleans())
def test_planner_equals_full_tokenization(tokenizer, text, k, lead, left):
    # A first piece of a character or so makes the planner cut and grow even on these short texts.
    enc = TruncatingTokenizer(Tokenizer.from_str(tokenizer.to_str()), chars_per_token_guess=0, min_prefix_chars=1)
    text = lead + text
    assert enc.encode(text, k, left=left) == _full_ids(tokenizer, text, k, left)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(text=texts)
def test_piecewise_tokenization_for_chunks_equals_whole(tokenizer, text):
    enc = TruncatingTokenizer(Tokenizer.from_str(tokenizer.to_str()))
    old = truncation.CHUNK_TOKENIZE_CHARS
    truncation.CHUNK_TOKENIZE_CHARS = 7  # many pieces even in short texts
    try:
        ids = [i for piece in enc.content_ids(text) for i in piece]
    finally:
        truncation.CHUNK_TOKENIZE_CHARS = old
    assert ids == tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("k", [8, 64, 256, 512])
@pytest.mark.parametrize("left", [False, True])
def test_long_real_documents(tokenizer, k, left):
    enc = TruncatingTokenizer(Tokenizer.from_str(tokenizer.to_str()))
    for seed in range(3):
        doc = corpus.long_document(300_000, seed=seed)
        assert enc.encode(doc, k, left=left) == _full_ids(tokenizer, doc, k, left)
    assert enc.prefix_encodes == 3 and enc.full_encodes_of_long_text == 0  # never the whole document


def test_token_count_stops_at_a_prefix_that_proves_too_long(wordpiece):
    enc = TruncatingTokenizer(Tokenizer.from_str(wordpiece.to_str()))
    doc = corpus.long_document(1_000_000, seed=5)
    count, exact = enc.count_tokens(doc, 254)
    assert not exact and 254 < count < 2000 and enc.full_encodes_of_long_text == 0
    short = "just a few words"
    assert enc.count_tokens(short, 254) == (len(wordpiece.encode(short, add_special_tokens=False).ids), True)


# Text without whitespace: scripts written without spaces, identifiers, base64, minified code.
GLUE = ["", "", "", "。", "、", "，", ",", ".", "-", "_", "/", "+", "=", "!", "(", ")", "'", "’", "«", "»", "0", "42",
        "\u0301", "🙂"]
no_space_texts = st.lists(
    st.one_of(st.sampled_from(PIECES + ["日本語のテキストです", "中文文本", "QUJDREVG", "x1y2"]),
              st.text(st.characters(blacklist_categories=("Zs", "Zl", "Zp", "Cc", "Cs")), min_size=1, max_size=12)),
    min_size=1, max_size=300).flatmap(
    lambda words: st.lists(st.sampled_from(GLUE), min_size=len(words), max_size=len(words)).map(
        lambda glue: "".join(w + g for w, g in zip(words, glue)).replace(" ", "").replace("\u00a0", "")))


@pytest.mark.slow
@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(text=no_space_texts, k=st.integers(min_value=2, max_value=40), left=st.booleans())
def test_planner_equals_full_tokenization_on_text_without_whitespace(tokenizer, text, k, left):
    enc = TruncatingTokenizer(Tokenizer.from_str(tokenizer.to_str()), chars_per_token_guess=0, min_prefix_chars=1)
    assert enc.encode(text, k, left=left) == _full_ids(tokenizer, text, k, left)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(text=no_space_texts)
def test_piecewise_tokenization_without_whitespace_equals_whole(tokenizer, text):
    enc = TruncatingTokenizer(Tokenizer.from_str(tokenizer.to_str()))
    old = truncation.CHUNK_TOKENIZE_CHARS
    truncation.CHUNK_TOKENIZE_CHARS = 7
    try:
        ids = [i for piece in enc.content_ids(text) for i in piece]
    finally:
        truncation.CHUNK_TOKENIZE_CHARS = old
    assert ids == tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.slow
@pytest.mark.parametrize("left", [False, True])
def test_long_text_without_whitespace_is_cut_at_a_split_point_not_tokenized_whole(wordpiece, left):
    """3M CJK characters cost a worker 1.3 GB when tokenized whole; a prefix at a point where the
    pre-tokenizer splits costs what the kept tokens cost, with the same ids."""
    enc = TruncatingTokenizer(Tokenizer.from_str(wordpiece.to_str()))
    for text in ["日本語のテキストです。" * 30_000, "中文文本没有空格但是有标点符号，例如逗号和句号。" * 10_000,
                 "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVphYmNk+/0123" * 6_000]:
        for k in (8, 256):
            assert enc.encode(text, k, left=left) == _full_ids(wordpiece, text, k, left)
    assert enc.full_encodes_of_long_text == 0 and enc.split_cuts == enc.prefix_encodes == 6


@pytest.mark.parametrize("left", [False, True])
def test_byte_level_families_cut_text_without_whitespace_between_letters_and_punctuation(tokenizer, left):
    enc = TruncatingTokenizer(Tokenizer.from_str(tokenizer.to_str()))
    text = "日本語のテキストです。" * 20_000 + "naïve,café;x1y2" * 2_000
    for k in (8, 64):
        assert enc.encode(text, k, left=left) == _full_ids(tokenizer, text, k, left)
    if enc.rule.split_kind is None:  # Metaspace splits at spaces only: still the exact full path
        assert enc.full_encodes_of_long_text == 2
    else:
        assert enc.full_encodes_of_long_text == 0 and enc.split_cuts == 2


def test_chunk_pieces_of_text_without_whitespace_stay_small(wordpiece):
    enc = TruncatingTokenizer(Tokenizer.from_str(wordpiece.to_str()))
    text = "日本語のテキストです。" * 30_000  # 330k characters, one piece before
    pieces = list(enc.content_ids(text))
    assert len(pieces) >= len(text) // (4 * truncation.CHUNK_TOKENIZE_CHARS)
    assert [i for piece in pieces for i in piece] == wordpiece.encode(text, add_special_tokens=False).ids


def test_unknown_tokenizer_shapes_are_not_trusted():
    tok = Tokenizer(models.BPE())  # no pre-tokenizer: tokens may span whitespace
    assert not analyse_tokenizer(tok).exact
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="isolated")
    assert not analyse_tokenizer(tok).exact
    tok.pre_tokenizer = pre_tokenizers.Metaspace(split=False)
    assert not analyse_tokenizer(tok).exact


def test_find_cut_is_before_a_whitespace_run():
    rng = random.Random(0)
    text = "".join(rng.choice(["word", "x", "  ", " ", "\n", "\t"]) for _ in range(5000))
    for near in range(10, len(text), 97):
        cut = find_cut(text, near, " \t\n\r")
        if cut is not None:
            assert text[cut] in " \t\n\r" and not text[cut - 1].isspace()
    assert find_cut("abcdefgh" * 100, 50, " ") is None


@pytest.mark.slow
@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.tuples(st.integers(0, 300), st.integers(0, 300)), max_tokens=st.integers(5, 160),
       caps=st.tuples(st.one_of(st.none(), st.integers(1, 200)), st.one_of(st.none(), st.integers(1, 200))))
# Both sides past the budget, one only through its cap (58 > 57): their order decides the odd token.
@example(words=(41, 37), max_tokens=60, caps=(None, 58))
def test_pairs_keep_what_longest_first_keeps(wordpiece, words, max_tokens, caps):
    """A pair is cut as tokenizers' longest_first cuts the whole texts -- the odd token of an odd
    budget to the longer side, to the second on a tie -- after each side's own cap."""
    pool = " ".join(corpus.sentences(40, seed=5)).split()
    first, second = " ".join(pool[:words[0]]), " ".join(pool[-words[1]:] if words[1] else [])
    enc = TruncatingTokenizer(Tokenizer.from_str(wordpiece.to_str()))
    ids, types = enc.encode_pair(first, second, max_tokens, *caps)
    whole = Tokenizer.from_str(wordpiece.to_str())
    whole.no_padding()
    whole.no_truncation()
    a, b = (whole.encode(t, add_special_tokens=False) for t in (first, second))
    for e, cap in zip((a, b), caps):
        if cap is not None:
            e.truncate(cap)
    whole.enable_truncation(max_length=max_tokens, strategy="longest_first")
    want = whole.post_process(a, b)
    assert ids == want.ids and types == want.type_ids
