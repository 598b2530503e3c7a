"""A tokenizer's own description (its tokenizer.json), read for the shortcuts that depend on its shape."""

from __future__ import annotations

import json

from tokenizers import Tokenizer


def describe(tokenizer: Tokenizer) -> dict:
    """The tokenizer as it is configured now (transformers may have changed it since loading)."""
    return json.loads(tokenizer.to_str())


def flatten(node: dict | None, key: str) -> list[dict]:
    """The steps of a normalizer or pre-tokenizer (`key`: "normalizers" / "pretokenizers"), with
    Sequences opened, in order."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        out: list[dict] = []
        for child in node.get(key) or []:
            out.extend(flatten(child, key))
        return out
    return [node]
