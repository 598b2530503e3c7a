"""The benchmark's side of its CPU peers: each peer (sentence-transformers + OpenVINO, + ONNX, + ONNX
int8) runs in a child process of an interpreter that has its packages (scripts/peer_embed.py), loads
its model once and then times each workload when asked, so the peers are measured in the same run
as the pipeline, on the same texts, case by case.

Texts go to the child in a JSON file and its vectors come back in a .npy file (no pickle).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

PEER_SCRIPT = Path(__file__).with_name("peer_embed.py")
# bench_embed.py's method key -> (peer_embed.py's name, label in the tables)
PEERS = {"st_openvino": ("openvino", "ST + OpenVINO"), "st_openvino_f32": ("openvino-f32", "ST + OpenVINO f32"),
         "st_onnx": ("onnx", "ST + ONNX"), "st_onnx_int8": ("onnx-int8", "ST + ONNX int8")}
SETUP_HINT = "pass --peer-python, see README, Benchmark"


class Peer:
    """One peer's child process. `skipped` holds the reason when it could not load its model."""

    def __init__(self, key: str, python: str, model_dir: str, work_dir: Path, *, threads: int, max_seq_length: int,
                 batch_size: int, log_path: Path, hint: bool):
        self.key, self.label = key, PEERS[key][1]
        self.work_dir = work_dir / key
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "w")  # the libraries' warnings and any traceback
        self.skipped: str | None = None
        self.hint = hint
        self.info: dict = {"python": python}
        self.proc = subprocess.Popen(
            [python, str(PEER_SCRIPT), PEERS[key][0], model_dir, str(self.work_dir), "--threads", str(threads),
             "--max-seq-length", str(max_seq_length), "--batch-size", str(batch_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def wait_ready(self) -> None:
        """Waits for the child to load (export) its model; it is started first so that the peers
        load side by side with the pipeline's start-up."""
        message = self._read()
        if message.get("ready"):
            self.info.update(load_s=message["load_s"], detail=message["detail"], versions=message["versions"])
            return
        self.info["versions"] = message.get("versions", {})
        self.skipped = message.get("skipped") or message.get("error", "no answer")
        if self.hint:
            self.skipped += f" ({SETUP_HINT})"
        self.close()

    def time(self, texts_file: Path, repeats: int) -> tuple[list[float], np.ndarray] | str:
        """Seconds of each repeat and the last repeat's vectors, or the error as a string."""
        out = self.work_dir / "vectors.npy"
        self.proc.stdin.write(json.dumps({"texts": str(texts_file), "out": str(out), "repeats": repeats}) + "\n")
        self.proc.stdin.flush()
        message = self._read()
        if "seconds" not in message:
            return message.get("error", "no answer")
        return message["seconds"], np.load(out)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            return {"error": f"the peer process exited ({self.proc.returncode}); see {self.log.name}"}
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def start_peers(keys: list[str], python: str | None, model_dir: str, work_dir: Path, log_dir: Path, **settings) -> list[Peer]:
    """Without `python`, the peers are tried in this interpreter (in a child, so their threads stay
    out of this process); where they do not import, the skipped row says how to set them up."""
    return [Peer(key, python or sys.executable, model_dir, work_dir, log_path=log_dir / f"peer-{key}.log",
                 hint=python is None, **settings) for key in keys]


def max_cos_deviation(vectors: np.ndarray, reference: np.ndarray) -> float:
    """max over rows of |cos(v, ref) - 1|: 0 for the same directions, whatever the norms."""
    a = np.asarray(vectors, dtype=np.float64)
    b = np.asarray(reference, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"vectors of shape {a.shape} against a reference of shape {b.shape}")
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(np.abs(cos - 1.0).max())


def parse_list(value: str, allowed, what: str) -> list[str]:
    """A comma list of names from `allowed` (argparse type helper); "none" is the empty list."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{what}: {unknown or value!r} not in {sorted(allowed)}")
    return list(dict.fromkeys(names))
