#!/usr/bin/env python
"""SentenceEncoder.similarity against sentence-transformers' own, side by side in one run.

    python scripts/bench_similarity.py                      # 10,000 x 10,000 x 384, every function
    python scripts/bench_similarity.py --rows 2000 --repeats 5

Both sides get the same float32 numpy arrays (what `encode` returns) and give a torch tensor; the
table has each one's median seconds over the repeats, the ratio (ST / ours: above 1 is faster) and
the largest difference between the two results. Nothing but the two libraries runs meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=10_000, help="rows of each side (default 10,000)")
    ap.add_argument("--dim", type=int, default=384, help="embedding width (default 384, MiniLM's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--functions", default="cosine,dot,euclidean,manhattan")
    return ap


def median_seconds(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    args = build_parser().parse_args()
    from sentence_transformers import util

    from pooling_pipeline.similarity import similarity_matrix

    rng = np.random.default_rng(0)
    a = rng.standard_normal((args.rows, args.dim)).astype(np.float32)
    b = rng.standard_normal((args.rows, args.dim)).astype(np.float32)
    st_functions = {"cosine": util.cos_sim, "dot": util.dot_score, "euclidean": util.euclidean_sim,
                    "manhattan": util.manhattan_sim}
    print(f"| similarity ({args.rows:,} x {args.rows:,} x {args.dim}, float32) | pipeline s | "
          "sentence-transformers s | ST / pipeline | max |diff| |")
    print("|---|---|---|---|---|")
    for name in args.functions.split(","):
        similarity_matrix(name, a[:500], b[:500]), st_functions[name](a[:500], b[:500])  # warm both up
        ours, got = median_seconds(lambda name=name: similarity_matrix(name, a, b), args.repeats)
        theirs, want = median_seconds(lambda name=name: st_functions[name](a, b), args.repeats)
        diff = float((got - want).abs().max())
        print(f"| {name} | {ours:.3f} | {theirs:.3f} | {theirs / ours:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
