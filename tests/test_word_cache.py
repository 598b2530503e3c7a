"""The word cache gives exactly the `tokenizers` library's ids, for every BERT-shaped tokenizer it
takes, and is never used for a tokenizer or a text it cannot vouch for."""

import random

import corpus
import model_zoo
import pytest
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


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
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
