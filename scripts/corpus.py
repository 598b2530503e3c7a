"""Real English text built from what ships with Python: the standard library's docstrings.

Tests, benchmarks and the launcher's demo need real text (tokenizers behave differently on random
strings) without shipping a corpus or downloading one. Docstrings are read with `ast` from the
standard library's source files, without importing any module. Deterministic for a given Python.
"""

from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
from pathlib import Path

_SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "__pycache__"}
_SPACES = re.compile(r"[ \t]+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


@functools.lru_cache(maxsize=1)
def docstrings() -> tuple[str, ...]:
    """Every docstring of the standard library with at least a few words, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if _SKIP_PARTS.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= 4:
                    found.append(doc.strip())
    return tuple(found)


def _paragraphs() -> list[str]:
    paras = []
    for doc in docstrings():
        for para in doc.split("\n\n"):
            para = _SPACES.sub(" ", " ".join(line.strip() for line in para.splitlines())).strip()
            if len(para.split()) >= 4:
                paras.append(para)
    return paras


def sentences(n: int, seed: int = 0) -> list[str]:
    """Short real sentences (about 5 to 60 words)."""
    pool = [s for p in _paragraphs() for s in _SENTENCE_END.split(p) if 5 <= len(s.split()) <= 60]
    return random.Random(seed).sample(pool, n) if n <= len(pool) else [pool[i % len(pool)] for i in range(n)]


def medium_texts(n: int, seed: int = 0, min_chars: int = 400, max_chars: int = 3000) -> list[str]:
    """Whole docstrings of a few paragraphs, newlines and indentation kept."""
    pool = [d for d in docstrings() if min_chars <= len(d) <= max_chars]
    return random.Random(seed).sample(pool, n) if n <= len(pool) else [pool[i % len(pool)] for i in range(n)]


def long_document(target_chars: int, seed: int = 0) -> str:
    """One long document: docstrings in a shuffled order joined with blank lines, cut at a word."""
    rng = random.Random(seed)
    docs = list(docstrings())
    parts, size = [], 0
    while size < target_chars:
        doc = docs[rng.randrange(len(docs))]
        parts.append(doc)
        size += len(doc) + 2
    text = "\n\n".join(parts)[:target_chars]
    return text[: text.rfind(" ")] if " " in text else text


def long_documents(n: int, min_chars: int, max_chars: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [long_document(rng.randint(min_chars, max_chars), seed=seed * 1000 + i) for i in range(n)]
