"""The simulated accelerator (a measurement instrument) and the engine loop it drives: steps
launched one ahead, results that stay checkable request by request."""

import corpus
import numpy as np
import pytest
from transformers import AutoTokenizer

from pooling_pipeline import Pipeline
from pooling_pipeline.core.engine.sim_runner import sim_vectors
from pooling_pipeline.core.shared.sim_device import SIM_PRESETS, SimDevice, resolve_sim_device


def _expected(ids: list[list[int]], dim: int) -> np.ndarray:
    return sim_vectors([np.asarray(x, dtype=np.int32) for x in ids], dim)


@pytest.mark.slow
def test_sim_device_returns_each_requests_own_vector_in_order(model_path):
    """Texts through the real render workers and a slow simulated device (steps overlap: the next
    one is launched before the previous one is waited for): every result is its own request's
    vector, in order, nothing lost."""
    texts = corpus.sentences(600, seed=161) + [corpus.long_document(3000, seed=162)]
    tok = AutoTokenizer.from_pretrained(model_path)
    ids = tok(texts, truncation=True, max_length=256)["input_ids"]
    device = SimDevice(step_s=2e-3, token_s=1e-7, dim=48)
    with Pipeline(device="sim", sim_device=device, max_num_seqs=32, num_render_workers=2) as pipe:
        info = pipe.stats()["engine"]
        assert info["device"] == "sim" and info["launch_ahead"] is True
        got = np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False)])
        streamed = [(o.index, o.embedding) for o in pipe.embed_stream(iter(texts))]
        token_outs = pipe.embed([{"prompt_token_ids": x} for x in ids[:50]], use_tqdm=False)
    expected = _expected(ids, 48)
    assert got.shape == (len(texts), 48)
    np.testing.assert_array_equal(got, expected)  # rows of a table: exact
    assert [i for i, _ in streamed] == list(range(len(texts)))
    np.testing.assert_array_equal(np.stack([v for _, v in streamed]), expected)
    np.testing.assert_array_equal(np.stack([o.embedding for o in token_outs]), expected[:50])


def test_sim_device_presets_and_bad_values():
    assert resolve_sim_device(None) == SIM_PRESETS["minilm-h100"]
    assert resolve_sim_device("base-h100").dim == 768
    assert resolve_sim_device((1e-4, 1e-9)) == SimDevice(step_s=1e-4, token_s=1e-9)
    for bad in ("h200", (1.0,), (-1.0, 0.0), (True, 0.0), "1,2"):
        with pytest.raises(ValueError, match="sim_device"):
            resolve_sim_device(bad)
    with pytest.raises(ValueError, match="sim_device applies to device='sim'"):
        Pipeline(device="cpu", sim_device="minilm-h100")


@pytest.mark.slow
def test_a_long_call_sends_whole_messages(model_path):
    """A fast device answers a step (a dozen requests) at a time; the call waits for room for a
    whole message while enough is in flight instead of refilling each step's slots with a small
    message (every process pays per message). Counted: the messages sent for 20,000 texts, and
    the results are still each request's own, in order."""
    texts = corpus.sentences(20_000, seed=163)
    tok = AutoTokenizer.from_pretrained(model_path)
    ids = tok(texts, truncation=True, max_length=256)["input_ids"]
    with Pipeline(device="sim", sim_device="minilm-h100", max_num_seqs=256, num_render_workers=1) as pipe:
        outs = list(pipe.embed_stream(iter(texts), use_tqdm=False))
        sent = sum(pipe.stats()["group"]["batches_per_worker"])
        per_message = pipe._dispatcher.batch_items
    assert [o.index for o in outs] == list(range(len(texts)))
    np.testing.assert_array_equal(np.stack([o.embedding for o in outs]), _expected(ids, SIM_PRESETS["minilm-h100"].dim))
    assert per_message == 256  # (max_num_seqs=256: messages of up to 256 requests)
    assert sent <= 1.1 * len(texts) / per_message, sent
