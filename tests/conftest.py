import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import shutil
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.config import default_model_path  # noqa: E402
from pipeline import Pipeline, corpus  # noqa: E402

# The test process runs sentence-transformers next to the engine process: keep it to one thread
# so the two do not fight over the 2 cores.
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def pipe():
    with Pipeline() as p:
        yield p


@pytest.fixture(scope="session")
def st_model(model_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_path, device="cpu")


@pytest.fixture(scope="session")
def mixed_texts() -> list[str]:
    """Real text of very different lengths, long documents (~50k-200k chars) included."""
    texts = corpus.sentences(120, seed=11) + corpus.medium_texts(40, seed=12)
    texts += corpus.long_documents(4, 50_000, 200_000, seed=13)
    texts += ["", "   ", "a", "Émile's café: naïve façade — 東京 and emoji 🙂🚀", "word " * 600]
    order = np.random.default_rng(5).permutation(len(texts))
    return [texts[i] for i in order]


@pytest.fixture(scope="session")
def reference(st_model, mixed_texts) -> np.ndarray:
    return st_model.encode(mixed_texts, batch_size=32, convert_to_numpy=True)


def wait_gone(pids, timeout_s: float = 10.0) -> list[int]:
    """The pids still running (zombies count as gone) after waiting up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        if alive:
            time.sleep(0.1)
    return alive


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_small_bert(root: Path, name: str, model_cls, model_path: str, **config_kwargs) -> str:
    """A small BERT of a transformers class (a head, a config option), random weights, with the
    bundled tokenizer: a model to check a task against transformers' own forward pass."""
    from transformers import BertConfig

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128, **config_kwargs)
    model = model_cls(config).eval()
    target = root / name
    model.save_pretrained(target)
    for f in TOKENIZER_FILES:
        shutil.copy(f"{model_path}/{f}", target / f)
    return str(target)


def faulty_model_dir(tmp_path: Path, model_path: str, trigger_token_id: int) -> Path:
    """A real model whose forward raises when a chosen token id is in the batch.

    The model class lives in a module of the model directory and loads through the normal path
    (transformers' auto_map with trust_remote_code), so no code of the project is patched.
    """
    target = tmp_path / "faulty-model"
    shutil.copytree(model_path, target)
    config = (target / "config.json").read_text()
    import json

    cfg = json.loads(config)
    cfg["auto_map"] = {"AutoModel": "modeling_faulty.FaultyBertModel"}
    cfg["fault_token_id"] = trigger_token_id
    (target / "config.json").write_text(json.dumps(cfg))
    (target / "modeling_faulty.py").write_text(
        "from transformers import BertModel\n\n\n"
        "class FaultyBertModel(BertModel):\n"
        "    def forward(self, input_ids=None, **kwargs):\n"
        "        if input_ids is not None and bool((input_ids == self.config.fault_token_id).any()):\n"
        "            raise RuntimeError(f'fault token {self.config.fault_token_id} in the batch')\n"
        "        return super().forward(input_ids=input_ids, **kwargs)\n"
    )
    return target


@pytest.fixture(scope="session", autouse=True)
def no_orphans_at_end():
    yield
    leftovers = [p for p in psutil.Process().children(recursive=True) if _running(p.pid)]
    assert not leftovers, f"processes left behind by the tests: {leftovers}"
