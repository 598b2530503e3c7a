"""Packed (unpadded) steps for the encoder families (core/engine/packed_attention.py): a step's rows back to
back in one sequence, positions restarting per row, attention kept inside each row by a varlen
kernel. On a CPU the kernel is the per-row reference (forced: the CPU stays padded by default);
on CUDA flash_attn's varlen kernel, which this suite cannot run (scripts/device_check.py compares
it with the bucketed path on the device).

What is held here: forced packed gives the padded path's vectors within 1e-5 in float32 (and
sentence-transformers' own), for mean, CLS and per-token outputs, rows of 1 to 300 tokens in one
step, a pair's token types and a RoBERTa pad id inside a row; the start-up choice (a CPU: padded;
CUDA with flash_attn importable: packed for the supported families only); the override refused
where packed is not exact, the start-up probe refusing a family whose packed forward differs; and
stats() saying the choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import synthetic_batch as batch
from model_zoo import build_cross_encoder, build_st

from pooling_pipeline.core.engine import packed_attention
from pooling_pipeline.core.engine.heads import head_for_st_chain
from pooling_pipeline.core.engine.model_runner import ModelRunner
from pooling_pipeline.core.shared.model_folder.load import load_model_spec

TOL = 1e-5
# (family, pooling): every family packed runs, each pooling kind once or more.
CASES = [("bert", "mean"), ("bert", "cls"), ("distilbert", "mean"), ("modernbert", "mean"), ("roberta", "cls"),
         ("xlmr", "mean")]


def runners(path: str) -> tuple:
    """The same model as two runners of their own (a packed runner switches its module's attention)."""
    spec = load_model_spec(path)
    return (spec, ModelRunner(spec, "cpu", "float32", backend="torch", attention="padded"),
            ModelRunner(spec, "cpu", "float32", backend="torch", attention="packed"))


def longest_row(runner: ModelRunner) -> int:
    """300 tokens, or the most the model's position table takes (RoBERTa's counts from pad_id + 1)."""
    config = runner.model.config
    table = getattr(config, "max_position_embeddings", 512)
    return min(300, table - (runner.pad_token_id + 1 if config.model_type in ("roberta", "xlm-roberta") else 0))


def same(got, expected) -> None:
    if isinstance(expected, np.ndarray):
        np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)
        return
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family,pooling", CASES)
def test_packed_rows_give_the_padded_vectors(family, pooling, tmp_path):
    """Rows of 1 to 300 tokens in one step: each row's vector (and its per-token vectors) packed
    equals the padded step's within 1e-5 -- no attention across rows, positions restarting per row."""
    spec, padded, packed = runners(build_st(tmp_path, family, pooling_mode=pooling))
    assert packed.backend_info["batching"].startswith("packed (reference"), packed.backend_info
    assert padded.backend_info["batching"].startswith("padded"), padded.backend_info
    vocab = min(spec.vocab_size, 1000)
    lengths = [1, longest_row(packed), 17, 2, 64, 5, 33]
    for task in ("embed", "token_embed"):
        step = batch(lengths, task, vocab=vocab)
        expected, padded_tokens = padded.run(step)
        got, packed_tokens = packed.run(step)
        same(got, expected)
        assert packed_tokens == sum(lengths) < padded_tokens  # (the padding is not computed)
    # A row alone gives the vector it gives packed between a long row and a short one.
    row = batch([17], vocab=vocab, seed=5).token_ids
    alone, _ = packed.run(batch([17], ids=row))
    long = longest_row(packed)
    among, _ = packed.run(batch([long, 17, 3], ids=np.concatenate([np.full(long, 7), row, [9, 9, 9]])))
    np.testing.assert_allclose(among[1], alone[0], atol=TOL, rtol=0)


@pytest.mark.slow
def test_a_pairs_token_types_a_prompt_left_out_and_a_pad_id_inside_a_row(tmp_path):
    """BERT: a pair's second text gets token type 1 in its row only; a prompt left out of the pooling
    (include_prompt=false) is left out packed too. RoBERTa numbers positions by counting a row's
    non-pad tokens: a pad id inside a row (token ids as given) keeps that numbering."""
    from model_zoo import build_bert_prompts

    _, padded, packed = runners(build_st(tmp_path, "bert"))
    assert packed.uses_token_types
    step = batch([9, 40, 6, 12], pair_start=[4, -1, 3, 11])
    same(packed.run(step)[0], padded.run(step)[0])
    _, padded, packed = runners(build_bert_prompts(tmp_path, include_prompt=False))
    step = batch([9, 40, 6, 12], pool_start=[3, 0, 5, 1])
    same(packed.run(step)[0], padded.run(step)[0])
    _, padded, packed = runners(build_st(tmp_path, "roberta"))
    ids = batch([8, 20, 5]).token_ids.copy()
    ids[[3, 8 + 10, 8 + 11]] = padded.pad_token_id
    step = batch([8, 20, 5], ids=ids)
    same(packed.run(step)[0], padded.run(step)[0])


@pytest.mark.slow
def test_packed_vectors_equal_sentence_transformers(tmp_path):
    """The packed runner on ST's own token ids gives ST's vectors within 1e-5 (texts of 2 to 128 tokens)."""
    from sentence_transformers import SentenceTransformer

    path = build_st(tmp_path, "bert", pooling_mode="mean")
    _, _, packed = runners(path)
    st = SentenceTransformer(path, device="cpu")
    texts = ["", "a", "The quick brown fox jumps over the lazy dog. " * 30, "short one", "medium text " * 12]
    tokenized = st.tokenize(texts)
    lengths = tokenized["attention_mask"].sum(dim=1).numpy()
    ids = tokenized["input_ids"][tokenized["attention_mask"].bool()].numpy()
    assert lengths.max() == st.max_seq_length and lengths.min() == 2
    got, _ = packed.run(batch(lengths, ids=ids))
    np.testing.assert_allclose(got, st.encode(texts), atol=TOL, rtol=0)


# ---- the start-up choice ---------------------------------------------------------------------------

def choice(spec, device_type: str, dtype=torch.float16, flash: bool = True, forced: str | None = None):
    return packed_attention.choose(spec, torch_module=True, quantized=False, device_type=device_type, dtype=dtype,
                                   forced=forced, head_refusal=head_for_st_chain(spec).packed_refusal, flash=flash)


@pytest.mark.slow
def test_the_choice_on_cuda_with_flash_attn_and_on_a_cpu(tmp_path):
    """CUDA (a stand-in: the choice is asked with flash_attn importable) in half precision: packed for
    the supported families, padded for the others with the reason; without flash_attn or in float32
    padded. A CPU: padded unless forced (packed measured not faster there)."""
    supported = {family: load_model_spec(build_st(tmp_path, family)) for family in ("bert", "modernbert", "xlmr")}
    others = {"mpnet": load_model_spec(build_st(tmp_path, "mpnet")),
              "t5": load_model_spec(build_st(tmp_path, "t5")),
              "cross-encoder": load_model_spec(build_cross_encoder(tmp_path))}
    for family, spec in supported.items():
        assert choice(spec, "cuda")[:2] == ("packed", "flash"), family
        assert choice(spec, "cuda", dtype=torch.bfloat16)[:2] == ("packed", "flash"), family
        layout, _, why = choice(spec, "cuda", flash=False)
        assert layout == "padded" and "flash_attn is not importable" in why
        assert choice(spec, "cuda", dtype=torch.float32)[0] == "padded"
        layout, _, why = choice(spec, "cpu", dtype=torch.float32)
        assert layout == "padded" and "not faster on a CPU" in why
        assert choice(spec, "cpu", dtype=torch.float32, forced="packed")[:2] == ("packed", "reference")
        # forced on CUDA without flash_attn: torch's nested jagged SDPA (checked on the device)
        assert choice(spec, "cuda", flash=False, forced="packed")[:2] == ("packed", "nested")
    for name, spec in others.items():
        layout, kernel, why = choice(spec, "cuda")
        assert (layout, kernel) == ("padded", None), name
        assert spec.model_type in why or "head" in why, why
    assert "'mpnet' is not among the packed families" in choice(others["mpnet"], "cuda")[2]


@pytest.mark.slow
def test_the_override_refuses_what_packed_cannot_run_exactly(tmp_path, monkeypatch):
    """POOLING_PIPELINE_ATTENTION=packed on a family packed cannot run exactly (MPNet's relative
    position bias, a cross-encoder's head, OpenVINO) is refused at start-up, naming why; an unknown
    value is refused; =padded keeps a supported family padded."""
    mpnet = load_model_spec(build_st(tmp_path, "mpnet"))
    monkeypatch.setenv(packed_attention.ATTENTION_ENV, "packed")
    with pytest.raises(ValueError, match=r"POOLING_PIPELINE_ATTENTION=packed cannot run model .*'mpnet' is not among"):
        ModelRunner(mpnet, "cpu", "float32", backend="torch")
    with pytest.raises(ValueError, match="its head reads the padded"):
        ModelRunner(load_model_spec(build_cross_encoder(tmp_path)), "cpu", "float32", backend="torch")
    bert = load_model_spec(build_st(tmp_path, "bert"))
    with pytest.raises(ValueError, match="int8 dynamic quantization"):
        ModelRunner(bert, "cpu", "float32", backend="torch", quantize="int8")
    assert ModelRunner(bert, "cpu", "float32", backend="torch").backend_info["batching"].startswith("packed")
    monkeypatch.setenv(packed_attention.ATTENTION_ENV, "sideways")
    with pytest.raises(ValueError, match="POOLING_PIPELINE_ATTENTION='sideways': expected one of packed, padded"):
        ModelRunner(bert, "cpu", "float32", backend="torch")
    monkeypatch.setenv(packed_attention.ATTENTION_ENV, "padded")
    assert ModelRunner(bert, "cpu", "float32", backend="torch").packed is None


@pytest.mark.slow
def test_the_start_up_probe_refuses_a_family_whose_packed_forward_differs(tmp_path, monkeypatch):
    """MPNet computes its attention itself (no attention interface: rows would attend across each
    other): listed as a packed family by mistake, the start-up probe against the padded forward
    catches it -- forced, refused; chosen, it stays padded and says why."""
    monkeypatch.setitem(packed_attention.PACKED_FAMILIES, "mpnet", "after_padding_idx")
    mpnet = load_model_spec(build_st(tmp_path, "mpnet"))
    with pytest.raises(ValueError, match="a packed probe differs from the padded forward"):
        ModelRunner(mpnet, "cpu", "float32", backend="torch", attention="packed")
    monkeypatch.setattr(packed_attention, "CPU_PACKED_DEFAULT", True)
    runner = ModelRunner(mpnet, "cpu", "float32", backend="torch")
    assert runner.packed is None
    assert runner.backend_info["batching"].startswith("padded: a packed probe differs"), runner.backend_info
    assert runner.model.config._attn_implementation not in packed_attention.NAMES.values()


def test_positions_restart_per_row_and_count_roberta_non_pad_tokens():
    """Positions as the padded forward numbers them: 0, 1, ... per row (BERT); pad_id + 1, + 2, ...
    counting the row's non-pad tokens, pad_id at a pad token (RoBERTa's create_position_ids)."""
    from pooling_pipeline.core.engine.model_runner import positions_in_row

    lengths = np.array([3, 1, 4])
    in_row = positions_in_row(lengths)
    assert in_row.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    ids = np.array([5, 1, 6, 7, 8, 9, 1, 9])
    assert packed_attention.positions(ids, in_row, "arange", 1).tolist() == in_row.tolist()
    assert packed_attention.positions(ids, in_row, "after_padding_idx", 1).tolist() == [2, 1, 3, 2, 2, 3, 1, 4]
    assert packed_attention.offsets(lengths).tolist() == [0, 3, 4, 8]


@pytest.mark.slow
def test_stats_say_the_choice_and_a_packed_engine_gives_st_vectors(tmp_path, monkeypatch):
    """The engine's start-up info (stats()["engine"]["batching"], the start-up line) says packed or
    padded and why; a packed engine's vectors equal ST's within 1e-5."""
    from sentence_transformers import SentenceTransformer

    from pooling_pipeline import Pipeline
    from pooling_pipeline.backends import describe_backend

    path = build_st(tmp_path, "bert")
    texts = ["a", "The quick brown fox jumps over the lazy dog. " * 20, "", "two words", "x " * 50]
    expected = SentenceTransformer(path, device="cpu").encode(texts)
    with Pipeline(model=path, backend="torch") as pipe:
        engine = pipe.stats()["engine"]
        assert engine["batching"] == "padded: packed measured not faster on a CPU (docs/benchmarks.md)"
    monkeypatch.setenv(packed_attention.ATTENTION_ENV, "packed")
    with Pipeline(model=path, backend="torch") as pipe:
        got = pipe.embed(texts, use_tqdm=False)
        engine = pipe.stats()["engine"]
    assert engine["batching"].startswith("packed (reference varlen kernel; forced"), engine
    assert "batching: packed" in describe_backend(engine)
    np.testing.assert_allclose(np.stack([out.data for out in got]), expected, atol=TOL, rtol=0)


@pytest.mark.slow
def test_the_device_checks_packed_rows_rehearsed_on_a_cpu(tmp_path):
    """scripts/device_check_steps.packed_rows (the graphs part's packed rows) on a CPU: the packed
    runner's vectors against the bucketed path's (max |diff| in float32), ms per step for both, what
    ran; a model packed cannot run is an error row naming why, not a failed part."""
    import device_check_steps as dcs

    spec = load_model_spec(build_st(tmp_path, "bert"))
    bucketed = ModelRunner(spec, "cpu", "float32", backend="torch", device_steps=True, cuda_graphs=True)
    batches = [batch([3, 40, 7, 12]), batch([5] * 6 + [90], seed=1)]
    vectors = np.concatenate([bucketed.run(b)[0] for b in batches])
    same_vectors, timing, ran = dcs.packed_rows(spec, "cpu", "float32", batches, bucketed, vectors, ("max_abs",))
    assert same_vectors.result == "pass" and same_vectors.check.endswith("max abs diff"), same_vectors
    assert "4 rows (62 of 160 tokens): host" in timing.figure and "device" in timing.figure
    assert ran.figure.startswith("packed (reference varlen kernel; forced"), ran
    mpnet = load_model_spec(build_st(tmp_path, "mpnet"))
    (refused,) = dcs.packed_rows(mpnet, "cpu", "float32", batches, bucketed, vectors, ("max_abs",))
    assert refused.result == "error" and "'mpnet' is not among the packed families" in refused.figure


def test_the_kernels_agree_with_one_sdpa_call_per_row():
    """The nested jagged kernel (torch's SDPA on nested tensors; CUDA's fallback without flash_attn)
    and the per-row reference give each row's own attention; a window keeps |q - k| within it."""
    torch.manual_seed(0)
    lengths = np.array([5, 1, 30, 7])
    q, k, v = (torch.randn(1, 4, int(lengths.sum()), 8) for _ in range(3))
    offsets = torch.from_numpy(packed_attention.offsets(lengths))
    module = torch.nn.Module()
    kwargs = {"cu_seq_lens_q": offsets, "max_length_q": int(lengths.max())}
    reference, _ = packed_attention.reference_varlen(module, q, k, v, None, scaling=0.3, **kwargs)
    nested, _ = packed_attention.nested_varlen(module, q, k, v, None, scaling=0.3, **kwargs)
    assert reference.shape == (1, int(lengths.sum()), 4, 8)
    torch.testing.assert_close(nested, reference, atol=1e-6, rtol=0)
    for (start, end) in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        row = torch.nn.functional.scaled_dot_product_attention(q[:, :, start:end], k[:, :, start:end],
                                                               v[:, :, start:end], scale=0.3)
        torch.testing.assert_close(reference[:, start:end], row.transpose(1, 2), atol=1e-6, rtol=0)
    windowed, _ = packed_attention.reference_varlen(module, q, k, v, None, scaling=0.3, sliding_window=3, **kwargs)
    assert not torch.allclose(windowed[:, 6:36], reference[:, 6:36])  # (the 30-token row is cut to |q - k| <= 2)
    with pytest.raises(RuntimeError, match="without the rows' offsets"):
        packed_attention.reference_varlen(module, q, k, v, None, scaling=0.3)
    with pytest.raises(RuntimeError, match="no sliding window"):
        packed_attention.nested_varlen(module, q, k, v, None, scaling=0.3, sliding_window=3, **kwargs)


@pytest.mark.slow
def test_the_nested_kernel_in_a_runner_gives_the_padded_vectors(tmp_path, monkeypatch):
    """Forced packed where the nested kernel is chosen (CUDA without flash_attn; here on the CPU):
    the padded path's vectors within 1e-5; a sliding-window family (ModernBERT) is refused by the
    start-up probe, the kernel having no window."""
    monkeypatch.setattr(packed_attention, "packed_kernel", lambda *args, **kwargs: "nested")
    _, padded, packed = runners(build_st(tmp_path, "bert"))
    assert packed.backend_info["batching"].startswith("packed (nested varlen kernel")
    step = batch([1, 300, 17, 2, 64], pair_start=[-1, 100, -1, -1, 10])
    same(packed.run(step)[0], padded.run(step)[0])
    with pytest.raises(ValueError, match="the packed probe failed .*no sliding window"):
        ModelRunner(load_model_spec(build_st(tmp_path, "modernbert")), "cpu", "float32", backend="torch",
                    attention="packed")
