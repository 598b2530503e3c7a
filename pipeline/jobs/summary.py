"""The end-of-run report of pipeline-run, for a local job and for a Ray job alike: aligned rows,
then the call's details, then one closing line.

Its own module so the launcher and the Ray job (which the launcher starts) both use it without
importing each other.
"""

from __future__ import annotations

from pooling_pipeline.jobs.output_dir import META_DIR
from pooling_pipeline.jobs.results_store import ERRORS


def print_summary(rows: list[tuple[str, str]], records: int, details: list[str] = ()) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for line in details:
        print(line)
    print(f"embedded {records} records")


def print_local_summary(manifest: dict, stats: dict, out_dir: str, details: list[str], verbose: bool = False) -> None:
    """A local run: what a user reads -- records, time, rate, errors, where the output is; with
    `verbose` (--verbose) also tokens, engine load, padding and memory, then the call's statistics
    (`details`: stage busy times, queue depth histograms)."""
    m = manifest
    wall = stats["wall_s"]
    done = stats["records_this_run"]
    rows = [
        ("records (this run)", f"{done}"),
        ("records in output", f"{m['rows']} ({m['errors']} failed)"),
        ("wall time", f"{wall:.1f} s (+ {stats['startup_s']:.1f} s start-up)"),
        ("throughput", f"{done / max(wall, 1e-9):.1f} records/s, "
                       f"{stats['tokens'] / max(wall, 1e-9):,.0f} tokens/s"),
        ("errors", f"{m['errors']}" + (f" (see {ERRORS})" if m["errors"] else "")),
        ("output", f"{out_dir}/ (metadata in {META_DIR}/)"),
    ]
    if verbose:
        rss = stats["peak_rss_mb"]
        rows[4:4] = [
            ("tokens", f"{stats['tokens']:,}"),
            ("engine busy", f"{stats['engine_busy_fraction']:.0%}"),
            ("padding efficiency", f"{1 - stats['padding_fraction']:.0%}"),
            ("peak RSS", f"frontend {rss['frontend'] or 0:.0f} MB, "
                         + (f"engine {rss['engine'] or 0:.0f} MB" if len(rss.get("engines") or [0]) <= 1 else
                            "engines " + ", ".join(f"{e or 0:.0f} MB" for e in rss["engines"]))
                         + ", workers " + ", ".join(f"{w:.0f} MB" for w in rss["workers"] if w is not None)),
        ]
    print_summary(rows, stats["records"], details if verbose else [])


def print_ray_summary(manifest: dict, plan: dict, wall: float, tokens: int, out_dir) -> None:
    """A Ray job: records, the actor pool, throughput."""
    rate = manifest["records_done"] / max(wall, 1e-9)
    print_summary([
        ("records", f"{manifest['records_done']} ({manifest['errors']} failed)"),
        ("Ray actors", f"{plan['actors']} x ({plan['num_cpus']} CPU" + (", 1 GPU)" if plan["num_gpus"] else ")")),
        ("wall time", f"{wall:.1f} s"),
        ("throughput", f"{rate:.1f} records/s, {tokens / max(wall, 1e-9):,.0f} tokens/s"),
        ("errors", f"{manifest['errors']}" + (" (see errors.jsonl)" if manifest["errors"] else "")),
        ("output", f"{out_dir}/"),
    ], manifest["rows"])
