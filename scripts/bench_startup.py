#!/usr/bin/env python
"""Start-up and close time by backend: how long `Pipeline(model=..., backend=B)` takes to be ready
and `close()` to return, in a fresh process each time (imports, the process group, loading the
model, the step-cost probe, and for OpenVINO loading and compiling the cached conversion and its
check against torch), next to sentence-transformers loading the same model.

    python scripts/bench_startup.py                       # torch, openvino, ST; 5 rounds, interleaved
    python scripts/bench_startup.py --backends torch openvino --rounds 7 --model DIR
    python scripts/bench_startup.py --pythons /old/venv/bin/python python   # before / after a change

First each backend starts once into an empty cache folder (what the first start of a model costs:
the conversion, the probe); then each round starts every (interpreter, backend) once, in turn,
with that cache, so a noisy machine slows all alike. Prints a markdown table of medians, where the
engine's start-up went (from `stats()["engine"]`, where the interpreter's version reports it), and
the ratio to the first row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# The child: time to a ready Pipeline, one call, and the close; prints one JSON line.
CHILD = """
import json, sys, time
started = time.perf_counter()
from pooling_pipeline import Pipeline
pipe = Pipeline(model=sys.argv[1], backend=sys.argv[2])
ready = time.perf_counter() - started
pipe.embed(["one short sentence"], use_tqdm=False)
engine = pipe.stats()["engine"]
closing = time.perf_counter()
pipe.close()
print(json.dumps({"ready_s": ready, "close_s": time.perf_counter() - closing, **engine}))
"""

# sentence-transformers, the same model: import, load, one call (what a notebook user compares with).
ST_CHILD = """
import json, sys, time
started = time.perf_counter()
from sentence_transformers import SentenceTransformer
model = SentenceTransformer(sys.argv[1], device="cpu")
ready = time.perf_counter() - started
model.encode(["one short sentence"])
print(json.dumps({"ready_s": ready, "close_s": 0.0, "backend": "sentence-transformers"}))
"""

PHASES = ("startup_torch_import_s", "startup_load_s", "startup_probe_s", "compile_s", "verify_s")


def start_once(python: str, model: str, backend: str, cache: str) -> dict:
    env = dict(os.environ, POOLING_PIPELINE_CACHE=cache, HF_HUB_OFFLINE="1")
    child = ST_CHILD if backend == "st" else CHILD
    done = subprocess.run([python, "-c", child, model, backend], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{python} backend {backend}: the child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--backends", nargs="+", default=["torch", "openvino", "st"],
                        help="pipeline backends, and 'st' for sentence-transformers' own load")
    parser.add_argument("--pythons", nargs="+", default=[sys.executable],
                        help="interpreters to compare (each with its own install of the package)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.model is None:
        from pooling_pipeline.core.shared.model_folder.model_path import default_model_path

        args.model = str(default_model_path())
    rows = [(python, backend) for python in args.pythons for backend in args.backends
            if backend != "st" or python == args.pythons[0]]
    runs: dict[tuple[str, str], list[dict]] = {row: [] for row in rows}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as root:
        caches = {python: os.path.join(root, str(i)) for i, python in enumerate(args.pythons)}
        for python, backend in rows:
            if backend == "st":
                continue
            info = start_once(python, args.model, backend, caches[python])
            print(f"first start, {_name(python, args)} {backend}: ready in {info['ready_s']:.2f} s, backend "
                  f"{info.get('backend')}, conversion {info.get('conversion', '-')} {info.get('conversion_s', '')}")
        for _ in range(args.rounds):
            for python, backend in rows:
                info = start_once(python, args.model, backend, caches[python])
                if backend == "openvino" and info.get("conversion") != "cached":
                    raise SystemExit(f"backend {backend}: expected the cached conversion, got {info.get('conversion')}")
                runs[(python, backend)].append(info)
    base = statistics.median(r["ready_s"] for r in runs[rows[0]])
    phases = " | ".join(p.removeprefix("startup_") for p in PHASES)
    print(f"\n| interpreter | backend | ready, median of {args.rounds} (s) | close (s) | ratio to first row | {phases} |")
    print("|---|---|---|---|---|" + "---|" * len(PHASES))
    for (python, backend), infos in runs.items():
        ready = statistics.median(r["ready_s"] for r in infos)
        close = statistics.median(r["close_s"] for r in infos)
        parts = " | ".join(_median_of(infos, p) for p in PHASES)
        print(f"| {_name(python, args)} | {backend} | {ready:.2f} | {close:.2f} | {ready / base:.2f}x | {parts} |")
    return 0


def _name(python: str, args) -> str:
    return python if len(args.pythons) > 1 else "this"


def _median_of(infos: list[dict], key: str) -> str:
    values = [r[key] for r in infos if isinstance(r.get(key), (int, float))]
    return f"{statistics.median(values):.2f}" if values else "-"


if __name__ == "__main__":
    sys.exit(main())
