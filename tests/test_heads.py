"""Output heads as objects (core/engine/heads.py): the runner runs whatever head its family composes
it with, and sentence-transformers' module chain asks for the head its last module is. The heads'
numbers against ST are tested per family in test_families_quick.py; here, that the runner asks no
question of its own."""

from __future__ import annotations

import model_zoo as zoo
import numpy as np
import pytest
import torch
from helpers import synthetic_batch

from pooling_pipeline.core.engine.heads import (
    ClassifierHead,
    LogitScoreHead,
    OutputHead,
    PooledHead,
    SparseHead,
    StepRows,
    TokenVectorsHead,
    head_for_st_chain,
)
from pooling_pipeline.core.engine.model_runner import ModelRunner
from pooling_pipeline.core.shared.model_folder.load import load_model_spec

TOL = 1e-5


class FirstTokenNorms(OutputHead):
    """A head no family has: each row's first hidden state and the norm of its last real one."""

    def outputs(self, rows: StepRows):
        last = rows.output[torch.arange(len(rows.batch)), rows.lengths - 1]
        tensors = [rows.output[:, 0].float(), last.float().norm(dim=-1)]

        def finish(arrays):
            first, norms = arrays
            return [np.concatenate([first[i], norms[i:i + 1]]) for i in range(len(first))]

        return tensors, finish


@pytest.mark.parametrize("device_steps", [False, True], ids=["cpu steps", "device steps (buckets, 4-D mask)"])
def test_the_runner_runs_a_head_it_has_never_heard_of(tmp_path, device_steps):
    """A family's own head through the runner, padded rows and buckets alike: what it reads is the
    transformer's own output for each row (a plain transformers forward of the row alone)."""
    from transformers import AutoModel

    path = zoo.build_st(tmp_path, "bert")
    spec = load_model_spec(path)
    runner = ModelRunner(spec, "cpu", "float32", backend="torch", output_head=lambda _spec: FirstTokenNorms,
                         device_steps=device_steps, attention="padded")
    assert isinstance(runner.head, FirstTokenNorms)
    lengths = [3, 9, 1, 17]
    batch = synthetic_batch(lengths, vocab=spec.vocab_size)
    got, _ = runner.run(batch)
    model = AutoModel.from_pretrained(path).eval()
    starts = np.cumsum(lengths) - lengths
    for row, (start, length) in enumerate(zip(starts, lengths)):
        ids = torch.from_numpy(batch.token_ids[start:start + length].astype(np.int64))[None]
        with torch.inference_mode():
            hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        want = np.concatenate([hidden[0].numpy(), [float(hidden[-1].norm())]])
        np.testing.assert_allclose(got[row], want, atol=TOL, rtol=TOL)


CHAINS = {
    "Pooling": (lambda tmp: zoo.build_st(tmp, "bert"), PooledHead),
    "a cross-encoder's classifier": (lambda tmp: zoo.build_cross_encoder(tmp), ClassifierHead),
    "SpladePooling": (lambda tmp: zoo.build_splade(tmp), SparseHead),
    "MultiVectorEncoder": (lambda tmp: zoo.build_colbert(tmp), TokenVectorsHead),
    "LogitScore": (lambda tmp: zoo.build_llm_reranker(tmp, "qwen3"), LogitScoreHead),
}


@pytest.mark.parametrize("chain", [pytest.param(name, marks=[pytest.mark.slow] if name == "LogitScore" else [])
                                   for name in CHAINS])
def test_each_st_chain_asks_for_the_head_its_last_module_is(chain, tmp_path):
    build, head = CHAINS[chain]
    spec = load_model_spec(build(tmp_path))
    assert head_for_st_chain(spec) is head
    # what only a head knows, asked of it by the runner, the OpenVINO conversion and the packed choice
    assert (head.reads, head.base_model) == {PooledHead: ("last_hidden_state", False),
                                              TokenVectorsHead: ("last_hidden_state", False),
                                              SparseHead: ("logits", False), ClassifierHead: ("logits", False),
                                              LogitScoreHead: ("last_hidden_state", True)}[head]
    assert (head.packed_refusal is None) == (head is PooledHead)
    assert (head.own_forward is not None) == (head is LogitScoreHead)
