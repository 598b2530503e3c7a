#!/usr/bin/env python
"""Load test: sweep render workers (and engine threads) in two regimes, check every run, print a table.

    python scripts/loadtest.py                                # tiny model, workers 1..cores
    python scripts/loadtest.py --regime real --requests 3000
    python scripts/loadtest.py --workers 1 2 4 8 16 --threads 1 4 --png sweep.png   # a big machine

Regimes: "tiny" -- a tiny BERT built on the fly, so tokenization and transport are the bottleneck
(what a GPU engine looks like from the CPU side; it gets a GPU's batch shape too: 256 sequences,
16384 tokens); "real" -- the bundled all-MiniLM-L6-v2 with the CPU defaults, model-bound.
Each run embeds the same generated short texts through `embed_stream`, checks that every result
came back once and in order, samples each process's CPU% and RSS with psutil, and prints the
pipeline's own stage statistics (busy time per stage, padding, queue depth histograms).
Bounded: at most --requests per run and --max-seconds per run.

On a machine with 16+ cores, sweep the workers and the engine threads, e.g.

    python scripts/loadtest.py --workers 1 2 4 8 12 16 --threads 1 2 4 --png sweep.png --json sweep.json

The tiny regime then shows how far render workers scale before the frontend or the engine's
loop becomes the bottleneck; the real regime shows where adding workers stops paying because
the model is the bottleneck (engine busy ~100%). The PNG needs matplotlib (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import corpus
import psutil  # noqa: E402
from tiny_models import TINY_BATCH_SHAPE, build_tiny_model  # noqa: E402

from pooling_pipeline import Pipeline  # noqa: E402
from pooling_pipeline.call_stats import format_stats  # noqa: E402
from pooling_pipeline.cpu_plan import available_cores  # noqa: E402


class Sampler:
    """CPU% and peak RSS of a set of processes, sampled every 0.5 s in a thread."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.cpu = {name: [] for name in pids}
        self.rss = {name: 0.0 for name in pids}
        self.stop = threading.Event()
        for p in self.procs.values():
            p.cpu_percent(None)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            for name, p in self.procs.items():
                try:
                    self.cpu[name].append(p.cpu_percent(None))
                    self.rss[name] = max(self.rss[name], p.memory_info().rss / 2**20)
                except psutil.NoSuchProcess:
                    pass

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        return {name: {"cpu_pct": sum(v) / len(v) if v else 0.0, "rss_mb": self.rss[name]} for name, v in self.cpu.items()}


def run_once(model: str | None, workers: int, threads: int | None, texts: list[str], max_seconds: float,
             batch_shape: dict) -> dict:
    kwargs = {} if threads is None else {"engine_threads": threads}
    with Pipeline(model=model, num_render_workers=workers, **batch_shape, **kwargs) as pipe:
        pipe.embed(texts[:256], use_tqdm=False)  # warm-up
        pids = {"frontend": os.getpid(), "engine": pipe.pids["engine"]}
        pids.update({f"worker{i}": p for i, p in enumerate(pipe.pids["workers"])})
        sampler = Sampler(pids)
        start = time.perf_counter()
        done = 0
        for out in pipe.embed_stream(iter(texts)):
            if out.index != done:
                raise SystemExit(f"order broken: expected {done}, got {out.index}")
            done += 1
            if time.perf_counter() - start > max_seconds:
                break
        wall = time.perf_counter() - start
        procs = sampler.finish()
        stats = pipe.stats()
    complete = done == len(texts)
    engine_threads = stats["cpu_plan"]["engine_threads"] if threads is None else threads
    return {"workers": workers, "threads_requested": threads, "engine_threads": engine_threads,
            "requests": done, "complete": complete, "wall_s": wall, "requests_per_s": done / wall,
            "tokens_per_s": stats["prompt_tokens"] / wall, "engine_busy": stats["engine_busy_fraction"],
            "padding_efficiency": 1 - stats["padding_fraction"], "max_inflight": stats["max_inflight_seen"],
            "max_in_core": stats["max_in_core_seen"], "processes": procs,
            "stages": stats["stages"], "queue_depths": stats["queue_depths"], "stats_lines": format_stats(stats)}


def series(runs: list[dict]) -> dict[str, list[dict]]:
    """Runs grouped by the engine-threads setting (one curve each), in worker order."""
    out: dict[str, list[dict]] = {}
    for r in runs:
        key = "threads: CPU plan" if r["threads_requested"] is None else f"engine threads {r['threads_requested']}"
        out.setdefault(key, []).append(r)
    return {k: sorted(v, key=lambda r: r["workers"]) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regime", choices=["tiny", "real"], default="tiny")
    ap.add_argument("--workers", type=int, nargs="+", default=None, help="default: 1 .. cores")
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="engine threads (default: the CPU plan)")
    ap.add_argument("--requests", type=int, default=None, help="per run (default: 40000 tiny, 2000 real)")
    ap.add_argument("--texts", choices=["short", "medium"], default="short",
                    help="short sentences (~24 tokens) or medium texts (600-4000 characters, kept to 256 tokens)")
    ap.add_argument("--max-seconds", type=float, default=120)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: 256 tiny, the Pipeline's default real")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="default: 16384 tiny (a GPU's budget), the engine's default real")
    ap.add_argument("--json", default=None, help="write the runs here")
    ap.add_argument("--png", default=None, help="draw throughput and engine busy %% against workers (matplotlib)")
    args = ap.parse_args()

    cores = available_cores()
    workers_list = args.workers or list(range(1, cores + 1))
    model = build_tiny_model() if args.regime == "tiny" else None
    n = args.requests or (40_000 if args.regime == "tiny" else 2_000)
    pool = corpus.sentences(5000, seed=5) if args.texts == "short" else \
        corpus.medium_texts(2000, seed=5, min_chars=600, max_chars=4000)
    texts = [pool[i % len(pool)] for i in range(n)]
    batch_shape = {}
    if args.max_num_seqs or args.regime == "tiny":
        batch_shape["max_num_seqs"] = args.max_num_seqs or TINY_BATCH_SHAPE["max_num_seqs"]
    if args.max_num_batched_tokens or args.regime == "tiny":
        batch_shape["max_num_batched_tokens"] = args.max_num_batched_tokens or TINY_BATCH_SHAPE["max_num_batched_tokens"]
    runs = []
    for threads in args.threads or [None]:
        for workers in workers_list:
            run = run_once(model, workers, threads, texts, args.max_seconds, batch_shape)
            runs.append(run)
            print(f"workers {workers} threads {run['engine_threads']}: {run['requests_per_s']:,.0f} req/s, "
                  f"engine busy {run['engine_busy']:.0%}", flush=True)
            for line in run["stats_lines"]:
                print(f"  {line}")

    print(f"\nregime {args.regime}, {n:,} {args.texts} texts per run, {cores} cores, batch shape {batch_shape or 'default'}")
    print("| workers | engine threads | requests/s | tokens/s | engine busy | padding eff. | complete+ordered "
          "| CPU% frontend / engine / workers | peak RSS MB frontend / engine / workers |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        p = r["processes"]
        worker_cpu = " ".join(f"{v['cpu_pct']:.0f}" for k, v in p.items() if k.startswith("worker"))
        worker_rss = " ".join(f"{v['rss_mb']:.0f}" for k, v in p.items() if k.startswith("worker"))
        print(f"| {r['workers']} | {r['engine_threads']} | {r['requests_per_s']:,.0f} | {r['tokens_per_s']:,.0f} "
              f"| {r['engine_busy']:.0%} | {r['padding_efficiency']:.0%} | {'yes' if r['complete'] else 'no (time limit)'} "
              f"| {p['frontend']['cpu_pct']:.0f} / {p['engine']['cpu_pct']:.0f} / {worker_cpu} "
              f"| {p['frontend']['rss_mb']:.0f} / {p['engine']['rss_mb']:.0f} / {worker_rss} |")
    for setting, group in series(runs).items():
        base = next((r for r in group if r["workers"] == 1), None)
        for r in group:
            if base and r["workers"] > 1:
                print(f"scaling ({setting}): {r['workers']} workers / 1 worker = "
                      f"{r['requests_per_s'] / base['requests_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"regime": args.regime, "cores": cores, "batch_shape": batch_shape,
                                               "runs": runs}, indent=2))
    if args.png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print('--png needs matplotlib (pip install -e ".[bench]")')
            return
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for setting, group in series(runs).items():
            ax.plot([r["workers"] for r in group], [r["requests_per_s"] for r in group], "o-", label=setting)
            ax2.plot([r["workers"] for r in group], [100 * r["engine_busy"] for r in group], "s--", label=setting)
        ax.set_xlabel("render workers")
        ax.set_ylabel("requests/s")
        ax.set_title(f"throughput, {args.regime} model, {cores} cores")
        ax2.set_xlabel("render workers")
        ax2.set_ylabel("engine busy %")
        ax2.set_ylim(0, 105)
        ax2.set_title("engine busy")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.png)
        print(f"chart: {args.png}")


if __name__ == "__main__":
    main()
