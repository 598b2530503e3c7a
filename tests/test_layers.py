"""Layers only look down -- lazy imports inside functions included. Laid out as installed, from the
bottom: pooling_pipeline.core.shared (what every process imports) imports only itself; the engine
core process (core.engine) only shared and itself; the model families (core.families) the two
below them; a render worker (workers/) shared, the families and itself, never the engine; the
frontend, API, job runner and server (the rest) anything below them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

SHARED, ENGINE, FAMILIES = "pooling_pipeline.core.shared", "pooling_pipeline.core.engine", "pooling_pipeline.core.families"
# Each folder (as in the repository) and the packages its files may import.
ALLOWED = {"core/shared": (SHARED,), "core/engine": (SHARED, ENGINE), "core/families": (SHARED, ENGINE, FAMILIES),
           "workers": (SHARED, FAMILIES, "pooling_pipeline.workers")}
# The engine core process's entry point wires its pieces together: it asks the model's family
# (above the engine's pieces: a family builds its runner from them) which runner to run.
ENTRY_POINTS = {"core/engine/main.py": (SHARED, ENGINE, FAMILIES)}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every pooling_pipeline module a file imports, anywhere in it, with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names] \
                if node.module == "pooling_pipeline" else [node.module]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return sorted((line, name) for line, name in found if name == "pooling_pipeline" or name.startswith("pooling_pipeline."))


def test_core_and_workers_import_only_downward():
    wrong = []
    for folder, allowed in ALLOWED.items():
        files = sorted((ROOT / folder).rglob("*.py"))
        assert files, f"no Python file in {folder}: the table above is out of date"
        for path in files:
            may = ENTRY_POINTS.get(path.relative_to(ROOT).as_posix(), allowed)
            for line, name in imports_of(path):
                if not name.startswith(may):
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not wrong, "layers that look up:\n" + "\n".join(wrong)


def test_the_checker_sees_lazy_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from pooling_pipeline.jobs.fingerprint import cache_root\n"
                      "import pooling_pipeline.api\nfrom pooling_pipeline import Pipeline\n")
    assert imports_of(sample) == [(2, "pooling_pipeline.jobs.fingerprint"), (3, "pooling_pipeline.api"),
                                  (4, "pooling_pipeline"), (4, "pooling_pipeline.Pipeline")]


def test_the_mteb_adapter_and_the_encoder_do_not_import_each_other():
    mteb = ROOT / "pipeline" / "integrations" / "mteb_encoder.py"
    assert not [name for _, name in imports_of(mteb) if name.startswith("pooling_pipeline.integrations")]


def test_every_file_of_core_is_in_one_of_its_layers():
    loose = sorted(p.name for p in (ROOT / "core").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"core/ holds {loose} outside shared/, engine/ and families/: put each in its layer"


def test_what_the_frontend_and_the_workers_import_of_core_costs_no_torch():
    """The shared layer and the families are imported by every process; torch is the engine's alone
    (a render worker that imported it would pay ~1 s and ~200 MB for nothing)."""
    modules = [f"pooling_pipeline.core.shared.{p.stem}" for p in sorted((ROOT / "core" / "shared").glob("*.py"))]
    modules += [f"pooling_pipeline.core.shared.model_folder.{p.stem}"
                for p in sorted((ROOT / "core" / "shared" / "model_folder").glob("*.py"))]
    modules += ["pooling_pipeline.core.families", "pooling_pipeline.workers.render", "pooling_pipeline.workers.main"]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n    importlib.import_module(name)\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
