#!/usr/bin/env python
"""Audio embedding (CLAP): the pipeline against sentence-transformers 6 on the same audio files, one run,
one table.

A CLAP model of laion/clap-htsat-unfused's shape (random weights, built on the fly:
scripts/tiny_models.py `build_clap`; an HTS-AT audio tower over 48 kHz, 10 s, 64-mel features)
embeds two clip sets written here: (a) 5 s WAV files at 48 kHz (decoded, no resampling), (b) 10 s
FLAC files at 16 kHz (decoded and resampled to 48 kHz by soxr, as transformers' load_audio does on
both sides). Both sides are given the files' paths; float32 on the CPU. Per set:

* clips/s of `Pipeline.embed` (the render workers decode and run the feature extractor while the
  engine runs the audio tower) and of ST's `encode(paths, batch_size=32)` (one process: decode,
  features, forward in turn), and their ratio, taken pass by pass (each pipeline pass followed by
  one of ST on the same set; the median of the pairs' ratios);
* the largest |difference| between the two sides' vectors (they must agree within 1e-5);
* the render workers' CPU seconds per clip, the engine's busy fraction, and peak RSS of a render
  worker and of this process (the frontend's: ST runs in a child process).

    python scripts/bench_audio.py
    python scripts/bench_audio.py --clips 8 --repeats 2 --model /tmp/clap/st
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
from bench_images import STChild, measure_pipeline, paired_ratio  # noqa: E402

from pooling_pipeline import Pipeline  # noqa: E402

SETS = {"wav": ("(a) WAV 5 s, 48 kHz", 5.0, 48000, "wav"), "flac": ("(b) FLAC 10 s, 16 kHz", 10.0, 16000, "flac")}
MAX_ABS_DIFF = 1e-5


def write_clips(folder: Path, count: int) -> dict[str, list[str]]:
    """Each set's files: a few tones over noise, seeded (what decoding and the features cost does
    not depend on the sound)."""
    import soundfile

    folder.mkdir(parents=True, exist_ok=True)
    sets = {}
    for kind, (_, seconds, rate, suffix) in SETS.items():
        paths = []
        for k in range(count):
            rng = np.random.default_rng(k)
            t = np.arange(int(seconds * rate)) / rate
            samples = sum(0.2 * np.sin(2 * np.pi * f * t) for f in rng.uniform(100, 4000, 3))
            samples = (samples + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
            path = folder / f"{kind}-{k:03d}.{suffix}"
            soundfile.write(str(path), samples, rate, subtype="PCM_16")
            paths.append(str(path))
        sets[kind] = paths
    return sets


def build_model(work: Path) -> str:
    """The HTS-AT-shaped CLAP, built in a child process (this one stays free of torch)."""
    target = work / "clap-htsat"
    code = f"import tiny_models; tiny_models.build_clap({str(target)!r})"
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return str(target / "st")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a CLAP model folder (default: build the HTS-AT-shaped one)")
    ap.add_argument("--clips", type=int, default=16, help="clips per set")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None, help="render workers (default: the pipeline's plan)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-audio-"))
    model = args.model or build_model(work)
    clip_sets = write_clips(work / "clips", args.clips)
    st_child: STChild | None = None

    def st_beside(info: dict):
        nonlocal st_child
        st_child = STChild(model, int(info["engine"]["torch_threads"]), work)
        return st_child.encode_pass

    with Pipeline(model=model, dtype="float32", num_render_workers=args.workers) as pipe:
        info = {"engine": pipe.stats()["engine"], "cpu_plan": pipe.cpu_plan.as_dict()}
        print(f"pipeline: {info['engine'].get('model')}; plan {info['cpu_plan']}", flush=True)
        sides = measure_pipeline(pipe, clip_sets, args.repeats, st_beside(info))
    st_child.close()
    st_sides = st_child.sides()
    print(f"\nCLAP (HTS-AT shape, random weights), float32, torch on both sides; {platform.processor() or 'cpu'}, "
          f"{os.cpu_count()} cores; {args.clips} clips a set, median of {args.repeats} passes")
    header = ["set", "pipeline clips/s", "ST clips/s", "pipeline / ST", "max |diff|", "worker CPU s/clip",
              "engine busy", "worker RSS MB", "frontend RSS MB"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    failed = False
    for kind, side in sides.items():
        st = st_sides[kind]
        ratio = paired_ratio([st_pass.seconds for st_pass in st.passes], [p.seconds for p in side.passes])
        diff = float(np.abs(side.vectors - st.vectors).max())
        failed |= diff > MAX_ABS_DIFF
        print(f"| {SETS[kind][0]} | {side.images_per_s:.2f} | {st.images_per_s:.2f} | {ratio:.2f}x | {diff:.1e} | "
              f"{side.median('worker_cpu_s') / side.images:.3f} | {side.median('engine_busy'):.2f} | "
              f"{side.peak_rss('worker'):.0f} | {side.peak_rss('frontend'):.0f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
