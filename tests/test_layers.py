"""Layers only look down: the engine (core/) imports nothing of the render workers, the frontend,
the API or the job runner, and a render worker (workers/) only core and itself -- lazy imports
inside functions included. Laid out as installed: pooling_pipeline.core and .workers below the rest."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

ALLOWED = {"core": ("pooling_pipeline.core",), "workers": ("pooling_pipeline.core", "pooling_pipeline.workers")}


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
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, name in imports_of(path):
                if not name.startswith(allowed):
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
