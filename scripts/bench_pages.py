#!/usr/bin/env python
"""Page retrieval (ColPali): the pipeline against sentence-transformers 6's MultiVectorEncoder on the same
image files, one run, one table.

A ColPali page retriever with ColPali v1.3's input (448 px pages, 1,024 image tokens, 128 values a
token) on small random towers (scripts/tiny_models.py `build_colpali`: the real model takes ~30 s a
page on this CPU) embeds two sets built here: (a) document pages, 1240x1754 PNGs (A4 at 150 dpi:
text lines and a figure on white), (b) web JPEGs, 500x400 (scripts/image_set.py). Both sides get
the files' paths: the pipeline's `encode(paths, task="token_embed", route="document")` (render
workers decode and resize while the engine runs the model) and ST's `encode_document(paths,
batch_size=32)` in a child process (decode, resize and forward in turn). Per set: pages/s of each and
their ratio (pass by pass: each pipeline pass followed by one of ST; the median of the pairs'
ratios), the largest |difference| of the token vectors (within 1e-5), the render workers' CPU per
page, the engine's busy fraction and peak RSS.

    python scripts/bench_pages.py
    python scripts/bench_pages.py --count 8 --repeats 2 --model /tmp/colpali/st
    python scripts/bench_pages.py --device cuda --json pages.json      # scripts/device_check.py's "pages" part

On a GPU (`--device cuda`) both sides run there in float32 (ST's child too); `--json` writes the table's
figures as scripts/device_check.py's rows (the vectors within 1e-4 on CUDA, 1e-5 on the CPU; the
ratio informative).
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
from image_set import build_image_set  # noqa: E402
from loadtest import Sampler, cpu_seconds  # noqa: E402

from pooling_pipeline import Pipeline  # noqa: E402

SETS = {"pages": "(a) document pages, PNG 1240x1754", "web": "(b) web JPEGs, 500x400"}
MAX_ABS_DIFF = 1e-5
WARMUP = 2


def build_pages(folder: Path, count: int) -> list[str]:
    """Document-like pages: lines of dark 'words' on white, a grey figure, seeded per page."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(count):
        rng = np.random.default_rng(k)
        page = Image.new("RGB", (1240, 1754), "white")
        draw = ImageDraw.Draw(page)
        y = 120
        while y < 1650:
            x = 110
            while x < 1130:
                width = int(rng.integers(20, 110))
                draw.rectangle([x, y, min(x + width, 1130), y + 14], fill=tuple(int(v) for v in rng.integers(0, 60, 3)))
                x += width + 12
            y += 30 if rng.random() > 0.1 else 70
        top = int(rng.integers(300, 1200))
        draw.rectangle([200, top, 1000, top + 300], fill=(200, 200, 200), outline=(0, 0, 0), width=3)
        path = folder / f"page-{k:03d}.png"
        page.save(path)
        paths.append(str(path))
    return paths


def build_model(work: Path) -> str:
    code = f"import tiny_models; print(tiny_models.build_colpali({str(work / 'colpali')!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, check=True, capture_output=True,
                         text=True)
    return out.stdout.strip().splitlines()[-1]


def serve_st(model: str, threads: int, device: str = "cpu") -> None:
    """The child's loop: a JSON line {"paths", "out"} in, the token vectors saved to `out` (npz), a
    JSON line {"seconds"} out; until stdin closes."""
    import torch
    from sentence_transformers import MultiVectorEncoder

    torch.set_num_threads(threads)
    st = MultiVectorEncoder(model, device=device)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        started = time.perf_counter()
        vectors = st.encode_document(request["paths"], batch_size=32)
        seconds = time.perf_counter() - started
        np.savez(request["out"], *[np.asarray(v) for v in vectors])
        print(json.dumps({"seconds": seconds}), flush=True)


class STChild:
    def __init__(self, model: str, threads: int, work: Path, device: str = "cpu") -> None:
        code = f"import bench_pages; bench_pages.serve_st({model!r}, {threads}, {device!r})"
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
    outs = pipe.encode(paths, task="token_embed", route="document", use_tqdm=False)
    seconds = time.perf_counter() - started
    after, sampled = cpu_seconds(pids), sampler.finish()
    return {"seconds": seconds, "vectors": [o.data for o in outs], "busy": pipe.stats()["engine_busy_fraction"],
            "worker_cpu": sum(after[w] - before[w] for w in workers),
            "worker_rss": max(sampled[w]["rss_mb"] for w in workers), "frontend_rss": sampled["frontend"]["rss_mb"]}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a ColPali folder (default: build the benchmark-sized one)")
    ap.add_argument("--count", type=int, default=16, help="images per set")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda: both sides run there (default: cpu)")
    ap.add_argument("--json", default=None, help="write the figures as scripts/device_check.py's rows here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    max_diff = MAX_ABS_DIFF if args.device == "cpu" else 1e-4
    work = Path(tempfile.mkdtemp(prefix="bench-pages-"))
    model = args.model or build_model(work)
    sets = {"pages": build_pages(work / "pages", args.count), "web": build_image_set(work / "web", "web", args.count)}
    rows, failed = [], False
    figures = []
    with Pipeline(model=model, dtype="float32", device=args.device, num_render_workers=args.workers) as pipe:
        info = pipe.stats()["engine"]
        st = STChild(model, int(info.get("torch_threads") or 1), work, args.device)
        try:
            for kind, paths in sets.items():
                pipe.encode(paths[:WARMUP], task="token_embed", route="document", use_tqdm=False)
                st.encode(paths[:WARMUP])
                ours, theirs = [], []
                for _ in range(args.repeats):
                    ours.append(pipeline_pass(pipe, paths))
                    theirs.append(st.encode(paths))
                    print(f"  {kind}: {len(paths) / ours[-1]['seconds']:.2f} vs ST {len(paths) / theirs[-1][0]:.2f} "
                          "pages/s", flush=True)
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
    print(f"\nColPali (v1.3's input on small random towers), float32, torch on both sides, {os.cpu_count()} cores; "
          f"{args.count} images a set, median of {args.repeats} passes")
    header = ["set", "pipeline pages/s", "ST pages/s", "pipeline / ST", "max |diff|", "worker CPU s/page",
              "engine busy", "worker RSS MB", "frontend RSS MB"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    print("\n".join(rows))
    if args.json:
        out = []
        for kind, rate, ratio, diff in figures:
            out.append({"check": f"pages: ColPali token vectors against ST, {SETS[kind]}, float32 on {args.device}",
                        "figure": f"max |diff| {diff:.1e}", "target": f"<= {max_diff:g}",
                        "result": "pass" if diff <= max_diff else "FAIL"})
            out.append({"check": f"pages: pages/s, {SETS[kind]}, float32 on {args.device}",
                        "figure": f"{rate:.1f} pages/s, {ratio:.2f}x ST", "target": "(informative)", "result": "info"})
        Path(args.json).write_text(json.dumps({"rows": out}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
