"""From a model argument to a `ModelSpec`: where the model is, and what its files say.

The entry point of the subpackage (see its __init__ for the order of the modules). A Router model
is a spec per route (router.py); any other is one chain of modules (st_modules.py) made a spec
(chain_spec.py).
"""

from __future__ import annotations

import os

from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.model_folder.chain_spec import spec_of_layout
from pooling_pipeline.core.shared.model_folder.model_path import model_dir
from pooling_pipeline.core.shared.model_folder.router import load_router_spec, router_module
from pooling_pipeline.core.shared.model_folder.st_modules import read_st_layout


def load_model_spec(model: str | os.PathLike | None, trust_remote_code: bool = False,
                    revision: str | None = None) -> ModelSpec:
    """Reads config.json and the sentence-transformers files of a model directory (or hub id)."""
    root = model_dir(model, revision)
    if router_module(root) is not None:  # ST's Router: a spec per route (see load_router_spec)
        return load_router_spec(root, trust_remote_code)
    return spec_of_layout(root, read_st_layout(root, trust_remote_code), trust_remote_code)
