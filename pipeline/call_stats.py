"""Where a call's time went: per-stage busy time, padding, and queue depth histograms.

Every number is measured where the work happens and reaches the frontend in-band, so it is
exact for the call and costs nothing extra on the wire:

* frontend: time the call loop spends working (building and sending requests, decoding and
  reordering results), not waiting on sockets or on the caller;
* render workers: tokenization time, reported by each worker with its inputs to the engine and
  passed on with the engine's next output batch;
* engine: time admitting inputs (decode, validation) and time in steps (forward and pooling).
  With data-parallel engine cores the busy fractions are the mean over the engine cores (busy
  seconds / (wall time x engine cores)); `per_engine` has each one's requests, batches and busy time.

Queue depths are sampled once per output batch: requests in the engine's admission window,
requests in flight in the frontend's window, results waiting in the reorder buffer, and the
batch size itself. `format_stats` turns it all into a few lines for people.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


class DepthHistogram:
    """Counts of a non-negative integer in power-of-two buckets: 0, 1, 2-3, 4-7, ..."""

    def __init__(self) -> None:
        self.counts: list[int] = [0] * 48
        self.samples = 0
        self.total = 0
        self.max = 0

    def add(self, value: int) -> None:
        value = max(0, int(value))
        self.counts[min(value.bit_length(), len(self.counts) - 1)] += 1
        self.samples += 1
        self.total += value
        self.max = max(self.max, value)

    @staticmethod
    def bucket_label(index: int) -> str:
        if index <= 1:
            return str(index)
        return f"{1 << (index - 1)}-{(1 << index) - 1}"

    def as_dict(self) -> dict:
        return {"samples": self.samples, "mean": self.total / self.samples if self.samples else 0.0,
                "max": self.max,
                "buckets": {self.bucket_label(i): c for i, c in enumerate(self.counts) if c}}


QUEUES = ("engine_window", "frontend_inflight", "reorder_buffer", "batch_size")


@dataclass
class CallStats:
    start: float = field(default_factory=time.perf_counter)
    wall_s: float = 0.0
    frontend_busy_s: float = 0.0
    render_busy_s: dict[int, float] = field(default_factory=dict)  # per worker
    engine_admit_s: float = 0.0
    engine_busy_s: float = 0.0  # in steps
    requests: int = 0
    prompt_tokens: int = 0
    padded_tokens: int = 0
    batches: int = 0
    max_inflight_seen: int = 0
    max_in_core_seen: int = 0
    duplicates_dropped: int = 0
    worker_restarts: int = 0
    engine_restarts: int = 0  # engine cores lost (and restarted) while the call ran
    errors: int = 0
    engines: int = 1  # engine cores of the group (data_parallel_size)
    requests_per_engine: dict[int, int] = field(default_factory=dict)
    engine_busy_per_engine: dict[int, float] = field(default_factory=dict)  # (kept with several engines)
    batches_per_engine: dict[int, int] = field(default_factory=dict)  # (kept with several engines)
    depths: dict[str, DepthHistogram] = field(default_factory=lambda: {q: DepthHistogram() for q in QUEUES})

    def as_dict(self) -> dict:
        wall = self.wall_s or (time.perf_counter() - self.start)

        def fraction(seconds: float, lanes: int = 1) -> float:
            return seconds / (wall * lanes) if wall > 0 and lanes else 0.0

        render_total = sum(self.render_busy_s.values())
        workers = len(self.render_busy_s)
        engines = self.engines
        if engines == 1:
            busy, batches = {0: self.engine_busy_s}, {0: self.batches}
        else:
            busy, batches = self.engine_busy_per_engine, self.batches_per_engine
        per_engine = [{"requests": self.requests_per_engine.get(k, 0), "batches": batches.get(k, 0),
                       "busy_s": busy.get(k, 0.0), "busy_fraction": fraction(busy.get(k, 0.0))}
                      for k in range(engines)]
        return {
            "wall_s": wall,
            "engine_busy_s": self.engine_busy_s,  # all engine cores together
            "engine_busy_fraction": fraction(self.engine_busy_s, engines),  # the mean over engine cores
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "padded_tokens": self.padded_tokens,
            "padding_fraction": 1 - self.prompt_tokens / self.padded_tokens if self.padded_tokens else 0.0,
            "padding_efficiency": self.prompt_tokens / self.padded_tokens if self.padded_tokens else 1.0,
            "batches": self.batches,
            "requests_per_s": self.requests / wall if wall > 0 else 0.0,
            "tokens_per_s": self.prompt_tokens / wall if wall > 0 else 0.0,
            "max_inflight_seen": self.max_inflight_seen,
            "max_in_core_seen": self.max_in_core_seen,
            "duplicates_dropped": self.duplicates_dropped,
            "worker_restarts": self.worker_restarts,
            "engine_restarts": self.engine_restarts,
            "errors": self.errors,
            "data_parallel_size": engines,
            "per_engine": per_engine,
            # busy_fraction: of the wall time, per lane (one lane per worker for the workers, per
            # engine core for the engine's stages).
            "stages": {
                "frontend": {"busy_s": self.frontend_busy_s, "busy_fraction": fraction(self.frontend_busy_s)},
                "render": {"busy_s": render_total, "busy_fraction": fraction(render_total, workers),
                           "per_worker_busy_s": {str(k): v for k, v in sorted(self.render_busy_s.items())}},
                "engine_admit": {"busy_s": self.engine_admit_s, "busy_fraction": fraction(self.engine_admit_s, engines)},
                "engine_step": {"busy_s": self.engine_busy_s, "busy_fraction": fraction(self.engine_busy_s, engines)},
            },
            "queue_depths": {name: hist.as_dict() for name, hist in self.depths.items()},
        }


def format_stats(stats: dict) -> list[str]:
    """The stage times, padding and queue depths of `Pipeline.stats()` as lines of text."""
    stages = stats["stages"]
    per_worker = " ".join(f"{float(v):.1f}" for v in stages["render"]["per_worker_busy_s"].values())
    lines = [
        "stage busy (fraction of wall time): "
        f"frontend {stages['frontend']['busy_fraction']:.0%} | "
        f"render workers {stages['render']['busy_fraction']:.0%} each on average"
        + (f" ({per_worker} s)" if per_worker else "") + " | "
        f"engine admit {stages['engine_admit']['busy_fraction']:.0%} | "
        f"engine steps {stages['engine_step']['busy_fraction']:.0%}"
        + (f" (mean of {stats['data_parallel_size']} engine cores: "
           + " ".join(f"{e['busy_fraction']:.0%}" for e in stats.get("per_engine", [])) + ")"
           if stats.get("data_parallel_size", 1) > 1 else ""),
        f"padding efficiency (real / padded tokens): {stats['padding_efficiency']:.1%} "
        f"over {stats['batches']} batches",
    ]
    for name, hist in stats["queue_depths"].items():
        if not hist["samples"]:
            continue
        total = hist["samples"]
        buckets = " ".join(f"{label}:{count / total:.0%}" for label, count in hist["buckets"].items()
                           if count / total >= 0.005)
        lines.append(f"{name.replace('_', ' ')}: mean {hist['mean']:.0f}, max {hist['max']} | {buckets}")
    return lines
