"""`SentenceEncoder` is a LangChain `Embeddings` where langchain-core is installed: code that checks
the type (a pydantic field typed `Embeddings`, as LangChain's contextual-compression filters
declare) takes it, as it takes anything with `embed_documents` / `embed_query` otherwise.

The encoder is registered as a virtual subclass of `langchain_core.embeddings.Embeddings` (an ABC)
without importing LangChain: at once where the module that defines it is imported already, else
when it is imported -- an import hook on that one module, which removes itself once it has run.
Importing it costs what a user without LangChain must not pay: 0.19 s and 30 MB of RSS
(pydantic and the rest of langchain-core, measured on this 2-core machine).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from types import ModuleType

# Where langchain-core defines `Embeddings` (`langchain_core.embeddings` imports it lazily from there).
EMBEDDINGS_MODULE = "langchain_core.embeddings.embeddings"
_lock = threading.Lock()
_waiting: list[type] = []  # classes to register when the module is imported


def register_as_embeddings(cls: type) -> None:
    """Makes `cls` a virtual subclass of LangChain's `Embeddings`, now or when it is imported; nothing
    where langchain-core is not installed."""
    with _lock:
        module = sys.modules.get(EMBEDDINGS_MODULE)
        if module is not None and hasattr(module, "Embeddings"):
            module.Embeddings.register(cls)
            return
        if importlib.util.find_spec("langchain_core") is None:  # (finds, does not import)
            return
        _waiting.append(cls)
        if not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport())


def _register_waiting(module: ModuleType) -> None:
    with _lock:
        for cls in _waiting:
            module.Embeddings.register(cls)
        _waiting.clear()
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _RegisterOnImport)]


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for EMBEDDINGS_MODULE, the spec the other finders give, its loader
    wrapped so that the waiting classes are registered once the module has run."""

    def find_spec(self, name, path, target=None):
        if name != EMBEDDINGS_MODULE:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenRegister(spec.loader)
                return spec
        return None


class _ThenRegister(importlib.abc.Loader):
    """A module's own loader, then the registration. The module keeps its own loader as
    `__loader__` (inspect and linecache read its source through it)."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _register_waiting(module)
