"""Exact truncation without tokenizing the whole text.

A 200k-token web page kept to 256 tokens should cost about what 256 tokens cost. The planner
tokenizes a character prefix of the text instead of the whole of it, and is exact: the ids equal
those of full tokenization followed by truncation. That holds when

1. the prefix is cut just before a whitespace run (the character before the cut is not whitespace),
   so every word of the prefix is a whole word of the full text;
2. the tokenizer's normalizer works character by character (lowercase, NFx, accent stripping,
   BERT cleaning ...) and its pre-tokenizer splits at that whitespace, so the pre-tokens of the
   prefix are exactly the first pre-tokens of the full text and the model (WordPiece, BPE, Unigram)
   tokenizes each pre-token on its own;
3. the prefix yields more tokens than are kept (plus a safety margin); otherwise the prefix is
   doubled and tried again.

`analyse_tokenizer` checks (2) on the tokenizer's own description; a tokenizer it cannot vouch for,
or a text with no usable whitespace (CJK, base64, minified code), takes the slow, full path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from tokenizers import Encoding, Tokenizer

# Normalizers that map each character on its own (or only touch the ends of the text).
_LOCAL_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents",
                      "Strip", "Prepend", "Nmt", "ByteLevel"}
# Pre-tokenizers whose pre-tokens never span a whitespace run.
_WHITESPACE_SPLITTING = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits",
                         "ByteLevel", "Metaspace"}
SAFETY_MARGIN_TOKENS = 8
CHARS_PER_TOKEN_GUESS = 6  # generous for prose; the prefix doubles when it falls short


@dataclass(frozen=True)
class PrefixRule:
    exact: bool  # True when a whitespace-aligned prefix gives exact ids
    cut_chars: str  # characters a cut may be placed before
    reason: str  # why not, when not exact (reported in stats and debug logs)


def analyse_tokenizer(tokenizer: Tokenizer) -> PrefixRule:
    desc = json.loads(tokenizer.to_str())
    cut_chars = " \t\n\r"
    for added in desc.get("added_tokens") or []:
        if any(ch.isspace() for ch in added.get("content", "")):
            return PrefixRule(False, "", f"added token {added.get('content')!r} contains whitespace")

    for norm in _flatten(desc.get("normalizer"), "normalizers"):
        kind = norm.get("type")
        if kind == "Replace":
            pattern = (norm.get("pattern") or {}).get("String")
            if pattern is None or len(pattern) != 1:
                return PrefixRule(False, "", f"Replace normalizer with pattern {norm.get('pattern')}")
            if pattern == " ":
                cut_chars = " "  # SentencePiece style: only the space becomes the word marker
        elif kind not in _LOCAL_NORMALIZERS:
            return PrefixRule(False, "", f"normalizer {kind} is not known to be prefix-safe")

    pre_tokenizers = _flatten(desc.get("pre_tokenizer"), "pretokenizers")
    if not pre_tokenizers:
        return PrefixRule(False, "", "no pre-tokenizer: tokens may span whitespace")
    for pre in pre_tokenizers:
        kind = pre.get("type")
        if kind not in _WHITESPACE_SPLITTING:
            return PrefixRule(False, "", f"pre-tokenizer {kind} is not known to be prefix-safe")
        if kind == "ByteLevel" and not pre.get("use_regex", True):
            return PrefixRule(False, "", "ByteLevel pre-tokenizer without its splitting regex")
        if kind == "Metaspace":
            if pre.get("split") is False:
                return PrefixRule(False, "", "Metaspace pre-tokenizer that does not split")
            cut_chars = " "  # Metaspace splits on the space only, not on tabs or newlines
    return PrefixRule(True, cut_chars, "")


def _flatten(node: dict | None, key: str) -> list[dict]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        out: list[dict] = []
        for child in node.get(key) or []:
            out.extend(_flatten(child, key))
        return out
    return [node]


class TruncatingEncoder:
    """Tokenizes text and keeps the first `max_tokens` tokens, special tokens included."""

    def __init__(self, tokenizer: Tokenizer, preprocess: Callable[[str], str] | None = None,
                 chars_per_token_guess: int = CHARS_PER_TOKEN_GUESS, min_prefix_chars: int = 256) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        self.rule = analyse_tokenizer(tokenizer)
        processor = tokenizer.post_processor
        self.num_special_tokens = processor.num_special_tokens_to_add(False) if processor else 0
        # Character-local text preprocessing (e.g. sentence-transformers' do_lower_case).
        self.preprocess = preprocess or (lambda s: s)
        self.chars_per_token_guess = chars_per_token_guess
        self.min_prefix_chars = min_prefix_chars
        self.prefix_encodes = 0  # how often the fast path was taken
        self.full_encodes_of_long_text = 0  # how often a long text had to be tokenized whole

    def content_budget(self, max_tokens: int) -> int:
        return max(0, max_tokens - self.num_special_tokens)

    def short_enough(self, text: str, max_tokens: int) -> bool:
        """Texts this short are tokenized whole: planning would not save anything."""
        return len(text) <= 2 * self._first_prefix_chars(self.content_budget(max_tokens))

    def encode_many(self, texts: list[str], max_tokens: list[int]) -> list[list[int]]:
        """Batch path for short texts (one call into the tokenizer for all of them)."""
        encodings = self.tokenizer.encode_batch([self.preprocess(t) for t in texts], add_special_tokens=False)
        return [self._finish(enc, k) for enc, k in zip(encodings, max_tokens)]

    def encode(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> list[int]:
        """The first `max_tokens` ids of `text` (special tokens included when added)."""
        if not add_special_tokens:
            return self.content(text, max_tokens).ids
        return self._finish(self.content(text, self.content_budget(max_tokens)), max_tokens)

    def encode_pair(self, first: str, second: str, max_tokens: int, max_first: int | None = None,
                    max_second: int | None = None) -> tuple[list[int], list[int]]:
        """A text pair (cross-encoder) with the tokenizer's longest-first truncation: (ids, type ids).

        Neither side can keep more than the pair's content budget, so each side is planned to that
        (or to its own cap) first; the pair truncation then runs on those prefixes exactly as it
        would on the whole texts.
        """
        processor = self.tokenizer.post_processor
        budget = max(0, max_tokens - (processor.num_special_tokens_to_add(True) if processor else 0))
        enc_first = self.content(first, min(budget, max_first) if max_first is not None else budget)
        enc_second = self.content(second, min(budget, max_second) if max_second is not None else budget)
        self.tokenizer.enable_truncation(max_length=max_tokens, strategy="longest_first")
        try:
            enc = self.tokenizer.post_process(enc_first, enc_second)
        finally:
            self.tokenizer.no_truncation()
        return enc.ids, enc.type_ids

    def content(self, text: str, budget: int) -> Encoding:
        """The first `budget` tokens of `text`, without special tokens."""
        if len(text) <= 2 * self._first_prefix_chars(budget):  # planning would not save anything
            enc = self.tokenizer.encode(self.preprocess(text), add_special_tokens=False)
        else:
            enc = self._encode_long(text, budget)
        enc.truncate(budget)
        return enc

    def _first_prefix_chars(self, budget: int) -> int:
        guess = (budget + SAFETY_MARGIN_TOKENS) * self.chars_per_token_guess
        return max(self.min_prefix_chars, guess)

    def _encode_long(self, text: str, budget: int) -> Encoding:
        needed = budget + SAFETY_MARGIN_TOKENS
        if self.rule.exact:
            length = self._first_prefix_chars(budget)
            while length < len(text):
                cut = find_cut(text, length, self.rule.cut_chars)
                if cut is None:
                    break  # no whitespace to cut at: full tokenization below
                enc = self.tokenizer.encode(self.preprocess(text[:cut]), add_special_tokens=False)
                if len(enc.ids) >= needed:
                    self.prefix_encodes += 1
                    return enc
                length = max(cut, length) * 2
        self.full_encodes_of_long_text += 1
        return self.tokenizer.encode(self.preprocess(text), add_special_tokens=False)

    def _finish(self, enc: Encoding, max_tokens: int) -> list[int]:
        enc.truncate(self.content_budget(max_tokens))
        return self.tokenizer.post_process(enc).ids


def find_cut(text: str, near: int, cut_chars: str) -> int | None:
    """A cut position p close to `near` with text[p] a cut character and text[p-1] not whitespace.

    Looks back to near/2 first (a shorter prefix is cheaper), then forward to 4 * near.
    Returns None when the text has no such position in that range.
    """
    lo = near // 2
    pos = max(text.rfind(c, lo, near + 1) for c in cut_chars)
    if pos < 0:
        hits = [i for i in (text.find(c, near, 4 * near) for c in cut_chars) if i >= 0]
        if not hits:
            return None
        pos = min(hits)
    while pos > 0 and text[pos - 1] in cut_chars:
        pos -= 1  # the start of the whitespace run
    if pos == 0 or text[pos - 1].isspace():
        return None  # a run that starts with other whitespace: not a cut we can vouch for
    return pos
