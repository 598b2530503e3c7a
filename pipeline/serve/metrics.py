"""Prometheus' text format, by hand (a few counters and histograms do not need a client library):
requests by route and status, errors by kind, latency histograms, inputs and tokens, the admission
queue, and the pipeline's group counters read at scrape time."""

from __future__ import annotations

import bisect
from collections import defaultdict

# Seconds; the request latencies of an embedding server span ~1 ms (one text on a GPU) to minutes
# (a large batch on a CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value


class Metrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (route, status) -> count
        self.errors: dict[str, int] = defaultdict(int)  # kind -> count
        self.latency: dict[str, Histogram] = {}
        self.inputs = 0
        self.prompt_tokens = 0
        self.disconnects = 0

    def observe(self, route: str, status: int, seconds: float, timed: bool = True) -> None:
        """A request answered; `timed`: its latency goes in the route's histogram (the model's routes)."""
        self.requests[(route, status)] += 1
        if not timed:
            return
        hist = self.latency.get(route)
        if hist is None:
            hist = self.latency[route] = Histogram(LATENCY_BUCKETS)
        hist.observe(seconds)

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """The exposition text; `gauges`: name -> (help, value), read from the pipeline now."""
        out = ["# HELP pipeline_requests_total HTTP requests answered, by route and status code.",
               "# TYPE pipeline_requests_total counter"]
        for (route, status), n in sorted(self.requests.items()):
            out.append(f'pipeline_requests_total{{route="{route}",status="{status}"}} {n}')
        out += ["# HELP pipeline_errors_total Requests answered with an error, by kind.",
                "# TYPE pipeline_errors_total counter"]
        for kind, n in sorted(self.errors.items()):
            out.append(f'pipeline_errors_total{{kind="{kind}"}} {n}')
        out += ["# HELP pipeline_request_duration_seconds Time from a request's arrival to its answer.",
                "# TYPE pipeline_request_duration_seconds histogram"]
        for route, hist in sorted(self.latency.items()):
            running = 0
            for bound, n in zip((*hist.buckets, float("inf")), hist.counts):
                running += n
                le = "+Inf" if bound == float("inf") else repr(bound)
                out.append(f'pipeline_request_duration_seconds_bucket{{route="{route}",le="{le}"}} {running}')
            out.append(f'pipeline_request_duration_seconds_sum{{route="{route}"}} {hist.sum:.6f}')
            out.append(f'pipeline_request_duration_seconds_count{{route="{route}"}} {running}')
        for name, help_text, value in (("pipeline_inputs_total", "Inputs (texts, pairs, images) served.", self.inputs),
                                       ("pipeline_prompt_tokens_total", "Prompt tokens the model saw.",
                                        self.prompt_tokens),
                                       ("pipeline_client_disconnects_total",
                                        "Requests whose client left before the answer (their work aborted).",
                                        self.disconnects)):
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        for name, (help_text, value) in gauges.items():
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value:g}"]
        return "\n".join(out) + "\n"
