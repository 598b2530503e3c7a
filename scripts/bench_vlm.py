#!/usr/bin/env python
"""A VLM embedder (Qwen3-VL-Embedding's kind): the pipeline against sentence-transformers 6 on the same
image files, one run, one table.

A Qwen3-VL embedder with Qwen3-VL-Embedding's input (16-pixel patches merged 2 x 2, 4 to 1,280 vision
tokens an image by the processor's dynamic resolution) on small random towers (scripts/vlm_models.py
BENCH_SIZES: the real 2B model takes seconds an image on this CPU) embeds two sets built here: (a)
document pages, 1240x1754 PNGs (scripts/bench_pages.py's), (b) web JPEGs, 500x400
(scripts/image_set.py). Both sides get the files' paths: the pipeline's `embed(paths)` (render
workers decode and run the processor while the engine runs the model) and ST's `encode(paths,
batch_size=32)` in a child process (decode, process and forward in turn). Per set: images/s of each
and their ratio (pass by pass; the median of the pairs' ratios), the largest |difference| of the
vectors (within 1e-5), the render workers' CPU per image, the engine's busy fraction and peak RSS.
Needs torchvision (transformers 5 loads a Qwen-VL processor only with it).

    python scripts/bench_vlm.py
    python scripts/bench_vlm.py --count 8 --repeats 2 --model /tmp/vlm/st
    python scripts/bench_vlm.py --device cuda --json vlm.json

On a GPU (`--device cuda`) both sides run there in float32; `--json` writes the table's figures as
scripts/device_check.py's rows (the vectors within 1e-4 on CUDA, 1e-5 on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
from bench_pages import build_pages  # noqa: E402
from image_set import build_image_set  # noqa: E402
from loadtest import Sampler, cpu_seconds  # noqa: E402

from pooling_pipeline import Pipeline  # noqa: E402

SETS = {"pages": "(a) document pages, PNG 1240x1754", "web": "(b) web JPEGs, 500x400"}
MAX_ABS_DIFF = 1e-5
WARMUP = 2


def build_model(work: Path) -> str:
    code = ("import vlm_models; print(vlm_models.build_qwen3vl_embedder("
            f"{str(work / 'vlm')!r}, sizes=vlm_models.BENCH_SIZES))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, check=True, capture_output=True,
                         text=True)
    return out.stdout.strip().splitlines()[-1]


def serve_st(model: str, threads: int, device: str = "cpu") -> None:
    """The child's loop: a JSON line {"paths", "out"} in, the vectors saved to `out` (npz), a
    JSON line {"seconds"} out; until stdin closes."""
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    st = SentenceTransformer(model, device=device)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        started = time.perf_counter()
        vectors = st.encode(request["paths"], batch_size=32)
        seconds = time.perf_counter() - started
        np.savez(request["out"], *[np.asarray(v) for v in vectors])
        print(json.dumps({"seconds": seconds}), flush=True)


class STChild:
    def __init__(self, model: str, threads: int, work: Path, device: str = "cpu") -> None:
        code = f"import bench_vlm; bench_vlm.serve_st({model!r}, {threads}, {device!r})"
        self.out = work / "st-vectors.npz"
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parent, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if not self.proc.stdout.readline():
            raise RuntimeError("the sentence-transformers child process did not start")

    def encode(self, paths: list[str]) -> tuple[float, list[np.ndarray]]:
        self.proc.stdin.write(json.dumps({"paths": paths, "out": str(self.out)}) + "\n")
        self.proc.stdin.flush()
        seconds = float(json.loads(self.proc.stdout.readline())["seconds"])
        with np.load(self.out) as saved:
            return seconds, [saved[f"arr_{k}"] for k in range(len(paths))]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def pipeline_pass(pipe: Pipeline, paths: list[str]) -> dict:
    pids = {"frontend": os.getpid(), **{f"worker{i}": pid for i, pid in enumerate(pipe.pids["workers"])}}
    workers = [name for name in pids if name.startswith("worker")]
    sampler, before = Sampler(pids), cpu_seconds(pids)
    started = time.perf_counter()
    outs = pipe.embed(paths, use_tqdm=False)
    seconds = time.perf_counter() - started
    after, sampled = cpu_seconds(pids), sampler.finish()
    return {"seconds": seconds, "vectors": [o.embedding for o in outs], "busy": pipe.stats()["engine_busy_fraction"],
            "worker_cpu": sum(after[w] - before[w] for w in workers),
            "worker_rss": max(sampled[w]["rss_mb"] for w in workers), "frontend_rss": sampled["frontend"]["rss_mb"]}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a VLM embedder's folder (default: build the benchmark-sized one)")
    ap.add_argument("--count", type=int, default=16, help="images per set")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda: both sides run there (default: cpu)")
    ap.add_argument("--json", default=None, help="write the figures as scripts/device_check.py's rows here")
    ap.add_argument("--max-inflight", type=int, default=None, help="the Pipeline's max_inflight (default: its own)")
    ap.add_argument("--sets", default="pages,web", help="which image sets, of pages,web")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    max_diff = MAX_ABS_DIFF if args.device == "cpu" else 1e-4
    work = Path(tempfile.mkdtemp(prefix="bench-vlm-"))
    model = args.model or build_model(work)
    builders = {"pages": lambda: build_pages(work / "pages", args.count),
                "web": lambda: build_image_set(work / "web", "web", args.count)}
    sets = {kind: builders[kind]() for kind in args.sets.split(",")}
    rows, failed = [], False
    figures = []
    with Pipeline(model=model, dtype="float32", device=args.device, num_render_workers=args.workers,
                  max_inflight=args.max_inflight) as pipe:
        info = pipe.stats()["engine"]
        st = STChild(model, int(info.get("torch_threads") or 1), work, args.device)
        try:
            for kind, paths in sets.items():
                pipe.embed(paths[:WARMUP], use_tqdm=False)
                st.encode(paths[:WARMUP])
                ours, theirs = [], []
                for _ in range(args.repeats):
                    ours.append(pipeline_pass(pipe, paths))
                    theirs.append(st.encode(paths))
                    print(f"  {kind}: {len(paths) / ours[-1]['seconds']:.2f} vs ST {len(paths) / theirs[-1][0]:.2f} "
                          "images/s", flush=True)
                diff = max(float(np.abs(a - b).max()) for a, b in zip(ours[-1]["vectors"], theirs[-1][1]))
                failed |= diff > max_diff
                med = lambda key: statistics.median(p[key] for p in ours)  # noqa: E731
                ratio = statistics.median(t[0] / o["seconds"] for o, t in zip(ours, theirs))
                figures.append((kind, len(paths) / med("seconds"), ratio, diff))
                rows.append(f"| {SETS[kind]} | {len(paths) / med('seconds'):.2f} | "
                            f"{len(paths) / statistics.median(t[0] for t in theirs):.2f} | {ratio:.2f}x | {diff:.1e} | "
                            f"{med('worker_cpu') / len(paths):.3f} | {med('busy'):.2f} | "
                            f"{max(p['worker_rss'] for p in ours):.0f} | {max(p['frontend_rss'] for p in ours):.0f} |")
        finally:
            st.close()
    print(f"\nVLM embedder (Qwen3-VL-Embedding's input on small random towers), float32, torch on both sides, "
          f"{os.cpu_count()} cores; "
          f"{args.count} images a set, median of {args.repeats} passes")
    header = ["set", "pipeline images/s", "ST images/s", "pipeline / ST", "max |diff|", "worker CPU s/image",
              "engine busy", "worker RSS MB", "frontend RSS MB"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    print("\n".join(rows))
    if args.json:
        out = []
        for kind, rate, ratio, diff in figures:
            out.append({"check": f"vlm: Qwen3-VL embedder's vectors against ST, {SETS[kind]}, float32 on {args.device}",
                        "figure": f"max |diff| {diff:.1e}", "target": f"<= {max_diff:g}",
                        "result": "pass" if diff <= max_diff else "FAIL"})
            out.append({"check": f"vlm: images/s, {SETS[kind]}, float32 on {args.device}",
                        "figure": f"{rate:.1f} images/s, {ratio:.2f}x ST", "target": "(informative)", "result": "info"})
        Path(args.json).write_text(json.dumps({"rows": out}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
