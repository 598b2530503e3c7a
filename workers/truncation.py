"""Exact truncation without tokenizing the whole text.

A 200k-token web page kept to 256 tokens should cost about what 256 tokens cost. The planner
tokenizes a character prefix of the text (a suffix when truncating on the left) instead of the
whole of it, and is exact: the ids equal those of full tokenization followed by truncation.
That holds when

1. the prefix is cut just before a whitespace run (the character before the cut is not
   whitespace); a suffix starts at the last whitespace character of a run (one whitespace
   character, then a word) -- so every word kept is a whole word of the full text, with the
   space that byte-level BPE and Metaspace attach to it;
2. the tokenizer's normalizer works character by character (lowercase, NFx, accent stripping,
   BERT cleaning ...) and its pre-tokenizer splits at that whitespace, so the pre-tokens of the
   piece are exactly the first (last) pre-tokens of the full text and the model (WordPiece, BPE,
   Unigram) tokenizes each pre-token on its own;
3. the piece yields more tokens than are kept (plus a safety margin); otherwise it is doubled and
   tried again.

`analyse_tokenizer` checks (2) on the tokenizer's own description, per family: WordPiece (BERT),
byte-level BPE (GPT-2 / RoBERTa regex, or the GPT-4-style Split regex of Llama-3 and Qwen, where
only a space is a safe cut because punctuation swallows the newlines after it) and SentencePiece
style Metaspace (the space only). A tokenizer it cannot vouch for takes the slow, full path:
correct first.

Text without usable whitespace (CJK, base64, minified code) must not be tokenized whole either (3M
CJK characters cost a worker 1.3 GB that way). The fallback cuts where the pre-tokenizer is known
to split whatever the context, instead of (1):

1'. WordPiece (BertPreTokenizer): just before a punctuation character (each is a pre-token of its
    own) or, when the BertNormalizer pads Chinese characters with spaces, a CJK ideograph;
    byte-level BPE (the GPT-2 regex or a known Split regex): between a letter and a digit,
    punctuation or symbol (no alternative of those regexes matches a letter and then such a
    character). Metaspace splits at spaces only: no fallback there.

and verifies each cut on the text around it, with the tokenizer itself: no added token can cover
it, the normalizer treats both sides apart (normalizing the window equals normalizing each side),
and the pre-tokenizer splits the normalized window there. A piece that starts at such a cut (a
suffix, a chunk-mode piece) is used only when nothing acts on the start of a text (no Strip or
Prepend normalizer, no ByteLevel add_prefix_space).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass

from tokenizers import Encoding, Tokenizer

from pooling_pipeline.workers.tokenizer_shape import describe, flatten
from pooling_pipeline.workers.word_cache import WordCache

# Normalizers that map each character on its own. (Strip and Prepend touch only the ends of the
# text: harmless at a prefix's end, not at a suffix's start.)
_LOCAL_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents", "Nmt",
                      "ByteLevel"}
_START_NORMALIZERS = {"Strip", "Prepend"}
WHITESPACE = " \t\n\r"
# Pre-tokenizers whose pieces never span a whitespace run, and where they may be cut.
_SPLITTERS = {"BertPreTokenizer": WHITESPACE, "Whitespace": WHITESPACE, "WhitespaceSplit": WHITESPACE,
              "ByteLevel": WHITESPACE, "Metaspace": " "}
# Pre-tokenizers that only split pieces further (never join across a boundary).
_REFINERS = {"Punctuation", "Digits", "ByteLevel", "UnicodeScripts"}
# Split regexes known to end pieces at a space: GPT-4 style, as in Llama-3 (\p{N}{1,3}) and Qwen2 (\p{N}).
_KNOWN_SPLIT_PATTERNS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
}
SAFETY_MARGIN_TOKENS = 8
CHARS_PER_TOKEN_GUESS = 6  # generous for prose; the piece doubles when it falls short
CHUNK_TOKENIZE_CHARS = 1 << 16  # chunk mode tokenizes a long document in pieces of about this size


# Candidates for a cut without whitespace, by the pre-tokenizer's family (each one is then checked
# exactly, character by character, and verified with the tokenizer itself).
_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002ceaf\U0002f800-\U0002fa1f"
_SPLIT_CANDIDATES = {
    "bert": re.compile(f"[^\\w\\s]|_|[{_CJK}]"),  # punctuation (BERT's: ASCII symbols too) or a CJK ideograph
    "letters": re.compile(r"(?<=[^\W\d_])(?:[^\w\s]|\d)"),  # a letter, then a digit, punctuation or symbol
}
MAX_SPLIT_VERIFICATIONS = 32  # candidates verified per search before giving up (then the full path)
VERIFY_WINDOW_CHARS = 16  # text on each side of a cut that its verification looks at


@dataclass(frozen=True)
class PrefixRule:
    exact: bool  # a whitespace-aligned prefix gives exact ids
    cut_chars: str  # characters a cut may be placed at
    reason: str  # why not, when not exact (reported in stats and debug logs)
    suffix_exact: bool = False  # a suffix (left truncation) gives exact ids too
    # Text without whitespace: "bert" or "letters" (see the module docstring), or None.
    split_kind: str | None = None
    split_start_safe: bool = False  # a piece may start at such a cut (suffixes, chunk-mode pieces)
    added_chars: frozenset[str] = frozenset()  # characters of the added tokens: never cut at one


def analyse_tokenizer(tokenizer: Tokenizer) -> PrefixRule:
    """Where this tokenizer's text may be cut so that a prefix (or a suffix) tokenizes exactly as
    the whole text does there, read from its own description; not exact, with the reason, when a
    member of its pipeline is not known to be safe."""
    desc = describe(tokenizer)
    try:
        _check_added_tokens(desc)
        cut_chars, suffix_exact = _read_normalizers(desc)
        splitters, split_kinds, prefix_space = _read_pre_tokenizers(desc)
    except _NotPrefixSafe as e:
        return PrefixRule(False, "", str(e))
    for chars in splitters:
        cut_chars = "".join(c for c in cut_chars if c in chars)
    split_kind = split_kinds.pop() if len(split_kinds) == 1 and split_kinds <= {"bert", "letters"} else None
    return PrefixRule(True, cut_chars, "", suffix_exact, split_kind, suffix_exact and not prefix_space,
                      _added_token_chars(desc))


class _NotPrefixSafe(Exception):
    """Why a tokenizer's prefixes are not known to tokenize exactly (`PrefixRule.reason`)."""


def _check_added_tokens(desc: dict) -> None:
    for added in desc.get("added_tokens") or []:
        if any(ch.isspace() for ch in added.get("content", "")):
            raise _NotPrefixSafe(f"added token {added.get('content')!r} contains whitespace")


def _read_normalizers(desc: dict) -> tuple[str, bool]:
    """(the characters a cut may be placed at as far as the normalizers go, whether a suffix
    normalizes as it does inside the text)."""
    cut_chars = WHITESPACE
    suffix_exact = True
    for norm in flatten(desc.get("normalizer"), "normalizers"):
        kind = norm.get("type")
        if kind == "Replace":
            pattern = (norm.get("pattern") or {}).get("String")
            if (norm.get("pattern") or {}).get("Regex") == " {2,}" and norm.get("content") == " ":
                # XLM-R / T5: runs of spaces become one. A prefix cut before a run (or a suffix
                # starting at its last space) holds whole runs only, so it normalizes the same.
                continue
            if pattern is None or len(pattern) != 1:
                raise _NotPrefixSafe(f"Replace normalizer with pattern {norm.get('pattern')}")
            if pattern == " ":
                cut_chars = " "  # SentencePiece style: only the space becomes the word marker
        elif kind in _START_NORMALIZERS:
            suffix_exact = False  # it would act on the suffix's first character
        elif kind not in _LOCAL_NORMALIZERS:
            raise _NotPrefixSafe(f"normalizer {kind} is not known to be prefix-safe")
    return cut_chars, suffix_exact


def _read_pre_tokenizers(desc: dict) -> tuple[list[str], set[str], bool]:
    """(the characters each splitting pre-tokenizer may be cut at, the splitters' families for
    text without whitespace, whether something adds a space in front of a text's first word)."""
    splitters = []
    split_kinds = set()
    prefix_space = False
    for pre in flatten(desc.get("pre_tokenizer"), "pretokenizers"):
        kind = pre.get("type")
        if kind == "ByteLevel":
            prefix_space = prefix_space or bool(pre.get("add_prefix_space"))
        if kind == "Split":
            pattern = (pre.get("pattern") or {}).get("Regex")
            if pattern not in _KNOWN_SPLIT_PATTERNS or pre.get("behavior") != "Isolated" or pre.get("invert"):
                raise _NotPrefixSafe(f"Split pre-tokenizer with an unknown pattern {pre.get('pattern')}")
            splitters.append(" ")
            split_kinds.add("letters")
        elif kind == "ByteLevel" and not pre.get("use_regex", True):
            continue  # byte mapping of pieces split by another member
        elif kind == "Metaspace" and pre.get("split") is False:
            raise _NotPrefixSafe("Metaspace pre-tokenizer that does not split")
        elif kind in _SPLITTERS:
            splitters.append(_SPLITTERS[kind])
            split_kinds.add({"BertPreTokenizer": "bert", "ByteLevel": "letters"}.get(kind, "none"))
        elif kind not in _REFINERS:
            raise _NotPrefixSafe(f"pre-tokenizer {kind} is not known to be prefix-safe")
    if not splitters:
        raise _NotPrefixSafe("no pre-tokenizer splits at whitespace: tokens may span it")
    return splitters, split_kinds, prefix_space


def _added_token_chars(desc: dict) -> frozenset[str]:
    """Every character of the added tokens, as written, lowercased and NFKC-lowercased."""
    added_chars = set()
    for added in desc.get("added_tokens") or []:
        content = added.get("content", "")
        for form in (content, content.lower(), unicodedata.normalize("NFKC", content).lower()):
            added_chars.update(form)
    return frozenset(added_chars)


class TruncatingTokenizer:
    """Tokenizes text and keeps the first (or last) `max_tokens` tokens, special tokens included."""

    def __init__(self, tokenizer: Tokenizer, chars_per_token_guess: int = CHARS_PER_TOKEN_GUESS,
                 min_prefix_chars: int = 256) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        # A twin that truncates and adds special tokens inside the tokenizer (Rust), for the batch
        # path of short texts: one call per batch instead of two Python calls per text.
        self.batch_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.batch_tokenizer.no_padding()
        self._batch_limit: int | None = None
        # encode_batch_fast (tokenizers >= 0.21) skips character offsets, which are never used here.
        self._encode_batch = getattr(self.batch_tokenizer, "encode_batch_fast", self.batch_tokenizer.encode_batch)
        self.rule = analyse_tokenizer(tokenizer)
        processor = tokenizer.post_processor
        self.num_special_tokens = processor.num_special_tokens_to_add(False) if processor else 0
        self.num_special_tokens_pair = processor.num_special_tokens_to_add(True) if processor else 0
        # The special tokens around a single text, e.g. [CLS] ... [SEP], from a probe.
        probe = tokenizer.encode("probe", add_special_tokens=False)
        wrapped = tokenizer.post_process(tokenizer.encode("probe", add_special_tokens=False)).ids
        at = next(i for i in range(len(wrapped) - len(probe.ids) + 1)
                  if wrapped[i:i + len(probe.ids)] == probe.ids)
        self.special_prefix, self.special_suffix = wrapped[:at], wrapped[at + len(probe.ids):]
        # Plain ASCII text for a BERT-shaped tokenizer: ids from a cache of words (see word_cache.py).
        self.word_cache = WordCache.for_tokenizer(tokenizer, self.special_prefix, self.special_suffix)
        self.chars_per_token_guess = chars_per_token_guess
        self.min_prefix_chars = min_prefix_chars
        self.prefix_encodes = 0  # how often the fast path was taken
        self.split_cuts = 0  # of those, how often at a cut without whitespace (the fallback)
        self.full_encodes_of_long_text = 0  # how often a long text had to be tokenized whole
        self._normalize = tokenizer.normalizer.normalize_str if tokenizer.normalizer is not None else (lambda t: t)
        self._pre_tokenize = tokenizer.pre_tokenizer.pre_tokenize_str if tokenizer.pre_tokenizer is not None else None

    def content_budget(self, max_tokens: int) -> int:
        return max(0, max_tokens - self.num_special_tokens)

    def short_text_chars(self, max_tokens: int) -> int:
        """Texts this short (in characters) are tokenized whole: planning would not save anything."""
        return 2 * self._first_piece_chars(self.content_budget(max_tokens))

    def encode_many(self, texts: list[str], max_tokens: int) -> list[list[int]]:
        """Batch path for short texts: the first `max_tokens` ids of each, special tokens included,
        in one call into the tokenizer. The tokenizer's own truncation keeps `max_tokens` minus
        the special tokens, then adds them: the same ids as `encode`. Texts the word cache vouches
        for skip the library (the same ids, a fifth of the cost)."""
        if self.word_cache is None:
            return self._library_encode_many(texts, max_tokens)
        out = self.word_cache.encode_many(texts, max_tokens)
        rest = [i for i, ids in enumerate(out) if ids is None]
        if rest:
            for i, ids in zip(rest, self._library_encode_many([texts[i] for i in rest], max_tokens)):
                out[i] = ids
        return out

    def _library_encode_many(self, texts: list[str], max_tokens: int) -> list[list[int]]:
        if max_tokens != self._batch_limit:
            self.batch_tokenizer.enable_truncation(max_length=max_tokens)
            self._batch_limit = max_tokens
        return [enc.ids for enc in self._encode_batch(texts)]

    def encode(self, text: str, max_tokens: int, add_special_tokens: bool = True, left: bool = False) -> list[int]:
        """The first (last, when `left`) `max_tokens` ids of `text`, special tokens included when added."""
        if not add_special_tokens:
            return self.content(text, max_tokens, left).ids
        return self.finish(self.content(text, self.content_budget(max_tokens), left), max_tokens, left)

    def encode_pair(self, first: str, second: str, max_tokens: int, max_first: int | None = None,
                    max_second: int | None = None) -> tuple[list[int], list[int]]:
        """A text pair (cross-encoder) with the tokenizer's longest-first truncation: (ids, type ids).

        `longest_first` below computes the lengths tokenizers would keep; it needs a side's exact
        length only when that side fits, and, when both sides overflow an odd budget, which one is
        longer (it keeps the extra token). Each side is tokenized one token past the budget (its
        prefix, so a 200k-token document costs about the budget), and further only to break that tie.
        `max_first` / `max_second` cap a side's content before pairing.
        """
        budget = max(0, max_tokens - self.num_special_tokens_pair)
        sides = [(first, max_first), (second, max_second)]
        encs, lengths = [], []
        for text, cap in sides:
            limit = budget + 1 if cap is None else min(budget + 1, cap)
            enc = self.content(text, limit)
            encs.append(enc)
            # Fewer tokens than asked for, or as many as the cap: the exact (capped) length.
            known = len(enc.ids) < limit or (cap is not None and limit == cap)
            lengths.append(len(enc.ids) if known else None)
        # A side overflows when its length is unknown (past the budget) or known past it (a cap
        # above the budget gives a known length of budget + 1 or more).
        if all(n is None or n > budget for n in lengths):  # both overflow: only their order matters
            first_longer = self._first_is_longer(sides, budget)
            lengths = [budget + 2, budget + 1] if first_longer else [budget + 1, budget + 1]
        else:  # an overflowing side is the longer one; any length past the budget acts the same
            lengths = [budget + 1 if n is None else n for n in lengths]
        keep_first, keep_second = longest_first(lengths[0], lengths[1], budget)
        encs[0].truncate(keep_first)
        encs[1].truncate(keep_second)
        enc = self.tokenizer.post_process(encs[0], encs[1])
        return enc.ids, enc.type_ids

    def pair_tokens(self, first: str, second: str, max_tokens: int, max_first: int | None = None,
                    max_second: int | None = None) -> tuple[int, bool]:
        """A pair's length before its longest-first cut, special tokens included, each side first capped
        at `max_first` / `max_second` content tokens: (tokens, exact). Each side is tokenized no further
        than `max_tokens` needs to tell, so past it the count is a lower bound."""
        budget = max(0, max_tokens - self.num_special_tokens_pair)
        total, exact = self.num_special_tokens_pair, True
        for text, cap in ((first, max_first), (second, max_second)):
            count, whole = self.count_tokens(text, budget if cap is None else min(budget, cap))
            if cap is not None and count >= cap:
                count, whole = cap, True
            total, exact = total + count, exact and whole
        return total, exact

    def _first_is_longer(self, sides: list[tuple[str, int | None]], budget: int) -> bool:
        """Whether the first text has more (capped) content tokens than the second: counted on
        growing prefixes until one side's length is known."""
        limit = max(2 * budget, 64)
        while True:
            counts = []
            for text, cap in sides:
                count, exact = self.count_tokens(text, limit if cap is None else min(limit, cap))
                if cap is not None and count >= cap:
                    count, exact = cap, True
                counts.append((count, exact))
            (c1, e1), (c2, e2) = counts
            if e1 and e2:
                return c1 > c2
            if e1 and c1 <= limit < c2:  # the second is past the limit, the first is not
                return False
            if e2 and c2 <= limit < c1:
                return True
            limit *= 2

    def content(self, text: str, budget: int, left: bool = False) -> Encoding:
        """The first (last) `budget` tokens of `text`, without special tokens."""
        if len(text) <= 2 * self._first_piece_chars(budget):  # planning would not save anything
            enc = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            enc, _ = self._encode_long(text, budget, left)
        enc.truncate(budget, direction="left" if left else "right")
        return enc

    def count_tokens(self, text: str, budget: int) -> tuple[int, bool]:
        """Content tokens of `text`: (count, exact). When a prefix already shows more than
        `budget`, the count is a lower bound and the rest of the text is never tokenized."""
        if len(text) > 2 * self._first_piece_chars(budget):
            enc, whole = self._encode_long(text, budget)
            return len(enc.ids), whole
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids), True

    def content_ids(self, text: str) -> Iterator[list[int]]:
        """All content ids of a text, tokenized in whitespace-aligned pieces (chunk mode): memory
        stays at one piece's encoding, however long the document. A piece after the first starts
        with a whitespace run, where a whole-text tokenization starts a new pre-token too."""
        start = 0
        piecewise = self.rule.exact and self.rule.suffix_exact
        while start < len(text):
            end = len(text)
            if piecewise and len(text) - start > 2 * CHUNK_TOKENIZE_CHARS:
                near = start + CHUNK_TOKENIZE_CHARS
                cut = find_cut(text, near, self.rule.cut_chars)
                if (cut is None or cut <= start) and self.rule.split_start_safe:
                    cut = self.find_split_cut(text, near, lo=start + 1)
                end = cut if cut is not None and cut > start else len(text)
            yield self.tokenizer.encode(text[start:end], add_special_tokens=False).ids
            start = end

    def with_special_tokens(self, content_ids: list[int]) -> list[int]:
        return [*self.special_prefix, *content_ids, *self.special_suffix]

    def finish(self, enc: Encoding, max_tokens: int, left: bool = False) -> list[int]:
        enc.truncate(self.content_budget(max_tokens), direction="left" if left else "right")
        return self.tokenizer.post_process(enc).ids

    def _first_piece_chars(self, budget: int) -> int:
        guess = (budget + SAFETY_MARGIN_TOKENS) * self.chars_per_token_guess
        return max(self.min_prefix_chars, guess)

    def _encode_long(self, text: str, budget: int, left: bool = False) -> tuple[Encoding, bool]:
        """At least `budget` + margin tokens from a prefix (suffix), or the whole text's: (encoding, whole)."""
        needed = budget + SAFETY_MARGIN_TOKENS
        if self.rule.exact and (self.rule.suffix_exact or not left):
            length = self._first_piece_chars(budget)
            while length < len(text):
                split = False
                if left:
                    cut = find_suffix_cut(text, len(text) - length, self.rule.cut_chars)
                    if cut is None and self.rule.split_start_safe:  # no whitespace: a split point
                        near = len(text) - length
                        cut, split = self.find_split_cut(text, near, lo=max(1, near - max(near // 2, 1024)),
                                                         forward=False), True
                    piece = text[cut:] if cut is not None else None
                else:
                    cut = find_cut(text, length, self.rule.cut_chars)
                    if cut is None:  # no whitespace: a split point
                        cut, split = self.find_split_cut(text, length), True
                    piece = text[:cut] if cut is not None else None
                if piece is None:
                    break  # no place to cut at: full tokenization below
                enc = self.tokenizer.encode(piece, add_special_tokens=False)
                if len(enc.ids) >= needed:
                    self.prefix_encodes += 1
                    self.split_cuts += split
                    return enc, False
                length = max(len(piece), length) * 2
        self.full_encodes_of_long_text += 1
        return self.tokenizer.encode(text, add_special_tokens=False), True


    # ---- cuts in text without whitespace ---------------------------------------------------

    def find_split_cut(self, text: str, near: int, lo: int | None = None, forward: bool = True) -> int | None:
        """A position p close to `near` where the pre-tokenizer splits whatever the text around
        (see the module docstring), verified with the tokenizer; looks back to `lo` (default
        near/2) first, then forward to 4 * near. None when there is none (or none verifies)."""
        rule = self.rule
        if rule.split_kind is None:
            return None
        pattern = _SPLIT_CANDIDATES[rule.split_kind]
        lo = max(1, near // 2 if lo is None else lo)
        near = min(near, len(text) - 1)
        if near < lo:
            return None
        budget = [MAX_SPLIT_VERIFICATIONS]
        # Backwards in growing windows (the nearest candidate is usually a few characters away).
        end, size = near + 1, 64
        while end > lo and budget[0] > 0:
            start = max(lo, end - size)
            for match in reversed(list(pattern.finditer(text, start, end))):
                if self._split_ok(text, match.start(), budget):
                    return match.start()
            end, size = start, size * 8
        if forward:
            for match in pattern.finditer(text, near + 1, min(len(text), 4 * near)):
                if budget[0] <= 0:
                    break
                if self._split_ok(text, match.start(), budget):
                    return match.start()
        return None

    def _split_ok(self, text: str, p: int, budget: list[int]) -> bool:
        """Whether the pre-tokens of text[:p] (and of text[p:]) are exactly those of the text on
        that side of p: the exact character rule, then a verification with the tokenizer."""
        if p <= 0 or p >= len(text):
            return False
        before, at = text[p - 1], text[p]
        rule = self.rule
        if at in rule.added_chars or at.isspace() or before.isspace():
            return False
        if rule.split_kind == "letters":
            if not before.isalpha() or unicodedata.category(at)[0] not in "NPS":
                return False
        elif not (_is_bert_punctuation(at) or _is_cjk(at)):
            return False
        budget[0] -= 1
        left = self._normalize(text[max(0, p - VERIFY_WINDOW_CHARS):p])
        right = self._normalize(text[p:p + VERIFY_WINDOW_CHARS])
        window = self._normalize(text[max(0, p - VERIFY_WINDOW_CHARS):p + VERIFY_WINDOW_CHARS])
        if not left or not right or window != left + right:
            return False  # the normalizer joins or changes the two sides: not a cut we can vouch for
        if rule.split_kind == "letters":
            if not left[-1].isalpha() or unicodedata.category(right[0])[0] not in "NPS":
                return False
        elif not (right[0].isspace() or _is_bert_punctuation(right[0])):
            return False
        if self._pre_tokenize is None:
            return False
        junction = len(left)
        return all(not start < junction < end for _, (start, end) in self._pre_tokenize(window))


def _is_bert_punctuation(ch: str) -> bool:
    """Punctuation as BertPreTokenizer sees it: ASCII symbols, and Unicode's P* categories."""
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(ch: str) -> bool:
    """A CJK ideograph, as BertNormalizer's handle_chinese_chars pads them with spaces."""
    cp = ord(ch)
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def longest_first(len_first: int, len_second: int, max_length: int) -> tuple[int, int]:
    """The content lengths tokenizers' `longest_first` truncation keeps of a pair (its Rust code,
    line by line): the shorter side whole when it fits in half, the longer gets the rest; both
    over half: half each, the odd token to the longer side (to the second on a tie)."""
    if len_first + len_second <= max_length:
        return len_first, len_second
    swap = len_first > len_second
    n1, n2 = (len_second, len_first) if swap else (len_first, len_second)
    n2 = n1 if n1 > max_length else max(n1, max_length - n1)
    if n1 + n2 > max_length:
        n1 = max_length // 2
        n2 = n1 + max_length % 2
    return (n2, n1) if swap else (n1, n2)


def find_cut(text: str, near: int, cut_chars: str) -> int | None:
    """A prefix end p close to `near`: text[p] starts a whitespace run of cut characters and
    text[p-1] is not whitespace.

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


def find_suffix_cut(text: str, near: int, cut_chars: str) -> int | None:
    """A suffix start p close to `near` (at or before it first): text[p] is a cut character,
    text[p+1] is not whitespace -- one whitespace character, then a word."""
    near = max(0, min(near, len(text) - 2))
    lo = max(0, near - max(near // 2, 1024))
    for c_pos in sorted((text.rfind(c, lo, near + 1) for c in cut_chars), reverse=True):
        if c_pos < 0:
            continue
        pos = c_pos
        while pos >= lo:
            if text[pos] in cut_chars and pos + 1 < len(text) and not text[pos + 1].isspace():
                return pos
            pos = max(text.rfind(c, lo, pos) for c in cut_chars)
            if pos < 0:
                break
        break
    return None
