#!/usr/bin/env python
"""Packed against padded rows on this machine's CPU (core/engine/packed_attention.py): the decision behind
`CPU_PACKED_DEFAULT` (a CPU stays padded unless packed is faster there).

    python scripts/bench_packed.py                # all-MiniLM-L6-v2, mixed short texts, 3 repeats
    python scripts/bench_packed.py --model DIR --repeats 5

Two measurements, each padded then packed, alternated, the median of the repeats:
* engine -- `Pipeline.embed(texts)` on the torch backend (a CPU's default, backend 'auto', runs
  OpenVINO where it can: padded shapes, never packed), the whole process group,
  POOLING_PIPELINE_ATTENTION set for its engine (the scheduler cuts steps by length, as served);
* steps  -- the ModelRunner alone on steps of 64 texts, in input order (the most padding a step can
  have) and sorted by length (about what the engine's scheduler cuts): their seconds, and the largest
  difference of the two layouts' vectors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import medium_texts, sentences  # noqa: E402


def mixed_texts(n: int) -> list[str]:
    """Mostly sentences, one in ten a medium text (400-1,500 characters), in a fixed shuffled order."""
    import random

    texts = sentences(n - n // 10) + medium_texts(n // 10, min_chars=400, max_chars=1500)
    random.Random(0).shuffle(texts)
    return texts


def engine_seconds(model, texts: list[str], layout: str) -> tuple[float, str]:
    from pooling_pipeline import Pipeline

    os.environ["POOLING_PIPELINE_ATTENTION"] = layout
    with Pipeline(model=model, backend="torch") as pipe:
        pipe.embed(texts[:64], use_tqdm=False)  # (warm)
        started = time.perf_counter()
        pipe.embed(texts, use_tqdm=False)
        took = time.perf_counter() - started
        said = pipe.stats()["engine"].get("batching", "")
    return took, said


def step_seconds(model, texts: list[str], rows: int, by_length: bool) -> dict:
    import torch
    from transformers import AutoTokenizer

    from pooling_pipeline.core.engine.columns import COL, TASK_CODE, Requests
    from pooling_pipeline.core.engine.model_runner import ModelRunner
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec
    from pooling_pipeline.core.shared.schema import blank_table

    spec = load_model_spec(model)
    tokenizer = AutoTokenizer.from_pretrained(spec.path)
    encoded = tokenizer(texts, truncation=True, max_length=spec.max_model_len)["input_ids"]
    if by_length:
        encoded = sorted(encoded, key=len)
    batches = []
    for at in range(0, len(encoded), rows):
        part = encoded[at:at + rows]
        cols = blank_table(len(part))
        cols[:, COL["indices"]] = np.arange(len(part))
        cols[:, COL["lengths"]] = [len(ids) for ids in part]
        cols[:, COL["task"]] = TASK_CODE["embed"]
        calls = np.empty(len(part), dtype=object)
        calls[:] = "bench"
        batches.append(Requests(calls, cols, np.concatenate(part).astype(np.int32)))
    runners = {layout: ModelRunner(spec, "cpu", "float32", attention=layout) for layout in ("padded", "packed")}
    vectors = {}
    timed = {}
    for layout, runner in runners.items():
        started = time.perf_counter()
        vectors[layout] = np.concatenate([runner.run(b)[0] for b in batches])
        timed[layout] = time.perf_counter() - started
    real = sum(int(b.lengths.sum()) for b in batches)
    padded = sum(int(b.lengths.max()) * len(b) for b in batches)
    return {**timed, "real_tokens": real, "padded_tokens": padded, "threads": torch.get_num_threads(),
            "max_diff": float(np.abs(vectors["padded"] - vectors["packed"]).max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a local model directory (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=64, help="texts per step in the steps measurement")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    texts = mixed_texts(args.texts)
    engine = {"padded": [], "packed": []}
    steps = {order: {"padded": [], "packed": []} for order in ("input order", "by length")}
    said, measured = {}, {}
    for _ in range(args.repeats):
        for layout in ("padded", "packed"):
            took, said[layout] = engine_seconds(args.model, texts, layout)
            engine[layout].append(took)
        for order in steps:
            measured[order] = step_seconds(args.model, texts, args.rows, order == "by length")
            for layout in ("padded", "packed"):
                steps[order][layout].append(measured[order][layout])
    print(f"{len(texts)} mixed short texts; torch threads {measured['by length']['threads']}")
    print("| measure | real / padded tokens | padded s | packed s | packed / padded |")
    print("|---|---:|---:|---:|---:|")
    rows = [("engine (Pipeline.embed, backend torch)", "", engine)]
    rows += [(f"steps of {args.rows} (ModelRunner, {order})",
              f"{measured[order]['real_tokens']:,} / {measured[order]['padded_tokens']:,}", got)
             for order, got in steps.items()]
    for name, tokens, got in rows:
        a, b = statistics.median(got["padded"]), statistics.median(got["packed"])
        print(f"| {name} | {tokens} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    print(f"max |diff| of the vectors, packed vs padded: {max(m['max_diff'] for m in measured.values()):.1e}")
    print(f"said: padded -> {said['padded']!r}; packed -> {said['packed']!r}")


if __name__ == "__main__":
    main()
