"""The word cache gives exactly the `tokenizers` library's ids, for every BERT-shaped tokenizer it
takes, and is never used for a tokenizer or a text it cannot vouch for."""

import json
import random

import corpus
import model_zoo
import pytest
from helpers import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors

import pooling_pipeline.workers.word_cache as word_cache
from pooling_pipeline.workers.render import lowercase_first
from pooling_pipeline.workers.truncation import TruncatingTokenizer
from pooling_pipeline.workers.word_cache import WordCache

MAX_TOKENS = (3, 5, 16, 64, 512)
ASCII = [chr(c) for c in range(32, 127)]
PIECES = ["the", "The", "THE", "unaffable", "x" * 101, "x" * 60, "3.14", "don't", "U.S.A.", "a-b_c", "[CLS]",
          "[cls]", "[MASK]x", "<s>", "</s>", "<mask>", "hello", "HeLLo", "helloworld", "café", "naïve", "東京",
          "\u00a0", "\x00", "\x0b", "\x1f", "\x7f", "ﬁ", "\ufffd"]
SEPARATORS = [" ", "  ", "\t", "\n", "\r\n", "", ". ", ",", "!?"]


def _backend(hf) -> Tokenizer:
    return Tokenizer.from_str(hf.backend_tokenizer.to_str())


def _cased_bert() -> Tokenizer:
    """BERT-cased's shape: the bundled vocabulary, no lowercasing."""
    tok = _backend(model_zoo.wordpiece_tokenizer())
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=False,
                                                lowercase=False)
    return tok


def _do_lower_case_bert() -> Tokenizer:
    """ST's do_lower_case over a cased tokenizer: Sequence[Lowercase, BertNormalizer]."""
    tok = _cased_bert()
    lowercase_first(tok)
    return tok


def _bert_with_added_words() -> Tokenizer:
    """Added vocabulary of a fine-tuned model: words matched as written and normalized ones."""
    tok = _backend(model_zoo.wordpiece_tokenizer())
    tok.add_tokens([AddedToken("hello", normalized=True), AddedToken("Foo-Bar", normalized=False),
                    AddedToken("café", normalized=True)])
    return tok


def _bert_processing() -> Tokenizer:
    tok = _backend(model_zoo.wordpiece_tokenizer())
    tok.post_processor = processors.BertProcessing(("[SEP]", 102), ("[CLS]", 101))
    return tok


CACHED = {
    "bert-uncased": lambda: _backend(model_zoo.wordpiece_tokenizer()),
    "mpnet": lambda: _backend(model_zoo.mpnet_tokenizer()),
    "bert-cased": _cased_bert,
    "do-lower-case": _do_lower_case_bert,
    "added-words": _bert_with_added_words,
    "bert-processing": _bert_processing,
    "spaced-added-token": lambda: _backend(model_zoo.spaced_added_token_tokenizer()),
}


@pytest.fixture(scope="module", params=sorted(CACHED))
def tokenizer(request) -> TruncatingTokenizer:
    tok = TruncatingTokenizer(CACHED[request.param]())
    assert tok.word_cache is not None, f"{request.param} should be served by the word cache"
    return tok


def _library_ids(tok: TruncatingTokenizer, texts: list[str], max_tokens: int) -> list[list[int]]:
    reference = Tokenizer.from_str(tok.tokenizer.to_str())
    reference.no_padding()
    reference.enable_truncation(max_length=max_tokens)
    return [enc.ids for enc in reference.encode_batch(texts)]


def _assert_same(tok: TruncatingTokenizer, texts: list[str], max_tokens: int) -> None:
    got = tok.encode_many(texts, max_tokens)
    want = _library_ids(tok, texts, max_tokens)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"text {i} {texts[i]!r} at max_tokens={max_tokens}: {g} != library {w}"


@pytest.mark.parametrize("max_tokens", MAX_TOKENS)
def test_real_sentences_and_documents(tokenizer, max_tokens):
    texts = corpus.sentences(1500, seed=3) + corpus.medium_texts(40, seed=3, max_chars=1500)
    before = tokenizer.word_cache.texts
    _assert_same(tokenizer, texts, max_tokens)
    assert tokenizer.word_cache.texts - before > len(texts) // 2  # the shortcut itself was tested


@pytest.mark.parametrize("max_tokens", MAX_TOKENS)
def test_random_ascii_with_every_character_class(tokenizer, max_tokens):
    rng = random.Random(max_tokens)
    alphabet = ASCII + ["\t", "\n", "\r", " ", " ", " "]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300))) for _ in range(1500)]
    _assert_same(tokenizer, texts, max_tokens)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(PIECES), st.sampled_from(SEPARATORS)), max_size=12),
       st.sampled_from(MAX_TOKENS))
def test_added_tokens_odd_characters_and_long_words(tokenizer, parts, max_tokens):
    """Mixed in one batch: texts the cache takes and texts it must leave to the library (added tokens
    in any case, non-ASCII, control characters), each in its place."""
    text = "".join(piece + sep for piece, sep in parts)
    _assert_same(tokenizer, [text, text.upper(), text.lower(), "plain words", text], max_tokens)


def test_texts_the_cache_cannot_vouch_for_go_to_the_library():
    tok = TruncatingTokenizer(_bert_with_added_words())
    cache = tok.word_cache
    refused = ["[CLS] x", "[cls] x", "say HELLO", "foo-bar", "cafe", "naïve", "tab\x0bvertical", "nul\x00", "del\x7f"]
    assert cache.encode_many(refused, 64) == [None] * len(refused)
    assert all(ids is not None for ids in cache.encode_many(["say hell", "foo bar", "caf", "plain\ttab\r\n"], 64))


def test_other_tokenizer_shapes_get_no_cache():
    for name in ("qwen-bpe", "roberta-bpe", "xlmr-unigram", "t5-unigram", "deberta-unigram"):
        assert TruncatingTokenizer(_backend(model_zoo.TOKENIZERS[name]())).word_cache is None, name
    vocab = {"[UNK]": 0, "a": 1, "##b": 2}
    whitespace = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()  # groups punctuation runs: not BERT's split
    assert WordCache.for_tokenizer(whitespace, [], []) is None
    replaced = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    replaced.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    replaced.normalizer = normalizers.Replace("a", "b")
    assert WordCache.for_tokenizer(replaced, [], []) is None
    spaced = _backend(model_zoo.wordpiece_tokenizer())
    spaced.add_tokens(["new york"])  # a token with a space could match across normalized whitespace
    assert TruncatingTokenizer(spaced).word_cache is None


def test_the_switch_turns_the_cache_off(monkeypatch):
    monkeypatch.setenv(word_cache.WORD_CACHE_ENV, "0")
    assert TruncatingTokenizer(_backend(model_zoo.wordpiece_tokenizer())).word_cache is None


def test_a_full_cache_is_emptied_and_refilled_with_the_same_ids(monkeypatch):
    monkeypatch.setattr(word_cache, "MAX_CACHED_WORDS", 50)
    tok = TruncatingTokenizer(_backend(model_zoo.wordpiece_tokenizer()))
    texts = corpus.sentences(400, seed=11)
    for _ in range(2):
        _assert_same(tok, texts, 128)
        assert len(tok.word_cache._cache) <= 50
    assert tok.word_cache.word_misses > 100  # it was emptied and refilled, not grown


# ---- added tokens matched in the normalized text (issue 24) -------------------------------------------

NORMALIZERS = {
    "nfkd-bert": lambda: normalizers.Sequence([normalizers.NFKD(), normalizers.BertNormalizer(lowercase=True)]),
    "bert-uncased": lambda: normalizers.BertNormalizer(lowercase=True),
    "bert-cased": lambda: normalizers.BertNormalizer(lowercase=False, strip_accents=False),
    "nfkc-lowercase": lambda: normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
    "bert-no-clean-text": lambda: normalizers.Sequence([normalizers.NFKD(),
                                                        normalizers.BertNormalizer(clean_text=False)]),
}
# Contents whose normalized forms hold a space (U+00A8 and U+00AF decompose to a space and a combining
# mark), letters in both cases, punctuation, accents.
ADDED_CONTENTS = ["a\u00a8b", "Q\u00afR", "x-y", "Hello", "caf\u00e9", "\u00a8"]
ADDED_FLAVOURS = {
    "normalized": dict(normalized=True),
    "raw": dict(normalized=False),
    "lstrip-rstrip": dict(normalized=True, lstrip=True, rstrip=True),
    "single-word": dict(normalized=True, single_word=True),
    "special": dict(normalized=True, special=True),
}
SPACED_PIECES = ["a", "b", "A", "B", "q", "R", "ab", "x", "y", "-", "hello", "HELLO", "cafe", "Q", "r"]
SPACED_SEPARATORS = [" ", "\t", "\n", "\r", "\r\n", "  ", "", "\u00a8", "\u00af", ".", " \t"]


def _spaced_texts(count: int, seed: int) -> list[str]:
    """Short texts of the added tokens' letters around every kind of whitespace (and the diacritics)."""
    rng = random.Random(seed)
    return ["".join(rng.choice(SPACED_PIECES) + rng.choice(SPACED_SEPARATORS) for _ in range(rng.randint(1, 8)))
            for _ in range(count)]


def _with_added_tokens(normalizer: str, flavour: str) -> Tokenizer:
    tok = _backend(model_zoo.wordpiece_tokenizer())
    tok.normalizer = NORMALIZERS[normalizer]()
    tokens = [AddedToken(content, **ADDED_FLAVOURS[flavour]) for content in ADDED_CONTENTS]
    if ADDED_FLAVOURS[flavour].get("special"):
        tok.add_special_tokens(tokens)
    else:
        tok.add_tokens(tokens)
    return tok


def test_an_added_token_normalized_to_a_space_is_matched_across_tabs_newlines_and_returns():
    """NFKD + BertNormalizer: "a\u00a8b" is "a b" once normalized, and clean_text makes "a\\tb" "a b"
    too, so the library gives one token for it; the cache (or the library behind it) must as well."""
    tok = TruncatingTokenizer(_backend(model_zoo.spaced_added_token_tokenizer()))
    library = _library_ids(tok, ["a\tb", "a\nb", "a\rb", "a b", "a\r\nb"], 64)
    assert library[0] == library[3] and len(library[0]) == 3  # the reference: one added token between [CLS] [SEP]
    assert len(library[4]) == 4  # two spaces: no match
    texts = ["a\tb", "a\nb", "a\rb", "a b", "a\r\nb", "xa\tby", "A\tB", "a\t\tb"] + _spaced_texts(2000, seed=5)
    for max_tokens in (3, 5, 64):
        _assert_same(tok, texts, max_tokens)
    assert tok.word_cache is not None and tok.word_cache.texts > 1000  # the shortcut itself was tested


@pytest.mark.parametrize("flavour", sorted(ADDED_FLAVOURS))
@pytest.mark.parametrize("normalizer", sorted(NORMALIZERS))
def test_added_token_flavours_under_each_normalizer_give_the_library_ids(normalizer, flavour):
    """normalized / raw / lstrip+rstrip / single_word / special added tokens whose normalized forms hold
    spaces, under normalizers with and without clean_text: every text gives the library's ids."""
    tok = TruncatingTokenizer(_with_added_tokens(normalizer, flavour))
    texts = _spaced_texts(600, seed=len(normalizer) * 7 + len(flavour))
    for max_tokens in (4, 64):
        _assert_same(tok, texts, max_tokens)


def _without_unk() -> Tokenizer:
    """BERT's vocabulary with [UNK] taken out: the library raises on a word it cannot spell."""
    desc = json.loads(_backend(model_zoo.wordpiece_tokenizer()).to_str())
    del desc["model"]["vocab"]["[UNK]"]
    desc["added_tokens"] = [t for t in desc["added_tokens"] if t["content"] != "[UNK]"]
    return Tokenizer.from_str(json.dumps(desc))


def test_a_vocabulary_without_unk_loads_and_gives_the_library_ids_or_its_error():
    tok = TruncatingTokenizer(_without_unk())
    assert tok.word_cache is not None  # its start-up probe did not need [UNK]
    texts = corpus.sentences(300, seed=9) + ["plain\ttab\r\n", "", "Hello, World!"]
    for max_tokens in (5, 64):
        _assert_same(tok, texts, max_tokens)
    assert tok.word_cache.texts > 0
    too_long = "x" * 150  # longer than max_input_chars_per_word: [UNK], which this vocabulary lacks
    with pytest.raises(Exception, match="Missing \\[UNK\\]") as library_error:
        _library_ids(tok, [too_long], 64)
    for texts in ([too_long], ["fine words", "a " + too_long]):
        with pytest.raises(type(library_error.value), match="Missing \\[UNK\\]"):
            tok.encode_many(texts, 64)


@pytest.mark.slow
def test_pipeline_with_a_spaced_added_token_matches_sentence_transformers(tmp_path):
    """End to end: a tiny BERT saved by ST over the NFKD + BertNormalizer tokenizer with "a\u00a8b"."""
    from sentence_transformers import SentenceTransformer
    from test_fidelity import assert_close, assert_differs, embed

    from pooling_pipeline import Pipeline

    path = model_zoo.build_bert_spaced_added_token(tmp_path)
    texts = ["x a\tb y", "x a\nb y", "x a\r\nb y", "a\tb", "A\rB and more", "plain words"] + _spaced_texts(60, 3)
    ref = SentenceTransformer(path, device="cpu").encode(texts, batch_size=16)
    assert_differs(ref[0], ref[2], "the added token (a\\tb vs a\\r\\nb)")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        assert_close(embed(pipe, texts), ref, "spaced added token")
