#!/usr/bin/env python
"""The GPU check: what issues 49 and 62 ask of a GPU, in one run of at most 6.5 minutes (--quick: the
headline rows in 4), one table at the end, everything it saw saved in one folder.

    python scripts/device_check.py                          # all parts, 6.5 minutes at most, outputs in $OUT
    python scripts/device_check.py --quick                  # docs/s, x ST, host ms/step, BERT-base kernel share
    python scripts/device_check.py --dry-run [--quick]      # the plan: parts, budgets, commands (no CUDA needed)
    python scripts/device_check.py --rehearse --cores 16 --st-texts 2000   # the plan timed here, without a GPU
    python scripts/device_check.py --parts replay,profile --max-minutes 3 --out-dir check/

Parts, in the order they run (the headline figures first, then what explains them, then the checks the
first GPU run passed already); each runs its steps as subprocesses, with its own time budget inside one
hard overall deadline (time a part leaves unused passes to the next one):

* env      -- the device, torch / CUDA / cuDNN / transformers versions, and the SDPA kernel torch picks for a
              masked float16 call shaped like the engine's (4-D bool mask), with torch's defaults and with
              cuDNN off as the engine runs: the first call of each new shape against a repeated one;
* loadtest -- scripts/loadtest.py with the bundled all-MiniLM-L6-v2 in float16 on ~24-token texts: the most
              render workers, then fewer (2, 4, 8 by default, never more than the cores less the frontend's
              and the engine's threads), then any --seq-caps at the most workers; each run warms up on its own
              texts, then a 5 s window of 250,000: docs/s, engine busy, and in the window texts, host ms and
              device ms per step and the graphs captured; targets >= 50,000 docs/s and "more render workers
              never slower";
* st       -- sentence-transformers in float16 on the same GPU and texts (batch 64 and 256, its tokenizer's
              threads on) against the pipeline (warmed up, then a 5 s window): docs/s side by side (target
              >= 2x ST) and the lowest cosine between them;
* replay   -- step shapes recorded from 30,000 real short texts through the engine's Scheduler with the GPU
              settings, replayed through the ModelRunner one step at a time: host ms and device ms per step,
              first-seen against repeated shapes, for the engine's path (CUDA graphs), the same eager, and the
              path of the first GPU run (every step its own shape, the 2-D mask); in two subprocesses, with
              cuDNN's SDPA off (the engine's default) and on (POOLING_PIPELINE_CUDNN_SDPA=1); target host
              <= 1 ms per repeated step on the engine's path;
* profile  -- torch.profiler over 5 warm steps launched as the engine launches them: host ms, kernel ms,
              kernel launches, graph launches and host syncs per step, the chrome trace saved; MiniLM's most
              common step, then a BERT-base-shaped model (random weights, built here) at 512 tokens (target:
              kernel time >= 90% of the step's wall time); target: no host sync in a step;
* graphs   -- CUDA-graph replay against eager on the same batches: min cosine in float16 (>= 0.9999), max
              |diff| in float32 (<= 1e-5), time per step; then packed rows (POOLING_PIPELINE_ATTENTION=packed's
              runner: flash_attn's varlen kernel where importable, else torch's nested jagged SDPA) against the
              bucketed graphs on the same batches: min cosine in float16 (>= 0.9999), max |diff| in float32
              (<= 1e-4), host and device ms per step for both;
* dtype    -- float16 and bfloat16 against float32 through the pipeline on CUDA (min cosine >= 0.9999),
              float32 on CUDA against float32 on the CPU (max |diff| <= 1e-4), 300 real texts;
* pages    -- the VLMs: a ColPali page retriever with ColPali v1.3's input (448 px pages, 1,024 image tokens a
              page) and a Qwen3-VL embedder with Qwen3-VL-Embedding's (dynamic resolution, up to 1,280 vision
              tokens an image), each on small random towers, the pipeline against sentence-transformers on the
              device, float32 both: vectors within 1e-4, images/s of each (scripts/bench_pages.py,
              scripts/bench_vlm.py; the VLM row only where torchvision imports);
* images   -- a CLIP ViT-B/32-sized dual encoder (random weights) and 100 web JPEGs: the pipeline against
              sentence-transformers in this environment (float32 on the CPU, the image processor
              transformers picks here, <= 1e-5), then scripts/loadtest.py --regime images in float16.

Outputs (--out-dir, default $OUT when set, else a new temporary folder; said at the end): table.md (the
table), rows.json (every row with its part, and each step's status and time), logs/PART-K.log (each step's
output), each step's JSON, replay-*-steps.json (every replayed step), profile-*-trace.json.gz (chrome traces,
for chrome://tracing or Perfetto) and env-sdpa.json.gz. The table and rows.json are rewritten after every
part, so a run cut short keeps the parts done.

A part that runs out of time is a "timeout" row, one that fails an "error" row with its last line; the
others still run and the table is always printed. A step's whole process group (its Pipelines included)
is killed when its time is up, or when this script is stopped (Ctrl-C, SIGTERM). Exit status 0 when every
row passed (or is only informative), 1 otherwise. Without a CUDA device it says so and exits 0 at once.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from device_check_steps import Row, clip_model_path, verdict

SCRIPTS = Path(__file__).resolve().parent
PARTS = ("env", "loadtest", "st", "replay", "profile", "graphs", "dtype", "pages", "images")
# The parts a forced CPU runs (the tests): the load test and the images part need CUDA (a rehearsal runs them on
# the simulated device instead).
CPU_PARTS = ("env", "st", "replay", "profile", "graphs", "dtype")
# --quick: the headline rows alone -- docs/s (loadtest, the most workers), x ST fp16 (st), host ms per repeated
# step (replay, the engine's path), BERT-base 512 kernel share (profile) -- and the versions (env).
QUICK_PARTS = ("env", "loadtest", "st", "replay", "profile")
# Each part's budget: what its rehearsal took here (`--rehearse --cores 16 --st-texts 2000`, 2026-12-07: this
# 2-core machine at a load average of 5-7, shared with other sessions; docs/benchmarks.md has the table), where
# the time is starting processes (which a quiet 16-core node does faster, plus CUDA's context, ~3 s a process,
# and the start-up graph capture, ~5-10 s a Pipeline), or the GPU's pace where the time here was the CPU's
# arithmetic; and room to spare:
# env      -- one process (torch, transformers), a few SDPA calls: 16 s here (cuDNN's first builds on CUDA);
# loadtest -- one Pipeline per worker count (8, 2, 4): 65, 37, 37 s here (8 workers on 2 cores), each a start, a
#             warm-up of <= 3 s, the 5 s window (250,000 texts: 200k+ at the 50,000 docs/s target), the graph
#             counters read after a heartbeat (2 x 1.25 s on CUDA), the close;
# st       -- 464 s here, all of it ST in float32 on 2 loaded cores (12 texts/s); on the GPU ST's 2 x 40,000
#             texts take ~2 s each, then one Pipeline: start, a warm-up over the 40,000, a 5 s window;
# replay   -- 88 s here for one process, three settings each cut at REPLAY_SETTING_MAX_S (6 s) by the CPU's
#             slow steps; on the GPU two processes, each ~10 s of start and tokenizing 30,000 texts + 3 settings;
# profile  -- MiniLM's common step 67 s, building BERT-base 18 s, BERT-base 4 x 512 on the CPU 63 s here; the
#             GPU runs its 32 x 512 steps in milliseconds, so the build and three process starts;
# graphs   -- 226 s here (the CPU's float32 forwards); under a second of steps on the GPU, both dtypes; the
#             packed runner adds a model load and its start-up probe per dtype and 2 x 10 timed steps per batch
#             (~2 s a dtype on the GPU): 8 s more, taken from loadtest (5) and dtype (3);
# dtype    -- 22 s here for one Pipeline (float32 against itself); four on CUDA (~10 s each);
# pages    -- (added 2026-12-07, its 32 s taken from loadtest 15, dtype 7, images 10) building the benchmark
#             ColPali (448 px pages, 1,024 image tokens, small towers) 12 s here, then scripts/bench_pages.py on
#             CUDA, float32, both sides: a Pipeline and ST's MultiVectorEncoder, 16 pages and 16 JPEGs once each;
#             (13 s more, from images, on 2026-12-07 for the Qwen3-VL embedder: its build, then scripts/bench_vlm.py
#             on 8 pages and 8 JPEGs, where torchvision imports);
# images   -- building CLIP-B/32 and 100 JPEGs 36 s here, the comparison with ST on the CPU 48 s, the load test
#             28 s (simulated device, 8 workers on 2 cores); on 16 cores the build and the comparison take about
#             half. The last part: it also gets whatever the parts before it left unused.
DEFAULT_BUDGETS_S = {"env": 20.0, "loadtest": 75.0, "st": 40.0, "replay": 45.0, "profile": 45.0, "graphs": 28.0,
                     "dtype": 45.0, "pages": 45.0, "images": 47.0}
# --quick: one load-test run (8 workers), the replay of the engine's path only, the BERT-base profile only.
QUICK_BUDGETS_S = {"env": 20.0, "loadtest": 60.0, "st": 50.0, "replay": 40.0, "profile": 50.0}
DEFAULT_MINUTES = 6.5
QUICK_MINUTES = 4.0
MAX_MINUTES = 30.0
# Render workers: 2, 4, 8 -- 8 short-text workers feed more than one engine (docs/benchmarks.md: ~120,000 texts/s
# a worker from the word cache), and the first GPU run was 25% slower with 14 than with 1 on 16 cores. Never
# more than the cores minus the frontend's threads (the caller's loop, the receiver) and the engine's (its loop,
# ZeroMQ's IO thread, the CUDA driver's): each would otherwise take a core from them.
DEFAULT_WORKERS = (2, 4, 8)
FRONTEND_THREADS = 2
ENGINE_THREADS = 3
NODE_CORES = 16  # the lent GPU node's (a dry run plans for it unless --cores names another)
DEFAULT_SEQ_CAPS: tuple[int, ...] = ()  # swept at the most workers when given (--seq-caps 256), besides the default
# A step started with less time than this left could not even load the model: it is reported as a timeout instead.
MIN_STEP_S = 10.0
# After SIGTERM a step's process group gets this long to exit before SIGKILL.
KILL_GRACE_S = 3.0
CUDNN_SDPA_ENV = "POOLING_PIPELINE_CUDNN_SDPA"
DOCS_PER_S_TARGET = 50_000  # all-MiniLM-L6-v2, ~24-token texts, float16, an H200-class GPU (issue 49)
# "More render workers never slower": a run of a few seconds moves by a few percent between tries, so a
# run with more workers passes at 95% of the best with fewer.
SCALING_TOLERANCE = 0.95
# A timed window holds 200,000+ texts at the 50,000 docs/s target: 5 s, and texts for 5 s at that rate.
LOADTEST_REQUESTS = 250_000
WINDOW_TEXTS = 200_000
LOADTEST_MAX_SECONDS = 5
# The warm-up before each window: the window's own texts, until every shape it will cut has run (a second
# at the target rate), cut at 3 s so that a slow engine leaves the window its time.
LOADTEST_WARMUP = 50_000
LOADTEST_WARMUP_SECONDS = 3
REPLAY_TEXTS = 30_000
ST_TEXTS = 40_000
IMAGES_COUNT = 100  # distinct web JPEGs, cycled through
IMAGES_REQUESTS = 20_000
IMAGES_MAX_SECONDS = 6
NO_CUDA = "no CUDA device: nothing to check"


@dataclass
class Step:
    label: str  # the check this step stands for in the table when it fails or runs out of time
    argv: list[str]
    output: Path | None = None  # the JSON the step writes
    rows_from: str | None = None  # how its output becomes rows: "rows" (a list of Row dicts), "loadtest", "images"
    env: dict[str, str] = field(default_factory=dict)  # set for this step's processes
    meta: dict = field(default_factory=dict)  # what the part's summary needs to know of it (workers, cap)


@dataclass
class Part:
    name: str
    budget_s: float
    steps: list[Step]
    independent: bool = False  # a failed step does not stop the next ones (one per worker count)
    cleanup: list[Path] = field(default_factory=list)
    # Rows drawn from all the part's results once it ends: [(step.meta, the step's JSON)] -> rows.
    summary: Callable[[list[tuple[dict, dict]]], list[Row]] | None = None


class Deadline:
    """A point in time on a monotonic clock; `within(s)` is the earlier of it and s seconds from now."""

    def __init__(self, seconds: float, clock=time.monotonic) -> None:
        self.clock = clock
        self.end = clock() + seconds

    def left(self) -> float:
        return max(0.0, self.end - self.clock())

    def within(self, seconds: float) -> Deadline:
        sub = Deadline(0.0, self.clock)
        sub.end = min(self.end, self.clock() + seconds)
        return sub


# ---------------------------------------------------------------------------------------------- arguments

def parse_parts(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no part given")
    for name in names:
        if name not in PARTS:
            raise argparse.ArgumentTypeError(f"unknown part {name!r} (choose from {', '.join(PARTS)})")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a part is repeated in {text!r}")
    return [p for p in PARTS if p in names]  # always in the order they are meant to run


def parse_budgets(text: str) -> dict[str, float]:
    budgets = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        name, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r} is not PART=SECONDS")
        if name not in PARTS:
            raise argparse.ArgumentTypeError(f"unknown part {name!r} (choose from {', '.join(PARTS)})")
        try:
            seconds = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: {value!r} is not a number of seconds") from None
        if not seconds > 0:  # also rejects nan
            raise argparse.ArgumentTypeError(f"{name}: the budget must be positive, got {value}")
        budgets[name] = seconds
    if not budgets:
        raise argparse.ArgumentTypeError("no budget given")
    return budgets


def parse_max_minutes(text: str) -> float:
    try:
        minutes = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < minutes <= MAX_MINUTES:
        raise argparse.ArgumentTypeError(f"must be in (0, {MAX_MINUTES:g}], got {text}")
    return minutes


def parse_counts(text: str) -> list[int]:
    """A comma-separated list of distinct positive integers (worker counts, sequence caps)."""
    try:
        counts = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(w < 1 for w in counts):
        raise argparse.ArgumentTypeError(f"each must be at least 1, got {text}")
    if len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"a value is repeated in {text!r}")
    return counts


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def parse_settings(text: str) -> list[str]:
    from device_check_steps import RUNNER_SETTINGS

    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in RUNNER_SETTINGS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(RUNNER_SETTINGS)}")
    return names


INTERNAL = ("env", "replay", "graphs", "profile", "st", "dtype", "build-model", "build-clip", "images-st",
            "build-colpali", "build-vlm")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=parse_parts, default=None,
                    help=f"comma-separated, of {','.join(PARTS)} (default: all; --quick: {','.join(QUICK_PARTS)})")
    ap.add_argument("--quick", action="store_true",
                    help=f"the headline rows alone in {QUICK_MINUTES:g} minutes: one load-test run with the most workers, "
                         "ST, the replay of the engine's path, the BERT-base profile (and the versions)")
    ap.add_argument("--max-minutes", type=parse_max_minutes, default=None,
                    help=f"hard deadline for the whole run (default {DEFAULT_MINUTES:g}, --quick {QUICK_MINUTES:g}; "
                         f"at most {MAX_MINUTES:g})")
    ap.add_argument("--budget-s", type=parse_budgets, default={},
                    help="per-part budgets in seconds, e.g. replay=90,loadtest=120 (default: "
                         + ",".join(f"{k}={v:g}" for k, v in DEFAULT_BUDGETS_S.items()) + "; --quick: "
                         + ",".join(f"{k}={v:g}" for k, v in QUICK_BUDGETS_S.items()) + ")")
    ap.add_argument("--workers", type=parse_counts, default=None,
                    help="render-worker counts for the load test (the most also for st and images; default "
                         f"{','.join(map(str, DEFAULT_WORKERS))}, those the cores allow), at most the cores less "
                         f"{FRONTEND_THREADS} frontend and {ENGINE_THREADS} engine threads")
    ap.add_argument("--cores", type=positive_int, default=None,
                    help=f"the cores the worker counts are planned for (default: this machine's; --dry-run: {NODE_CORES}, "
                         "the lent GPU node's)")
    ap.add_argument("--seq-caps", type=parse_counts, default=list(DEFAULT_SEQ_CAPS),
                    help="sequence caps (max_num_seqs) the load test sweeps at the most workers, besides the default "
                         "(default: none)")
    ap.add_argument("--model", default=None, help="the text model (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--texts", type=positive_int, default=300, help="real texts for the dtype comparison")
    ap.add_argument("--replay-texts", type=positive_int, default=REPLAY_TEXTS,
                    help="real short texts whose steps the replay records")
    ap.add_argument("--st-texts", type=positive_int, default=ST_TEXTS,
                    help="real short texts sentence-transformers and the pipeline embed")
    ap.add_argument("--out-dir", default=None, help="where the outputs go (default: $OUT when set, else a new "
                                                    "temporary folder)")
    ap.add_argument("--out", default=None, help="write the table to this file too")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (parts, commands, budgets) and exit")
    ap.add_argument("--rehearse", action="store_true",
                    help="run the plan here without a GPU, to time it: the load tests on the simulated device, every "
                         "other step on the CPU in float32 (figures of this machine, not a GPU's; pass a smaller "
                         "--st-texts, the CPU embeds slowly)")
    # Only for the tests: run the parts that can on the CPU (float32), CUDA or not.
    ap.add_argument("--force-device", choices=["cpu"], default=None, help=argparse.SUPPRESS)
    # The steps this script runs as its own subprocesses, and what they take.
    ap.add_argument("--internal", choices=INTERNAL, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--image-folder", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--settings", type=parse_settings, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--length", type=positive_int, default=None, help=argparse.SUPPRESS)
    return ap


def max_workers(cores: int) -> int:
    """The most render workers a node of `cores` cores runs: its cores less the frontend's and the engine's
    threads (at least one)."""
    return max(1, cores - FRONTEND_THREADS - ENGINE_THREADS)


def worker_counts(asked: list[int] | None, cores: int) -> list[int]:
    """The load test's worker counts: those asked for (each within `max_workers`, else a ValueError naming
    the cap), or the defaults the cores allow (the cap itself where none does)."""
    cap = max_workers(cores)
    if asked is None:
        return [w for w in DEFAULT_WORKERS if w <= cap] or [cap]
    if max(asked) > cap:
        raise ValueError(f"at most {cap} render workers on {cores} cores ({cores} less {FRONTEND_THREADS} frontend "
                         f"and {ENGINE_THREADS} engine threads), got {max(asked)}")
    return asked


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.rehearse:
        args.force_device = "cpu"
    explicit_parts = args.parts is not None
    args.parts = args.parts or list(QUICK_PARTS if args.quick else PARTS)
    args.max_minutes = args.max_minutes or (QUICK_MINUTES if args.quick else DEFAULT_MINUTES)
    if args.force_device and not args.rehearse and not args.internal and not set(args.parts) <= set(CPU_PARTS):
        ap.error(f"--force-device: only {','.join(CPU_PARTS)} run on a forced device (give --parts from those)")
    if args.quick and explicit_parts and not set(args.parts) <= set(QUICK_PARTS):
        ap.error(f"--quick: its parts are {','.join(QUICK_PARTS)}")
    args.cores = args.cores or (NODE_CORES if args.dry_run else available_cores())
    if not args.internal:
        try:
            args.workers = worker_counts(args.workers, args.cores)
        except ValueError as e:
            ap.error(f"--workers: {e}")
    else:
        args.workers = args.workers or [1]
    needs_json = ("env", "replay", "graphs", "profile", "st", "dtype", "images-st")
    if args.internal in needs_json and not args.json:
        ap.error(f"--internal {args.internal} needs --json")
    if args.internal in ("build-model", "build-clip", "images-st", "build-colpali", "build-vlm") and not args.model_dir:
        ap.error(f"--internal {args.internal} needs --model-dir")
    if args.internal in ("build-clip", "images-st") and not args.image_folder:
        ap.error(f"--internal {args.internal} needs --image-folder")
    if args.internal == "replay" and not args.settings:
        ap.error("--internal replay needs --settings")
    return args


# ---------------------------------------------------------------------------------------------- the plan

def python(script: str, *args) -> list[str]:
    return [sys.executable, str(SCRIPTS / script), *map(str, args)]


def internal(name: str, args: argparse.Namespace, *extra) -> list[str]:
    """A step of this script: `--internal name`, with the text model and forced device it was given."""
    given = (["--model", args.model] if args.model else []) + (["--force-device", args.force_device]
                                                              if args.force_device else [])
    return python("device_check.py", "--internal", name, *extra, *given)


def make_plan(args: argparse.Namespace, out: Path, scratch: Path) -> list[Part]:
    """The parts asked for, in PARTS order: step outputs in `out`, built models and images in `scratch`."""
    budgets = {**(QUICK_BUDGETS_S if args.quick else DEFAULT_BUDGETS_S), **args.budget_s}
    makers = {"env": env_part, "loadtest": loadtest_part, "st": st_part, "replay": replay_part,
              "profile": profile_part, "graphs": graphs_part, "dtype": dtype_part, "pages": pages_part,
              "images": images_part}
    parts = []
    for name in args.parts:
        steps, extra = makers[name](args, out, scratch)
        parts.append(Part(name, budgets.get(name, DEFAULT_BUDGETS_S[name]), steps, **extra))
    return parts


def rows_step(label: str, argv: list[str], output: Path, **kwargs) -> Step:
    return Step(label, argv, output, "rows", **kwargs)


def env_part(args, out, scratch):
    return [rows_step("env: versions and the SDPA kernel", internal("env", args, "--json", out / "env.json"),
                      out / "env.json")], {}


# A rehearsal's load test: the simulated device in the GPU's step shape (core.shared.config.GPU_MAX_NUM_SEQS sequences,
# core.engine.main.GPU_BATCH_TOKENS tokens; importing the engine here would cost torch's import).
REHEARSAL_BATCH_TOKENS = 16384


def loadtest_device(args) -> list:
    """The load test's device arguments: float16 on CUDA; in a rehearsal, the simulated device running the
    real model's tokenizer in the GPU's step shape."""
    if not args.rehearse:
        return ["--regime", "real", "--device", "cuda", "--dtype", "float16", *(["--model", args.model] if args.model else [])]
    from pooling_pipeline.core.shared.config import GPU_MAX_NUM_SEQS
    from pooling_pipeline.core.shared.model_folder.model_path import default_model_path

    return ["--regime", "sim", "--model", args.model or default_model_path(), "--max-num-batched-tokens",
            REHEARSAL_BATCH_TOKENS, "--max-num-seqs", GPU_MAX_NUM_SEQS]


def loadtest_part(args, out, scratch):
    """The most workers first (the headline figure), then fewer, then the sequence caps at the most workers;
    --quick: the most workers alone. Each run warms up on its own texts before a window of 200k+ texts."""
    most = max(args.workers)
    runs = [(most, None)]
    if not args.quick:
        runs += [(w, None) for w in sorted(args.workers) if w != most] + [(most, c) for c in args.seq_caps]
    steps = []
    for workers, cap in runs:
        output = out / f"loadtest-{workers}w-{'cap' + str(cap) if cap else 'default'}.json"
        device = loadtest_device(args)
        if cap:  # (a rehearsal's own cap replaced)
            device = device[:-2] if "--max-num-seqs" in device else device
        argv = python("loadtest.py", *device, "--workers", workers, "--repeats", 1,
                      *(["--max-num-seqs", cap] if cap else []), "--requests", LOADTEST_REQUESTS,
                      "--max-seconds", LOADTEST_MAX_SECONDS, "--warmup", LOADTEST_WARMUP,
                      "--warmup-seconds", LOADTEST_WARMUP_SECONDS, "--json", output)
        steps.append(Step(f"loadtest: real model, {'simulated device' if args.rehearse else 'float16'}, {workers} "
                          f"render worker{'s' if workers > 1 else ''}, sequence cap {cap or 'default'}", argv, output,
                          "loadtest", meta={"workers": workers, "cap": cap}))
    return steps, {"independent": True, "summary": functools.partial(loadtest_summary, rehearsal=args.rehearse)}


def st_part(args, out, scratch):
    workers = 1 if args.force_device and not args.rehearse else max(args.workers)
    return [rows_step(f"st: sentence-transformers and the pipeline, {args.st_texts:,} texts",
                      internal("st", args, "--json", out / "st.json", "--st-texts", args.st_texts, "--workers", workers),
                      out / "st.json")], {}


def replay_part(args, out, scratch):
    """The engine's default attention (cuDNN's SDPA off) with three runner settings (--quick: the engine's path
    alone); then cuDNN's on (not on a CPU, not --quick)."""
    settings = "graphs" if args.quick else "graphs,eager,plain"
    steps = [rows_step("replay: cuDNN SDPA off (the engine's default)",
                       internal("replay", args, "--json", out / "replay-cudnn-off.json", "--settings", settings,
                                "--replay-texts", args.replay_texts), out / "replay-cudnn-off.json")]
    if not args.force_device and not args.quick:
        steps.append(rows_step(f"replay: cuDNN SDPA on ({CUDNN_SDPA_ENV}=1)",
                               internal("replay", args, "--json", out / "replay-cudnn-on.json", "--settings", "graphs,plain",
                                        "--replay-texts", args.replay_texts), out / "replay-cudnn-on.json",
                               env={CUDNN_SDPA_ENV: "1"}))
    return steps, {"independent": True}


def profile_part(args, out, scratch):
    """The text model's common step (not --quick); then (on CUDA, or in a rehearsal) a BERT-base-shaped model
    at 512 tokens."""
    steps = [] if args.quick else [
        rows_step("profile: the text model's common step", internal("profile", args, "--json", out / "profile-text.json"),
                  out / "profile-text.json")]
    if args.force_device and not args.rehearse:
        return steps, {"independent": True}
    bert = scratch / "bert-base"
    forced = ["--force-device", args.force_device] if args.force_device else []
    steps += [Step("profile: building the BERT-base model", internal("build-model", args, "--model-dir", bert)),
              rows_step("profile: BERT-base, 512 tokens",
                        python("device_check.py", "--internal", "profile", "--model", bert, "--length", 512,
                               "--json", out / "profile-bert-base-512.json", *forced), out / "profile-bert-base-512.json")]
    return steps, {"independent": True, "cleanup": [bert]}


def graphs_part(args, out, scratch):
    return [rows_step("graphs: CUDA-graph replay against eager", internal("graphs", args, "--json", out / "graphs.json"),
                      out / "graphs.json")], {}


def dtype_part(args, out, scratch):
    label = (f"dtype: float32 on {args.force_device} against itself" if args.force_device
             else "dtype: float16 / bfloat16 / CPU against float32 on CUDA")
    return [rows_step(label, internal("dtype", args, "--json", out / "dtype.json", "--texts", args.texts),
                      out / "dtype.json")], {}


def pages_part(args, out, scratch):
    """A VLM's row: ColPali page retrieval (PaliGemma's towers, small) against ST on the device."""
    model = scratch / "colpali"
    built = model / "colpali" / "st"
    device = "cpu" if args.rehearse else "cuda"
    steps = [
        Step("pages: building the benchmark ColPali (448 px pages, 1,024 image tokens)",
             python("device_check.py", "--internal", "build-colpali", "--model-dir", model)),
        rows_step(f"pages: ColPali against ST's MultiVectorEncoder, float32 on {device}, 16 pages and 16 JPEGs",
                  python("bench_pages.py", "--model", built, "--device", device, "--count", 16, "--repeats", 1,
                         "--json", out / "pages.json"), out / "pages.json")]
    vlm = scratch / "vlm"
    if importlib.util.find_spec("torchvision") is not None:  # (transformers 5 loads a Qwen-VL processor only with it)
        steps += [
            Step("pages: building the benchmark Qwen3-VL embedder (up to 1,280 vision tokens an image)",
                 python("device_check.py", "--internal", "build-vlm", "--model-dir", vlm)),
            rows_step(f"pages: a Qwen3-VL embedder against ST, float32 on {device}, 8 pages and 8 JPEGs",
                      python("bench_vlm.py", "--model", vlm / "st", "--device", device, "--count", 8, "--repeats", 1,
                             "--json", out / "vlm.json"), out / "vlm.json")]
    return steps, {"cleanup": [model, vlm]}


def images_part(args, out, scratch):
    from device_check_steps import IMAGES_ST_COUNT

    model, folder = scratch / "clip-b32", scratch / "images"
    workers = max(args.workers)
    device = ["--regime", "sim-images"] if args.rehearse else ["--regime", "images", "--device", "cuda", "--dtype", "float16"]
    steps = [
        Step("images: building the CLIP-B/32 model and the JPEGs",
             python("device_check.py", "--internal", "build-clip", "--model-dir", model, "--image-folder", folder)),
        rows_step(f"images: the pipeline against ST in this environment, float32 on the CPU, {IMAGES_ST_COUNT} JPEGs "
                  "in three forms",
                  python("device_check.py", "--internal", "images-st", "--model-dir", clip_model_path(model),
                         "--image-folder", folder, "--json", out / "images-st.json"), out / "images-st.json"),
        Step(f"images: CLIP ViT-B/32 (random weights), {'simulated device' if args.rehearse else 'float16'}, 224 px, "
             f"{IMAGES_COUNT} web JPEGs by path, {workers} render worker{'s' if workers > 1 else ''}",
             python("loadtest.py", *device, "--model", clip_model_path(model), "--workers", workers, "--repeats", 1,
                    "--images", IMAGES_COUNT, "--image-folder", folder, "--requests", IMAGES_REQUESTS,
                    "--max-seconds", IMAGES_MAX_SECONDS, "--warmup", 512, "--json", out / "images.json"),
             out / "images.json", "images")]
    return steps, {"cleanup": [model, folder]}


def command_line(step: Step) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in step.env.items()), shlex.join(step.argv)])


def default_out_dir() -> str | None:
    return os.environ.get("OUT") or None


def format_plan(parts: list[Part], max_minutes: float, out: str, args: argparse.Namespace | None = None) -> str:
    total = sum(p.budget_s for p in parts)
    lines = [f"plan{' (--quick)' if args is not None and args.quick else ''}: {len(parts)} part(s), budgets {total:g} s "
             f"in all, hard deadline {max_minutes * 60:g} s"
             + (" (the budgets add up to more: the last parts may time out)" if total > max_minutes * 60 else "")
             + "; time a part leaves unused passes to the next", f"outputs in {out}"]
    if args is not None:
        workers = [max(args.workers)] if args.quick else args.workers
        lines.append(f"render workers {','.join(map(str, workers))}: planned for {args.cores} cores, at most "
                     f"{max_workers(args.cores)} ({args.cores} less {FRONTEND_THREADS} frontend and {ENGINE_THREADS} "
                     "engine threads)" + ("; a rehearsal: the simulated device and the CPU, no GPU" if args.rehearse else ""))
    for p in parts:
        lines.append(f"part {p.name}: budget {p.budget_s:g} s, {len(p.steps)} step(s)")
        lines.extend(f"  {command_line(s)}" for s in p.steps)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- running

def cuda_available() -> bool:
    """torch.cuda.is_available(), answered without importing torch (seconds) where the answer is sure to be no:
    a CPU build of torch, or no NVIDIA driver on the machine."""
    try:
        if "+cpu" in importlib.metadata.version("torch"):
            return False
    except importlib.metadata.PackageNotFoundError:
        return False
    if not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/dxg")):
        return False
    import torch

    return torch.cuda.is_available()


def kill_group(proc: subprocess.Popen) -> None:
    """Stops a step and everything it started (its Pipelines' processes are in its process group)."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            # The leader is gone; children still in the group get the same signal on the next pass.
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, deadline: Deadline, log: Path, min_start_s: float | None = None) -> tuple[str, str]:
    """Runs one step until it exits or the deadline passes: ("ok" | "error" | "timeout", detail)."""
    if deadline.left() < (MIN_STEP_S if min_start_s is None else min_start_s):
        return "timeout", f"not started: {deadline.left():.0f} s left in the budget"
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(step.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "HF_HUB_OFFLINE": "1", **step.env})
        try:
            rc = proc.wait(deadline.left())
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return "timeout", f"stopped after {time.monotonic() - start:.0f} s (its time was up)"
        except BaseException:  # Ctrl-C, SIGTERM: nothing is left behind
            kill_group(proc)
            raise
        finally:
            kill_group(proc)  # whatever the step left running in its group
    if rc != 0:
        return "error", f"exit {rc}: {last_line(log)}"
    return "ok", f"{time.monotonic() - start:.0f} s"


def last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "(no output)"


def load_result(step: Step) -> tuple[list[Row], dict]:
    """The rows a step's JSON gives, and the JSON itself."""
    record = json.loads(step.output.read_text())
    if step.rows_from == "rows":
        return [Row(**r) for r in record["rows"]], record
    return loadtest_rows(record, step.label, "images" if step.rows_from == "images" else "docs"), record


def loadtest_rows(record: dict, label: str, unit: str = "docs") -> list[Row]:
    r = record["runs"][0]
    figure = f"{r['requests_per_s']:,.0f} {unit}/s, engine busy {r['engine_busy']:.0%}"
    if r.get("window"):  # the timed window's steps: texts, host and device ms a step, graphs captured in it
        from loadtest import format_window

        figure += f", {format_window(r['window']).replace('texts/step', unit + '/step')}"
    elif r.get("batches"):
        figure += f", {r['requests'] / r['batches']:.0f} {unit}/step"
        engine_us = r.get("processes", {}).get("engine", {}).get("cpu_us_per_request")
        if engine_us is not None:  # (the engine process's CPU, ZeroMQ's IO thread included)
            figure += f", engine CPU {engine_us * r['requests'] / r['batches'] / 1e3:.2f} ms/step"
    if not r["complete"] and r.get("window") and unit == "docs" and r["requests"] < WINDOW_TEXTS:
        figure += f" ({r['requests']:,} {unit} in the window: fewer than the 200,000 it was sized for)"
    elif not r["complete"]:
        figure += f" ({r['requests']:,} {unit}: the run's time cap)"
    if not 0 <= r["engine_busy"] <= 1:  # the engine's steps counted twice: an accounting bug
        return [Row(label, figure, "all results, in order; engine busy within 100%", "FAIL")]
    return [Row(label, figure, "all results, in order", "pass")]  # loadtest.py exits non-zero on a broken order


def loadtest_summary(results: list[tuple[dict, dict]], rehearsal: bool = False) -> list[Row]:
    """The load test's targets over its runs: docs/s with the most workers at the default sequence cap,
    and more render workers never slower (at the default cap); a rehearsal's are informative (not a GPU's)."""
    judge = (lambda ok: "info") if rehearsal else verdict
    rate = {(m["workers"], m["cap"]): r["runs"][0]["requests_per_s"] for m, r in results}
    default = sorted((w, v) for (w, cap), v in rate.items() if cap is None)
    rows = []
    if default:
        workers, docs = default[-1]
        (best_w, best_cap), best = max(rate.items(), key=lambda kv: kv[1])
        rows.append(Row(f"loadtest: docs/s, {workers} render workers, the default sequence cap",
                        f"{docs:,.0f} docs/s (the sweep's best: {best:,.0f}, {best_w} workers, cap {best_cap or 'default'})",
                        f">= {DOCS_PER_S_TARGET:,} docs/s (H200-class GPU)", judge(docs >= DOCS_PER_S_TARGET)))
    if len(default) > 1:
        slower, fewer_best = [], 0.0
        for workers, docs in default:
            if docs < SCALING_TOLERANCE * fewer_best:
                slower.append(workers)
            fewer_best = max(fewer_best, docs)
        rows.append(Row("loadtest: more render workers never slower (default cap)",
                        ", ".join(f"{w}: {d:,.0f}" for w, d in default) + " docs/s"
                        + (f"; slower with {', '.join(map(str, slower))}" if slower else ""),
                        f"each >= {SCALING_TOLERANCE:.0%} of the best with fewer", judge(not slower)))
    return rows


def run_part(part: Part, deadline: Deadline, out: Path, rows: list[Row]) -> list[dict]:
    """Runs a part's steps within `deadline`, appending their rows to `rows` as each ends (so an
    interrupt keeps them): -> each step's status, time and log, for rows.json."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    done, record = [], []
    try:
        for k, step in enumerate(part.steps):
            log = logs / f"{part.name}-{k}.log"
            print(f"[{part.name}] {step.label} ({deadline.left():.0f} s left)", flush=True)
            started = time.monotonic()
            status, detail = run_step(step, deadline, log)
            print(f"[{part.name}]   {status}: {detail}", flush=True)
            if step.output is not None:
                if step.output.exists():  # a step that failed or ran out of time may have written some rows
                    try:
                        step_rows, result = load_result(step)
                        rows += step_rows
                        if status == "ok":
                            done.append((step.meta, result))
                    except (ValueError, KeyError, IndexError, TypeError) as e:
                        if status == "ok":
                            status, detail = "error", f"unreadable result {step.output.name}: {e!r}"
                elif status == "ok":
                    status, detail = "error", f"exited 0 without writing {step.output.name}: {last_line(log)}"
            record.append({"label": step.label, "command": command_line(step), "status": status, "detail": detail,
                           "seconds": round(time.monotonic() - started, 1), "log": str(log.relative_to(out))})
            if status != "ok":
                if log.exists() and status == "error":
                    print("\n".join(f"    | {ln}" for ln in log.read_text(errors="replace").splitlines()[-15:]))
                rows.append(Row(step.label, detail, "-", status))
                if not part.independent:
                    break
        if part.summary is not None:
            rows += part.summary(done)
    finally:
        for path in part.cleanup:
            shutil.rmtree(path, ignore_errors=True)
    return record


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def format_table(rows: list[Row]) -> str:
    lines = ["| check | figure | target | pass/fail |", "|---|---|---|---|"]
    lines += [f"| {cell(r.check)} | {cell(r.figure)} | {cell(r.target)} | {cell(r.result)} |" for r in rows]
    return "\n".join(lines)


def all_passed(rows: list[Row]) -> bool:
    return bool(rows) and all(r.result in ("pass", "info") for r in rows)


def save_outputs(out: Path, rows: list[Row], parts: list[dict], started: float, finished: bool) -> None:
    """table.md and rows.json (every row with the part it came from, each part's steps), rewritten
    after every part (a run cut short keeps what it saw)."""
    owners = [name for part in parts for name in [part["name"]] * part.get("rows", 0)]
    owners += [parts[-1]["name"] if parts else "-"] * (len(rows) - len(owners))  # (a part cut short)
    (out / "table.md").write_text(format_table(rows) + "\n")
    (out / "rows.json").write_text(json.dumps({"finished": finished, "seconds": round(time.monotonic() - started, 1),
                                               "argv": sys.argv, "parts": parts,
                                               "rows": [{"part": o, **asdict(r)} for o, r in zip(owners, rows)]},
                                              indent=1))


# ---------------------------------------------------------------------------------------------- main

def run_internal(args: argparse.Namespace) -> int:
    """One step, in this subprocess."""
    import device_check_steps as steps

    device = args.force_device or "cuda"
    out = Path(args.json) if args.json else None
    if args.internal == "env":
        steps.env_check(out, device)
    elif args.internal == "replay":
        steps.replay_check(out, args.model, device, args.settings, args.replay_texts)
    elif args.internal == "graphs":
        steps.graphs_check(out, args.model, device)
    elif args.internal == "profile":
        steps.profile_check(out, args.model, device, args.length)
    elif args.internal == "st":
        steps.st_check(out, args.model, device, args.st_texts, max(args.workers))
    elif args.internal == "dtype":
        steps.dtype_check(out, args.texts, args.force_device, args.model)
    elif args.internal == "build-model":
        print(steps.build_base_model(Path(args.model_dir)))
    elif args.internal == "build-clip":
        print(steps.build_clip_inputs(Path(args.model_dir), Path(args.image_folder)))
    elif args.internal == "images-st":
        steps.images_st_check(Path(args.model_dir), Path(args.image_folder), out)
    elif args.internal == "build-colpali":
        import tiny_models

        print(tiny_models.build_colpali(Path(args.model_dir)))
    elif args.internal == "build-vlm":
        import vlm_models

        print(vlm_models.build_qwen3vl_embedder(str(Path(args.model_dir) / "st"), sizes=vlm_models.BENCH_SIZES))
    return 0


def stop_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_parts(parts: list[Part], overall: Deadline, out: Path, started: float) -> list[Row]:
    """Every part in order, each within its budget plus what the parts before it left unused, the
    outputs saved after each; stopped (SIGINT, SIGTERM), the rows so far and an "interrupted" row."""
    rows: list[Row] = []
    records: list[dict] = []
    unused = 0.0
    try:
        for part in parts:
            deadline = overall.within(part.budget_s + unused)
            record = {"name": part.name, "budget_s": part.budget_s, "given_s": round(deadline.left(), 1), "steps": []}
            records.append(record)
            before = len(rows)
            try:
                record["steps"] = run_part(part, deadline, out, rows)
            except Exception as e:  # the check's own fault: still a row, still a table
                rows.append(Row(part.name, f"{type(e).__name__}: {e}", "-", "error"))
            record["rows"] = len(rows) - before
            unused = deadline.left()
            save_outputs(out, rows, records, started, finished=False)
    except KeyboardInterrupt as e:
        rows.append(Row("device check", f"interrupted ({e or 'Ctrl-C'}): the parts after this did not run", "-", "error"))
    save_outputs(out, rows, records, started, finished=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    if args.internal:
        return run_internal(args)
    where = args.out_dir or default_out_dir()
    if args.dry_run:
        plan = make_plan(args, Path(where or "<a new temporary folder>"), Path("<scratch>"))
        print(format_plan(plan, args.max_minutes, where or "a new temporary folder", args))
        return 0
    if not args.force_device and not cuda_available():
        print(NO_CUDA)
        return 0

    overall = Deadline(args.max_minutes * 60)
    started = time.monotonic()
    out = Path(where) if where else Path(tempfile.mkdtemp(prefix="device-check-"))
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="device-check-scratch-"))  # built models and images: large, not kept
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        parts = make_plan(args, out, scratch)
        print(format_plan(parts, args.max_minutes, str(out), args), flush=True)
        rows = run_parts(parts, overall, out, started)
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(scratch, ignore_errors=True)
    table = format_table(rows)
    print(f"\ndevice check: {time.monotonic() - started:.0f} s; outputs in {out}: table.md, rows.json, logs/, "
          "each step's JSON, replay-*-steps.json, profile-*-trace.json.gz\n")
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0 if all_passed(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
