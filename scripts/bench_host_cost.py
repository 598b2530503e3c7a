#!/usr/bin/env python
"""The host's CPU per request, before and after: this checkout against an earlier commit, in one run.

    python scripts/bench_host_cost.py --before 565a652                 # 3 rounds, 200,000 requests a run
    python scripts/bench_host_cost.py --before 565a652 --rounds 5 --requests 400000

Each round runs `scripts/loadtest.py --regime sim --workers 1 --inputs both` (the simulated
accelerator: the whole engine path for real, a step that only waits) once with the earlier commit's
package and once with this checkout's, alternating, so that both sides see the same machine load;
the table gives each process's CPU microseconds per request (the median over rounds, and the range)
and the ratio after / before, with the `tokenizers` library's own cost per text from the same run
beside them as this machine's yardstick (the figures scale with the CPU). The earlier commit's
package is extracted with `git archive` into a temporary folder laid out as installed
(pooling_pipeline/, .../core, .../workers) and put first on PYTHONPATH; its scripts are this
checkout's, so both sides run the same load test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The project's top-level folders and where each one installs (pyproject's package-dir).
INSTALLED = {"pipeline": "pooling_pipeline", "core": "pooling_pipeline/core", "workers": "pooling_pipeline/workers"}
PROCESSES = ("frontend", "engine", "worker0")


def extract(rev: str, into: Path) -> Path:
    """The package of commit `rev`, laid out as installed under `into`; returns the PYTHONPATH entry."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *INSTALLED], check=True, capture_output=True).stdout
    raw = into / "raw"
    raw.mkdir()
    subprocess.run(["tar", "-x", "-C", str(raw)], input=archive, check=True)
    package = into / "pkg"
    package.mkdir()
    (raw / "pipeline").rename(package / "pooling_pipeline")
    for folder in ("core", "workers"):
        (raw / folder).rename(package / "pooling_pipeline" / folder)
    return package


def one_run(pythonpath: str | None, requests: int, out: Path) -> dict[str, dict[str, float]]:
    """{input kind: {process: CPU us per request, "requests_per_s": ...}} of one load-test run."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(ROOT / "scripts" / "loadtest.py"), "--regime", "sim", "--workers", "1",
           "--inputs", "both", "--requests", str(requests), "--repeats", "1", "--json", str(out)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    figures = {}
    for run in json.loads(out.read_text())["runs"]:
        row = {name: run["processes"][name]["cpu_us_per_request"] for name in PROCESSES}
        row["requests_per_s"] = run["requests_per_s"]
        figures[run["inputs"]] = row
    return figures


def tokenizer_us() -> float:
    """The `tokenizers` library's own cost per short text here (loadtest's yardstick)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import corpus
    from loadtest import tokenizer_cost_us

    return tokenizer_cost_us(corpus.sentences(5000, seed=5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=200_000, help="per run and input kind")
    ap.add_argument("--json", default=None, help="write every round's figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="host-cost-") as tmp:
        before_path = str(extract(args.before, Path(tmp)))
        rounds: dict[str, list[dict]] = {"before": [], "after": []}
        yardstick = []
        for k in range(args.rounds):
            for side, path in (("before", before_path), ("after", None)):
                rounds[side].append(one_run(path, args.requests, Path(tmp) / f"{side}{k}.json"))
                print(f"round {k + 1}/{args.rounds} {side}: " + ", ".join(
                    f"{kind} {figs['frontend']:.2f}/{figs['engine']:.2f}/{figs['worker0']:.2f} us"
                    for kind, figs in rounds[side][-1].items()), flush=True)
            yardstick.append(tokenizer_us())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"\nCPU us per request, median of {args.rounds} rounds (range), before = {args.before}, after = {head} "
          f"(+ uncommitted changes if any); the tokenizers library alone: {statistics.median(yardstick):.1f} us a text "
          f"in this run")
    print("| inputs | process | before | after | after / before |")
    print("|---|---|---|---|---|")
    for kind in ("text", "ids"):
        for name in (*PROCESSES, "requests_per_s"):
            b = [r[kind][name] for r in rounds["before"]]
            a = [r[kind][name] for r in rounds["after"]]
            fmt = (lambda v: f"{v:,.0f}") if name == "requests_per_s" else (lambda v: f"{v:.2f}")
            label = "requests/s" if name == "requests_per_s" else name.replace("worker0", "render worker")
            print(f"| {kind} | {label} | {fmt(statistics.median(b))} ({fmt(min(b))}-{fmt(max(b))}) | "
                  f"{fmt(statistics.median(a))} ({fmt(min(a))}-{fmt(max(a))}) | "
                  f"{statistics.median(a) / statistics.median(b):.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"before": args.before, "after": head, "rounds": rounds,
                                               "tokenizers_us": yardstick}, indent=2))


if __name__ == "__main__":
    main()
