#!/usr/bin/env python
"""Start-up time by backend: how long `Pipeline(model=..., backend=B)` takes to be ready, in a fresh
process each time (imports, the process group, loading the model, the step-cost probe, and for
OpenVINO loading and compiling the cached conversion and checking it against torch).

    python scripts/bench_startup.py                       # torch, openvino; 5 rounds, interleaved
    python scripts/bench_startup.py --backends torch openvino --rounds 7 --model DIR

First the conversion is made once into an empty cache folder (its time is printed: what the first
start of a model costs); then each round starts every backend once, in turn, with that cache, so a
noisy machine slows both alike. Prints a markdown table of medians and the ratio to the first backend.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# The child: time to a ready Pipeline, then one call; prints one JSON line.
CHILD = """
import json, sys, time
started = time.perf_counter()
from pooling_pipeline import Pipeline
with Pipeline(model=sys.argv[1], backend=sys.argv[2]) as pipe:
    ready = time.perf_counter() - started
    pipe.embed(["one short sentence"], use_tqdm=False)
    engine = pipe.stats()["engine"]
print(json.dumps({"ready_s": ready, "backend": engine.get("backend"), "conversion": engine.get("conversion"),
                  "conversion_s": engine.get("conversion_s"), "compile_s": engine.get("compile_s")}))
"""


def start_once(model: str, backend: str, cache: str) -> dict:
    env = dict(os.environ, POOLING_PIPELINE_CACHE=cache, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", CHILD, model, backend], env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"backend {backend}: the child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--backends", nargs="+", default=["torch", "openvino"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.model is None:
        from pooling_pipeline.core.model_folder.model_path import default_model_path

        args.model = str(default_model_path())
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as cache:
        first = {b: start_once(args.model, b, cache) for b in args.backends if b != "torch"}
        for backend, info in first.items():
            print(f"first start, {backend}: ready in {info['ready_s']:.2f} s, backend {info['backend']}, "
                  f"conversion {info['conversion']} in {info['conversion_s']} s, compiled in {info['compile_s']} s")
        times: dict[str, list[float]] = {b: [] for b in args.backends}
        for _ in range(args.rounds):
            for backend in args.backends:
                info = start_once(args.model, backend, cache)
                if backend != "torch" and info["conversion"] != "cached":
                    raise SystemExit(f"backend {backend}: expected the cached conversion, got {info['conversion']}")
                times[backend].append(info["ready_s"])
    base = statistics.median(times[args.backends[0]])
    print(f"\n| backend | start-up to ready, median of {args.rounds} (s) | runs (s) | ratio to {args.backends[0]} |")
    print("|---|---|---|---|")
    for backend, runs in times.items():
        median = statistics.median(runs)
        print(f"| {backend} | {median:.2f} | {' '.join(f'{t:.2f}' for t in runs)} | {median / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
