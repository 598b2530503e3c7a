"""pipeline-run on files: streamed input, chunked output, read back in order."""

import json
import os
import subprocess
import sys

import numpy as np

from conftest import ROOT
from pipeline import load_results


def _run(args, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "pipeline.launcher", *args], capture_output=True, text=True,
                            env=env, timeout=300, **kw)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_bundled_sample_to_disk_and_back(tmp_path, st_model):
    out = tmp_path / "out"
    result = _run(["--output", str(out), "--limit", "120", "--chunk-rows", "50", "--quiet"])
    assert "embedded 120 records" in result.stdout
    ids, data = load_results(out)
    assert data.shape == (120, 384) and data.dtype == np.float32 and len(ids) == 120
    manifest = json.loads((out / "manifest.json").read_text())
    assert [c["rows"] for c in manifest["chunks"]] == [50, 50, 20]
    assert manifest["task"] == "embed" and len(manifest["model_sha256"]) == 64
    sample = [json.loads(line) for line in open(ROOT / "pipeline" / "data" / "sample.jsonl")][:120]
    assert ids == [r["id"] for r in sample]
    ref = st_model.encode([r["text"] for r in sample])
    assert np.abs(data - ref).max() <= 1e-5


def test_plain_text_from_stdin(tmp_path, st_model):
    lines = ["first line of text", "second line", "third, with more words in it"]
    out = tmp_path / "stdin-out"
    _run(["--input", "-", "--output", str(out), "--quiet"], input="\n".join(lines) + "\n")
    ids, data = load_results(out)
    assert ids == ["stdin:1", "stdin:2", "stdin:3"]
    assert np.abs(data - st_model.encode(lines)).max() <= 1e-5
