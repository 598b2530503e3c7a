"""Writes the type stubs of the public API -- `pipeline/api.pyi` (`Pipeline`) and
`pipeline/integrations/sentence_encoder.pyi` (`SentenceEncoder`) -- from what the running code declares.

Why a stub: the call methods (`embed`, `score`, `rank`, `classify`, `encode`, their streams and async
twins) and `Pipeline.__init__` are built at run time from the options declared once in
pipeline/options.py and core/shared/options.py (`_call_method`, `OptionsSignature`), so their source reads
`embed(self, prompts, **options)`: an editor completes no keyword and a type checker checks none.
The stub spells out the signature the running method has -- its `inspect.signature`, the one `help()`
shows -- with the docstring `help()` shows, so the two cannot say different things. It installs next
to its module (pooling_pipeline/api.pyi) with a `py.typed` marker; tests/test_type_stubs.py fails when a
checked-in stub differs from what this script writes, and runs mypy on tests/typecheck/.

    python scripts/gen_stubs.py           # rewrite the stubs after changing an option or a public method
    python scripts/gen_stubs.py --check   # exit 1, naming the stale stubs, if they differ

What a stub holds: each stubbed class's public methods and properties (and `__init__`, `__enter__`,
`__exit__`, `__call__`), the public attributes its `__init__` sets (typed where the source annotates
them, `Any` otherwise), and a module `__getattr__` that types the module's other names as `Any` (a
partial stub: only what the API's users reach is spelled out). A `**kwargs` that takes a known set
of keywords is spelled out too (`KWARGS`), so a misspelt one is flagged; an unannotated parameter or
return is `Any`.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import inspect
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "python scripts/gen_stubs.py"
LINE_LENGTH = 130  # ruff's, in pyproject.toml (ruff checks the stubs too)
# Dunder methods a stub keeps (the others are object's own, or private).
PUBLIC_DUNDERS = ("__init__", "__enter__", "__exit__", "__call__")
# A name an annotation uses that neither the stubbed module nor pooling_pipeline's exports import.
EXTRA_NAMES = {"SimDevice": "pooling_pipeline.core.shared.sim_device"}


@dataclasses.dataclass(frozen=True)
class Stub:
    """One stub file: the module it types, where it lies in the repository, the classes it spells out."""

    module: str
    path: str
    classes: tuple[str, ...]


STUBS = (
    Stub("pooling_pipeline.api", "pipeline/api.pyi", ("Pipeline",)),
    Stub("pooling_pipeline.integrations.sentence_encoder", "pipeline/integrations/sentence_encoder.pyi",
         ("SentenceEncoder", "ModelCardData")),
)


# ---- what a **kwargs stands for ---------------------------------------------------------------

def _keyword_only(params) -> list[inspect.Parameter]:
    return [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]


def _pipeline_options() -> list[inspect.Parameter]:
    """SentenceEncoder(model, **pipeline_options) hands them to Pipeline(model, ...): its options, by keyword."""
    from pooling_pipeline.api import Pipeline

    return _keyword_only(list(inspect.signature(Pipeline.__init__).parameters.values())[2:])


# The types of the keywords SentenceEncoder.encode takes through its **kwargs besides MTEB 2's
# (those come from mteb_encoder.encode_for_mteb's signature): ST's Router route (`task`) and what
# MTEB 1 passed (sentence_encoder.IGNORED_KEYWORDS). Any other keyword is a TypeError there; a keyword
# added there without a type here stops this script.
ENCODE_KEYWORD_TYPES = {"task": "str | None", "task_name": "str | None", "prompt_type": "Any", "pool": "Any",
                        "chunk_size": "int | None"}


def encode_keywords() -> list[inspect.Parameter]:
    """SentenceEncoder.encode's **kwargs, each by name (all optional, keyword-only)."""
    from pooling_pipeline.integrations import mteb_encoder, sentence_encoder

    accepted = ("task", *sentence_encoder.IGNORED_KEYWORDS)
    untyped = set(accepted) - set(ENCODE_KEYWORD_TYPES)
    if untyped:
        raise SystemExit(f"SentenceEncoder.encode takes {sorted(untyped)} with no type in "
                         "gen_stubs.ENCODE_KEYWORD_TYPES: add it there")
    out = {name: inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                   annotation=ENCODE_KEYWORD_TYPES[name]) for name in accepted}
    mteb = inspect.signature(mteb_encoder.encode_for_mteb).parameters.values()
    for p in mteb:  # MTEB 2's protocol (task_metadata selects it), optional through encode
        if p.kind is p.KEYWORD_ONLY and p.name not in out:
            out[p.name] = p.replace(default=None if p.default is p.empty else p.default)
    return list(out.values())


def _encode_rest(cls: type) -> list[inspect.Parameter]:
    """encode_query / encode_document(sentences, prompt_name, prompt, **kwargs) hand kwargs to encode."""
    params = [p for p in inspect.signature(cls.encode).parameters.values() if p.kind is not p.VAR_KEYWORD]
    names = [p.name for p in params]
    return _keyword_only(params[names.index("prompt") + 1:]) + encode_keywords()


# (class, method) -> the parameters its **kwargs stands for, in order.
KWARGS: dict[tuple[str, str], Callable[[type], list[inspect.Parameter]]] = {
    ("SentenceEncoder", "__init__"): lambda cls: _pipeline_options(),
    ("SentenceEncoder", "encode"): lambda cls: encode_keywords(),
    ("SentenceEncoder", "encode_query"): _encode_rest,
    ("SentenceEncoder", "encode_document"): _encode_rest,
}


# ---- rendering --------------------------------------------------------------------------------

def _annotation(a: Any) -> str:
    if a is inspect.Parameter.empty or a is inspect.Signature.empty:
        return "Any"
    if isinstance(a, str):
        return a
    return inspect.formatannotation(a)


def _default(value: Any) -> str:
    """A default as the stub shows it: the value where it is a plain literal, else `...`."""
    if value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) < 60):
        return repr(value)
    return "..."


def _parameters(cls: type, name: str, sig: inspect.Signature) -> list[str]:
    params = list(sig.parameters.values())
    if params and params[-1].kind is inspect.Parameter.VAR_KEYWORD and (cls.__name__, name) in KWARGS:
        params = params[:-1] + KWARGS[cls.__name__, name](cls)
    out: list[str] = []
    star = any(p.kind is p.VAR_POSITIONAL for p in params)
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        text = ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
        if not (i == 0 and p.name == "self"):
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {_default(p.default)}"
        out.append(text)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            out.append("/")
    return out


def _docstring(doc: str | None, indent: str) -> list[str]:
    if not doc:
        return []
    text = inspect.cleandoc(doc).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    lines = text.splitlines()
    if len(lines) == 1:
        return [f'{indent}"""{lines[0]}"""']
    return [f'{indent}"""{lines[0]}'] + [f"{indent}{line}" if line else "" for line in lines[1:]] + [f'{indent}"""']


def _function(cls: type, name: str, fn: Callable, indent: str) -> list[str]:
    sig = inspect.signature(fn)
    head = f"{indent}{'async ' if inspect.iscoroutinefunction(fn) else ''}def {name}("
    tail = f") -> {_annotation(sig.return_annotation)}:"
    params = _parameters(cls, name, sig)
    one_line = head + ", ".join(params) + tail
    lines = [one_line] if len(one_line) + 4 <= LINE_LENGTH else \
        [head] + [f"{indent}    {p}," for p in params] + [f"{indent}{tail}"]
    doc = _docstring(fn.__doc__, indent + "    ")  # its own (getdoc would inherit object's)
    if doc:
        return lines + doc
    if len(lines[-1]) + 4 <= LINE_LENGTH:
        return lines[:-1] + [lines[-1] + " ..."]
    return lines + [f"{indent}    ..."]


def _init_attributes(cls: type) -> list[tuple[str, str]]:
    """The public attributes `cls.__init__` sets on self: (name, annotation), `Any` where not annotated."""
    init = cls.__dict__.get("__init__")
    if init is None:
        return []
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(init))))
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" \
                    and not t.attr.startswith("_") and t.attr not in cls.__dict__:
                if isinstance(node, ast.AnnAssign):
                    found[t.attr] = ast.unparse(node.annotation)
                else:
                    found.setdefault(t.attr, "Any")
    return list(found.items())


def _class(cls: type) -> list[str]:
    lines = ["@dataclass"] if dataclasses.is_dataclass(cls) else []
    lines.append(f"class {cls.__name__}:")
    lines += _docstring(cls.__doc__ if "__doc__" in cls.__dict__ else None, "    ")
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            default = "" if f.default is dataclasses.MISSING else f" = {_default(f.default)}"
            lines.append(f"    {f.name}: {_annotation(f.type)}{default}")
        return lines
    attributes = _init_attributes(cls)
    if attributes:
        lines += ([""] if len(lines) > 1 else []) + [f"    {name}: {annotation}" for name, annotation in attributes]
    for name, member in vars(cls).items():
        if name.startswith("_") and name not in PUBLIC_DUNDERS:
            continue
        if isinstance(member, property):
            lines += ["", "    @property"] + _function(cls, name, member.fget, "    ")
        elif isinstance(member, types.FunctionType):
            lines += [""] + _function(cls, name, member, "    ")
        else:
            raise SystemExit(f"{cls.__name__}.{name} is a {type(member).__name__}: gen_stubs does not know how to "
                             "stub it (teach _class)")
    return lines


def _imports(module: types.ModuleType, lines: list[str], defined: set[str]) -> list[str]:
    """The import lines for every name the stub's annotations and decorators use, found where the
    module (or options.py, or the package's exports) has it; in isort's order (ruff checks it)."""
    import pooling_pipeline
    import pooling_pipeline.options as options

    sections: dict[int, tuple[set[str], dict[str, set[str]]]] = {}  # section -> (import lines, from-imports)
    for name in sorted(_names(lines) - defined - set(dir(builtins))):
        obj = vars(module).get(name, vars(options).get(name))
        if obj is None and name in pooling_pipeline._EXPORTS:
            obj = getattr(pooling_pipeline, name)
        where = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", EXTRA_NAMES.get(name))
        if where is None:
            raise SystemExit(f"{module.__name__}'s stub uses {name!r}, which gen_stubs cannot place: import it in the "
                             "module, or add it to gen_stubs.EXTRA_NAMES")
        top = where.partition(".")[0]
        straight, froms = sections.setdefault(
            0 if top in sys.stdlib_module_names else 2 if top == "pooling_pipeline" else 1, (set(), {}))
        if isinstance(obj, types.ModuleType):
            straight.add(f"import {where}" + (f" as {name}" if name != where else ""))
        else:
            froms.setdefault(where, set()).add(name)
    out: list[str] = []
    for _, (straight, froms) in sorted(sections.items()):
        out += ([""] if out else []) + sorted(straight) + [
            f"from {where} import {', '.join(sorted(names, key=_isort_key))}" for where, names in sorted(froms.items())]
    return out


def _isort_key(name: str) -> tuple[int, str]:
    """ruff's isort order within one import: CONSTANTS, Classes, then functions."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def _names(lines: list[str]) -> set[str]:
    """The names the stub's annotations and decorators use (its docstrings left out)."""
    source = "\n".join(lines)
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        for annotation in _annotations_of(node) + getattr(node, "decorator_list", []):
            names |= {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
    return names


def _annotations_of(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        args = a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x is not None]
        return [x.annotation for x in args if x.annotation is not None] + ([node.returns] if node.returns else [])
    if isinstance(node, ast.AnnAssign):
        return [node.annotation]
    return []


def render(stub: Stub) -> str:
    """The text of one stub file."""
    module = __import__(stub.module, fromlist=["_"])
    body: list[str] = []
    for name in stub.classes:  # (one blank line between top-level definitions, as stubs have it)
        body += [""] + _class(getattr(module, name))
    body += ["", "# The module's other names are not part of the typed API: Any.",
             "def __getattr__(name: str) -> Any: ..."]
    imports = _imports(module, body, set(stub.classes))
    header = ["# Generated by scripts/gen_stubs.py from the declared options and the signatures the API builds from",
              f"# them at run time; do not edit: change the source and run `{REGENERATE}`."]
    return "\n".join(header + [""] + imports + body) + "\n"


def stale() -> list[str]:
    """The stubs whose checked-in text differs from what `render` writes now."""
    return [s.path for s in STUBS if not (ROOT / s.path).exists() or (ROOT / s.path).read_text() != render(s)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a checked-in stub differs; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        paths = stale()
        for path in paths:
            print(f"{path} is stale: run `{REGENERATE}`", file=sys.stderr)
        return 1 if paths else 0
    for s in STUBS:
        (ROOT / s.path).write_text(render(s))
        print(f"wrote {s.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
