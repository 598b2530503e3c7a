"""scripts/device_check.py, the one-run GPU check: its arguments, its plan, its table, its deadlines, and
part (a)'s comparison run on the CPU (float32 against float32), so a GPU session only has to run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import device_check as dc
import psutil
import pytest
from helpers import ROOT, wait_gone

SCRIPT = ROOT / "scripts" / "device_check.py"


def run_script(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # CUDA hidden, so that on a GPU machine too this is the "no device" path unless a test forces the CPU.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def test_without_cuda_it_says_so_and_exits_0():
    result = run_script()
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == dc.NO_CUDA


def test_dry_run_prints_every_part_with_its_commands_and_budget():
    result = run_script("--dry-run", "--workers", "1,3", "--budget-s", "bench=33", "--max-minutes", "5")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "hard deadline 300 s" in out
    assert "part dtype: budget 90 s" in out and "part bench: budget 33 s" in out and "part loadtest: budget 145 s" in out
    assert "part images: budget 95 s" in out and "budgets 363 s in all" in out
    assert "device_check.py --internal dtype" in out
    assert "device_check.py --internal build-model" in out
    assert "bench_embed.py --device cuda --dtype float16 --model" in out and "--medium-chars 2400 4000" in out
    for w in (1, 3):
        assert f"loadtest.py --regime real --device cuda --workers {w} " in out
    assert "--workers 14" not in out
    assert "device_check.py --internal build-clip --model-dir" in out
    assert "loadtest.py --regime images --model" in out and "--device cuda --dtype float16 --workers 3 --images 100" in out


def test_dry_run_of_some_parts_plans_only_those():
    out = run_script("--dry-run", "--parts", "loadtest,dtype").stdout
    assert "part dtype" in out and "part loadtest" in out and "part bench" not in out and "part images" not in out
    assert out.index("part dtype") < out.index("part loadtest")  # run in their fixed order
    out = run_script("--dry-run", "--parts", "images").stdout
    assert "part images" in out and "part loadtest" not in out


@pytest.mark.parametrize("args, names", [
    (["--parts", "dtype,gpu"], ["--parts", "'gpu'"]),
    (["--parts", ""], ["--parts"]),
    (["--budget-s", "bench=0"], ["--budget-s", "positive"]),
    (["--budget-s", "bench=-5"], ["--budget-s", "positive"]),
    (["--budget-s", "bench"], ["--budget-s", "PART=SECONDS"]),
    (["--budget-s", "gpu=10"], ["--budget-s", "'gpu'"]),
    (["--max-minutes", "9"], ["--max-minutes", "(0, 8]"]),
    (["--max-minutes", "0"], ["--max-minutes"]),
    (["--workers", "1,two"], ["--workers", "integers"]),
    (["--workers", "0,4"], ["--workers", "at least 1"]),
    (["--workers", "4,4"], ["--workers", "repeated"]),
    (["--texts", "0"], ["--texts"]),
    (["--force-device", "cpu"], ["--force-device", "--parts dtype"]),
    (["--internal", "build-clip", "--model-dir", "m"], ["--image-folder"]),
])
def test_a_bad_argument_is_exit_2_naming_it(args, names):
    result = run_script(*args, "--dry-run")
    assert result.returncode == 2, (result.stdout, result.stderr)
    for name in names:
        assert name in result.stderr


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


def rows_step(tmp_path, name: str, rows: list[dict], rc: int = 0) -> dc.Step:
    out = tmp_path / f"{name}.json"
    code = f"import json, sys; open({str(out)!r}, 'w').write(json.dumps({{'rows': {rows!r}}})); sys.exit({rc})"
    return dc.Step(name, [sys.executable, "-c", code], out, "rows")


def test_a_part_goes_on_after_a_failure_only_when_its_steps_are_independent(tmp_path):
    ok = {"check": "c1", "figure": "1", "target": "-", "result": "pass"}
    failing = dc.Step("broken step", [sys.executable, "-c", "raise SystemExit('it broke')"], tmp_path / "none.json", "rows")
    later = rows_step(tmp_path, "later", [ok])
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    rows = dc.run_part(dc.Part("p", 60, [failing, later], independent=True, cleanup=[scratch]), dc.Deadline(60), tmp_path)
    assert [(r.check, r.result) for r in rows] == [("broken step", "error"), ("c1", "pass")]
    assert "it broke" in rows[0].figure
    assert not scratch.exists()
    rows = dc.run_part(dc.Part("p", 60, [failing, later]), dc.Deadline(60), tmp_path)
    assert [(r.check, r.result) for r in rows] == [("broken step", "error")]


def test_a_step_that_exits_0_without_its_result_is_an_error(tmp_path):
    step = dc.Step("silent", [sys.executable, "-c", "print('done')"], tmp_path / "missing.json", "rows")
    rows = dc.run_part(dc.Part("p", 60, [step]), dc.Deadline(60), tmp_path)
    assert [(r.check, r.result) for r in rows] == [("silent", "error")]
    assert "without writing missing.json" in rows[0].figure


def bench_record(busy: float) -> dict:
    """What bench_embed.py writes (its keys, as measure_case and main build them), one backend."""
    return {"engine": {"device": "cuda:0", "dtype": "float16"}, "backends": ["auto"],
            "results": [{"case": "b", "docs": 2000, "kept_tokens": 2000 * 512,
                         "per_backend": {"auto": {"engine_busy": busy}},
                         "docs_per_s": {"pipeline (auto)": 3000.0, "pipeline (auto), token ids": 3050.0,
                                        "sentence_transformers": 2000.0, "forward_limit": 3100.0,
                                        "forward_limit (auto)": 3100.0}}]}


def test_bench_rows_report_throughput_and_hold_engine_busy_to_its_target():
    info, busy = dc.bench_rows(bench_record(0.97))
    assert "512 tokens/doc" in info.check and "float16 on cuda:0" in info.check
    assert info.figure.startswith("3,000 docs/s (1,536,000 tokens/s)") and info.result == "info"
    assert (busy.figure, busy.target, busy.result) == ("97.0%", ">= 95%", "pass")
    assert dc.bench_rows(bench_record(0.94))[1].result == "FAIL"


def test_bench_rows_name_the_model_by_its_config(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "num_hidden_layers": 12, "hidden_size": 768}')
    info, _ = dc.bench_rows({**bench_record(0.97), "model": str(tmp_path)})
    assert info.check.startswith("bench: BERT 12 x 768, float16 on cuda:0")
    assert dc.model_shape(str(tmp_path / "gone")) == "model"


def test_loadtest_rows_say_when_the_run_was_cut_by_its_time_cap():
    run = {"requests_per_s": 12345.6, "engine_busy": 0.81, "complete": True, "requests": 30000}
    (row,) = dc.loadtest_rows({"runs": [run]}, "loadtest: 4 workers")
    assert (row.check, row.figure, row.result) == ("loadtest: 4 workers", "12,346 docs/s, engine busy 81%", "pass")
    (row,) = dc.loadtest_rows({"runs": [{**run, "complete": False, "requests": 9000}]}, "w")
    assert "9,000 docs: the run's time cap" in row.figure
    (row,) = dc.loadtest_rows({"runs": [run]}, "images: 14 workers", "images")
    assert row.figure == "12,346 images/s, engine busy 81%"
    # The first run on a GPU read "engine busy 170%" for images (each step counted twice): a failed row.
    (row,) = dc.loadtest_rows({"runs": [{**run, "engine_busy": 1.7}]}, "images: 14 workers", "images")
    assert (row.figure, row.result) == ("12,346 images/s, engine busy 170%", "FAIL")


def test_compare_rows_hold_cosine_and_abs_diff_to_their_targets():
    import numpy as np

    ref = np.random.default_rng(0).standard_normal((50, 384)).astype(np.float32)
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    half = ref.astype(np.float16).astype(np.float32)  # what float16 rounding alone does: well within the target
    (cos,) = dc.compare_rows("half", ref, half, ("cosine",))
    assert cos.check == "half: min cosine" and cos.result == "pass" and float(cos.figure) >= 0.9999
    bent = ref.copy()
    bent[7] = np.roll(bent[7], 1)  # one embedding wrong
    cos, diff = dc.compare_rows("bent", ref, bent, ("cosine", "max_abs"))
    assert cos.result == "FAIL" and diff.result == "FAIL" and float(diff.figure) > 1e-2
    (same,) = dc.compare_rows("same", ref, ref.copy(), ("max_abs",))
    assert (same.figure, same.result) == ("0.00e+00", "pass")
    with pytest.raises(ValueError, match="unknown metric"):
        dc.compare_rows("x", ref, ref, ("l2",))


def test_the_bench_model_is_a_sentence_transformers_folder_kept_to_512_tokens(tmp_path):
    from pooling_pipeline.core.model_folder.load import load_model_spec

    path = dc.build_base_model(tmp_path / "model", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_size=64)
    assert (tmp_path / "model" / "modules.json").exists()
    spec = load_model_spec(path)
    assert (spec.default_max_tokens, spec.max_model_len, spec.hidden_size) == (512, 512, 32)
    assert spec.normalize and spec.pooling.modes == ["mean"]


@pytest.mark.slow
def test_part_a_on_the_cpu_compares_float32_with_float32_and_prints_the_table(tmp_path):
    """The real comparison path through the step subprocess: the reference Pipeline (float32 on the CPU)
    embeds the texts twice, and the two are compared as part (a) compares float16 with float32."""
    table_file = tmp_path / "table.md"
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # (the session's shared Pipeline may be up)
    # A budget far above what it needs: this machine may be shared, and a timeout here would be a flaky failure.
    result = run_script("--parts", "dtype", "--force-device", "cpu", "--texts", "20", "--out", str(table_file),
                        "--budget-s", "dtype=400", timeout=450)
    assert result.returncode == 0, result.stdout + result.stderr
    table = table_file.read_text()
    assert table in result.stdout
    assert "| dtype: float32 on cpu vs float32 on cpu, 20 texts: min cosine | 1.000000 | >= 0.9999 | pass |" in table
    # Not bit-equal: the two runs may batch the texts differently (other padding, other summation order).
    (diff_row,) = [line for line in table.splitlines() if "20 texts: max abs diff" in line]
    _, check, figure, target, verdict, _ = diff_row.split("|")
    assert float(figure) < 1e-5 and target.strip() == "<= 1e-04" and verdict.strip() == "pass"
    leftovers = [p for p in psutil.Process().children(recursive=True)
                 if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert leftovers == []


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


def test_every_command_of_the_plan_is_accepted_by_its_script(tmp_path):
    """A flag a script does not know would cost a GPU session its run: each step's arguments go through
    the parser of the script it calls."""
    import bench_embed
    import loadtest

    parsers = {"bench_embed.py": bench_embed.build_parser(), "loadtest.py": loadtest.build_parser(),
               "device_check.py": dc.build_parser()}
    parts = dc.make_plan(dc.parse_args(["--workers", "1,14"]), tmp_path)
    parsed = {}
    for step in (s for p in parts for s in p.steps):
        script = step.argv[1].rsplit("/", 1)[-1]
        parsed.setdefault(script, []).append(parsers[script].parse_args(step.argv[2:]))
    bench = parsed["bench_embed.py"][0]
    assert (bench.device, bench.model, bench.medium_chars, bench.no_decoder) == ("cuda", str(tmp_path / "bert-base"),
                                                                                [2400, 4000], True)
    assert [(a.regime, a.device, a.workers) for a in parsed["loadtest.py"]] == [("real", "cuda", [1]), ("real", "cuda", [14]),
                                                                              ("images", "cuda", [14])]
    images = parsed["loadtest.py"][-1]
    assert (images.model, images.dtype, images.image_folder) == (str(tmp_path / "clip-b32" / "st"), "float16",
                                                                 str(tmp_path / "images"))
    assert sorted(a.internal for a in parsed["device_check.py"]) == ["build-clip", "build-model", "dtype", "images-st"]


def test_loadtest_image_capacity_is_a_gpus_images_per_s_over_what_one_worker_core_feeds():
    import loadtest

    from pooling_pipeline.core.sim_device import SIM_PRESETS

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


@pytest.mark.slow
def test_the_images_comparison_with_st_runs_on_a_cpu(tmp_path, monkeypatch):
    """The images part's first step (the pipeline against ST with the image processor transformers
    picks in the environment), on a tiny CLIP and a few JPEGs: its rows name the processor and pass."""
    from image_set import build_image_set
    from model_zoo import build_clip

    monkeypatch.setattr(dc, "IMAGES_ST_COUNT", 3)
    model = build_clip(tmp_path / "clip", layout="st")
    build_image_set(tmp_path / "images", "web", 4)
    out = tmp_path / "images-st.json"
    dc.images_st_check(Path(model), tmp_path / "images", out)
    rows = [dc.Row(**r) for r in json.loads(out.read_text())["rows"]]
    assert rows[0].result == "info" and "CLIPImageProcessor" in rows[0].figure
    assert [r.check.split(", ")[0] for r in rows[1:]] == ["images: 3 JPEGs by path", "images: 3 JPEGs PIL images",
                                                          "images: 3 JPEGs arrays"]
    assert all(r.result == "pass" for r in rows[1:]), rows
