#!/usr/bin/env python
"""The serving benchmark (issue 51): `pipeline-serve` against the in-process async API and Infinity, side by side.

Part 1, the bundled all-MiniLM-L6-v2 on this CPU. Every row serves the same real sentences (scripts/corpus.py) as
OpenAI-shaped embedding requests of one text or of 32 texts, at concurrency 1, 16 and 128:

* pipeline-serve, one row per backend (`--backends`: auto = OpenVINO float32 here; torch float32, the like-for-like
  row against Infinity's torch float32), driven over HTTP by one aiohttp process on keep-alive connections;
* the in-process async API: `Pipeline(...)` in a process of its own, N coroutines each awaiting
  `pipe.aembed(one_text_or_32)` as the server's handler calls it -- the same work without HTTP;
* Infinity (`infinity-emb`, torch engine, float32, 2 threads, its default batch size 32), driven by the same client.

Columns: requests/s and docs/s (answered ones), p50 / p99 latency of the answered requests, errors (connection
resets, non-200 answers, wrong answer counts: counted, never fatal), the client's own CPU per request, and the
server's process-tree CPU per request (psutil, user + system, read around the measured requests: the HTTP process
and its render workers and engine core; for the in-process row, its process and the Pipeline's children).

Part 2, the simulated device (`device="sim"`, the minilm-h100 preset: a step only waits, so the host's costs show):
the server's main process CPU per request minus the in-process API's main process CPU per request (the same
Pipeline work, no HTTP; the render workers and the engine are the same in both and are not counted), at concurrency
16, single texts and 32-text batches, answered as JSON floats and as base64 (the `openai` client's default): "the
HTTP layer's CPU per request". Beside it, the same app on a stub pipeline that answers at once: the HTTP layer's
cost measured alone, with no frontend work to share the process with.

Every measurement is warmed up first (the same shape and concurrency), the rows are measured in rotation repeat by
repeat (a load that comes and goes on the shared machine falls on all of them alike), and each cell is the median of
the repeats. One table is printed at the end with the ratios issue 51 names; the raw runs go to --json.

    python scripts/bench_serve.py                    # full run, ~30 min on 2 cores (docs/benchmarks.md)
    python scripts/bench_serve.py --quick            # a smoke run: fewer requests, one repeat (~8 min)
    python scripts/bench_serve.py --skip-infinity    # without the Infinity rows (its venv is absent)
    python scripts/bench_serve.py --parts sim --profile sim   # part 2 only; py-spy on the sim and stub servers

Needs: aiohttp, uvloop, psutil (the serve and test extras); Infinity's own environment (docs/serving-stack.md,
"Infinity for the benchmark") for its rows; py-spy for --profile.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from collections import Counter
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import corpus  # noqa: E402
import psutil  # noqa: E402
from infinity_server import SERVED_MODEL_NAME, bundled_model_dir, infinity_python, start_infinity, stop_infinity  # noqa: E402

SHAPES = {"single": 1, "batch32": 32}  # texts per request
CONCURRENCIES = (1, 16, 128)


class Cell(NamedTuple):
    """One measurement's load: texts per request, concurrent clients, and how the vectors are answered
    (OpenAI's `encoding_format`: JSON floats, or base64 -- what the `openai` client asks for by default)."""

    shape: str
    concurrency: int
    fmt: str = "float"

    def __str__(self) -> str:
        return f"{self.shape} c={self.concurrency} {self.fmt}"


# Requests in one measured run. Chosen so that a run lasts ~4-40 s on the 2-core machine (OpenVINO answers
# ~600 short sentences/s there, torch and Infinity ~300) and a batch run at 128 clients sees three rounds of them.
REQUESTS = {Cell("single", 1): 400, Cell("single", 16): 2000, Cell("single", 128): 2560,
            Cell("batch32", 1): 80, Cell("batch32", 16): 160, Cell("batch32", 128): 384}
# The simulated device answers in ~0.3 ms a step, so the main processes are the bottleneck (~2,000 single requests/s
# here): runs of ~5 s. The in-process row answers no HTTP; it runs the base64 cells as the float ones (its baseline).
SIM_REQUESTS = {Cell("single", 16): 10000, Cell("batch32", 16): 1000,
                Cell("single", 16, "base64"): 10000, Cell("batch32", 16, "base64"): 1000}
QUICK_DIVISOR = 8  # --quick: requests / 8 (at least one round of the concurrency), one repeat
TEXT_POOL = 4096  # distinct sentences, cycled through by request index: every row gets the same texts
MAX_TOKENS = 256  # the bundled model's max_seq_length
START_TIMEOUT_S = 300.0  # a server's start on a loaded machine (model load, OpenVINO's compile when its cache is cold)
STOP_TIMEOUT_S = 60.0
READY = re.compile(r"pipeline-serve: ready on (http://\S+)")
SERVE_MODEL_NAME = SERVED_MODEL_NAME  # both servers answer to the same `model`, so the request bodies are identical
HEADERS = {"content-type": "application/json"}


# -- the texts and the requests, the same in every process --

@functools.lru_cache(maxsize=1)
def text_pool() -> tuple[str, ...]:
    """TEXT_POOL real sentences (scripts/corpus.py) that fit the model: pipeline-serve refuses an over-long input by
    default (a 400) where Infinity cuts it, so the few sentences of more than its 256 tokens (4 of 4,608 drawn) are
    left out. Median 18 tokens, mean 23 (the bundled tokenizer, special tokens counted)."""
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(bundled_model_dir(), "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()  # (its tokenizer.json pads and cuts to 128)
    drawn = corpus.sentences(TEXT_POOL + 512, seed=0)
    fits = [text for text, encoding in zip(drawn, tokenizer.encode_batch(drawn)) if len(encoding.ids) <= MAX_TOKENS]
    if len(fits) < TEXT_POOL:
        raise RuntimeError(f"only {len(fits)} of {len(drawn)} sentences fit {MAX_TOKENS} tokens: this is a bug")
    return tuple(fits[:TEXT_POOL])


def request_texts(shape: str, count: int) -> list[list[str]]:
    """Request i's texts: the next `SHAPES[shape]` sentences of the pool, cycled."""
    pool = text_pool()
    per = SHAPES[shape]
    return [[pool[(i * per + k) % TEXT_POOL] for k in range(per)] for i in range(count)]


def request_body(texts: list[str], fmt: str) -> bytes:
    """OpenAI's embedding request: one text as a string (what a single-text client sends), 32 as a list."""
    body = {"model": SERVE_MODEL_NAME, "input": texts[0] if len(texts) == 1 else texts}
    if fmt != "float":  # (left out otherwise: float is every server's default)
        body["encoding_format"] = fmt
    return json.dumps(body).encode()


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * (len(sorted_values) - 1) + 0.5))]


def run_result(wall_s: float, latencies: list[float], errors: Counter, cpu_s: float | None) -> dict:
    latencies.sort()
    return {"wall_s": wall_s, "answered": len(latencies), "p50_ms": 1e3 * percentile(latencies, 0.50),
            "p99_ms": 1e3 * percentile(latencies, 0.99), "errors": dict(errors), "own_cpu_s": cpu_s}


# -- the HTTP client (a child process: one JSON job a line in, one JSON result a line out) --

async def drive_http(job: dict) -> dict:
    """`requests` POSTs from `concurrency` coroutines on as many keep-alive connections; each answer is checked
    for its status and its number of embeddings (counted in the bytes: parsing 32 x 384 floats would cost the
    client more than the check is worth)."""
    import aiohttp
    texts = request_texts(job["shape"], job["requests"])
    bodies = [request_body(t, job["fmt"]) for t in texts]
    expected = SHAPES[job["shape"]]
    todo = iter(range(job["requests"]))  # shared by the coroutines: each request is sent once
    latencies: list[float] = []
    errors: Counter = Counter()

    async def client(session) -> None:
        for i in todo:
            start = time.perf_counter()
            try:
                async with session.post(job["url"], data=bodies[i], headers=HEADERS) as answer:
                    body = await answer.read()
                if answer.status != 200:
                    errors[f"HTTP {answer.status}"] += 1
                elif body.count(b'"index"') != expected:
                    errors["wrong count"] += 1
                else:
                    latencies.append(time.perf_counter() - start)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                errors[type(exc).__name__] += 1

    connector = aiohttp.TCPConnector(limit=job["concurrency"])
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        cpu0, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(job["concurrency"])))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return run_result(wall, latencies, errors, cpu)


# -- the in-process async API (a child process: the same job protocol) --

async def drive_inprocess(pipe, job: dict) -> dict:
    """The server's handler without HTTP: N coroutines, each awaiting `pipe.aembed` as openai_routes.embeddings
    calls it (the same options: no dimensions or normalize override, priority 0, over-long inputs refused)."""
    from pooling_pipeline import PoolingParams
    prompts = request_texts(job["shape"], job["requests"])
    expected = SHAPES[job["shape"]]
    todo = iter(range(job["requests"]))
    latencies: list[float] = []
    errors: Counter = Counter()

    async def caller() -> None:
        for i in todo:
            start = time.perf_counter()
            try:
                outs = await pipe.aembed(prompts[i], pooling_params=PoolingParams(dimensions=None, normalize=None),
                                         priority=0, long_inputs="error")
            except Exception as exc:  # counted, as the HTTP client counts a non-200
                errors[type(exc).__name__] += 1
                continue
            if len(outs) != expected:
                errors["wrong count"] += 1
            else:
                latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(job["concurrency"])))
    return run_result(time.perf_counter() - start, latencies, errors, None)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop, as pipeline-serve runs (and for the client, so that it costs the shared cores less)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def child_loop(handle) -> None:
    """Jobs run one after the other on one event loop (the warm-up's loop is the measured run's)."""
    loop = new_event_loop()
    try:
        for line in sys.stdin:
            print(json.dumps(loop.run_until_complete(handle(json.loads(line)))), flush=True)
    finally:
        loop.close()


def client_main() -> None:
    child_loop(drive_http)


def inprocess_main(backend: str, device: str) -> None:
    from pooling_pipeline import Pipeline
    with Pipeline(None, backend=backend, device=device) as pipe:
        print(json.dumps({"ready": True, "cpu_plan": pipe.stats()["cpu_plan"],
                          "backend": pipe.stats()["engine"].get("backend")}), flush=True)
        child_loop(lambda job: drive_inprocess(pipe, job))


class JobProcess:
    """A child process that takes one JSON job a line and answers one JSON line (the client, an in-process row)."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args[2:]} exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# -- the rows --

def cpu_s(pid: int, tree: bool) -> float:
    """User + system CPU seconds of a process so far, and of its living descendants with `tree`."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *(root.children(recursive=True) if tree else [])]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class Row:
    """One row of the table: a way of serving the model, measured cell by cell (`measure`)."""

    label: str
    pid: int
    client_side: bool = True  # driven by the HTTP client (else it drives itself: the in-process API)

    def job(self, cell: Cell, requests: int) -> dict:
        return {"url": self.url, "shape": cell.shape, "concurrency": cell.concurrency, "fmt": cell.fmt,
                "requests": requests}

    def stop(self) -> None:
        raise NotImplementedError


class ServeRow(Row):
    """`python -m pooling_pipeline.serve.cli --port 0 ARGS` (or `command`), started in a session of its own, stopped
    by SIGTERM."""

    def __init__(self, label: str, args: list[str], log_dir: Path, command: list[str] | None = None) -> None:
        self.label = label
        self.log_path = log_dir / (re.sub(r"\W+", "-", label).strip("-") + ".log")
        command = command or [sys.executable, "-m", "pooling_pipeline.serve.cli", "--port", "0",
                              "--served-model-name", SERVE_MODEL_NAME, *args]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        self.pid = self.proc.pid
        self._found: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:  # the ready line; the rest is drained so the pipe never fills
        for line in self.proc.stdout:
            match = READY.search(line)
            if match and not self._found:
                self._found.append(match.group(1))

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._found:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.label} did not start (exit {self.proc.returncode}); its log "
                                   f"({self.log_path}) ends:\n{self.log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        self.url = self._found[0] + "/v1/embeddings"

    def backend_notice(self) -> str:
        """What the server's start-up said about its backend (pipeline/backends.py's notice), if anything."""
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if "backend" in line.lower()]
        return lines[0].split(" WARNING ")[-1].split(" INFO ")[-1][:200] if lines else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the server drains and closes its process group
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait()


class InfinityRow(Row):
    def __init__(self, threads: int, log_dir: Path) -> None:
        self.label = f"Infinity {infinity_version()} (torch float32, {threads} threads, batch size {infinity_batch_size()})"
        self.threads, self.log_dir = threads, log_dir

    def wait_ready(self) -> None:
        import socket
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.proc = start_infinity(bundled_model_dir(), port, self.threads, log_path=self.log_dir / "infinity.log")
        self.pid = self.proc.pid
        self.url = f"http://127.0.0.1:{port}/embeddings"

    def stop(self) -> None:
        if getattr(self, "proc", None) is not None:
            stop_infinity(self.proc)


def infinity_version() -> str:
    probe = subprocess.run([infinity_python(), "-c", "import infinity_emb; print(infinity_emb.__version__)"],
                           capture_output=True, text=True)
    return probe.stdout.strip() or "?"


def infinity_batch_size() -> str:
    """Infinity's --batch-size: its default (32 in 0.0.78) unless INFINITY_BATCH_SIZE is set for it."""
    return os.environ.get("INFINITY_BATCH_SIZE", "32 (its default)")


class InProcessRow(Row):
    client_side = False

    def __init__(self, label: str, backend: str, device: str) -> None:
        self.label = label
        self.child = JobProcess(["--inprocess", backend, "--device", device])
        self.pid = self.child.proc.pid
        self.url = ""

    def wait_ready(self) -> None:
        facts = self.child.read()
        self.cpu_plan, self.backend = facts["cpu_plan"], facts["backend"]

    def stop(self) -> None:
        self.child.close()


def measure(row: Row, client: JobProcess, cell: Cell, requests: int, tree: bool) -> dict:
    """A warm-up run, then the measured run with the row's CPU (its process tree, or its main process alone) read
    around it."""
    driver = client.run if row.client_side else row.child.run
    driver(row.job(cell, warmup_requests(cell, requests)))
    before = cpu_s(row.pid, tree)
    result = driver(row.job(cell, requests))
    result["server_cpu_s"] = cpu_s(row.pid, tree) - before
    result["requests"] = requests
    result["load"] = os.getloadavg()[0]
    return result


def warmup_requests(cell: Cell, requests: int) -> int:
    """A tenth of the run, and at least one round of the clients (two of single texts)."""
    return max(requests // 10, cell.concurrency * (2 if cell.shape == "single" else 1), 8)


def rotate(rows: list, repeat: int) -> list:
    k = repeat % len(rows)
    return rows[k:] + rows[:k]


def run_cells(rows: list[Row], client: JobProcess, cells: dict, repeats: int, tree: bool, quick: bool) -> dict:
    """Every cell of every row, `repeats` times, rows in rotation; {row label: {cell: [runs]}}."""
    runs: dict = {row.label: {cell: [] for cell in cells} for row in rows}
    for repeat in range(repeats):
        for cell, count in cells.items():
            requests = max(count // QUICK_DIVISOR, cell.concurrency) if quick else count
            for row in rotate(rows, repeat):
                if cell.fmt != "float" and not row.client_side:
                    continue  # (the in-process API encodes nothing: its float cell is the baseline of both)
                result = measure(row, client, cell, requests, tree)
                runs[row.label][cell].append(result)
                print(f"  [{repeat + 1}/{repeats}] {row.label} | {cell}: "
                      f"{result['answered'] / result['wall_s']:.1f} req/s, p99 {result['p99_ms']:.0f} ms, "
                      f"errors {result['errors'] or 'none'}, load {result['load']:.1f}", file=sys.stderr, flush=True)
    return runs


def summarize(runs: list[dict], docs_per_request: int) -> dict:
    """Medians over the repeats; errors summed."""
    errors: Counter = Counter()
    for run in runs:
        errors.update(run["errors"])
    client = [run["own_cpu_s"] / run["requests"] for run in runs if run["own_cpu_s"] is not None]

    def med(f) -> float:
        return statistics.median(f(run) for run in runs)
    return {"requests_s": med(lambda r: r["answered"] / r["wall_s"]),
            "docs_s": med(lambda r: docs_per_request * r["answered"] / r["wall_s"]),
            "p50_ms": med(lambda r: r["p50_ms"]), "p99_ms": med(lambda r: r["p99_ms"]),
            "errors": dict(errors), "sent": sum(run["requests"] for run in runs),
            "answered": sum(run["answered"] for run in runs),
            "client_cpu_us": 1e6 * statistics.median(client) if client else None,
            "server_cpu_us": med(lambda r: 1e6 * r["server_cpu_s"] / r["requests"]),
            "server_cpu_range": [1e6 * f(r["server_cpu_s"] / r["requests"] for r in runs) for f in (min, max)]}


# -- the parts --

def start_rows(rows: list[Row]) -> list[Row]:
    """Every row started, then each waited for (they load at once); a row that fails to start is dropped, named."""
    started = []
    for row in rows:
        try:
            row.wait_ready()
            started.append(row)
        except RuntimeError as exc:
            print(f"skipped: {exc}", file=sys.stderr)
    return started


def part_cpu(args, log_dir: Path) -> dict:
    rows: list[Row] = [ServeRow(f"pipeline-serve --backend {b}", ["--backend", b], log_dir) for b in args.backends]
    rows += [InProcessRow(f"in-process aembed, backend {b}", b, "cpu") for b in args.backends]
    skipped = None
    if args.skip_infinity:
        skipped = "--skip-infinity"
    else:
        try:
            rows.append(InfinityRow(args.infinity_threads, log_dir))
        except RuntimeError as exc:
            skipped = str(exc).split(";")[0]
    client = JobProcess(["--client"])
    try:
        rows = start_rows(rows)
        facts = row_facts(rows)
        runs = run_cells(rows, client, REQUESTS, args.repeats, tree=True, quick=args.quick)
    finally:
        client.close()
        for row in rows:
            row.stop()
    table = {label: {cell: summarize(cell_runs, SHAPES[cell.shape]) for cell, cell_runs in by_cell.items()}
             for label, by_cell in runs.items()}
    return {"table": table, "facts": facts, "infinity_skipped": skipped, "runs": runs}


def row_facts(rows: list[Row]) -> dict:
    """What ran in each row: the in-process rows' backend and CPU plan (the server plans the same), the servers' notices."""
    facts = {}
    for row in rows:
        if isinstance(row, InProcessRow):
            facts[row.label] = f"engine backend {row.backend}; cpu plan: {row.cpu_plan.get('reason', row.cpu_plan)}"
        elif isinstance(row, ServeRow):
            facts[row.label] = row.backend_notice()
    return facts


def part_sim(args, log_dir: Path) -> dict:
    rows: list[Row] = [ServeRow("pipeline-serve --device sim", ["--device", "sim"], log_dir),
                       InProcessRow("in-process aembed, device sim", "auto", "sim"),
                       ServeRow(STUB_LABEL, [], log_dir, command=[sys.executable, __file__, "--stub-server",
                                                                  "--stub-delay-ms", str(args.stub_delay_ms)])]
    client = JobProcess(["--client"])
    try:
        rows = start_rows(rows)
        if len(rows) != 3:
            raise RuntimeError("the simulated-device rows did not both start (above)")
        runs = run_cells(rows, client, SIM_REQUESTS, args.sim_repeats, tree=False, quick=args.quick)
        profiles = {}
        for row in (rows[0], rows[2]) if args.profile == "sim" else ():  # the sim server, the stub server
            for cell, count in SIM_REQUESTS.items():
                requests = max(count // QUICK_DIVISOR, 500) if args.quick else count
                profiles[f"{row.label}, {cell}"] = profile_server(row, client, cell, requests)
    finally:
        client.close()
        for row in rows:
            row.stop()
    table = {label: {cell: summarize(cell_runs, SHAPES[cell.shape]) for cell, cell_runs in by_cell.items() if cell_runs}
             for label, by_cell in runs.items()}
    stub_delay = f"after {args.stub_delay_ms:g} ms" if args.stub_delay_ms else "at once"
    writing = {str(cell): vector_writing_us(cell) for cell in SIM_REQUESTS}
    return {"table": table, "runs": runs, "profiles": profiles, "stub_delay": stub_delay, "vector_writing_us": writing}


def vector_writing_us(cell: Cell) -> float:
    """The CPU the server's handler spends writing a cell's vectors into the answer (`embedding_items`, the function
    it calls), timed alone in this process on unit vectors of the sim preset's width: the part of the HTTP layer
    that grows with the numbers answered (JSON floats: float32's shortest round-trip digits, ~20 ns a number with
    orjson). Median of 7 repeats."""
    import numpy as np

    from pooling_pipeline.serve.http import embedding_items
    vectors = np.random.default_rng(1).standard_normal((SHAPES[cell.shape], 384)).astype(np.float32)
    rows = list(vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
    number = 200
    times = timeit.repeat(lambda: embedding_items(rows, cell.fmt), number=number, repeat=7)
    return 1e6 * statistics.median(times) / number


# -- pipeline-serve's app on a stub pipeline: the HTTP layer alone --

STUB_LABEL = "pipeline-serve's app, stub pipeline"


class StubOutput(NamedTuple):
    data: object  # a float32 vector
    num_prompt_tokens: int


class StubPipe:
    """What pipeline-serve's app reads of a Pipeline, answering each embedding call at once with fixed unit vectors:
    the server process then does the HTTP layer's work alone (routing, JSON in, the Server's admission, JSON or
    base64 out, the socket), and its CPU per request is that layer's cost without the frontend's."""

    max_inflight = 1024  # (the CPU default: 16 x 64)

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        import numpy as np

        from pooling_pipeline.core.shared.model_folder.load import load_model_spec
        self.model_spec = load_model_spec(None)
        rows = np.random.default_rng(0).standard_normal((64, 384)).astype(np.float32)
        self.rows = rows / np.linalg.norm(rows, axis=1, keepdims=True)

    def healthy(self) -> bool:
        return True

    def stats(self) -> dict:
        return {}

    async def aembed(self, prompts, **options) -> list[StubOutput]:
        await asyncio.sleep(self.delay_s)  # (a real call yields to the loop while it waits)
        return [StubOutput(self.rows[i % len(self.rows)], 20) for i in range(len(prompts))]


def stub_server_main(delay_ms: float) -> None:
    """Serves make_app(StubPipe(...)) as pipeline-serve's cli serves the real one: uvicorn running pipeline-serve's own
    HTTP protocol, uvloop, no access log, lifespan off, on a free port announced with the same ready line."""
    import uvicorn

    from pooling_pipeline.serve.app import ServeSettings
    from pooling_pipeline.serve.protocol import protocol_factory
    from pooling_pipeline.serve.routes import make_app
    app = make_app(StubPipe(delay_ms / 1e3), ServeSettings(served_model_names=(SERVE_MODEL_NAME,)))
    # (uvicorn's settings as pipeline/serve/cli.py's _serve gives them)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, http=protocol_factory(app), lifespan="off",
                                           proxy_headers=False, server_header=False, access_log=False,
                                           log_level="warning"))

    async def serve() -> None:
        task = asyncio.ensure_future(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            print(f"pipeline-serve: ready on http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", flush=True)
        await task
    new_event_loop().run_until_complete(serve())


# -- py-spy on the server's main process under load --

PY_SPY_RATE = 250  # samples a second


def profile_server(row: ServeRow, client: JobProcess, cell: Cell, requests: int) -> dict:
    """py-spy samples the server's main process (its active threads) while the client sends `requests` of `cell`;
    each function's share of the samples, scaled to the CPU per request psutil measured over the same requests.
    (A thread waiting for a core, or inside a syscall, counts as active: on a loaded machine the samples cover more
    than the CPU time, so the shares are the figure to read.)"""
    out = Path(tempfile.mkdtemp(prefix="bench-serve-pyspy-")) / "server.txt"
    client.run(row.job(cell, warmup_requests(cell, requests)))
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(row.pid), "--format", "raw", "--rate", str(PY_SPY_RATE),
                            "--output", str(out), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    time.sleep(1.0)  # py-spy attaches
    before = cpu_s(row.pid, tree=False)
    result = client.run(row.job(cell, requests))
    used = cpu_s(row.pid, tree=False) - before
    spy.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
    _, err = spy.communicate(timeout=60)
    if not out.exists():
        return {"error": f"py-spy wrote nothing: {err[-500:]}"}
    return {"file": str(out), "requests": requests, "cpu_us": 1e6 * used / requests, "cpu_s": used,
            "requests_s": result["answered"] / result["wall_s"], **collapse(out.read_text())}


def collapse(raw: str) -> dict:
    """py-spy's raw stacks ('thread;frame;frame;... count') into self and inclusive sample counts by function."""
    own: Counter = Counter()
    inclusive: Counter = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")[1:]]  # (the thread's name first)
        if frames:
            own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    return {"samples": total, "self": own.most_common(15), "inclusive": inclusive.most_common(35)}


# -- the report --

def fmt(value, spec: str = ".0f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_cpu_table(part: dict) -> None:
    print("\n| row | texts / request | clients | requests/s | docs/s | p50 ms | p99 ms | errors | "
          "client CPU us / request | server tree CPU us / request |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for cell in REQUESTS:
        for label, cells in part["table"].items():
            s = cells[cell]
            errors = ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "none"
            print(f"| {label} | {SHAPES[cell.shape]} | {cell.concurrency} | {s['requests_s']:.1f} | {s['docs_s']:.0f} | "
                  f"{s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {errors} | {fmt(s['client_cpu_us'])} | "
                  f"{s['server_cpu_us']:.0f} |")
    if part["infinity_skipped"]:
        print(f"\nInfinity: skipped ({part['infinity_skipped']})")
    for label, fact in part["facts"].items():
        print(f"- {label}: {fact}")


def answered(s: dict) -> str:
    return f"answered {s['answered']} of {s['sent']} ({s['answered'] / s['sent']:.4f})"


def paired_ratio(runs: dict, a: str, b: str, cell: Cell) -> str:
    """Row a over row b in docs/s (= requests/s: both serve the same shape), repeat by repeat -- each repeat measures
    the rows back to back, so a load that comes and goes cancels in its ratio --; the median, and each repeat's."""
    ratios = [(x["answered"] / x["wall_s"]) / (y["answered"] / y["wall_s"]) for x, y in zip(runs[a][cell], runs[b][cell])]
    return f"{statistics.median(ratios):.2f}x (repeats: {', '.join(f'{r:.2f}' for r in ratios)})"


def print_cpu_ratios(part: dict, backends: list[str]) -> None:
    table, runs = part["table"], part["runs"]
    infinity = next((label for label in table if label.startswith("Infinity")), None)
    print("\nWhat issue 51 asks (ratios: the median of each repeat's ratio):")
    for b in backends:
        serve, inproc = f"pipeline-serve --backend {b}", f"in-process aembed, backend {b}"
        if serve not in table:
            continue
        if infinity:
            cell = Cell("single", 16)
            print(f"- {b}: single texts, 16 clients: server / Infinity requests/s = "
                  f"{paired_ratio(runs, serve, infinity, cell)} (target >= 2x); p99 {table[serve][cell]['p99_ms']:.1f} ms "
                  f"vs {table[infinity][cell]['p99_ms']:.1f} ms (target: lower)")
        if inproc in table:
            for c in CONCURRENCIES:
                print(f"- {b}: 32-text batches, {c} clients: server / in-process docs/s = "
                      f"{paired_ratio(runs, serve, inproc, Cell('batch32', c))} (target >= 0.9x)")
        for shape in SHAPES:
            print(f"- {b}: {shape}, 128 clients: {answered(table[serve][Cell(shape, 128)])} (target: every one)")
    if infinity:
        for shape in SHAPES:
            print(f"- Infinity: {shape}, 128 clients: {answered(table[infinity][Cell(shape, 128)])}")


def print_sim(part: dict) -> None:
    table = part["table"]
    serve, inproc, stub = table["pipeline-serve --device sim"], table["in-process aembed, device sim"], table[STUB_LABEL]
    print("\nSimulated device (minilm-h100), 16 clients; CPU of the main process only (workers and engine not counted); "
          "HTTP layer = server - in-process, repeat by repeat; the stub row is pipeline-serve's app with a pipeline "
          f"that answers {part['stub_delay']} (the HTTP layer alone):\n")
    print("| texts / request | encoding_format | server requests/s | server p99 ms | in-process requests/s | server main CPU "
          "us / request (min-max) | in-process main CPU us / request (min-max) | HTTP layer us / request, median (min-max) | "
          "of which writing the vectors (timed alone) | stub server CPU us / request (min-max) | client CPU us / request |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def spread(s: dict) -> str:
        return f"{s['server_cpu_us']:.0f} ({s['server_cpu_range'][0]:.0f}-{s['server_cpu_range'][1]:.0f})"
    for cell in SIM_REQUESTS:
        s, i = serve[cell], inproc[cell._replace(fmt="float")]  # (the in-process baseline encodes nothing)
        http = http_layer_us(part["runs"], cell)
        print(f"| {SHAPES[cell.shape]} | {cell.fmt} | {s['requests_s']:.0f} | {s['p99_ms']:.1f} | {i['requests_s']:.0f} | "
              f"{spread(s)} | {spread(i)} | **{statistics.median(http):.0f}** ({min(http):.0f}-{max(http):.0f}; target "
              f"<= 150) | {part['vector_writing_us'][str(cell)]:.0f} | {spread(stub[cell])} | {fmt(s['client_cpu_us'])} |")
    for cell, profile in part.get("profiles", {}).items():
        print_profile(cell, profile)


def http_layer_us(runs: dict, cell: Cell) -> list[float]:
    """Server minus in-process main-process CPU per request, repeat by repeat (each repeat measures the rows back to
    back)."""
    server, inproc = runs["pipeline-serve --device sim"][cell], runs["in-process aembed, device sim"][cell._replace(fmt="float")]
    return [1e6 * (s["server_cpu_s"] / s["requests"] - i["server_cpu_s"] / i["requests"]) for s, i in zip(server, inproc)]


def print_profile(what: str, profile: dict) -> None:
    if "error" in profile:
        print(f"\npy-spy, {what}: {profile['error']}")
        return
    total, per = profile["samples"], profile["cpu_us"]
    print(f"\npy-spy on the main process of {what}, {profile['requests']} requests at "
          f"{profile['requests_s']:.0f}/s: {per:.0f} us CPU / request; {total} samples = "
          f"{total / PY_SPY_RATE:.1f} s active against {profile['cpu_s']:.1f} s CPU ({profile['file']})")
    for kind in ("self", "inclusive"):
        print(f"\n| function ({kind}) | share of samples | us / request |\n|---|---:|---:|")
        for frame, n in profile[kind]:
            print(f"| `{frame}` | {n / total:.1%} | {per * n / total:.1f} |")


def run_loads(results: dict) -> str:
    loads = [run["load"] for part in results.values() for cells in part["runs"].values()
             for runs in cells.values() for run in runs]
    return f"{min(loads):.1f}-{max(loads):.1f} (median {statistics.median(loads):.1f})" if loads else "-"


def versions() -> str:
    import aiohttp
    import uvicorn
    import uvloop

    import pooling_pipeline
    return (f"Python {platform.python_version()}, pooling_pipeline {getattr(pooling_pipeline, '__version__', '?')}, "
            f"uvicorn {uvicorn.__version__}, uvloop {uvloop.__version__}, client aiohttp {aiohttp.__version__} on uvloop")


def jsonable(value):
    if isinstance(value, dict):
        return {(str(k) if isinstance(k, Cell) else k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="cpu,sim", help="cpu (the bundled model on this CPU), sim, or both")
    parser.add_argument("--backends", default="auto,torch", help="pipeline backends, a row each (server and in-process)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of part 1 (medians)")
    parser.add_argument("--sim-repeats", type=int, default=5, help="repeats of part 2 (medians)")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: requests / {QUICK_DIVISOR}, one repeat")
    parser.add_argument("--skip-infinity", action="store_true", help="no Infinity rows (its environment is absent)")
    parser.add_argument("--infinity-threads", type=int, default=2)
    parser.add_argument("--profile", choices=["sim"], default=None,
                        help="py-spy on the sim server's and the stub server's main process, each part 2 cell")
    parser.add_argument("--stub-delay-ms", type=float, default=0.0,
                        help="the stub pipeline answers after this delay: at 16 clients, 5.5 ms paces it as the sim "
                             "server runs here (~2,200 single requests/s; the loop then wakes for fewer requests at a "
                             "time, and the HTTP layer costs more per request)")
    parser.add_argument("--log-dir", default="/tmp/bench_serve", help="the servers' logs")
    parser.add_argument("--json", default="bench-out/bench_serve.json", help="the raw runs and the summaries")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stub-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--inprocess", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client_main()
    if args.stub_server:
        return stub_server_main(args.stub_delay_ms)
    if args.inprocess:
        return inprocess_main(args.inprocess, args.device)
    args.backends = args.backends.split(",")
    parts = set(args.parts.split(","))
    if not parts <= {"cpu", "sim"}:
        parser.error(f"--parts takes cpu, sim or cpu,sim; got {args.parts!r}")
    if args.quick:
        args.repeats = args.sim_repeats = 1
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = time.time()
    results: dict = {}
    if "cpu" in parts:
        results["cpu"] = part_cpu(args, log_dir)
    if "sim" in parts:
        results["sim"] = part_sim(args, log_dir)
    header = (f"\n{psutil.cpu_count()} cores; load average (1/5/15 min) {'/'.join(f'{x:.1f}' for x in load_before)} "
              f"before, {'/'.join(f'{x:.1f}' for x in os.getloadavg())} after; {(time.time() - started) / 60:.0f} min; "
              f"{args.repeats} repeats (part 1), {args.sim_repeats} (part 2), medians; load average (1 min) during the "
              f"measured runs {run_loads(results)}; {versions()}")
    print(header)
    if "cpu" in results:
        print_cpu_table(results["cpu"])
        print_cpu_ratios(results["cpu"], args.backends)
    if "sim" in results:
        print_sim(results["sim"])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(jsonable({"header": header, **results}), indent=1))


if __name__ == "__main__":
    main()
