"""`rank` with failed documents (issue 35, item 3): under errors="return" a failed document scores
NaN; it is ordered after every scored document (in input order) and never displaces one from the
top k -- a NaN in the sort key broke the order and dropped the best document."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pooling_pipeline.api import _ranked
from pooling_pipeline.outputs import ScoringOutput


def outputs(scores: list[float]) -> list[ScoringOutput]:
    return [ScoringOutput(request_id=f"r-{i}", index=i, score=s, num_prompt_tokens=3,
                          error="failed" if math.isnan(s) else None) for i, s in enumerate(scores)]


def test_the_reported_case():
    scores = [.3, .2, .1, float("nan"), .9, .95, .4]
    assert [(r.index, r.score) for r in _ranked(outputs(scores), 2)] == [(5, .95), (4, .9)]
    full = _ranked(outputs(scores), None)
    assert [r.index for r in full] == [5, 4, 6, 0, 1, 2, 3]


@given(st.lists(st.one_of(st.floats(-10, 10, allow_nan=False), st.just(float("nan"))), max_size=30),
       st.one_of(st.none(), st.integers(1, 35)))
def test_failed_documents_go_last_and_scored_ones_are_never_dropped(scores, top_k):
    ranked = _ranked(outputs(scores), top_k)
    scored = [i for i, s in enumerate(scores) if not math.isnan(s)]
    failed = [i for i, s in enumerate(scores) if math.isnan(s)]
    best_first = sorted(scored, key=lambda i: -scores[i])  # (stable: ties in input order)
    want = (best_first + failed)[:top_k] if top_k is not None else best_first + failed
    assert [r.index for r in ranked] == want
    assert all(r.score == scores[r.index] or math.isnan(r.score) for r in ranked)


def test_rank_with_a_failed_document_end_to_end(pipe):
    """The bundled bi-encoder: a document that is not text fails alone under errors="return"."""
    docs = ["Python is a programming language.", 5, "The cat sat on the mat.", "Snakes are reptiles.",
            "Programming languages compile code."]
    ranked = pipe.rank("Which programming language?", docs, errors="return", use_tqdm=False)
    assert [r.index for r in ranked][-1] == 1 and math.isnan(ranked[-1].score)
    scores = [r.score for r in ranked[:-1]]
    assert scores == sorted(scores, reverse=True) and not np.isnan(scores).any()
    top = pipe.rank("Which programming language?", docs, top_k=2, errors="return", use_tqdm=False)
    assert [r.index for r in top] == [r.index for r in ranked[:2]]
