"""MTEB 2 takes a SentenceEncoder as it is (`mteb.evaluate(encoder, tasks)`, issue 37 item 1), and
scores what the same model scores under sentence-transformers: MTEB's own tasks classes (STS,
retrieval, classification) over in-memory data built from the repository's text -- nothing from a
hub --, run once with the pipeline and once with a SentenceTransformer of the same folder. A copy of
the model with prompts checks that the prompt is chosen as MTEB's sentence-transformers wrapper
chooses it (task type before prompt type, query and document prompts on their sides)."""

from __future__ import annotations

import json
import math
import random
import shutil

import corpus
import mteb  # the `integrations` extra (CI installs it)
import pytest
from datasets import Dataset, DatasetDict
from mteb.abstasks.classification import AbsTaskClassification
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.sts import AbsTaskSTS
from mteb.abstasks.task_metadata import TaskMetadata

from pooling_pipeline import SentenceEncoder

# Scores are ranks and accuracies over vectors within 1e-6 of sentence-transformers': equal unless
# two items tie to 1e-6, which these texts do not.
SCORE_TOL = 1e-6

GENERAL = dict(
    description="An in-memory task of the pooling-pipeline tests.", reference="https://example.org/tests",
    dataset={"path": "NA", "revision": "NA"}, category="t2t", eval_splits=["test"], eval_langs=["eng-Latn"],
    date=("2026-01-01", "2026-01-01"), dialect=["Written"], domains=[], task_subtypes=[], license="cc-by-4.0",
    annotations_creators="derived", modalities=["text"], sample_creation="found", bibtex_citation="")


def _texts(n: int, seed: int) -> list[str]:
    return corpus.sentences(n, seed=seed)


class PipelineSTS(AbsTaskSTS):
    metadata = TaskMetadata(type="STS", name="PipelineSTS", main_score="cosine_spearman", **GENERAL)
    min_score = 0
    max_score = 5

    def load_data(self, num_proc=None, **kwargs) -> None:
        first, second = _texts(40, 301), _texts(40, 302)
        # Some pairs close (a text less its last word; not identical: equal texts would tie at 1.0), the
        # rest unrelated, scored at random in between.
        second[:20] = [text.rsplit(" ", 1)[0] for text in first[:20]]
        scores = [5.0] * 20 + [random.Random(303).uniform(0, 4) for _ in range(20)]
        self.dataset = DatasetDict({"test": Dataset.from_dict({"sentence1": first, "sentence2": second, "score": scores})})
        self.data_loaded = True


class PipelineRetrieval(AbsTaskRetrieval):
    metadata = TaskMetadata(type="Retrieval", name="PipelineRetrieval", main_score="ndcg_at_10", **GENERAL)

    def load_data(self, num_proc=None, **kwargs) -> None:
        documents = corpus.medium_texts(30, seed=304, max_chars=800)
        # A query is the start of its document, reworded by cutting: retrieval has something to find.
        queries = {f"q{i}": " ".join(documents[i].split()[:8]) for i in range(0, 30, 3)}
        split = {
            "corpus": Dataset.from_list([{"id": f"d{i}", "text": text, "title": ""} for i, text in enumerate(documents)]),
            "queries": Dataset.from_list([{"id": qid, "text": text} for qid, text in queries.items()]),
            "relevant_docs": {qid: {f"d{qid[1:]}": 1} for qid in queries},
            "top_ranked": None,
        }
        self.dataset = {"default": {"test": split}}
        self.data_loaded = True


class PipelineClassification(AbsTaskClassification):
    metadata = TaskMetadata(type="Classification", name="PipelineClassification", main_score="accuracy",
                            **GENERAL | {"eval_splits": ["test"]})

    def load_data(self, num_proc=None, **kwargs) -> None:
        # Two classes a sentence embedding separates: the repository's prose and its docstrings' code-ish lines.
        prose, code = _texts(60, 305), [line for line in corpus.docstrings() if line.strip()][:60]
        texts = prose + code
        labels = [0] * len(prose) + [1] * len(code)
        order = list(range(len(texts)))
        random.Random(306).shuffle(order)
        rows = {"text": [texts[i] for i in order], "label": [labels[i] for i in order]}
        half = len(order) // 2
        self.dataset = DatasetDict({
            "train": Dataset.from_dict({k: v[:half] for k, v in rows.items()}),
            "test": Dataset.from_dict({k: v[half:] for k, v in rows.items()}),
        })
        self.data_loaded = True


TASKS = (PipelineSTS, PipelineRetrieval, PipelineClassification)


def _scores(model) -> dict[str, float]:
    """Every number MTEB reports per task (main score, correlations, ndcg/map/recall at k, accuracy, f1, ...)."""
    result = mteb.evaluate(model, [task() for task in TASKS], cache=None, show_progress_bar=False)
    scores = {}
    for task_result in result.task_results:
        for split, subsets in task_result.scores.items():
            for subset in subsets:
                for metric, value in subset.items():
                    if isinstance(value, float):
                        scores[f"{task_result.task_name}/{split}/{subset['hf_subset']}/{metric}"] = value
    return scores


def _assert_same_scores(ours: dict[str, float], theirs: dict[str, float]) -> None:
    assert {key.split("/")[0] for key in theirs} == {task.metadata.name for task in TASKS}
    assert set(ours) == set(theirs)
    for name, score in theirs.items():
        if math.isnan(score):  # MTEB's nAUC of a constant column: undefined on both sides
            assert math.isnan(ours[name]), name
        else:
            assert abs(ours[name] - score) <= SCORE_TOL, (name, ours[name], score)


@pytest.mark.slow
def test_mteb_evaluate_takes_the_encoder_and_scores_as_sentence_transformers(pipe, st_model):
    encoder = SentenceEncoder(pipeline=pipe)
    assert encoder.mteb_model_meta.embed_dim == 384 and encoder.mteb_model_meta.modalities == ["text"]
    ours, theirs = _scores(encoder), _scores(st_model)
    _assert_same_scores(ours, theirs)
    assert 0.5 < theirs["PipelineRetrieval/test/default/ndcg_at_10"] <= 1.0  # the tasks measure something


@pytest.fixture(scope="module")
def prompted_model_path(model_path, tmp_path_factory) -> str:
    """The bundled model with prompts: a task type's ("STS"), the query's and the document's."""
    target = tmp_path_factory.mktemp("prompted") / "model"
    shutil.copytree(model_path, target)
    config_path = target / "config_sentence_transformers.json"
    config = json.loads(config_path.read_text())
    config["prompts"] = {"query": "query: ", "document": "passage: ", "STS": "similar meaning: "}
    config_path.write_text(json.dumps(config))
    return str(target)


@pytest.mark.slow
def test_mteb_chooses_the_prompts_as_its_sentence_transformers_wrapper(prompted_model_path):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    with SentenceEncoder(prompted_model_path) as encoder:
        ours = _scores(encoder)
        plain = SentenceEncoder(pipeline=encoder.pipeline)
        plain.prompts = {}  # the same model without its prompts scores differently: the prompts were used
        unprompted = _scores(plain)
    theirs = _scores(SentenceTransformer(prompted_model_path, device="cpu"))
    _assert_same_scores(ours, theirs)
    assert any(abs(unprompted[name] - theirs[name]) > SCORE_TOL for name in theirs)


def test_a_non_text_mteb_task_is_refused_by_name(pipe):
    from pooling_pipeline.integrations.mteb_encoder import encode_for_mteb

    class ImageLoader:  # what MTEB's DataLoader looks like for an image task
        batch_size = 2
        dataset = type("D", (), {"features": {"image": object()}})()

    with pytest.raises(ValueError, match="PipelineSTS.*image.*text only"):
        encode_for_mteb(SentenceEncoder(pipeline=pipe), ImageLoader(), task_metadata=PipelineSTS.metadata)
