"""BERT WordPiece tokenization of plain ASCII text from a cache of words, exactly as `tokenizers` does it.

A render worker is the bottleneck of a pipeline that embeds short texts: the `tokenizers` library
spends ~35 us on a 24-token sentence, most of it in its normalizer and pre-tokenizer (character by
character, with offsets kept for every piece), while the words themselves repeat (Zipf): a corpus of
a hundred million documents has a few million distinct word forms, a batch of 256 sentences a few
hundred. For a BERT-shaped tokenizer and a text made only of printable ASCII, tab, newline and
carriage return, each of those steps is simple enough to do in C through Python's own string
methods, and the library's result is known without asking it:

- BertNormalizer / Lowercase / NFx / StripAccents: on such text only lowercasing changes anything,
  and `str.lower()` lowercases ASCII as Rust does (clean_text maps tab, newline and carriage return
  to spaces, which then split like spaces; accents and CJK padding have nothing to act on);
- BertPreTokenizer: splits at whitespace (dropped) and isolates each punctuation character; every
  printable ASCII character that is not a letter, digit or space is BERT punctuation, so the
  pre-tokens are the runs of letters and digits and the single other characters;
- WordPiece: each pre-token on its own, so a word's ids are the model's (`model.tokenize(word)`,
  the library's own code), remembered per word;
- added tokens ([CLS], [MASK] or a vocabulary's additions) are matched in the text before all of
  this: a text in which any of them may occur (as written, lowercased or normalized) is left to the
  library; so is any text with another character, and any tokenizer of another shape. The library
  looks for a normalized token's normalized form in the normalized text, where clean_text made tabs,
  newlines and carriage returns spaces: a form with a space ("a\u00a8b" is "a b" after NFKD and
  strip_accents) is searched with any whitespace character in its place (a superset of the library's
  matches: lstrip / rstrip / single_word / special only narrow or widen a match already found, and
  any match sends the text to the library);
- a word the model cannot spell (no [UNK] in the vocabulary) makes the library raise: such a text is
  left to the library too, which raises its own error.

`WordCache.for_tokenizer` vouches for a tokenizer from its own description and then checks itself
against the library on probe texts: anything it cannot match exactly is never used (the library's
path is the default, the cache a shortcut). The cache is bounded: when full it is emptied and
refilled by the words that come next (the frequent ones come back first).
"""

from __future__ import annotations

import itertools
import os
import re

from tokenizers import Tokenizer

from pooling_pipeline.workers.tokenizer_shape import describe, flatten

WORD_CACHE_ENV = "POOLING_PIPELINE_WORD_CACHE"  # "0" turns the shortcut off (for A/B measurements)
MAX_CACHED_WORDS = 1 << 17  # ~30 MB of words and ids per worker at most
MAX_CACHED_WORD_CHARS = 48  # longer words (rare) are tokenized each time, never kept
MAX_ADDED_TOKENS = 512  # more added tokens than this: their search would cost what it saves

# Normalizers that change nothing in printable ASCII but letter case.
_ASCII_NEUTRAL_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents"}
_POST_PROCESSORS = {None, "TemplateProcessing", "BertProcessing", "RobertaProcessing"}
# Characters outside printable ASCII but tab, newline and carriage return (BERT's whitespace among them).
_NOT_PLAIN = re.compile(r"[^\t\n\r\x20-\x7e]")
_PROBES = (
    "Hello, World! It's 3.14 -- a-b_c [x] {y} <z> ~`^|\\ \"quoted\" #tag @user $5 %d & * + = / ? ; :",
    "  leading\tand\ttabs\nnewlines\r\ncarriage  returns   ",
    "supercalifragilisticexpialidocious " + "x" * 150 + " unaffable UNAFFABLE MiXeD cAsE 12345678901234",
    "",
    "[CLS] [SEP] [MASK] [PAD] [UNK] <s> </s> <pad> <unk> <mask> [cls] [mask]",
)


class WordCache:
    """Token ids of plain ASCII texts for one BERT-shaped tokenizer, from remembered words."""

    def __init__(self, tokenizer: Tokenizer, lowercase: bool, added: list[str], prefix: list[int],
                 suffix: list[int]) -> None:
        self._model_tokenize = tokenizer.model.tokenize
        self._lowercase = lowercase
        self._words = re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9\s]").findall
        # Any occurrence of an added token, in any letter case, sends the text to the library (an
        # added token without letters or with only lowercase ones is matched the same way).
        self._added = re.compile("|".join(map(_form_pattern, sorted(added, key=len, reverse=True))),
                                 re.IGNORECASE).search if added else None
        self._prefix, self._suffix = list(prefix), list(suffix)
        self._cache: dict[str, tuple[int, ...]] = {}
        self.texts = 0  # texts tokenized from the cache
        self.word_misses = 0  # words the model had to tokenize

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, prefix: list[int], suffix: list[int]) -> WordCache | None:
        """A cache for this tokenizer when it is BERT-shaped and matches the library on the probes,
        else None (then every text goes through the library)."""
        if os.environ.get(WORD_CACHE_ENV, "1") == "0":
            return None
        desc = describe(tokenizer)
        if (desc.get("model") or {}).get("type") != "WordPiece":
            return None
        if (desc.get("pre_tokenizer") or {}).get("type") != "BertPreTokenizer":
            return None
        lowercase = False
        for norm in flatten(desc.get("normalizer"), "normalizers"):
            kind = norm.get("type")
            if kind not in _ASCII_NEUTRAL_NORMALIZERS:
                return None
            lowercase = lowercase or kind == "Lowercase" or (kind == "BertNormalizer" and bool(norm.get("lowercase")))
        if (desc.get("post_processor") or {}).get("type") not in _POST_PROCESSORS:
            return None
        added = _added_token_forms(tokenizer, desc.get("added_tokens") or [])
        if added is None:
            return None
        cache = cls(tokenizer, lowercase, added, prefix, suffix)
        return cache if cache._matches_library(tokenizer) else None

    def encode_many(self, texts: list[str], max_tokens: int) -> list[list[int] | None]:
        """The first `max_tokens` ids of each text (special tokens included), or None for a text
        the cache cannot vouch for. `max_tokens` covers at least the special tokens."""
        out: list[list[int] | None] = []
        cache, words_of, added = self._cache, self._words, self._added
        get = cache.get
        prefix, suffix = self._prefix, self._suffix
        end = max(len(prefix), max_tokens - len(suffix))  # where the content stops
        chain = itertools.chain.from_iterable
        for text in texts:
            if not text.isascii() or (not text.isprintable() and _NOT_PLAIN.search(text)) or (added and added(text)):
                out.append(None)
                continue
            words = words_of(text.lower() if self._lowercase else text)
            parts = list(map(get, words))
            if None in parts:
                try:
                    parts = [ids if ids is not None else self._learn(word) for ids, word in zip(parts, words)]
                except Exception:  # the model cannot spell a word (no [UNK]): the library raises its error
                    out.append(None)
                    continue
            ids = prefix.copy()
            ids.extend(chain(parts))
            if len(ids) > end:
                del ids[end:]
            ids.extend(suffix)
            out.append(ids)
            self.texts += 1
        return out

    def _learn(self, word: str) -> tuple[int, ...]:
        self.word_misses += 1
        ids = tuple(token.id for token in self._model_tokenize(word))
        if len(word) <= MAX_CACHED_WORD_CHARS:
            if len(self._cache) >= MAX_CACHED_WORDS:
                self._cache.clear()
            self._cache[word] = ids
        return ids

    def _matches_library(self, tokenizer: Tokenizer) -> bool:
        """Whether every probe the cache takes gives the library's ids, at several lengths, and the
        cache leaves to the library every probe the library refuses (a vocabulary without [UNK])."""
        reference = Tokenizer.from_str(tokenizer.to_str())
        reference.no_padding()
        for max_tokens in (512, 8, len(self._prefix) + len(self._suffix) + 1):
            reference.enable_truncation(max_length=max_tokens)
            for probe in _PROBES:
                [ids] = self.encode_many([probe], max_tokens)
                try:
                    want = reference.encode(probe).ids
                except Exception:  # the library refuses it: the cache must not answer
                    want = None
                if ids is not None and ids != want:
                    return False
        self._cache.clear()
        self.texts = self.word_misses = 0
        return True


def _added_token_forms(tokenizer: Tokenizer, added_tokens: list[dict]) -> list[str] | None:
    """Every form in which an added token may be matched in a normalized ASCII text (as written and
    as the normalizer leaves it), or None when the search could not be exact or cheap."""
    if len(added_tokens) > MAX_ADDED_TOKENS:
        return None
    forms = set()
    normalize = tokenizer.normalizer.normalize_str if tokenizer.normalizer is not None else None
    for token in added_tokens:
        content = token.get("content") or ""
        if not content or any(ch.isspace() for ch in content):
            return None  # a token with whitespace could match across what the normalizer maps
        forms.add(content)
        if normalize is not None:
            normalized = normalize(content)
            if not normalized:
                return None  # an empty pattern: what the library matches with it is not worth guessing
            forms.add(normalized)
    return sorted(forms)


def _form_pattern(form: str) -> str:
    """A regex for `form` in the raw text: each whitespace character of it may be any whitespace
    character there (the normalizer's clean_text turns tab, newline and carriage return into the
    space of a normalized form)."""
    return "".join(r"\s" if ch.isspace() else re.escape(ch) for ch in form)
