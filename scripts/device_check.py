#!/usr/bin/env python
"""The GPU check: everything this repository has for CUDA, in one run of at most 8 minutes, one table at the end.

    python scripts/device_check.py                         # all parts, 8 minutes at most
    python scripts/device_check.py --dry-run               # the plan: parts, commands, budgets (no CUDA needed)
    python scripts/device_check.py --parts dtype,bench --max-minutes 5 --out device-check.md

Parts (each in its own subprocesses, with its own time budget inside one hard overall deadline):

* dtype    -- the bundled all-MiniLM-L6-v2 on a few hundred real texts: float16 and bfloat16 against
              float32 on CUDA (min cosine >= 0.9999), float32 on CUDA against float32 on the CPU (max |diff|);
* bench    -- scripts/bench_embed.py on a BERT-base-shaped model (12 layers, 768 wide, random weights, built
              here and saved as a sentence-transformers folder) with texts all kept to 512 tokens:
              throughput and engine busy (target >= 95%);
* loadtest -- scripts/loadtest.py with the real model on CUDA, one run per render-worker count: docs/s and
              engine busy per count;
* images   -- a CLIP ViT-B/32-sized dual encoder (random weights, built here: vision 12 x 768 at 224 px in
              32 px patches, text 12 x 512, projection 512) and 100 generated web JPEGs (500x400, quality 85):
              first the pipeline against sentence-transformers in this environment (float32 on the CPU, the
              JPEGs by path, as PIL images and as arrays: max |diff| <= 1e-5), which checks that the workers
              run the image processor ST runs here -- the torchvision one where torchvision is installed, as
              on most GPU machines, and its own decoder for files; then scripts/loadtest.py --regime images
              in float16 by path with the most render workers given: images/s and engine busy (informative:
              the render workers' CPU is expected to be the bottleneck).

A part that runs out of time is reported as "timeout", one that fails with its error; the others still
run and the table is always printed. A step's whole process group (its Pipelines included) is killed when
its time is up. The exit status is 0 when every row passed (or is only informative), 1 otherwise. Without
a CUDA device it says so and exits 0 at once.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
PARTS = ("dtype", "bench", "loadtest", "images")
# Adding up to the 8 minutes: building the CLIP-B/32 model and the JPEGs takes ~20 s on a 16-core machine,
# its one load-test run ~30 s (start-up, warm-up, IMAGES_MAX_SECONDS).
# The images part's comparison with ST adds ~25 s (two CPU loads of the model, 3 x 24 images each way).
DEFAULT_BUDGETS_S = {"dtype": 90.0, "bench": 150.0, "loadtest": 145.0, "images": 95.0}
MAX_MINUTES = 8.0
DEFAULT_WORKERS = (1, 2, 4, 8, 14)
# A step started with less time than this left could not even load the model: it is reported as a timeout instead.
MIN_STEP_S = 10.0
# After SIGTERM a step's process group gets this long to exit before SIGKILL.
KILL_GRACE_S = 3.0
MIN_COSINE = 0.9999
# float32 on CUDA against float32 on the CPU: other kernels, other summation orders, so not bit-equal; a real
# fault (a wrong dtype, a missed mask) shows up as 1e-2 or more.
MAX_ABS_DIFF = 1e-4
BUSY_TARGET = 0.95
BENCH_DOCS = 2000
BENCH_CHARS = (2400, 4000)  # ~600-1000 tokens of docstring text: every one kept to the model's 512
LOADTEST_REQUESTS = 30_000
LOADTEST_MAX_SECONDS = 12
IMAGES_COUNT = 100  # distinct web JPEGs, cycled through
IMAGES_REQUESTS = 20_000
IMAGES_MAX_SECONDS = 8
IMAGES_ST_COUNT = 24  # JPEGs compared with sentence-transformers, in each of three forms
# The pipeline against ST, both float32 on the CPU with torch: the same arithmetic, so any difference is
# the image processor's (the PIL and torchvision resizes differ by ~4e-4 on a test CLIP).
IMAGES_ST_MAX_DIFF = 1e-5
NO_CUDA = "no CUDA device: nothing to check"


@dataclass
class Row:
    check: str
    figure: str
    target: str
    result: str  # pass | FAIL | info | error | timeout


@dataclass
class Step:
    label: str  # the check this step stands for in the table when it fails or runs out of time
    argv: list[str]
    output: Path | None = None  # the JSON the step writes
    rows_from: str | None = None  # how its output becomes rows: "rows" (a list of Row dicts), "bench", "loadtest"


@dataclass
class Part:
    name: str
    budget_s: float
    steps: list[Step]
    independent: bool = False  # a failed step does not stop the next ones (one per worker count)
    cleanup: list[Path] = field(default_factory=list)


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


def parse_workers(text: str) -> list[int]:
    try:
        counts = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(w < 1 for w in counts):
        raise argparse.ArgumentTypeError(f"worker counts must be at least 1, got {text}")
    if len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"a worker count is repeated in {text!r}")
    return counts


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=parse_parts, default=list(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    ap.add_argument("--max-minutes", type=parse_max_minutes, default=MAX_MINUTES,
                    help=f"hard deadline for the whole run (at most {MAX_MINUTES:g})")
    ap.add_argument("--budget-s", type=parse_budgets, default={},
                    help="per-part budgets in seconds, e.g. dtype=60,loadtest=180 (default: "
                         + ",".join(f"{k}={v:g}" for k, v in DEFAULT_BUDGETS_S.items()) + ")")
    ap.add_argument("--workers", type=parse_workers, default=list(DEFAULT_WORKERS),
                    help="render-worker counts for the load test, e.g. 1,2,4,8,14")
    ap.add_argument("--texts", type=positive_int, default=300, help="real texts for the dtype comparison")
    ap.add_argument("--out", default=None, help="write the table to this file too")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (parts, commands, budgets) and exit")
    # Only for the tests: run part (a)'s comparison on the CPU (float32 against float32), CUDA or not.
    ap.add_argument("--force-device", choices=["cpu"], default=None, help=argparse.SUPPRESS)
    # The steps this script runs as its own subprocesses.
    ap.add_argument("--internal", choices=["dtype", "build-model", "build-clip", "images-st"], default=None,
                    help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--image-folder", default=None, help=argparse.SUPPRESS)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.force_device and args.parts != ["dtype"] and not args.internal:
        ap.error("--force-device: only the dtype part runs on a forced device (give --parts dtype)")
    if args.internal == "dtype" and not args.json:
        ap.error("--internal dtype needs --json")
    if args.internal in ("build-model", "build-clip") and not args.model_dir:
        ap.error(f"--internal {args.internal} needs --model-dir")
    if args.internal in ("build-clip", "images-st") and not args.image_folder:
        ap.error(f"--internal {args.internal} needs --image-folder")
    if args.internal == "images-st" and not (args.model_dir and args.json):
        ap.error("--internal images-st needs --model-dir and --json")
    return args


# ---------------------------------------------------------------------------------------------- the plan

def python(script: str, *args) -> list[str]:
    return [sys.executable, str(SCRIPTS / script), *map(str, args)]


def make_plan(args: argparse.Namespace, work: Path) -> list[Part]:
    budgets = {**DEFAULT_BUDGETS_S, **args.budget_s}
    device = args.force_device or "cuda"
    parts = []
    if "dtype" in args.parts:
        extra = ["--force-device", args.force_device] if args.force_device else []
        out = work / "dtype.json"
        label = (f"dtype: float32 on {args.force_device} against itself" if args.force_device
                 else "dtype: float16 / bfloat16 / CPU against float32 on CUDA")
        parts.append(Part("dtype", budgets["dtype"], [Step(
            label,
            python("device_check.py", "--internal", "dtype", "--json", out, "--texts", args.texts, *extra),
            out, "rows")]))
    if "bench" in args.parts:
        model, out = work / "bert-base", work / "bench"
        parts.append(Part("bench", budgets["bench"], [
            Step("bench: building the BERT-base model", python("device_check.py", "--internal", "build-model",
                                                             "--model-dir", model)),
            Step("bench: BERT-base, 512 tokens, bench_embed.py",
                 python("bench_embed.py", "--device", device, "--dtype", "float16", "--model", model, "--cases", "b",
                        "--n-medium", BENCH_DOCS, "--medium-chars", *BENCH_CHARS, "--repeats", 3, "--no-decoder",
                        "--no-static", "--out", out),
                 out / "bench_embed.json", "bench")], cleanup=[model]))
    if "loadtest" in args.parts:
        steps = []
        for w in args.workers:
            out = work / f"loadtest-{w}.json"
            steps.append(Step(f"loadtest: real model, {w} render worker{'s' if w > 1 else ''}",
                              python("loadtest.py", "--regime", "real", "--device", device, "--workers", w,
                                     "--requests", LOADTEST_REQUESTS, "--max-seconds", LOADTEST_MAX_SECONDS,
                                     "--json", out),
                              out, "loadtest"))
        parts.append(Part("loadtest", budgets["loadtest"], steps, independent=True))
    if "images" in args.parts:
        model, folder, out = work / "clip-b32", work / "images", work / "images.json"
        workers = max(args.workers)
        parts.append(Part("images", budgets["images"], [
            Step("images: building the CLIP-B/32 model and the JPEGs",
                 python("device_check.py", "--internal", "build-clip", "--model-dir", model, "--image-folder", folder)),
            Step(f"images: the pipeline against ST in this environment, float32 on the CPU, {IMAGES_ST_COUNT} JPEGs "
                 "in three forms",
                 python("device_check.py", "--internal", "images-st", "--model-dir", clip_model_path(model),
                        "--image-folder", folder, "--json", work / "images-st.json"),
                 work / "images-st.json", "rows"),
            Step(f"images: CLIP ViT-B/32 (random weights), float16, 224 px, {IMAGES_COUNT} web JPEGs by path, "
                 f"{workers} render worker{'s' if workers > 1 else ''}",
                 python("loadtest.py", "--regime", "images", "--model", clip_model_path(model), "--device", device,
                        "--dtype", "float16", "--workers", workers, "--images", IMAGES_COUNT, "--image-folder", folder,
                        "--requests", IMAGES_REQUESTS, "--max-seconds", IMAGES_MAX_SECONDS, "--json", out),
                 out, "images")], cleanup=[model, folder]))
    return parts


def format_plan(parts: list[Part], max_minutes: float) -> str:
    total = sum(p.budget_s for p in parts)
    lines = [f"plan: {len(parts)} part(s), budgets {total:g} s in all, hard deadline {max_minutes * 60:g} s"
             + (" (the budgets add up to more: the last parts may time out)" if total > max_minutes * 60 else "")]
    for p in parts:
        lines.append(f"part {p.name}: budget {p.budget_s:g} s, {len(p.steps)} step(s)")
        lines.extend(f"  {shlex.join(s.argv)}" for s in p.steps)
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


def run_step(step: Step, deadline: Deadline, log: Path, min_start_s: float = MIN_STEP_S) -> tuple[str, str]:
    """Runs one step until it exits or the deadline passes: ("ok" | "error" | "timeout", detail)."""
    if deadline.left() < min_start_s:
        return "timeout", f"not started: {deadline.left():.0f} s left in the budget"
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(step.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            rc = proc.wait(deadline.left())
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return "timeout", f"stopped after {time.monotonic() - start:.0f} s (its time was up)"
        except BaseException:  # Ctrl-C: nothing is left behind
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


def rows_of(step: Step) -> list[Row]:
    record = json.loads(step.output.read_text())
    if step.rows_from == "rows":
        return [Row(**r) for r in record["rows"]]
    if step.rows_from == "bench":
        return bench_rows(record)
    return loadtest_rows(record, step.label, "images" if step.rows_from == "images" else "docs")


def model_shape(path: str | None) -> str:
    """"BERT 12 x 768" from the model's config.json (the folder is gone once the part ends: then "model")."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
        return f"{config['model_type'].upper()} {config['num_hidden_layers']} x {config['hidden_size']}"
    except (TypeError, OSError, ValueError, KeyError):
        return "model"


def bench_rows(record: dict) -> list[Row]:
    r = record["results"][0]
    backend = record["backends"][0]  # bench_embed.py's first (here: only) pipeline row
    dps = r["docs_per_s"]
    tokens_per_doc = r["kept_tokens"] / r["docs"]
    engine = record["engine"]
    name = f"bench: {model_shape(record.get('model'))}, {engine['dtype']} on {engine['device']}, {tokens_per_doc:.0f} tokens/doc"
    busy = r["per_backend"][backend]["engine_busy"]
    pipeline = dps[f"pipeline ({backend})"]
    return [Row(f"{name}: throughput",
                f"{pipeline:,.0f} docs/s ({pipeline * tokens_per_doc:,.0f} tokens/s); "
                f"sentence-transformers {dps['sentence_transformers']:,.0f}, forward limit {dps['forward_limit']:,.0f}",
                "-", "info"),
            Row(f"{name}: engine busy", f"{busy:.1%}", f">= {BUSY_TARGET:.0%}", "pass" if busy >= BUSY_TARGET else "FAIL")]


def loadtest_rows(record: dict, label: str, unit: str = "docs") -> list[Row]:
    r = record["runs"][0]
    figure = f"{r['requests_per_s']:,.0f} {unit}/s, engine busy {r['engine_busy']:.0%}"
    if not r["complete"]:
        figure += f" ({r['requests']:,} {unit}: the run's time cap)"
    if not 0 <= r["engine_busy"] <= 1:  # the engine's steps counted twice: an accounting bug
        return [Row(label, figure, "all results, in order; engine busy within 100%", "FAIL")]
    return [Row(label, figure, "all results, in order", "pass")]  # loadtest.py exits non-zero on a broken order


def run_part(part: Part, overall: Deadline, work: Path) -> list[Row]:
    deadline = overall.within(part.budget_s)
    rows = []
    try:
        for k, step in enumerate(part.steps):
            log = work / f"{part.name}-{k}.log"
            print(f"[{part.name}] {step.label} ({deadline.left():.0f} s left)", flush=True)
            status, detail = run_step(step, deadline, log)
            print(f"[{part.name}]   {status}: {detail}", flush=True)
            if step.output is not None:
                if step.output.exists():  # a step that failed or ran out of time may have written some rows
                    try:
                        rows += rows_of(step)
                    except (ValueError, KeyError, IndexError, TypeError) as e:
                        if status == "ok":
                            status, detail = "error", f"unreadable result {step.output.name}: {e!r}"
                elif status == "ok":
                    status, detail = "error", f"exited 0 without writing {step.output.name}: {last_line(log)}"
            if status != "ok":
                if log.exists() and status == "error":
                    print("\n".join(f"    | {ln}" for ln in log.read_text(errors="replace").splitlines()[-15:]))
                rows.append(Row(step.label, detail, "-", status))
                if not part.independent:
                    break
    finally:
        for path in part.cleanup:
            shutil.rmtree(path, ignore_errors=True)
    return rows


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def format_table(rows: list[Row]) -> str:
    lines = ["| check | figure | target | pass/fail |", "|---|---|---|---|"]
    lines += [f"| {cell(r.check)} | {cell(r.figure)} | {cell(r.target)} | {cell(r.result)} |" for r in rows]
    return "\n".join(lines)


def all_passed(rows: list[Row]) -> bool:
    return bool(rows) and all(r.result in ("pass", "info") for r in rows)


# ---------------------------------------------------------------------------------------------- the steps

def compare_rows(name: str, reference, candidate, metrics: tuple[str, ...]) -> list[Row]:
    """Rows comparing two [n, d] embedding arrays: "cosine" (the lowest row-wise cosine) and/or "max_abs"."""
    import numpy as np

    rows = []
    for metric in metrics:
        if metric == "cosine":
            norms = np.linalg.norm(candidate, axis=1) * np.linalg.norm(reference, axis=1)
            cos = float(np.min(np.sum(candidate * reference, axis=1) / norms))
            rows.append(Row(f"{name}: min cosine", f"{cos:.6f}", f">= {MIN_COSINE}", "pass" if cos >= MIN_COSINE else "FAIL"))
        elif metric == "max_abs":
            diff = float(np.max(np.abs(candidate - reference)))
            rows.append(Row(f"{name}: max abs diff", f"{diff:.2e}", f"<= {MAX_ABS_DIFF:.0e}",
                            "pass" if diff <= MAX_ABS_DIFF else "FAIL"))
        else:
            raise ValueError(f"unknown metric {metric!r}")
    return rows


def dtype_check(json_path: Path, n_texts: int, force_device: str | None) -> None:
    """Part (a), run as a step: each setting's embeddings against the float32 reference's, rows written after
    each comparison (so a timeout keeps the ones done). The reference Pipeline stays open throughout; a
    setting equal to it (the CPU test: float32 against float32) is a second call on it, the others get their own."""
    import corpus
    import numpy as np

    from pooling_pipeline import Pipeline

    texts = corpus.sentences(n_texts - n_texts // 3, seed=21) + corpus.medium_texts(n_texts // 3, seed=22)
    if force_device:
        reference = (force_device, "float32")
        candidates = [((force_device, "float32"), ("cosine", "max_abs"))]
    else:
        reference = ("cuda", "float32")
        candidates = [(("cuda", "float16"), ("cosine",)), (("cuda", "bfloat16"), ("cosine",)),
                      (("cpu", "float32"), ("max_abs",))]
    rows: list[Row] = []

    def save() -> None:
        json_path.write_text(json.dumps({"rows": [r.__dict__ for r in rows]}))

    def open_pipeline(device: str, dtype: str) -> Pipeline:
        # A few hundred texts need few workers; on the CPU (the tests' 2 cores) one starts fastest.
        pipe = Pipeline(device=device, dtype=dtype, num_render_workers=1 if force_device else 2)
        engine = pipe.stats()["engine"]
        if not engine["device"].startswith(device) or engine["dtype"] != dtype:
            pipe.close()
            raise RuntimeError(f"asked for {device}/{dtype}, the engine runs {engine['device']}/{engine['dtype']}")
        return pipe

    def embed(pipe: Pipeline) -> np.ndarray:
        return np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False)])

    if not force_device:
        import torch

        rows.append(Row("device", f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}",
                        "-", "info"))
    save()
    ref_name = f"{reference[1]} on {reference[0]}"
    try:
        ref_pipe = open_pipeline(*reference)
    except Exception as e:
        rows.append(Row(f"dtype: {ref_name} (the reference)", f"{type(e).__name__}: {e}", "-", "error"))
        save()
        return
    try:
        ref = embed(ref_pipe)
        for setting, metrics in candidates:
            name = f"dtype: {setting[1]} on {setting[0]} vs {ref_name}, {len(texts)} texts"
            try:
                if setting == reference:
                    emb = embed(ref_pipe)
                else:
                    with open_pipeline(*setting) as pipe:
                        emb = embed(pipe)
                rows += compare_rows(name, ref, emb, metrics)
            except Exception as e:
                rows.append(Row(name, f"{type(e).__name__}: {e}", "-", "error"))
            save()
    finally:
        ref_pipe.close()


def build_base_model(target: Path, hidden_size: int = 768, num_hidden_layers: int = 12, num_attention_heads: int = 12,
                     intermediate_size: int = 3072) -> str:
    """A BERT-base-shaped encoder (random weights, the bundled tokenizer) saved by sentence-transformers
    itself in `target` with mean pooling, Normalize and a 512-token max_seq_length."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from tiny_models import build_bert

    backbone = tempfile.mkdtemp(prefix="bert-backbone-")
    try:
        build_bert(backbone, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                   num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                   max_position_embeddings=512)
        model = SentenceTransformer(modules=[Transformer(backbone, max_seq_length=512),
                                             Pooling(hidden_size, pooling_mode="mean"), Normalize()], device="cpu")
        model.save(str(target))
    finally:
        shutil.rmtree(backbone, ignore_errors=True)
    return str(target)


def clip_model_path(model_dir: Path) -> Path:
    """Where `build_clip_inputs` leaves the model in `model_dir` (tiny_models.build_clip saves it in st/)."""
    return model_dir / "st"


def build_clip_inputs(model_dir: Path, image_folder: Path, count: int = IMAGES_COUNT) -> str:
    """The images part's inputs: a CLIP ViT-B/32-sized dual encoder (tiny_models.build_clip's defaults: vision
    12 layers x 768, 12 heads, 3072 inner, 224 px in 32 px patches; text 12 x 512, 8 heads, 2048 inner, 77
    positions; projection 512; random weights, saved by sentence-transformers) in `model_dir`, and `count` web
    JPEGs (scripts/image_set.py: 500x400, quality 85) in `image_folder`, generated in a thread meanwhile."""
    import threading

    from image_set import build_image_set
    from tiny_models import build_clip

    failed: list[BaseException] = []

    def images() -> None:
        try:
            build_image_set(image_folder, "web", count)
        except BaseException as e:  # raised below, in the step
            failed.append(e)

    thread = threading.Thread(target=images)
    thread.start()
    try:
        path = build_clip(model_dir)
    finally:
        thread.join()
    if failed:
        raise failed[0]
    if Path(path) != clip_model_path(model_dir):
        raise RuntimeError(f"build_clip saved the model in {path}, the plan expects {clip_model_path(model_dir)}")
    return path


def images_st_check(model: Path, image_folder: Path, json_path: Path) -> None:
    """The images part's first step: the pipeline's image vectors against sentence-transformers' in this
    environment, with the image processor transformers picks here (which the row names): JPEGs by path (the
    processor's own decoder where it has one), as PIL images and as arrays. Both float32 on the CPU with
    torch, so a difference is the preprocessing's."""
    import numpy as np
    from image_set import build_image_set
    from PIL import Image
    from sentence_transformers import SentenceTransformer
    from transformers import AutoImageProcessor

    from pooling_pipeline import Pipeline

    rows: list[Row] = []
    processor = AutoImageProcessor.from_pretrained(model)
    versions = []
    for package in ("torchvision", "torchcodec", "pillow"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"no {package}")
    rows.append(Row("images: the image processor here", f"{type(processor).__name__} "
                    f"({getattr(processor, 'backend', 'pil')}); {', '.join(versions)}", "-", "info"))
    json_path.write_text(json.dumps({"rows": [r.__dict__ for r in rows]}))
    paths = build_image_set(image_folder, "web", IMAGES_ST_COUNT)  # (the first of the set built before)
    forms = {"by path": paths, "PIL images": [Image.open(p) for p in paths],
             "arrays": [np.asarray(Image.open(p).convert("RGB")) for p in paths]}
    st = SentenceTransformer(str(model), device="cpu")
    with Pipeline(model=str(model), device="cpu", dtype="float32", backend="torch", num_render_workers=4) as pipe:
        for form, inputs in forms.items():
            reference = st.encode(inputs, batch_size=8)
            got = np.stack([o.embedding for o in pipe.embed(inputs, use_tqdm=False)])
            diff = float(np.abs(got - reference).max())
            rows.append(Row(f"images: {len(inputs)} JPEGs {form}, pipeline vs ST (float32, CPU)", f"max |diff| {diff:.2e}",
                            f"<= {IMAGES_ST_MAX_DIFF:.0e}", "pass" if diff <= IMAGES_ST_MAX_DIFF else "FAIL"))
            json_path.write_text(json.dumps({"rows": [r.__dict__ for r in rows]}))


# ---------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    if args.internal == "dtype":
        dtype_check(Path(args.json), args.texts, args.force_device)
        return 0
    if args.internal == "build-model":
        print(build_base_model(Path(args.model_dir)))
        return 0
    if args.internal == "build-clip":
        print(build_clip_inputs(Path(args.model_dir), Path(args.image_folder)))
        return 0
    if args.internal == "images-st":
        images_st_check(Path(args.model_dir), Path(args.image_folder), Path(args.json))
        return 0
    if args.dry_run:
        print(format_plan(make_plan(args, Path("<work>")), args.max_minutes))
        return 0
    if not args.force_device and not cuda_available():
        print(NO_CUDA)
        return 0

    overall = Deadline(args.max_minutes * 60)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="device-check-"))
    parts = make_plan(args, work)
    print(format_plan(parts, args.max_minutes), flush=True)
    rows: list[Row] = []
    for part in parts:
        try:
            rows += run_part(part, overall, work)
        except Exception as e:  # the check's own fault: still a row, still a table
            rows.append(Row(f"{part.name}", f"{type(e).__name__}: {e}", "-", "error"))
    table = format_table(rows)
    print(f"\ndevice check: {time.monotonic() - started:.0f} s, logs in {work}\n")
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0 if all_passed(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
