"""The shapes a step takes on an accelerator: a bounded set, so that per-shape work (a cuDNN
attention graph built, a CUDA graph captured, an allocator's new block) is paid once per shape,
not once per step.

A step's collated batch is [rows, longest] token ids. On a device the runner pads it up to a
bucket: the longest length rounded up to a multiple of LENGTH_STEP (never past the model's own
limit), the rows to the next value of a short ladder. The rows added are one pad token each and
their results are dropped; the tokens added are padding the attention mask hides. A replay of
30,000 real texts through the engine's scheduler gave ~80 distinct (rows, length) shapes in ~470
steps without buckets; `tests/test_step_shapes.py` holds the bucketed count under a bound.

On a CPU nothing is padded: there a step costs its padded tokens and nothing per shape (the CPU
defaults stay as measured).
"""

from __future__ import annotations

import bisect

import numpy as np

# Lengths round up to a multiple of 16 tokens up to 256, of 32 above (a step of 16 on a 24-token
# text is <= 40% more tokens on short texts, where a GPU step is mostly its fixed cost anyway;
# above 256 a step of 32 is <= 12%).
LENGTH_STEPS = ((256, 16), (1 << 30, 32))
# Rows: 1, 2, 4, 8, then powers of two and one and a half times them (12, 16, 24, 32, 48, ...): 18
# values up to 1,024. The scheduler fills a step's rows up to its bucket where requests wait
# (Scheduler(shape=...)), so most steps land on a value and the rows added are few; a finer ladder
# (multiples of 8 and 32) gave 77 distinct shapes in the replay's 1,000 steps, this one fewer.
ROW_LADDER = tuple(sorted({1, 2, 4, *(1 << k for k in range(3, 31)), *(3 << k for k in range(2, 30))}))


def _round_up(value: int, steps) -> int:
    for limit, step in steps:
        if value <= limit:
            return -(-value // step) * step
    raise ValueError(f"{value} is past every step: this is a bug")


def bucket_length(longest: int, cap: int) -> int:
    """The padded length of a step whose longest request has `longest` tokens (at most `cap`, the
    model's own limit, which it never passes)."""
    if longest > cap:
        raise ValueError(f"a step of {longest} tokens is past the model's limit of {cap}: this is a bug")
    return min(_round_up(max(longest, 1), LENGTH_STEPS), cap)


def bucket_rows(rows: int) -> int:
    """The padded row count of a step of `rows` requests."""
    return ROW_LADDER[bisect.bisect_left(ROW_LADDER, max(rows, 1))]


def rows_at_most(rows: int) -> int:
    """The largest row bucket that is not more than `rows` (a step cut to it computes no added row)."""
    return ROW_LADDER[bisect.bisect_right(ROW_LADDER, max(rows, 1)) - 1]


def bucket_shape(rows: int, longest: int, cap: int) -> tuple[int, int]:
    return bucket_rows(rows), bucket_length(longest, cap)


def padded_to(ids: np.ndarray, lengths: np.ndarray, shape: tuple[int, int], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """A collated [rows, longest] id matrix and its lengths grown to `shape`: columns of `pad_id`
    (masked out by the lengths), and rows of one `pad_id` token each (length 1: a row no token
    attends to would make a NaN of its softmax; its result is dropped)."""
    rows, longest = ids.shape
    target_rows, target_len = shape
    if (target_rows, target_len) == (rows, longest):
        return ids, lengths
    out = np.full((target_rows, target_len), pad_id, dtype=ids.dtype)
    out[:rows, :longest] = ids
    grown = np.ones(target_rows, dtype=lengths.dtype)
    grown[:rows] = lengths
    return out, grown


def scheduled_shapes(max_rows: int, max_tokens: int, cap: int, cut_above: int) -> list[tuple[int, int]]:
    """Every bucketed (rows, length) shape a step of the engine's scheduler can take (the CUDA graphs
    captured at start-up, core/cuda_graphs.capture_plan): a step of `count` requests up to `longest`
    tokens has count <= `max_rows` and count x longest <= `max_tokens` (one request alone whatever
    its length, at most `cap`, the model's limit); a step of more than `cut_above` requests is cut to
    a row bucket's size (Scheduler.next_batch), a smaller one is padded to its bucket. A bucket is
    reachable when its fewest rows times its shortest length fits."""
    lengths = [bucket_length(1, cap)]
    while lengths[-1] < cap:
        lengths.append(bucket_length(lengths[-1] + 1, cap))
    shortest = {length: (lengths[i - 1] + 1 if i else 1) for i, length in enumerate(lengths)}
    fewest = {bucket_rows(count): count for count in range(min(max_rows, cut_above), 0, -1)}
    fewest.update({rows: rows for rows in ROW_LADDER if cut_above < rows <= max_rows})
    return [(rows, length) for rows, least in sorted(fewest.items()) for length in lengths
            if least == 1 or least * shortest[length] <= max_tokens]
