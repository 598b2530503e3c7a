"""A model directory's fingerprint, recorded in pipeline-run's manifest and checked on --resume."""

from __future__ import annotations

import hashlib
from pathlib import Path


def model_hash(model_dir: str) -> str:
    """sha256 over the names and bytes of the model's config, tokenizer and weight files."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file() and path.suffix in (".json", ".safetensors", ".bin", ".txt", ".model", ".py"):
            digest.update(path.name.encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()
