"""A step as it runs on an accelerator, held on the CPU (the suite runs without a GPU): shapes from
buckets, the 4-D mask where a model takes it, nothing read back from the device between a step's
launch and its finish, and the same number of operations whatever the number of requests; results
equal to the CPU's own steps. (core/engine/step_shapes.py, core/engine/attention_mask.py, core/engine/sparse_outputs.py)"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from helpers import synthetic_batch as batch
from model_zoo import (
    build_colbert,
    build_cross_encoder,
    build_decoder_embedder,
    build_llm_reranker,
    build_splade,
    build_st,
)
from torch.utils._python_dispatch import TorchDispatchMode

TOL = 1e-5
# What reads a device value back to the host (a sync): none may run between a step's launch and
# its finish. (`nonzero` and boolean-mask indexing have a data-dependent size, read back too.)
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.item.default",
            "aten.nonzero.default", "aten.equal.default", "aten.masked_select.default"}


class OpLog(TorchDispatchMode):
    """Every aten op dispatched while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def runners(path: str):
    from pooling_pipeline.core.engine.model_runner import ModelRunner
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    spec = load_model_spec(path)
    plain = ModelRunner(spec, "cpu", "float32", backend="torch")
    device = ModelRunner(spec, "cpu", "float32", backend="torch", device_steps=True, shared_model=plain.model)
    return spec, plain, device


def same(a, b) -> None:
    if isinstance(a, np.ndarray) and not isinstance(b, list):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
        return
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, tuple):  # sparse: (ids, weights)
            assert np.array_equal(x[0], y[0])
            np.testing.assert_allclose(x[1], y[1], atol=TOL, rtol=0)
        else:
            np.testing.assert_allclose(x, y, atol=TOL, rtol=0)


MODELS = {
    "bert (mean)": lambda tmp: build_st(tmp, "bert"),
    "xlmr (cls)": lambda tmp: build_st(tmp, "xlmr", pooling_mode="cls"),
    "cross-encoder": lambda tmp: build_cross_encoder(tmp),
    "splade": lambda tmp: build_splade(tmp),
    "colbert": lambda tmp: build_colbert(tmp),
    "qwen3 decoder (last token)": lambda tmp: build_decoder_embedder(tmp),
    "llm reranker": lambda tmp: build_llm_reranker(tmp),
}
MASKS = {"bert (mean)": "4-D", "xlmr (cls)": "4-D", "cross-encoder": "4-D", "splade": "4-D", "colbert": "4-D",
         "qwen3 decoder (last token)": "2-D"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_device_steps_equal_the_cpus_own(name, tmp_path):
    """Bucketed shapes (rows of one pad token, columns of padding) and the 4-D mask change no
    result: every model kind's outputs equal the plain CPU step's within 1e-5. A causal decoder
    keeps the 2-D mask (a bidirectional 4-D one would change it), an encoder takes the 4-D one."""
    spec, plain, device = runners(MODELS[name](tmp_path))
    task = spec.tasks[0]
    for lengths in ([5, 9, 3], [17] * 11, [3, 40, 7, 22, 9]):
        step = batch(lengths, task, vocab=min(spec.vocab_size, 1000))
        expected, padded = plain.run(step)
        got, bucketed = device.run(step)
        same(got, expected)
        assert bucketed >= padded
    if name in MASKS:
        assert device.backend_info["attention_mask"].startswith(MASKS[name]), device.backend_info
    assert device.backend_info["step_shapes"].startswith("buckets")
    assert "step_shapes" not in plain.backend_info


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert (mean)", "splade", "cross-encoder"])
def test_a_device_step_reads_nothing_back_and_its_ops_do_not_grow_with_requests(name, tmp_path):
    """Between launch and finish no op reads a value back from the device (no .item(), .all(),
    nonzero, boolean-mask indexing: transformers' 2-D mask check, SPLADE's non-zeros and the
    bucket padding all used to), and a step of 64 requests dispatches the ops one of 4 does."""
    spec, _, device = runners(MODELS[name](tmp_path))
    counts = {}
    for rows in (4, 64):
        step = batch([11 + (k % 5) for k in range(rows)], spec.tasks[0], vocab=min(spec.vocab_size, 1000))
        with OpLog() as log:
            pending = device.launch(step)
        device.finish(pending)
        synced = sorted(set(log.ops) & SYNC_OPS)
        assert not synced, f"{name}: a step of {rows} reads the device back: {synced}"
        counts[rows] = len(log.ops)
    assert counts[4] == counts[64], counts


def test_the_4d_mask_is_refused_where_it_changes_the_result():
    """A model whose attention is causal (or takes only 2-D masks) keeps the 2-D mask: the probe
    compares both on padded rows."""
    from pooling_pipeline.core.engine.attention_mask import choose_mask

    class Causal(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            x = input_ids.float()[..., None].expand(-1, -1, 4)
            if attention_mask.dim() == 2:  # what a causal model makes of a 2-D mask
                mask = torch.tril(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool))[None] & attention_mask.bool()[:, None]
            else:
                mask = attention_mask[:, 0]
            weights = torch.where(mask, 1.0, 0.0)
            return type("Out", (), {"last_hidden_state": weights @ x})()

    class TwoDOnly(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            if attention_mask.dim() != 2:
                raise ValueError("Wrong shape for input_ids or attention_mask")
            return type("Out", (), {"last_hidden_state": input_ids.float()[..., None]})()

    class Bidirectional(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            keys = attention_mask.bool() if attention_mask.dim() == 2 else attention_mask[:, 0, 0]
            return type("Out", (), {"last_hidden_state": (input_ids.float() * keys)[..., None].cumsum(1)})()

    args = ("last_hidden_state", torch.device("cpu"), torch.float32, 100, 0, False)
    assert choose_mask(Causal(), *args)[0] is False
    assert choose_mask(TwoDOnly(), *args) == (False, "2-D (the model refuses a 4-D mask: ValueError)")
    assert choose_mask(Bidirectional(), *args)[0] is True


def test_sparse_outputs_on_a_device_equal_nonzero_and_read_a_long_row_whole():
    """The device's fixed top-k with counts gives every row's non-zeros, ids ascending, as the CPU's
    nonzero does; a row with more non-zeros than come back is read whole after the step."""
    from pooling_pipeline.core.engine import sparse_outputs as so

    rng = np.random.default_rng(3)
    weights = torch.from_numpy(np.where(rng.random((6, 3000)) < 0.02, rng.random((6, 3000)), 0).astype(np.float32))
    weights[4] = torch.from_numpy(rng.random(3000).astype(np.float32))  # 3000 non-zeros: past DEVICE_TOP_K
    weights[5] = 0  # none
    for limit in (None, 7):
        cpu_tensors, cpu_finish = so.sparse_outputs(weights, limit)
        dev_tensors, dev_finish = so.sparse_outputs(weights, limit, on_device=True)
        expected = cpu_finish([t.numpy() for t in cpu_tensors])
        got = dev_finish([t.numpy() for t in dev_tensors])
        for (ids_a, w_a), (ids_b, w_b) in zip(expected, got):
            assert np.array_equal(ids_a, ids_b) and np.array_equal(w_a, w_b)
            assert ids_b.dtype == np.int32 and w_b.dtype == np.float32
        assert len(got[4][0]) == (3000 if limit is None else 7) and len(got[5][0]) == 0


@pytest.mark.slow
def test_the_forward_replayed_from_graphs_gives_the_eager_steps_results(tmp_path):
    """The graph path's logic on the CPU stand-in (a "graph" replays the forward on its static
    buffers): one graph per bucketed shape, replayed for a repeated shape with the new step's
    inputs copied in; the vectors equal the plain CPU step's."""
    from pooling_pipeline.core.engine.model_runner import ModelRunner
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    spec, plain, _ = runners(MODELS["bert (mean)"](tmp_path))
    graphed = ModelRunner(load_model_spec(spec.path), "cpu", "float32", backend="torch", device_steps=True,
                          cuda_graphs=True, shared_model=plain.model)
    assert graphed.backend_info["cuda_graphs"].startswith("on (a CPU stand-in")
    steps = [([5, 9, 3], 0), ([6, 2, 8], 1), ([17] * 11, 2), ([3, 40, 7, 22, 9], 3), ([4, 4, 4], 4)]
    for lengths, seed in steps:
        step = batch(lengths, seed=seed)
        same(graphed.run(step)[0], plain.run(step)[0])
    stats = graphed.graph_stats()
    # (3, 9) (3, 8) (3, 4): one bucket (4 rows, 16 tokens); 11 x 17; 5 x 40: three graphs in all
    assert stats == {"captured": 3, "replays": 5, "eager_steps": 0}, stats
    assert ModelRunner(load_model_spec(spec.path), "cpu", "float32", backend="torch", device_steps=True,
                       shared_model=plain.model).backend_info["cuda_graphs"] == "off"  # (on a CPU: asked for only)


def test_graphs_that_fail_or_differ_are_turned_off_and_shapes_past_the_bound_run_eager():
    from pooling_pipeline.core.engine.cuda_graphs import EagerStandIn, GraphedForward

    weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))

    def forward(inputs):
        return inputs["x"] @ weight

    def step(rows: int, seed: int) -> dict:
        return {"x": torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed))}

    graphed = GraphedForward(forward, EagerStandIn(), half=False, max_graphs=2)
    for rows, seed in ((4, 0), (4, 1), (8, 2), (16, 3), (4, 4)):
        inputs = step(rows, seed)
        assert torch.allclose(graphed(inputs), forward(inputs))
    assert graphed.stats() == {"captured": 2, "replays": 4, "eager_steps": 1}  # 16 rows: past the bound

    class Differs(EagerStandIn):
        def capture(self, fn, static):
            replay, output = super().capture(fn, static)
            return (lambda: (replay(), output.mul_(1.01))), output

    class Fails:
        def capture(self, fn, static):
            raise RuntimeError("operation not permitted when stream is capturing")

    for backend, why in ((Differs(), "a replay differs from eager by"), (Fails(), "capture failed: RuntimeError")):
        graphed = GraphedForward(forward, backend, half=False)
        inputs = step(4, 5)
        assert torch.allclose(graphed(inputs), forward(inputs)) and graphed(inputs).shape == (4, 8)
        assert graphed.stats()["captured"] == 0 and graphed.stats()["off"].startswith(why)
        assert graphed.stats()["eager_steps"] == 2


@pytest.mark.slow
def test_a_pipeline_on_device_steps_equals_st(monkeypatch):
    """The engine's device path end to end on the CPU (DEVICE_STEPS_ENV, launching ahead): the
    scheduler counts bucketed shapes, the runner pads to them and takes the 4-D mask, the forward
    replays from (stand-in) graphs; every vector equals ST's within 1e-5, and stats say so."""
    import corpus
    from sentence_transformers import SentenceTransformer

    from pooling_pipeline import Pipeline
    from pooling_pipeline.core.engine.main import DEVICE_STEPS_ENV, GRAPH_PLAN_ENV, LAUNCH_AHEAD_ENV
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    monkeypatch.setenv(DEVICE_STEPS_ENV, "1")
    monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1")
    # Graphs captured as shapes come (the start-up plan of MiniLM's shapes is minutes of eager forwards
    # on the CPU stand-in; the next test checks the plan on a tiny model)
    monkeypatch.setenv(GRAPH_PLAN_ENV, "0")
    texts = corpus.sentences(300, seed=3) + corpus.medium_texts(30, seed=3)
    reference = SentenceTransformer(load_model_spec(None).path, device="cpu").encode(texts)
    with Pipeline(backend="torch", num_render_workers=1, max_num_seqs=32) as pipe:
        got = np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False)])
        engine = pipe.stats()["engine"]
    assert np.abs(got - reference).max() <= TOL
    assert engine["step_shapes"].startswith("buckets") and engine["attention_mask"].startswith("4-D"), engine
    assert engine["cuda_graphs"].startswith("on (a CPU stand-in") and engine["cuda_graphs_captured"] >= 1, engine


@pytest.mark.slow
def test_every_scheduled_shape_is_captured_before_the_first_request_and_none_while_serving(monkeypatch, tmp_path):
    """The engine's start in a real process group, on the CPU stand-in of CUDA graphs (DEVICE_STEPS_ENV):
    every bucketed shape its scheduler can cut (step_shapes.scheduled_shapes, with its limits) has a
    graph before the first request; requests of every length after that replay them -- no capture,
    no eager step -- and equal ST's vectors within 1e-5. The start-up facts say how many, how long
    and how much memory. (Before: only the probe's shapes were captured at the start, every other
    one on its first step, in the middle of serving.)"""
    import corpus
    from sentence_transformers import SentenceTransformer

    from pooling_pipeline import Pipeline
    from pooling_pipeline.backends import describe_backend
    from pooling_pipeline.core.engine.main import DEVICE_STEPS_ENV, LAUNCH_AHEAD_ENV
    from pooling_pipeline.core.engine.scheduler import MIN_ROWS_CUT
    from pooling_pipeline.core.engine.step_shapes import scheduled_shapes
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    model = build_st(tmp_path, "bert")
    monkeypatch.setenv(DEVICE_STEPS_ENV, "1")
    monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1")
    texts = corpus.sentences(200, seed=5) + corpus.medium_texts(40, seed=5) + ["a", "word " * 300]
    reference = SentenceTransformer(model, device="cpu").encode(texts)
    with Pipeline(model=model, backend="torch", num_render_workers=1, max_num_seqs=16, max_num_batched_tokens=512) as pipe:
        start = pipe.stats()["engine"]
        planned = len(scheduled_shapes(16, start["max_num_batched_tokens"], load_model_spec(model).max_model_len,
                                       MIN_ROWS_CUT))
        assert start["cuda_graphs_planned"] == start["cuda_graphs_startup_captured"] == planned, start
        assert "cuda_graphs_left_eager" not in start, start
        assert start["cuda_graphs_buffers_mb"] > 0 and start["cuda_graphs_capture_s"] > 0, start
        line = describe_backend(start)  # (the start-up line)
        assert f"CUDA graphs: {planned} of {planned} step shapes captured at start-up in" in line, line
        got = np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False)])
        got_again = np.stack([o.embedding for o in pipe.embed(texts[::-1], use_tqdm=False)])
        time.sleep(1.5)  # (the counts ride on the engine's heartbeat: one is due within a second)
        engine = pipe.stats()["engine"]
    np.testing.assert_allclose(got, reference, atol=TOL, rtol=0)
    np.testing.assert_allclose(got_again, reference[::-1], atol=TOL, rtol=0)
    assert engine["cuda_graphs_captured"] == planned and engine["cuda_graphs_captured_in_run"] == 0, engine
    assert engine["cuda_graphs_eager_steps"] == 0 and engine["cuda_graphs_replays"] >= 2, engine


def test_the_start_up_plan_keeps_the_smallest_shapes_within_its_bounds_and_the_rest_run_eager():
    """capture_plan on the stand-in: past the graph count or the memory budget the plan keeps the
    shapes of the fewest padded tokens (a large step keeps the device busy anyway) and says what
    was left; once sealed, a shape without a graph runs eager and is counted, none is captured."""
    from pooling_pipeline.core.engine.cuda_graphs import EagerStandIn, GraphedForward, capture_plan

    weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))

    def forward(inputs):
        return inputs["x"] @ weight

    def graphed_and_step(max_graphs: int):
        graphed = GraphedForward(forward, EagerStandIn(), half=False, max_graphs=max_graphs)

        def step(rows: int, length: int) -> None:
            graphed({"x": torch.randn(rows, length, 8, generator=torch.Generator().manual_seed(rows))})

        return graphed, step

    shapes = [(8, 64), (1, 16), (4, 32), (2, 16), (16, 64), (1, 32)]
    graphed, step = graphed_and_step(64)
    facts = capture_plan(graphed, shapes, step)
    assert facts["cuda_graphs_planned"] == facts["cuda_graphs_startup_captured"] == 6, facts
    assert "cuda_graphs_left_eager" not in facts and facts["cuda_graphs_buffers_mb"] > 0, facts

    graphed, step = graphed_and_step(3)  # the smallest three: (1, 16), (2, 16), (1, 32)
    facts = capture_plan(graphed, shapes, step)
    assert sorted(key[0][1][:2] for key in graphed.graphs) == [(1, 16), (1, 32), (2, 16)], facts
    assert facts["cuda_graphs_left_eager"].startswith("3 of 6 planned shapes run eager: at most 3 graphs"), facts

    graphed, step = graphed_and_step(64)  # buffers of 32 tokens x 8 floats x 2 (in, out): 2 KB per 16 tokens
    facts = capture_plan(graphed, shapes, step, memory_budget=(16 + 32 + 32 + 128) * 8 * 4 * 2)
    assert facts["cuda_graphs_startup_captured"] == 4 and "MB of buffers" in facts["cuda_graphs_left_eager"], facts
    graphed.seal()
    step(16, 64)
    step(1, 16)
    assert graphed.stats() == {"captured": 4, "replays": 1, "eager_steps": 1, "captured_in_run": 0}
