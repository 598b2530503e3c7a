"""mkdocs hook: the package's source as the API reference's reader expects it.

The folders do not bear the package's name (pipeline/ installs as pooling_pipeline, core/ as
pooling_pipeline.core, workers/ as pooling_pipeline.workers), so griffe, which reads source files,
cannot find the subpackages. Before the build, build/docs-src/pooling_pipeline/ is laid out as the
installed package is -- a copy of pipeline/'s sources, core/ and workers/ inside it (copies, not
links: the reader names a module by where its file really is) -- and mkdocs.yml points the reader
there."""

from __future__ import annotations

import shutil
from pathlib import Path

from mkdocs.plugins import event_priority


# Before mkdocstrings' own on_config: it drops a search path that does not exist yet, which is the
# case on a fresh clone (CI) -- a leftover build/ folder hid this locally.
@event_priority(100)
def on_config(config):
    root = Path(config.config_file_path).parent
    package = root / "build" / "docs-src" / "pooling_pipeline"
    shutil.rmtree(package.parent, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "data")
    shutil.copytree(root / "pipeline", package, ignore=ignore, dirs_exist_ok=True)
    for sub in ("core", "workers"):
        shutil.copytree(root / sub, package / sub, ignore=ignore)
    return config
