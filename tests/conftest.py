import atexit
import os
import shutil
import sys
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")  # chromadb (test_integrations): no network
# Marks every process this test session starts (its children inherit it, Ray actors' groups too), so a
# test that looks for leftover processes judges this session's only, not another run's on the machine.
os.environ.setdefault("POOLING_PIPELINE_TEST_SESSION", os.urandom(8).hex())
# The OpenVINO backend's conversions (backend "auto" with the extra installed): in a directory of this
# session, removed at its end, never in the user's own cache.
if "POOLING_PIPELINE_CACHE" not in os.environ:
    os.environ["POOLING_PIPELINE_CACHE"] = tempfile.mkdtemp(prefix="pooling-pipeline-test-cache-")
    os.environ["POOLING_PIPELINE_TEST_CACHE"] = os.environ["POOLING_PIPELINE_CACHE"]
    atexit.register(shutil.rmtree, os.environ["POOLING_PIPELINE_CACHE"], True)
# Under pytest-xdist each worker process has a cache of its own inside the session's (which the
# controller removes): a test that asserts that a start converted must not find another worker's entry.
if (worker := os.environ.get("PYTEST_XDIST_WORKER")) and \
        os.environ.get("POOLING_PIPELINE_TEST_CACHE") == os.environ["POOLING_PIPELINE_CACHE"]:
    os.environ["POOLING_PIPELINE_CACHE"] = os.path.join(os.environ["POOLING_PIPELINE_CACHE"], worker)
    os.makedirs(os.environ["POOLING_PIPELINE_CACHE"], exist_ok=True)

import corpus
import numpy as np
import psutil
import pytest
from helpers import running
from hypothesis import HealthCheck, settings

# Property tests: a quick profile by default (a fifth of each test's examples, see
# helpers.examples), the full counts with HYPOTHESIS_PROFILE=thorough.
settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# torch, the API and sentence-transformers are imported by the fixtures and tests that need them,
# not here: a quick test of a planner or a parser does not pay for them (collection took 29 s).
@pytest.fixture(autouse=True)
def one_torch_thread():
    """The test process runs sentence-transformers next to the engine process: one thread, so the two
    do not fight over the 2 cores (set once torch is imported, by whichever test imports it)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def model_path() -> str:
    from pooling_pipeline.core.shared.model_folder.model_path import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def pipe():
    from pooling_pipeline import Pipeline

    with Pipeline() as p:
        yield p


@pytest.fixture(scope="session")
def bert_task_models(tmp_path_factory) -> dict[str, str]:
    """Small BERTs with a task head (transformers' own classes), built once for the session:
    test_tasks and test_ray use the same three."""
    from tiny_models import build_bert
    from transformers import BertForSequenceClassification, BertForTokenClassification

    root = tmp_path_factory.mktemp("bert-task-models")
    return {"cross": build_bert(root / "cross", BertForSequenceClassification, num_labels=1),
            "classify3": build_bert(root / "classify3", BertForSequenceClassification, num_labels=3),
            "token_cls": build_bert(root / "token_cls", BertForTokenClassification, num_labels=5)}


@pytest.fixture(scope="session")
def bert_task_pipe(bert_task_models):
    """bert_task_pipe(name): a Pipeline (default options) of that model, started on first use and
    shared by the tests that only call it (test_tasks, test_ray's references); closed at the end."""
    from pooling_pipeline import Pipeline

    pipes = {}

    def get(name: str):
        if name not in pipes:
            pipes[name] = Pipeline(model=bert_task_models[name])
        return pipes[name]

    yield get
    for p in pipes.values():
        p.close()


@pytest.fixture(scope="session")
def faulty_pipe(tmp_path_factory, model_path):
    """A Pipeline (default options) of the bundled model made to raise when "zebra" is in a batch
    (tiny_models.faulty_model_dir): for the tests that fail a step and then check that the next
    call works (test_long_inputs, test_process_group). Returns (pipe, the trigger's token id)."""
    from tiny_models import faulty_model_dir
    from transformers import AutoTokenizer

    from pooling_pipeline import Pipeline

    trigger = AutoTokenizer.from_pretrained(model_path).convert_tokens_to_ids("zebra")
    model = faulty_model_dir(tmp_path_factory.mktemp("faulty"), model_path, trigger)
    with Pipeline(model=str(model), trust_remote_code=True) as p:
        yield p, trigger


@pytest.fixture(scope="session")
def st_model(model_path):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    return SentenceTransformer(model_path, device="cpu")


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory) -> str:
    """A tiny CLIP in sentence-transformers' layout (model_zoo.build_clip), shared by the image tests.
    Tests copy it before changing anything in it."""
    from model_zoo import build_clip

    return build_clip(tmp_path_factory.mktemp("clip"), layout="st")


@pytest.fixture(scope="session")
def clip_st(clip_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(clip_dir, device="cpu")


@pytest.fixture(scope="session")
def images(tmp_path_factory) -> dict:
    """The image files of image_samples.build_image_files (formats, modes, EXIF, alpha, 16-bit), read only."""
    from image_samples import build_image_files

    return build_image_files(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="session")
def image_backend(clip_dir) -> str:
    """"pil" or "torchvision": the image processor transformers (and so ST, and the render workers)
    picks in this environment -- torchvision's where it is installed."""
    from transformers import AutoImageProcessor

    from pooling_pipeline.workers.images import processor_backend

    return processor_backend(AutoImageProcessor.from_pretrained(clip_dir))


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


@pytest.fixture(scope="session", autouse=True)
def no_orphans_at_end():
    yield
    leftovers = [p for p in psutil.Process().children(recursive=True) if running(p.pid)]
    assert not leftovers, f"processes left behind by the tests: {leftovers}"
