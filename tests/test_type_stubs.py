"""The API's type stubs (pipeline/api.pyi, pipeline/integrations/sentence_encoder.pyi): generated from
the declared options by scripts/gen_stubs.py, shipped in the package, and read by a type checker as a
user's project reads them -- typical calls accepted, a misspelt keyword or a wrong type flagged."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import gen_stubs
import pytest

from pooling_pipeline import SentenceEncoder

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = Path(__file__).resolve().parent / "typecheck"
# What the wheel is built from (the rest of the repository is not part of the package).
PACKAGE_SOURCES = ("pyproject.toml", "README.md", "pipeline", "core", "workers")


def test_stubs_are_current():
    """A checked-in stub is exactly what the generator writes from the declarations now."""
    for stub in gen_stubs.STUBS:
        path = ROOT / stub.path
        assert path.exists(), f"{stub.path} is missing: run `{gen_stubs.REGENERATE}`"
        assert path.read_text() == gen_stubs.render(stub), \
            f"{stub.path} is stale (an option or a public signature changed): run `{gen_stubs.REGENERATE}`"


def _normalized(annotation) -> str:
    """An annotation as one spelling (quotes, spaces): "Literal['a', 'b'] | None"."""
    text = "Any" if annotation in (inspect.Parameter.empty, None) else annotation
    return ast.unparse(ast.parse(text if isinstance(text, str) else ast.unparse(text), mode="eval"))


def _stub_parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, str, object, str]]:
    """(name, kind, default, annotation) of each parameter a stub's function declares."""
    a, kind = fn.args, inspect.Parameter
    plain = a.posonlyargs + a.args
    defaults = [None] * (len(plain) - len(a.defaults)) + a.defaults
    out = [(x.arg, kind.POSITIONAL_ONLY if x in a.posonlyargs else kind.POSITIONAL_OR_KEYWORD, d, x.annotation)
           for x, d in zip(plain, defaults)]
    out += [(a.vararg.arg, kind.VAR_POSITIONAL, None, a.vararg.annotation)] if a.vararg else []
    out += [(x.arg, kind.KEYWORD_ONLY, d, x.annotation) for x, d in zip(a.kwonlyargs, a.kw_defaults)]
    out += [(a.kwarg.arg, kind.VAR_KEYWORD, None, a.kwarg.annotation)] if a.kwarg else []
    return [(name, k, kind.empty if d is None else ast.literal_eval(d), _normalized(t) if name != "self" else "")
            for name, k, d, t in out]


def _runtime_parameters(sig: inspect.Signature) -> list[tuple[str, str, object, str]]:
    return [(p.name, p.kind, p.default if p.default is p.empty or gen_stubs._default(p.default) != "..." else ...,
             _normalized(p.annotation) if p.name != "self" else "") for p in sig.parameters.values()]


@pytest.mark.parametrize("stub", gen_stubs.STUBS, ids=lambda s: s.path)
def test_stub_signatures_are_the_runtime_ones(stub):
    """Read back from the stub's text (not from the generator): each stubbed class has every public
    method and property the running class has, with the parameters, kinds, defaults, annotations,
    async-ness and return type `inspect.signature` (and help()) shows -- a `**kwargs` the generator
    spells out replaced by the keywords it stands for, after the same leading parameters."""
    module = __import__(stub.module, fromlist=["_"])
    tree = ast.parse((ROOT / stub.path).read_text())
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or dataclasses.is_dataclass(getattr(module, node.name)):
            continue
        cls = getattr(module, node.name)
        declared = {f.name: f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        public = {name for name, m in vars(cls).items() if isinstance(m, (property, types.FunctionType))
                  and (not name.startswith("_") or name in gen_stubs.PUBLIC_DUNDERS)}
        assert set(declared) == public, (cls.__name__, set(declared) ^ public)
        for name, fn in declared.items():
            member = vars(cls)[name]
            runtime_fn = member.fget if isinstance(member, property) else member
            sig = inspect.signature(runtime_fn)
            runtime, declared_params = _runtime_parameters(sig), _stub_parameters(fn)
            if (cls.__name__, name) in gen_stubs.KWARGS:  # its **kwargs spelled out
                assert runtime[-1][1] is inspect.Parameter.VAR_KEYWORD, (cls.__name__, name)
                runtime = runtime[:-1]
                assert all(k is not inspect.Parameter.VAR_KEYWORD for _, k, _, _ in declared_params[len(runtime):])
            else:
                assert len(declared_params) == len(runtime), (cls.__name__, name)
            assert declared_params[:len(runtime)] == runtime, (cls.__name__, name)
            assert isinstance(fn, ast.AsyncFunctionDef) == inspect.iscoroutinefunction(runtime_fn), (cls.__name__, name)
            assert ast.unparse(fn.returns) == _normalized(sig.return_annotation), (cls.__name__, name)


def test_sentence_encoder_keywords_are_those_encode_accepts():
    """The stub spells SentenceEncoder.encode's **kwargs out by name: each of them passes encode's keyword
    check, and a misspelt one is refused there too (so the stub flags exactly what the code refuses)."""
    encoder = SentenceEncoder.__new__(SentenceEncoder)  # no process group: the keyword check comes first
    mteb = {"task_metadata": object(), "hf_split": "test", "hf_subset": "default"}  # MTEB 2's protocol, together
    for p in gen_stubs.encode_keywords():
        given = mteb if p.name in mteb else {p.name: None}
        with pytest.raises(AttributeError):  # past the keyword check, at the pipeline this object lacks
            encoder.encode(["a text"], **given)
    with pytest.raises(TypeError, match="normalise_embeddings"):
        encoder.encode(["a text"], normalise_embeddings=True)


def _installed_package(tmp_path: Path) -> Path:
    """The package as a wheel installs it (built from the repository's files, nothing fetched), unpacked:
    the folder a type checker finds `pooling_pipeline` in."""
    source = tmp_path / "source"
    source.mkdir()
    for name in PACKAGE_SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (source / name).write_bytes(src.read_bytes())
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    site = tmp_path / "site"
    with zipfile.ZipFile(next(wheels.glob("*.whl"))) as wheel:
        shipped = set(wheel.namelist())
        wheel.extractall(site)
    for stub in gen_stubs.STUBS:
        assert stub.path.replace("pipeline/", "pooling_pipeline/", 1) in shipped, f"{stub.path} is not in the wheel"
    assert "pooling_pipeline/py.typed" in shipped, "the py.typed marker is not in the wheel"
    return site


def _mypy(site: Path, files: list[Path], cache: Path) -> dict[str, list[tuple[int, str]]]:
    """mypy's errors by file name: (line, message). The package's own modules are read as an installed
    package's are (their errors not reported); the stubs are checked themselves."""
    stubs = [site / stub.path.replace("pipeline/", "pooling_pipeline/", 1) for stub in gen_stubs.STUBS]
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--follow-imports=silent",
                          "--no-pretty", "--show-absolute-path", *map(str, files + stubs)],
                         capture_output=True, text=True, timeout=300, cwd=site.parent,
                         env={**os.environ, "MYPYPATH": str(site)})
    if run.returncode not in (0, 1) or "error: " not in run.stdout and run.returncode:
        pytest.fail(f"mypy did not run: {run.stdout}{run.stderr}")
    errors: dict[str, list[tuple[int, str]]] = {}
    for line in run.stdout.splitlines():
        m = re.match(r"(.+?):(\d+): error: (.*)", line)
        if m:
            errors.setdefault(Path(m.group(1)).name, []).append((int(m.group(2)), m.group(3)))
    return errors


def test_type_checker_accepts_good_calls_and_flags_bad_ones(tmp_path):
    """mypy on tests/typecheck/ against the package as installed: good_calls.py passes; in bad_calls.py each
    line whose comment starts with "E:" gets an error with the comment's text (a misspelt keyword, a wrong
    type, ...), and no other line does."""
    site = _installed_package(tmp_path)
    good, bad = EXAMPLES / "good_calls.py", EXAMPLES / "bad_calls.py"
    errors = _mypy(site, [good, bad], tmp_path / "mypy-cache")
    assert not {name: found for name, found in errors.items() if name != bad.name}, errors
    expected = {i: m.group(1).strip() for i, line in enumerate(bad.read_text().splitlines(), 1)
                if (m := re.search(r"# E: (.*)$", line))}
    assert len(expected) >= 10
    found = dict(errors.get(bad.name, []))
    assert set(found) == set(expected), (sorted(found.items()), expected)
    for line, text in expected.items():
        assert text in found[line], (line, found[line])
    misspelt = found[next(i for i, t in expected.items() if "pooling_param\"" in t)]
    assert misspelt.startswith('Unexpected keyword argument "pooling_param" for "embed" of "Pipeline"'), misspelt
