#!/usr/bin/env python
"""Load test: sweep render workers (and engine threads) in two regimes, check every run, print a table.

    python scripts/loadtest.py                                # tiny model, workers 1..cores
    python scripts/loadtest.py --regime real --requests 3000
    python scripts/loadtest.py --workers 1 2 4 8 16 --threads 1 4 --png sweep.png   # a big machine
    python scripts/loadtest.py --regime real --device cuda --workers 1 4 14           # the real model on a GPU
    python scripts/loadtest.py --regime sim-images --workers 1 2                      # images: cores per GPU
    python scripts/loadtest.py --regime images --model DIR --device cuda --dtype float16 --workers 14

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

Image regimes: a CLIP dual encoder embeds web-size JPEG files given by path (--images distinct
500x400 JPEGs, quality 85, built once by scripts/image_set.py into --image-folder and cycled
through), so each render worker opens, decodes, resizes and crops every image (the engine counts an
image as its vision sequence, 50 tokens for ViT-B/32 at 224). "images" -- a tiny CLIP built on the
fly (or --model DIR) on the Pipeline's device (--device, --dtype); "sim-images" -- a tiny CLIP on the
simulated device (--sim-device, default base-h100: a ViT-B/32 vision tower is BERT-base-shaped, 12
layers x 768, ~85M parameters), and a capacity table: how many render-worker cores feed one GPU
running CLIP-B/32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import corpus
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from image_set import build_image_set, default_folder, describe_set  # noqa: E402
from tiny_models import TINY_BATCH_SHAPE, build_clip, build_tiny_model  # noqa: E402

from pooling_pipeline import Pipeline  # noqa: E402
from pooling_pipeline.call_stats import format_stats  # noqa: E402
from pooling_pipeline.core.shared.model_folder.model_path import default_model_path  # noqa: E402
from pooling_pipeline.cpu_plan import available_cores  # noqa: E402

IMAGE_REGIMES = ("images", "sim-images")
# The simulated device each simulated regime runs on unless --sim-device names another.
SIM_REGIMES = {"sim": "minilm-h100", "sim-images": "base-h100"}
CLIP_SIZE = 224  # the tiny CLIP's image size and crop, as ViT-B/32's
# ViT-B/32 at 224 px: 4.4 GMACs an image (timm's vit_base_patch32_224) = 8.8 GFLOPs, i.e.
# 2 x ~86M parameters x 50 tokens (+ attention, small at 50 tokens): what `base-h100` charges, 50 tokens
# at 2 x 85M FLOPs a token on an H100 at 40% of its 989 dense bf16 TFLOP/s.
VIT_B32_GFLOPS = 8.8


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


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process has used so far (its threads included)."""
    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.NoSuchProcess:
            out[name] = float("nan")
    return out


# The engine's CUDA-graph counters in stats()["engine"], by the names engines have used: the first present
# is read (None: this engine does not count them, printed "n/a").
GRAPH_COUNTERS = {"graphs_captured": ("graphs_captured", "cuda_graphs_captured"),
                  "eager_steps": ("eager_steps", "cuda_graphs_eager_steps")}


def graph_counts(engine: dict) -> dict[str, float | None]:
    """The engine's graph counters (cumulative since its start) from stats()["engine"], None where absent."""
    return {name: next((float(engine[k]) for k in keys if engine.get(k) is not None), None)
            for name, keys in GRAPH_COUNTERS.items()}


def fresh_graph_counts(pipe) -> dict[str, float | None]:
    """graph_counts after one more heartbeat (they travel with it, once a second), so that captures made
    just before are in; no wait where the engine counts no graphs (a CPU, the simulated device)."""
    from pooling_pipeline.core.shared.runtime import HEARTBEAT_INTERVAL_S

    counts = graph_counts(pipe.stats()["engine"])
    if all(v is None for v in counts.values()):
        return counts
    time.sleep(HEARTBEAT_INTERVAL_S + 0.25)
    return graph_counts(pipe.stats()["engine"])


def window_figures(call: dict, graphs_before: dict, graphs_after: dict, engine_cpu_s: float) -> dict:
    """What happened in the engine during a timed window, from its call's stats (stats() counts one call):
    steps, texts a step, device ms a step (the steps' own time: events on CUDA), host ms a step (the
    engine process's CPU, its IO threads included), and the graphs captured and eager steps in it
    (None where the engine does not count them)."""
    steps = call["batches"]
    per = 1e3 / steps if steps else float("nan")
    counted = {name: (graphs_after[name] - graphs_before[name] if graphs_after[name] is not None
                      and graphs_before[name] is not None else None) for name in GRAPH_COUNTERS}
    return {"steps": steps, "texts_per_step": call["requests"] / steps if steps else 0.0,
            "device_ms_per_step": call["engine_busy_s"] * per, "host_ms_per_step": engine_cpu_s * per, **counted}


def format_window(window: dict) -> str:
    """"61 texts/step, host 0.42 ms/step, device 1.10 ms/step, graphs captured 0, eager steps 0" ("n/a": not counted)."""
    def count(name: str) -> str:
        return "n/a" if window.get(name) is None else f"{window[name]:.0f}"

    return (f"{window['texts_per_step']:.0f} texts/step, host {window['host_ms_per_step']:.2f} ms/step, "
            f"device {window['device_ms_per_step']:.2f} ms/step, graphs captured {count('graphs_captured')}, "
            f"eager steps {count('eager_steps')} (in the timed window: {window['steps']} steps)")


def warm_up(pipe, feed: list, count: int, max_seconds: float | None, max_tokens: int | None = None) -> int:
    """The first `count` inputs of the run's own feed (the timed window's distribution), stopped after
    `max_seconds`: the shapes the window will see are met (graphs captured, allocator blocks made) first."""
    start, done = time.perf_counter(), 0
    for _ in pipe.embed_stream(iter(feed[:count]), truncate_prompt_tokens=max_tokens):
        done += 1
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
    return done


def run_once(model: str | None, workers: int, threads: int | None, texts: list, max_seconds: float,
             batch_shape: dict, pipeline_kwargs: dict | None = None, max_tokens: int | None = None,
             warmup: int = 256, warmup_seconds: float | None = None) -> dict:
    kwargs = {} if threads is None else {"engine_threads": threads}
    with Pipeline(model=model, num_render_workers=workers, **batch_shape, **kwargs, **(pipeline_kwargs or {})) as pipe:
        warmed = warm_up(pipe, texts, warmup, warmup_seconds, max_tokens)
        pids = {"frontend": os.getpid(), "engine": pipe.pids["engine"]}
        # Data parallel: the other engine cores are sampled too and folded into "engine" below.
        pids.update({f"engine{k}": p for k, p in enumerate(pipe.pids.get("engines", [])) if k})
        pids.update({f"worker{i}": p for i, p in enumerate(pipe.pids["workers"])})
        graphs_before = fresh_graph_counts(pipe)
        sampler = Sampler(pids)
        cpu_before = cpu_seconds(pids)
        start = time.perf_counter()
        done = 0
        for out in pipe.embed_stream(iter(texts), truncate_prompt_tokens=max_tokens):
            if out.index != done:
                raise SystemExit(f"order broken: expected {done}, got {out.index}")
            done += 1
            if time.perf_counter() - start > max_seconds:
                break
        wall = time.perf_counter() - start
        cpu_after = cpu_seconds(pids)
        stats = pipe.stats()  # (the window's call: stats() counts the last call)
        procs = sampler.finish()
        window = window_figures(stats, graphs_before, fresh_graph_counts(pipe),
                                sum(cpu_after[n] - cpu_before[n] for n in pids if n.startswith("engine")))
    for name in procs:  # CPU microseconds per request, per process (the frontend's includes this loop)
        procs[name]["cpu_us_per_request"] = 1e6 * (cpu_after[name] - cpu_before[name]) / max(done, 1)
    for name in [n for n in procs if n.startswith("engine") and n != "engine"]:  # all engine cores together
        other = procs.pop(name)
        procs["engine"]["cpu_pct"] += other["cpu_pct"]
        procs["engine"]["cpu_us_per_request"] += other["cpu_us_per_request"]
        procs["engine"]["rss_mb"] = max(procs["engine"]["rss_mb"], other["rss_mb"])
    complete = done == len(texts)
    engine_threads = stats["cpu_plan"]["engine_threads"] if threads is None else threads
    return {"workers": workers, "threads_requested": threads, "engine_threads": engine_threads,
            "requests": done, "complete": complete, "wall_s": wall, "requests_per_s": done / wall,
            "tokens_per_s": stats["prompt_tokens"] / wall, "engine_busy": stats["engine_busy_fraction"],
            "padding_efficiency": 1 - stats["padding_fraction"], "max_inflight": stats["max_inflight_seen"],
            "max_in_core": stats["max_in_core_seen"], "processes": procs, "warmup_requests": warmed, "window": window,
            "stages": stats["stages"], "queue_depths": stats["queue_depths"], "stats_lines": format_stats(stats),
            "batches": stats["batches"], "padded_tokens": stats["padded_tokens"]}


def median_run(tries: list[dict]) -> dict:
    """One run standing for several of the same setting: the median run by throughput, with each
    process's CPU per request (and CPU%) replaced by its median over all of them (this shared
    machine moves single runs by +-15%)."""
    run = sorted(tries, key=lambda r: r["requests_per_s"])[len(tries) // 2]
    run = {**run, "processes": {name: dict(v) for name, v in run["processes"].items()}, "repeats": len(tries),
           "tries": [{"requests_per_s": r["requests_per_s"],
                      "cpu_us_per_request": {k: v["cpu_us_per_request"] for k, v in r["processes"].items()}}
                     for r in tries]}
    for name, values in run["processes"].items():
        for field in ("cpu_us_per_request", "cpu_pct"):
            values[field] = statistics.median(r["processes"][name][field] for r in tries if name in r["processes"])
    return run


def tokenizer_cost_us(texts: list[str], max_tokens: int = 256) -> float:
    """What the `tokenizers` library alone costs per text here: one thread, batch-encode with
    truncation, the bundled tokenizer -- the floor a render worker is compared with."""
    from tokenizers import Tokenizer


    tok = Tokenizer.from_file(os.path.join(default_model_path(), "tokenizer.json"))
    tok.enable_truncation(max_length=max_tokens)
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for i in range(0, len(texts), 64):
            tok.encode_batch_fast(texts[i:i + 64])
        best = min(best, time.process_time() - start)
    return 1e6 * best / len(texts)


def capacity_table(run: dict, sim, tokenizer_us: float, max_num_seqs: int, ids_run: dict | None = None) -> list[str]:
    """From measured runs: each stage's CPU per request, and what a node of C cores would reach
    with this device -- each process needs about one core; render workers are added until they
    stop being the bottleneck; data-parallel engines (one device each) lift the engine's cap.
    With `ids_run` (the same texts fed as token ids: the engine nearer saturation, in fuller
    steps, as on a big node) the engine's and frontend's costs come from it, the workers' from `run`."""
    p = run["processes"]
    worker = sum(v["cpu_us_per_request"] for k, v in p.items() if k.startswith("worker"))
    if ids_run is not None:
        p = ids_run["processes"]
    frontend = p["frontend"]["cpu_us_per_request"]
    engine = p["engine"]["cpu_us_per_request"]
    per_batch = run["requests"] / max(run["batches"], 1)
    padded_per_request = run["padded_tokens"] / max(run["requests"], 1)
    # A saturated engine forms full batches: the device's rate at max_num_seqs requests a step.
    device_rate = max_num_seqs / (sim.step_s + sim.token_s * max_num_seqs * padded_per_request)
    source = "" if ids_run is None else " (frontend and engine core measured with token-id inputs)"
    lines = [f"CPU per request{source}: frontend {frontend:.1f} us, engine core {engine:.1f} us, render worker {worker:.1f} us "
             f"(the tokenizers library alone: {tokenizer_us:.1f} us, ratio {worker / tokenizer_us:.2f}x)",
             f"simulated device {sim.name}: a = {sim.step_s * 1e6:.0f} us/step, b = {sim.token_s * 1e9:.3f} ns/token; "
             f"measured {per_batch:.0f} requests a step, {padded_per_request:.1f} padded tokens per request -> "
             f"one device, in full steps of {max_num_seqs}, serves {device_rate:,.0f} requests/s",
             "",
             "| cores | engines (devices) | render workers | predicted requests/s | bottleneck |",
             "|---|---|---|---|---|"]
    for cores in (8, 16, 32, 64):
        best = None
        for engines in (1, 2, 4, 8):
            workers = cores - 1 - engines  # one core for the frontend, one per engine core
            if workers < 1:
                continue
            limits = {"frontend": 1e6 / frontend, "engine cores": engines * 1e6 / engine,
                      "render workers": workers * 1e6 / worker, "devices": engines * device_rate}
            bottleneck = min(limits, key=limits.get)
            rate = limits[bottleneck]
            needed = int(np.ceil(rate * worker / 1e6))
            if best is None or rate > best[0] * 1.05:
                best = (rate, engines, needed, bottleneck)
            lines.append(f"| {cores} | {engines} | {needed} of {workers} | {rate:,.0f} | {bottleneck} |")
        if best:
            lines.append(f"| **{cores}** | **best: {best[1]}** | {best[2]} | **{best[0]:,.0f}** | {best[3]} |")
    return lines


def series(runs: list[dict]) -> dict[str, list[dict]]:
    """Runs grouped by the engine-threads setting (one curve each), in worker order."""
    out: dict[str, list[dict]] = {}
    for r in runs:
        key = "threads: CPU plan" if r["threads_requested"] is None else f"engine threads {r['threads_requested']}"
        out.setdefault(key, []).append(r)
    return {k: sorted(v, key=lambda r: r["workers"]) for k, v in out.items()}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regime", choices=["tiny", "real", "sim", *IMAGE_REGIMES], default="tiny",
                    help="sim / sim-images: the simulated accelerator (--sim-device) with a capacity table; "
                         "images / sim-images: a CLIP embeds JPEG files")
    ap.add_argument("--sim-device", default=None, help="a preset (minilm-h100, base-h100) or 'a,b' seconds "
                    "(default: minilm-h100 for sim, base-h100 -- a ViT-B/32 vision tower's size -- for sim-images)")
    ap.add_argument("--model", default=None, help="the model folder (default: the regime's; images: a tiny CLIP "
                    "built on the fly)")
    ap.add_argument("--dtype", default=None, help="the engine's dtype (default: the Pipeline's)")
    ap.add_argument("--images", type=int, default=100, help="distinct 500x400 JPEGs the image regimes cycle through")
    ap.add_argument("--image-folder", default=None,
                    help="where the image set is built once (default: build/bench-images, scripts/image_set.py's)")
    ap.add_argument("--gpu-images-per-s", type=float, default=None,
                    help="sim-images' capacity table: one GPU's CLIP-B/32 images/s (default: the simulated "
                         "device's rate in full steps)")
    ap.add_argument("--device", default=None, help="the engine's device for the tiny and real regimes "
                    "(default: the Pipeline's, auto: CUDA when there is one)")
    ap.add_argument("--data-parallel-size", type=int, default=1, help="engine cores (sim: one simulated device each)")
    ap.add_argument("--workers", type=int, nargs="+", default=None, help="default: 1 .. cores")
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="engine threads (default: the CPU plan)")
    ap.add_argument("--requests", type=int, default=None, help="per run (default: 40000 tiny, 2000 real)")
    ap.add_argument("--texts", choices=["short", "medium"], default="short",
                    help="short sentences (~24 tokens) or medium texts (600-4000 characters, kept to 256 tokens)")
    ap.add_argument("--inputs", choices=["text", "ids", "both"], default="text",
                    help="ids: the same texts tokenized beforehand (int32 arrays), so the render workers cost "
                         "almost nothing and the engine core and frontend are measured nearer saturation; "
                         "both: text runs, then ids runs (the capacity table then takes the render workers' "
                         "cost from the text runs and the engine's and frontend's from the ids runs)")
    ap.add_argument("--max-tokens", type=int, default=None, help="truncate_prompt_tokens for every request")
    ap.add_argument("--max-seconds", type=float, default=120)
    ap.add_argument("--warmup", type=int, default=256,
                    help="inputs of the run's own feed embedded before its timed window (default 256)")
    ap.add_argument("--warmup-seconds", type=float, default=None, help="stop the warm-up after this long")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of each setting; the tables show medians (default: 3 with a simulated regime, else 1)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: 256 tiny, the Pipeline's default real")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="default: 16384 tiny (a GPU's budget), the engine's default real")
    ap.add_argument("--json", default=None, help="write the runs here")
    ap.add_argument("--png", default=None, help="draw throughput and engine busy %% against workers (matplotlib)")
    return ap


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if args.device is not None and args.regime in SIM_REGIMES:
        ap.error(f"--device: the {args.regime} regime runs on the simulated device")
    images = args.regime in IMAGE_REGIMES
    if images and args.inputs != "text":
        ap.error(f"--inputs: the {args.regime} regime feeds image files")
    if args.images < 1:
        ap.error("--images: at least 1")

    cores = available_cores()
    workers_list = args.workers or list(range(1, cores + 1))
    model = args.model or regime_model(args.regime)
    n = args.requests or (2_000 if args.regime == "real" or images else 40_000)
    pipeline_kwargs, sim = pipeline_settings(args)
    if images:
        paths = image_paths(args)
        feeds, what = {"images": [paths[i % len(paths)] for i in range(n)]}, f"web JPEGs ({describe_set(paths)})"
    else:
        (texts, feeds), what = input_feeds(args, model, n), f"{args.texts} texts"
    batch_shape = batch_shape_of(args)
    runs = run_all(args, model, feeds, workers_list, batch_shape, pipeline_kwargs)

    print(f"\nregime {args.regime}, {n:,} {what} per run, {cores} cores, batch shape {batch_shape or 'default'}")
    print_tables(runs)
    if images:
        print()
        print("\n".join(image_table(runs)))
        if sim is not None:
            print()
            print("\n".join(image_capacity_table(runs, sim, batch_shape["max_num_seqs"], pil_cost_us(paths),
                                                 args.gpu_images_per_s)))
    elif sim is not None:
        print()
        first = {kind: min((r for r in runs if r["inputs"] == kind), key=lambda r: r["workers"]) for kind in feeds}
        for line in capacity_table(first.get("text", first.get("ids")), sim, tokenizer_cost_us(texts[:5000]),
                                   batch_shape["max_num_seqs"], ids_run=first.get("ids") if "text" in first else None):
            print(line)
    print_scaling(runs)
    if args.json:
        Path(args.json).write_text(json.dumps({"regime": args.regime, "cores": cores, "batch_shape": batch_shape,
                                               "runs": runs}, indent=2))
    if args.png:
        draw_chart(runs, args.regime, cores, args.png)


def pipeline_settings(args: argparse.Namespace) -> tuple[dict, object]:
    """(the Pipeline's keyword arguments the flags set, the simulated device or None)."""
    pipeline_kwargs = {}
    sim = None
    if args.regime in SIM_REGIMES:
        from pooling_pipeline.core.shared.sim_device import resolve_sim_device

        preset = args.sim_device or SIM_REGIMES[args.regime]
        sim = resolve_sim_device(tuple(float(x) for x in preset.split(",")) if "," in preset else preset)
        pipeline_kwargs = {"device": "sim", "sim_device": sim}
    if args.device is not None:
        pipeline_kwargs["device"] = args.device
    if args.dtype is not None:
        pipeline_kwargs["dtype"] = args.dtype
    if args.data_parallel_size != 1:
        pipeline_kwargs["data_parallel_size"] = args.data_parallel_size
    return pipeline_kwargs, sim


def regime_model(regime: str) -> str | None:
    """The model a regime runs when --model does not name one (None: the Pipeline's default)."""
    if regime in IMAGE_REGIMES:
        return build_tiny_clip()
    return build_tiny_model() if regime in ("tiny", "sim") else None


def build_tiny_clip() -> str:
    """A CLIP dual encoder as small as its towers get (1 layer, 32 wide) with ViT-B/32's image shape
    (224 px, 32 px patches: 50 tokens an image) and transformers' PIL image processor: the render
    workers' work is the real model's, the engine's forward pass costs almost nothing."""
    return build_clip(None, vision_hidden=32, vision_layers=1, vision_heads=4, vision_intermediate=64,
                      image_size=CLIP_SIZE, patch_size=32, text_hidden=32, text_layers=1, text_heads=4,
                      text_intermediate=64, projection_dim=16)


def image_paths(args: argparse.Namespace) -> list[str]:
    """--images distinct web JPEGs (500x400, quality 85: gradients, noise, shapes, photo crops, grain),
    built once by scripts/image_set.py (a set built before is reused)."""
    return build_image_set(args.image_folder or default_folder(), "web", args.images)


def pil_open_resize(path: str) -> None:
    """What a render worker cannot do with less: open, decode, RGB, shortest edge to 224 (bicubic, as
    CLIP's processor sizes it), center crop 224."""
    from PIL import Image

    with Image.open(path) as image:
        rgb = image.convert("RGB")
    scale = CLIP_SIZE / min(rgb.size)
    resized = rgb.resize((max(CLIP_SIZE, int(rgb.width * scale)), max(CLIP_SIZE, int(rgb.height * scale))),
                         Image.BICUBIC)
    left, top = (resized.width - CLIP_SIZE) // 2, (resized.height - CLIP_SIZE) // 2
    resized.crop((left, top, left + CLIP_SIZE, top + CLIP_SIZE)).tobytes()


def pil_cost_us(paths: list[str]) -> float:
    """CPU microseconds per image of `pil_open_resize` in this process (one thread), best of 3 passes."""
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for path in paths:
            pil_open_resize(path)
        best = min(best, time.process_time() - start)
    return 1e6 * best / len(paths)


def worker_us(run: dict) -> float:
    """The render workers' CPU per request, all of them together (each request is one worker's)."""
    return sum(v["cpu_us_per_request"] for k, v in run["processes"].items() if k.startswith("worker"))


def image_table(runs: list[dict]) -> list[str]:
    """Per worker count: images/s, what one worker feeds (measured, and its CPU bound), engine busy."""
    lines = ["| workers | images/s | images/s per worker | worker CPU us/image | one worker core's bound (1e6 / CPU) "
             "| engine busy | CPU us/image frontend / engine |", "|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: r["workers"]):
        p, cpu = r["processes"], worker_us(r)
        lines.append(f"| {r['workers']} | {r['requests_per_s']:,.0f} | {r['requests_per_s'] / r['workers']:,.0f} "
                     f"| {cpu:,.0f} | {1e6 / cpu:,.0f} images/s | {r['engine_busy']:.1%} "
                     f"| {p['frontend']['cpu_us_per_request']:,.0f} / {p['engine']['cpu_us_per_request']:,.0f} |")
    return lines


def image_capacity_table(runs: list[dict], sim, max_num_seqs: int, pil_us: float,
                         gpu_rate: float | None = None) -> list[str]:
    """How many render-worker cores feed GPUs running CLIP-B/32: a GPU's images/s (`gpu_rate`, or the
    simulated device's rate in full steps of `max_num_seqs` images) over what one worker core feeds
    (1e6 / its CPU per image, from the fewest-workers run). The frontend's and the engine core's CPU
    per image come from the most-workers run (the nearest to saturation; an idle engine core uses ~0.1%
    of a core, so its CPU per image is per-image work: taking in each image's pixels, 150 KB at 224 px).
    Cores in all: the render workers, the frontends (one per core of CPU they need: several pipelines)
    and one engine core per GPU; an engine core that would need more than one core caps its GPU."""
    run, busiest = min(runs, key=lambda r: r["workers"]), max(runs, key=lambda r: r["workers"])
    worker = worker_us(run)
    frontend, engine = (busiest["processes"][k]["cpu_us_per_request"] for k in ("frontend", "engine"))
    tokens = run["padded_tokens"] / max(run["requests"], 1)  # an image's vision sequence (no padding)
    step = sim.step_s + sim.token_s * max_num_seqs * tokens
    sim_rate = max_num_seqs / step
    if gpu_rate is None:
        gpu_rate, source = sim_rate, (
            f"the simulated device {sim.name}: {max_num_seqs} images a step of {step * 1e3:.2f} ms "
            f"(a = {sim.step_s * 1e6:.0f} us + b = {sim.token_s * 1e9:.1f} ns/token x {tokens:.0f} tokens x {max_num_seqs}), "
            f"i.e. ViT-B/32 at 224 px = {VIT_B32_GFLOPS} GFLOPs an image (4.4 GMACs) on an H100 at 40% of its 989 dense "
            f"fp16 TFLOP/s: {0.4 * 989e12 / (VIT_B32_GFLOPS * 1e9):,.0f} images/s before each step's fixed cost")
    else:
        source = f"--gpu-images-per-s (the simulated device {sim.name} would say {sim_rate:,.0f})"
    feed = 1e6 / worker
    lines = [f"CPU per image: render worker {worker:,.0f} us ({run['workers']} worker run; PIL alone, open + decode + RGB "
             f"+ resize + crop in this process: {pil_us:,.0f} us, ratio {worker / pil_us:.2f}x); frontend {frontend:.0f} us, "
             f"engine core {engine:.0f} us ({busiest['workers']} worker run, engine busy {busiest['engine_busy']:.1%})",
             f"one render-worker core feeds {feed:,.0f} images/s (1e6 / its CPU per image)",
             "",
             f"GPU node capacity, CLIP ViT-B/32 at 224 px (50 tokens an image): one GPU = {gpu_rate:,.0f} images/s, from "
             f"{source}. Render-worker cores = GPU images/s / {feed:,.0f}; cores in all = render workers + frontends "
             "(as many as the CPU they need) + one engine core per GPU",
             "",
             "| GPUs | images/s | render-worker cores | frontend CPU (cores) | engine-core CPU per GPU (cores) "
             "| cores in all |",
             "|---|---|---|---|---|---|"]
    engine_cores = gpu_rate * engine / 1e6
    for gpus in (1, 2, 4, 8):
        rate = gpus * gpu_rate
        workers = int(np.ceil(rate / feed))
        front_cores = rate * frontend / 1e6
        total = workers + max(1, int(np.ceil(front_cores))) + gpus
        lines.append(f"| {gpus} | {rate:,.0f} | {workers:,} | {front_cores:.1f} | {engine_cores:.1f} | {total:,} |")
    if engine_cores > 1:
        lines += ["", f"the engine core is the cap: at {engine:.0f} us of its CPU per image, one engine core (one per GPU) "
                      f"takes in at most {1e6 / engine:,.0f} images/s, {1e6 / engine / gpu_rate:.0%} of the GPU's rate; "
                      f"at that rate {int(np.ceil(1e6 / engine / feed))} render-worker cores per GPU suffice"]
    return lines


def input_feeds(args: argparse.Namespace, model: str | None, n: int) -> tuple[list[str], dict[str, list]]:
    """(the `n` texts, what each run is fed by input kind: "text" and / or "ids")."""
    pool = corpus.sentences(5000, seed=5) if args.texts == "short" else \
        corpus.medium_texts(2000, seed=5, min_chars=600, max_chars=4000)
    texts = [pool[i % len(pool)] for i in range(n)]
    feeds = {"text": texts}
    if args.inputs != "text":  # tokenized once here, as a user with a pre-tokenized corpus would have them
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model or default_model_path())
        encoded = tok(pool, truncation=True, max_length=args.max_tokens or 256)["input_ids"]
        id_pool = [np.asarray(ids, dtype=np.int32) for ids in encoded]
        feeds["ids"] = [id_pool[i % len(id_pool)] for i in range(n)]
        if args.inputs == "ids":
            del feeds["text"]
    return texts, feeds


def batch_shape_of(args: argparse.Namespace) -> dict:
    """max_num_seqs / max_num_batched_tokens as given, or the tiny models' shape (empty: the defaults)."""
    batch_shape = {}
    if args.max_num_seqs or args.regime != "real":
        batch_shape["max_num_seqs"] = args.max_num_seqs or TINY_BATCH_SHAPE["max_num_seqs"]
    if args.max_num_batched_tokens or args.regime != "real":
        batch_shape["max_num_batched_tokens"] = args.max_num_batched_tokens or TINY_BATCH_SHAPE["max_num_batched_tokens"]
    return batch_shape


def run_all(args: argparse.Namespace, model: str | None, feeds: dict[str, list], workers_list: list[int],
            batch_shape: dict, pipeline_kwargs: dict) -> list[dict]:
    """Every setting (input kind x engine threads x workers), each the median of its repeats."""
    runs = []
    repeats = args.repeats or (3 if args.regime in SIM_REGIMES else 1)
    for kind, feed in feeds.items():
        for threads in args.threads or [None]:
            for workers in workers_list:
                tries = []
                for _ in range(repeats):
                    run = run_once(model, workers, threads, feed, args.max_seconds, batch_shape, pipeline_kwargs,
                                   args.max_tokens, args.warmup, args.warmup_seconds)
                    tries.append(run)
                    print(f"inputs {kind}, workers {workers} threads {run['engine_threads']}: "
                          f"{run['requests_per_s']:,.0f} req/s, engine busy {run['engine_busy']:.0%}, CPU us/request "
                          + " / ".join(f"{name} {v['cpu_us_per_request']:.1f}" for name, v in run["processes"].items())
                          + f"; {format_window(run['window'])}", flush=True)
                run = median_run(tries)
                run["inputs"] = kind
                runs.append(run)
                for line in run["stats_lines"]:
                    print(f"  {line}")
    return runs


def print_tables(runs: list[dict]) -> None:
    """The runs' throughput, CPU and memory table, and their CPU cost per request."""
    print("| inputs | workers | engine threads | requests/s | tokens/s | engine busy | padding eff. | complete+ordered "
          "| CPU% frontend / engine / workers | peak RSS MB frontend / engine / workers |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        p = r["processes"]
        worker_cpu = " ".join(f"{v['cpu_pct']:.0f}" for k, v in p.items() if k.startswith("worker"))
        worker_rss = " ".join(f"{v['rss_mb']:.0f}" for k, v in p.items() if k.startswith("worker"))
        print(f"| {r['inputs']} | {r['workers']} | {r['engine_threads']} | {r['requests_per_s']:,.0f} | {r['tokens_per_s']:,.0f} "
              f"| {r['engine_busy']:.0%} | {r['padding_efficiency']:.0%} | {'yes' if r['complete'] else 'no (time limit)'} "
              f"| {p['frontend']['cpu_pct']:.0f} / {p['engine']['cpu_pct']:.0f} / {worker_cpu} "
              f"| {p['frontend']['rss_mb']:.0f} / {p['engine']['rss_mb']:.0f} / {worker_rss} |")
    print("| inputs | workers | requests a step | CPU us/request frontend / engine / workers |")
    print("|---|---|---|---|")
    for r in runs:
        p = r["processes"]
        workers_us = sum(v["cpu_us_per_request"] for k, v in p.items() if k.startswith("worker"))
        print(f"| {r['inputs']} | {r['workers']} | {r['requests'] / max(r['batches'], 1):.0f} "
              f"| {p['frontend']['cpu_us_per_request']:.1f} / {p['engine']['cpu_us_per_request']:.1f} / {workers_us:.1f} |")


def print_scaling(runs: list[dict]) -> None:
    """Each setting's throughput with N workers over its throughput with one."""
    for setting, group in series(runs).items():
        base = next((r for r in group if r["workers"] == 1), None)
        for r in group:
            if base and r["workers"] > 1:
                print(f"scaling ({setting}): {r['workers']} workers / 1 worker = "
                      f"{r['requests_per_s'] / base['requests_per_s']:.2f}x")


def draw_chart(runs: list[dict], regime: str, cores: int, png: str) -> None:
    """Throughput and engine busy against render workers, one line per setting (needs matplotlib)."""
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
    ax.set_title(f"throughput, {regime} model, {cores} cores")
    ax2.set_xlabel("render workers")
    ax2.set_ylabel("engine busy %")
    ax2.set_ylim(0, 105)
    ax2.set_title("engine busy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    print(f"chart: {png}")


if __name__ == "__main__":
    main()
