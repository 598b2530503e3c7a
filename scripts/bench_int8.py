#!/usr/bin/env python
"""What `quantize="int8"` gives and costs: the pipeline in float32 and in int8 (the transformer's
Linear layers dynamically quantized) on the same corpus, in one run.

    python scripts/bench_int8.py                     # 2000 documents, 200 queries, 3 repeats
    python scripts/bench_int8.py --docs 5000 --queries 500 --model DIR

The corpus is the standard library's docstrings (scripts/corpus.py): documents are whole docstrings
(up to 256 tokens kept), queries are single sentences. Reported: the cosine of each document's int8
vector to its float32 vector (min, median), the top-10 retrieval agreement (for each query, how many
of the float32 top-10 documents by cosine are in the int8 top-10, averaged), and the documents per
second of each, medians of the repeats, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus  # noqa: E402


def embed(pipe, texts: list[str]) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    outs = pipe.embed(texts, use_tqdm=False)
    seconds = time.perf_counter() - started
    return np.stack([o.embedding for o in outs]), seconds


def top_k(queries: np.ndarray, docs: np.ndarray, k: int) -> np.ndarray:
    scores = queries @ docs.T  # the vectors are normalized: cosine
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args(argv)
    if min(args.docs, args.queries, args.repeats, args.k) < 1 or args.k > args.docs:
        parser.error("--docs, --queries, --repeats and --k must be positive, --k at most --docs")

    from pooling_pipeline import Pipeline
    from pooling_pipeline.core.shared.model_folder.model_path import default_model_path

    model = args.model or str(default_model_path())
    docs = corpus.medium_texts(args.docs, seed=7, min_chars=200, max_chars=2000)
    queries = corpus.sentences(args.queries, seed=8)
    # int8 is a torch-backend mode: float32 is measured on torch too, so the ratio is int8's alone.
    modes = {"float32": {"backend": "torch"}, "int8": {"backend": "torch", "quantize": "int8"}}
    pipes = {name: Pipeline(model=model, **options) for name, options in modes.items()}
    try:
        vectors, seconds = {}, {name: [] for name in modes}
        for name, pipe in pipes.items():  # warm-up, and the vectors compared
            vectors[name] = (embed(pipe, docs)[0], embed(pipe, queries)[0])
        for _ in range(args.repeats):
            for name, pipe in pipes.items():
                seconds[name].append(embed(pipe, docs)[1])
    finally:
        for pipe in pipes.values():
            pipe.close()

    (doc32, q32), (doc8, q8) = vectors["float32"], vectors["int8"]
    cos = np.sum(doc32 * doc8, axis=1) / (np.linalg.norm(doc32, axis=1) * np.linalg.norm(doc8, axis=1))
    ref, got = top_k(q32, doc32, args.k), top_k(q8, doc8, args.k)
    overlap = np.array([len(set(r) & set(g)) / args.k for r, g in zip(ref.tolist(), got.tolist())])
    rate = {name: args.docs / statistics.median(s) for name, s in seconds.items()}
    print(f"| mode | docs/s (median of {args.repeats}) | speed vs float32 | cosine to float32 min / median "
          f"| top-{args.k} agreement (mean, min) |")
    print("|---|---|---|---|---|")
    print(f"| float32 (torch) | {rate['float32']:.1f} | 1.00x | 1 / 1 | 1.00, 1.00 |")
    print(f"| int8 (torch dynamic) | {rate['int8']:.1f} | {rate['int8'] / rate['float32']:.2f}x | "
          f"{cos.min():.4f} / {np.median(cos):.4f} | {overlap.mean():.3f}, {overlap.min():.2f} |")
    print(f"\n{args.docs} documents, {args.queries} queries, model {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
