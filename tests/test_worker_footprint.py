"""What a render worker process loads: the tokenizer and what it needs, never torch (the engine's).

A node runs up to one worker per core (40 on a 64-core node), so each worker's RSS counts many times.
The check reads the worker's memory map (/proc/<pid>/maps: what the process has loaded, whatever
imported it), and the engine core is the control: it runs the model, so its map shows torch.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import corpus
import numpy as np
import psutil
import pytest

from pooling_pipeline import Pipeline

# Generous: a worker measures ~100 MB with the bundled model; with torch loaded it was ~290 MB.
MAX_WORKER_RSS_MB = 150
TORCH_LIBRARY = re.compile(r"/torch/(lib/|_C)")  # libtorch_cpu.so, libc10.so, torch/_C*.so
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/<pid>/maps")


def torch_libraries(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if TORCH_LIBRARY.search(line)}


@pytest.mark.slow
def test_a_render_worker_loads_no_torch_and_stays_small(model_path):
    texts = corpus.sentences(2000, seed=3) + corpus.medium_texts(40, seed=4)
    conversation = [{"role": "user", "content": "How do I read a file?"},
                    {"role": "assistant", "content": "Use open() in a with block."}]
    with Pipeline(num_render_workers=1) as pipe:
        # The worker's render paths: short texts in one batched call, long ones through the
        # truncation planner, token ids, a conversation through a chat template (transformers' jinja).
        assert len(pipe.embed(texts, use_tqdm=False)) == len(texts)
        assert len(pipe.embed([[101, 7592, 102]], use_tqdm=False)) == 1
        chat = pipe.embed([conversation], chat_template=TEMPLATE, use_tqdm=False)
        assert chat[0].num_prompt_tokens > 0
        pids = pipe.pids
        assert torch_libraries(pids["engine"]), "the control failed: the engine core's map shows no torch"
        for pid in pids["workers"]:
            assert torch_libraries(pid) == set(), f"render worker {pid} has loaded torch"
            rss_mb = psutil.Process(pid).memory_info().rss / 2**20
            assert rss_mb <= MAX_WORKER_RSS_MB, f"render worker {pid}: {rss_mb:.0f} MB RSS"


TORCH_PLUGIN = '''
class TorchPlugin:
    """Imports torch when it renders: a plugin may use it, though the tokenizer does not."""

    task = "embed"

    def render(self, raw):
        import torch

        return raw["text"] + " " + str(int(torch.tensor([2, 3]).sum()))

    def post_process(self, output):
        return output.data
'''


@pytest.mark.slow
def test_a_plugin_may_still_import_torch_in_the_worker(tmp_path, monkeypatch, st_model):
    (tmp_path / "torch_plugin.py").write_text(textwrap.dedent(TORCH_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    with Pipeline(io_processor="torch_plugin:TorchPlugin", num_render_workers=1) as pipe:
        vectors = pipe.encode([{"text": "a file object"}], task="plugin", use_tqdm=False)
        assert all(torch_libraries(pid) for pid in pipe.pids["workers"])  # it did import torch there
    np.testing.assert_allclose(vectors[0], st_model.encode("a file object 5"), atol=1e-5, rtol=0)
