#!/usr/bin/env python
"""Memory soak: embed_stream over a million generated requests, sampling every process's RSS.

    python scripts/soak.py                       # 1,000,000 requests, tiny model
    python scripts/soak.py --requests 200000 --real-model

Prints RSS per process at each 10% of the run and the growth from 100k requests to the end.
A bounded pipeline shows a flat line: memory follows the configuration, not the input's length.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import corpus
import psutil  # noqa: E402
from tiny_models import TINY_BATCH_SHAPE, build_tiny_model  # noqa: E402

from pooling_pipeline import Pipeline  # noqa: E402
from pooling_pipeline.call_stats import format_stats  # noqa: E402


def rss_mb(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.NoSuchProcess:
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--real-model", action="store_true", help="the bundled model instead of the tiny one")
    ap.add_argument("--max-seconds", type=float, default=900, help="stop early after this long")
    args = ap.parse_args()

    model = None if args.real_model else build_tiny_model()
    pool = corpus.sentences(5000, seed=9)
    samples = []
    shape = {} if args.real_model else TINY_BATCH_SHAPE
    with Pipeline(model=model, num_render_workers=args.workers, **shape) as pipe:
        pids = {"frontend": os.getpid(), "engine": pipe.pids["engine"]}
        pids.update({f"worker{i}": p for i, p in enumerate(pipe.pids["workers"])})
        start = time.perf_counter()
        step = max(1, args.requests // 10)
        marks = {100_000 if args.requests >= 200_000 else step} | set(range(step, args.requests + 1, step))
        done = 0
        # Every request is a fresh string, as from a file: nothing is shared with earlier ones.
        stream = (pool[i % len(pool)] + f" #{i}" for i in range(args.requests))
        for out in pipe.embed_stream(stream):
            done += 1
            if out.index != done - 1:
                raise SystemExit(f"order broken at {done - 1}: got {out.index}")
            if done in marks:
                samples.append((done, time.perf_counter() - start, {k: rss_mb(p) for k, p in pids.items()}))
                print(f"{done:>9,} requests {samples[-1][1]:7.1f} s  " +
                      "  ".join(f"{k} {v:6.0f} MB" for k, v in samples[-1][2].items()), flush=True)
            if time.perf_counter() - start > args.max_seconds:
                print(f"stopping after {args.max_seconds:.0f} s")
                break
        stats = pipe.stats()
    first = next((s for s in samples if s[0] >= 100_000), samples[0])
    last = samples[-1]
    print()
    print(f"| process | RSS at {first[0]:,} requests | RSS at {last[0]:,} | growth |")
    print("|---|---|---|---|")
    for key in first[2]:
        print(f"| {key} | {first[2][key]:.0f} MB | {last[2][key]:.0f} MB | {last[2][key] - first[2][key]:+.1f} MB |")
    print(f"\n{last[0]:,} requests in {last[1]:.0f} s = {last[0] / last[1]:,.0f} requests/s; "
          f"max in flight {stats['max_inflight_seen']} (bound {pipe.max_inflight}), "
          f"max in engine {stats['max_in_core_seen']} (bound {pipe.engine_window})")
    for line in format_stats(stats):
        print(line)


if __name__ == "__main__":
    main()
