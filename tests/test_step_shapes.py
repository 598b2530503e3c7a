"""Step shapes on an accelerator: the buckets' arithmetic, and a replay of realistic texts through
the engine's own scheduler with the device settings, whose distinct step shapes stay under a bound
(each new shape costs a cuDNN build or a CUDA graph capture on a GPU)."""

from __future__ import annotations

import corpus
import numpy as np
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from pooling_pipeline.core.engine.columns import COL, TASK_CODE, Requests
from pooling_pipeline.core.engine.main import GPU_BATCH_TOKENS, GPU_MAX_PADDING, MAX_OVERHEAD_TOKENS
from pooling_pipeline.core.engine.scheduler import MIN_ROWS_CUT, Scheduler
from pooling_pipeline.core.engine.step_shapes import (
    ROW_LADDER,
    bucket_length,
    bucket_rows,
    bucket_shape,
    padded_to,
    rows_at_most,
    scheduled_shapes,
)
from pooling_pipeline.core.shared.config import GPU_MAX_NUM_SEQS
from pooling_pipeline.core.shared.schema import blank_table

# What the replay below holds the distinct step shapes to, per 1,000 steps (the buckets give 23
# there, against 181 distinct raw shapes; a replay of 30,000 texts gave ~80 in ~470 steps before).
MAX_SHAPES_PER_1000_STEPS = 40


def test_buckets():
    assert [bucket_rows(r) for r in (1, 2, 3, 5, 8, 9, 13, 63, 64, 65, 500, 513, 1024)] == \
        [1, 2, 4, 8, 8, 12, 16, 64, 64, 96, 512, 768, 1024]
    assert [bucket_length(n, 512) for n in (1, 16, 17, 250, 256, 257, 500, 512)] == [16, 16, 32, 256, 256, 288, 512, 512]
    assert bucket_length(70, 77) == 77  # never past the model's own limit
    with pytest.raises(ValueError, match="this is a bug"):
        bucket_length(78, 77)
    ids = np.arange(6).reshape(2, 3)
    grown, lengths = padded_to(ids, np.array([3, 2]), (4, 5), pad_id=0)
    assert grown.tolist() == [[0, 1, 2, 0, 0], [3, 4, 5, 0, 0], [0] * 5, [0] * 5]
    assert lengths.tolist() == [3, 2, 1, 1]  # (added rows: one pad token each)
    same, _ = padded_to(ids, np.array([3, 2]), (2, 3), pad_id=0)
    assert same is ids
    assert [rows_at_most(r) for r in (1, 3, 8, 11, 12, 100, 1024, 1100)] == [1, 2, 8, 8, 12, 96, 1024, 1024]


def token_lengths(n: int, seed: int) -> np.ndarray:
    """The token counts of n real short texts (the bundled model's tokenizer), as a sample to draw from."""
    from transformers import AutoTokenizer

    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    tokenizer = AutoTokenizer.from_pretrained(load_model_spec(None).path)
    texts = corpus.sentences(n, seed=seed) + corpus.medium_texts(n // 10, seed=seed)
    return np.minimum([len(ids) for ids in tokenizer(texts)["input_ids"]], 256)


def message(call: str, first: int, lengths: np.ndarray) -> Requests:
    cols = blank_table(len(lengths))
    cols[:, COL["indices"]] = np.arange(first, first + len(lengths))
    cols[:, COL["lengths"]] = lengths
    cols[:, COL["task"]] = TASK_CODE["embed"]
    calls = np.empty(len(lengths), dtype=object)
    calls[:] = call
    return Requests(calls, cols, np.ones(int(lengths.sum()), np.int32))


@pytest.mark.slow
def test_a_replay_of_real_texts_takes_few_step_shapes_on_device_settings():
    """Texts whose lengths follow real sentences and paragraphs, streamed through the scheduler as
    the engine runs it on a GPU (its window, the token budget, the GPU's sequence cap and padding):
    the bucketed (rows, length) shapes of 1,000 steps stay under the bound, and the padding the
    buckets add is a small share of the step's tokens."""
    rng = np.random.default_rng(0)
    sample = token_lengths(3000, seed=7)
    window = 8 * GPU_MAX_NUM_SEQS  # (the engine's window at the GPU default: 8 x max_num_seqs)
    # (a GPU step is mostly its fixed cost: the overhead the engine learns there is at its cap)
    scheduler = Scheduler(GPU_MAX_NUM_SEQS, GPU_BATCH_TOKENS, GPU_MAX_PADDING, overhead_tokens=MAX_OVERHEAD_TOKENS,
                          capacity=window, shape=lambda rows, longest: bucket_shape(rows, longest, 512))
    shapes, raw, real, bucketed, issued, rows = [], set(), 0, 0, 0, []
    while len(shapes) < 1000:
        while len(scheduler) + 256 <= window:  # the window refilled as the engine admits messages
            lengths = rng.choice(sample, 256)
            scheduler.add(message("c", issued, lengths))
            issued += 256
        step = scheduler.next_batch()
        shape = bucket_shape(len(step), int(step.lengths.max()), 512)
        shapes.append(shape)
        rows.append(len(step))
        raw.add((len(step), int(step.lengths.max())))
        real += int(step.lengths.sum())
        bucketed += shape[0] * shape[1]
    distinct = len(set(shapes))
    print(f"1,000 steps: {len(raw)} shapes unbucketed, {distinct} bucketed; {np.mean(rows):.0f} texts a step; "
          f"real tokens {real / bucketed:.1%} of the bucketed steps'")
    assert distinct <= MAX_SHAPES_PER_1000_STEPS, sorted(set(shapes))
    assert distinct < len(raw)
    assert np.mean(rows) >= 200  # hundreds of short texts a step, within the token budget
    assert all(r in ROW_LADDER for r in rows if r > 8)  # cut to a row bucket: no added rows
    assert real / bucketed >= 0.7, f"real tokens {real / bucketed:.0%} of the bucketed steps'"
    # Every shape is one the engine captured a graph for at its start (core/cuda_graphs.capture_plan).
    plan = set(scheduled_shapes(GPU_MAX_NUM_SEQS, GPU_BATCH_TOKENS, 512, MIN_ROWS_CUT))
    assert set(shapes) <= plan, sorted(set(shapes) - plan)


@given(st.integers(1, 300), st.integers(1, 4096), st.integers(8, 700), st.integers(0, 10**6),
       st.sampled_from(["short", "long", "mixed"]))
@settings(max_examples=examples(200))
def test_every_step_the_scheduler_cuts_is_a_shape_of_the_start_up_plan(max_seqs, max_tokens, cap, seed, kind):
    """Whatever the limits and the lengths, each step the scheduler cuts on a device (bucketed) is
    one of scheduled_shapes' -- the graphs captured at start-up -- so none is captured while serving."""
    rng = np.random.default_rng(seed)
    max_tokens = max(max_tokens, cap)  # (the engine's budget is at least the longest input: EngineCore)
    high = {"short": min(cap, 40), "long": cap, "mixed": cap}[kind]
    lengths = rng.integers(1, high + 1, 600) if kind != "mixed" else np.concatenate(
        [rng.integers(1, min(cap, 20) + 1, 400), rng.integers(1, cap + 1, 200)])
    scheduler = Scheduler(max_seqs, max_tokens, GPU_MAX_PADDING, overhead_tokens=float(rng.integers(0, 5000)),
                          capacity=len(lengths), shape=lambda rows, longest: bucket_shape(rows, longest, cap))
    scheduler.add(message("c", 0, rng.permutation(lengths)))
    plan = set(scheduled_shapes(max_seqs, max_tokens, cap, MIN_ROWS_CUT))
    while len(scheduler):
        step = scheduler.next_batch()
        shape = bucket_shape(len(step), int(step.lengths.max()), cap)
        assert shape in plan, (shape, max_seqs, max_tokens, cap)


def test_the_start_up_plan_is_every_reachable_bucket_and_no_other():
    """scheduled_shapes' arithmetic on small limits, by hand: rows 1, 2, 4 (3 requests), 8 (5 to 11),
    12 (12 to 15: cut to 12); lengths 16 (1 to 16 tokens), 32 (17 to 32), 40 (33 to the cap); 5 x 33
    tokens fit in 200, 12 x 17 do not (no (12, 32): a plan of shapes that cannot come costs captures)."""
    assert scheduled_shapes(15, 200, 40, MIN_ROWS_CUT) == [
        (1, 16), (1, 32), (1, 40), (2, 16), (2, 32), (2, 40), (4, 16), (4, 32), (4, 40),
        (8, 16), (8, 32), (8, 40), (12, 16)]
    # all-MiniLM-L6-v2 on a GPU (1,024 rows, 16,384 tokens, 256-token texts), and a BERT-base at 512
    assert len(scheduled_shapes(GPU_MAX_NUM_SEQS, GPU_BATCH_TOKENS, 256, MIN_ROWS_CUT)) == 197
    assert len(scheduled_shapes(GPU_MAX_NUM_SEQS, GPU_BATCH_TOKENS, 512, MIN_ROWS_CUT)) == 264
