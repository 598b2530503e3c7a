"""The OpenVINO conversion cache never serves anything but the model on disk, and never stops a run
(issue 35, items 1, 2, 4, 5): a damaged or truncated entry is removed and rebuilt, naming it; a
model rewritten in place (size and modification time kept) gets a conversion of its own; a cache
that cannot be written serves the conversion from memory; OpenVINO failing under `auto` runs torch.
With the openvino extra absent there is no cache: what holds then is asserted instead (no skips)."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import corpus
import numpy as np
import pytest
from helpers import rewrite_in_place
from tiny_models import build_bert

from pooling_pipeline import Pipeline

HAVE_OPENVINO = importlib.util.find_spec("openvino") is not None
TOL = 1e-5
TEXTS = corpus.sentences(16, seed=101) + corpus.medium_texts(3, seed=102)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("POOLING_PIPELINE_CACHE", str(root))
    return root


@pytest.fixture
def model(tmp_path) -> Path:
    return Path(build_bert(tmp_path / "model"))


def reference(model: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model), device="cpu").encode(TEXTS)


def run(model: Path, backend: str = "auto") -> tuple[dict, np.ndarray]:
    with Pipeline(model=str(model), backend=backend, num_render_workers=1) as pipe:
        vectors = np.stack([o.embedding for o in pipe.embed(TEXTS, use_tqdm=False)])
        return pipe.stats()["engine"], vectors


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert float(np.abs(got - want).max()) <= TOL


@pytest.mark.slow
def test_without_openvino_auto_runs_torch(cache, model):
    if HAVE_OPENVINO:
        engine, _ = run(model)
        assert engine["backend"] == "openvino" and engine["conversion"] == "converted"
        assert (Path(engine["conversion_cache"]) / "checksums.json").is_file()
        return
    engine, got = run(model)
    assert engine["backend"] == "torch"
    assert_close(got, reference(model))
    assert not cache.exists()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["changed", "truncated"])
def test_a_damaged_entry_is_removed_and_rebuilt(cache, model, caplog, damage):
    if not HAVE_OPENVINO:
        with pytest.raises(ValueError, match="openvino"):
            Pipeline(model=str(model), backend="openvino")
        return
    first, want = run(model, "openvino")
    entry = Path(first["conversion_cache"])
    weights = entry / "model.bin"
    if damage == "changed":  # the same size, some weights altered
        rewrite_in_place(weights)
    else:
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        second, got = run(model, "openvino")
    err = caplog.text
    assert second["conversion"] == "converted", second  # rebuilt, not served
    assert f"cached OpenVINO conversion {entry} is damaged" in err and "converting the model again" in err, err
    assert_close(got, want)
    assert_close(got, reference(model))
    third, _ = run(model, "openvino")  # the rebuilt entry serves the next start
    assert third["conversion"] == "cached"


@pytest.mark.slow
def test_a_model_rewritten_in_place_is_converted_anew(cache, model):
    """Weights changed in place with their size and modification time kept: the key covers the
    content, so the old model's conversion is not served; the results are the new model's."""
    if not HAVE_OPENVINO:
        engine, got = run(model)
        rewrite_in_place(model / "model.safetensors")
        assert_close(run(model)[1], reference(model))
        return
    first, before = run(model)
    rewrite_in_place(model / "model.safetensors")
    want = reference(model)
    assert float(np.abs(want - before).max()) > 1e-3  # the rewrite changed the model
    second, got = run(model)
    assert second["conversion"] == "converted" and second["conversion_cache"] != first["conversion_cache"]
    assert_close(got, want)


@pytest.mark.slow
def test_the_same_transformer_under_another_name_pooling_and_prompts_reuses_its_checked_conversion(cache, tmp_path):
    """The key covers what shapes the transformer's graph -- its config, weights, model_args, the
    module class -- not the folder's name, the tokenizer files, the prompts or the other modules'
    own folders: the same weights under another pooling, with prompts, in a folder of another name,
    start from the cached conversion and its remembered check (the torch module is not even built),
    and give their own results (ST's, prompt included)."""
    import model_zoo as zoo

    first_model = zoo.build_bert_pooling(tmp_path / "a", "cls")
    other = zoo.build_bert_prompts(tmp_path / "b", pooling_mode="max")
    for name in ("config.json", "model.safetensors"):  # the same transformer (the zoo's seeded backbone)
        assert (Path(first_model) / name).read_bytes() == (Path(other) / name).read_bytes()
    assert Path(first_model).name != Path(other).name
    first, _ = run(Path(first_model))
    second, got = run(Path(other))
    if not HAVE_OPENVINO:
        assert first["backend"] == second["backend"] == "torch"
    else:
        assert first["conversion"] == "converted" and second["conversion"] == "cached"
        assert second["conversion_cache"] == first["conversion_cache"] and second["torch_module"] == "not built"
    assert_close(got, reference(Path(other)))
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(other, device="cpu")
    name = "passage"  # (the default prompt is "query")
    with Pipeline(model=other, num_render_workers=1) as pipe:
        prompted = np.stack([o.embedding for o in pipe.embed(TEXTS, prompt_name=name, use_tqdm=False)])
    want = st.encode(TEXTS, prompt_name=name)
    assert float(np.abs(want - reference(Path(other))).max()) > 1e-3  # the prompt matters
    assert_close(prompted, want)


@pytest.mark.parametrize("how", ["cache is a file", "openvino folder is a file"])
def test_an_unwritable_cache_never_stops_the_run(cache, model, caplog, how):
    if how == "cache is a file":
        cache.write_text("not a folder\n")
    else:
        cache.mkdir()
        (cache / "openvino").write_text("not a folder\n")
    with caplog.at_level(logging.WARNING):
        engine, got = run(model)
    assert_close(got, reference(model))
    if HAVE_OPENVINO:
        assert engine["backend"] == "openvino" and engine["conversion"] == "converted"
        assert engine["conversion_cache"] == "not cached (see the warning)"
        assert "could not cache the OpenVINO conversion" in caplog.text and str(cache) in caplog.text


def test_a_failing_write_is_a_warning_not_a_failure(tmp_path, caplog):
    """What a full disk or a file-size limit gives OpenVINO's writer (a RuntimeError, not an OSError)."""
    from pooling_pipeline.core.engine import openvino_model

    class FailingWriter:
        @staticmethod
        def save_model(*args, **kwargs):
            raise RuntimeError("basic_ios::clear: iostream error")

    assert openvino_model.save_entry(FailingWriter, object(), str(tmp_path / "openvino" / "entry"), "key") is False
    assert "basic_ios::clear" in caplog.text
    assert not (tmp_path / "openvino" / "entry").exists()
    assert not [p for p in (tmp_path / "openvino").iterdir() if p.name.startswith(".converting-")]


def test_auto_runs_torch_when_openvino_itself_fails(model, monkeypatch):
    """Not only a refused conversion: any failure of OpenVINO under auto leaves the torch module
    running, with the reason; backend='openvino' refuses, naming it."""
    from pooling_pipeline.core.engine import model_runner, openvino_model
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    def broken(*args, **kwargs):
        raise RuntimeError("Exception from src/inference/src/cpp/core.cpp: out of memory")

    monkeypatch.setattr(openvino_model, "to_openvino", broken)
    spec = load_model_spec(str(model))
    runner = model_runner.ModelRunner(spec, "cpu", "auto", backend="auto")
    assert runner.backend_info["backend"] == "torch"
    assert "OpenVINO failed: RuntimeError" in runner.backend_info["openvino_refused"]
    if HAVE_OPENVINO:
        with pytest.raises(ValueError, match="cannot run model .*out of memory"):
            model_runner.ModelRunner(spec, "cpu", "auto", backend="openvino")


@pytest.mark.slow
def test_the_check_of_a_cached_entry_is_remembered_for_its_files_and_versions(cache, model):
    """A start from a cached entry does not repeat the check against the torch module that the
    entry passed (the results stay the model's); a check recorded for other files, other library
    versions or another CPU is made again."""
    if not HAVE_OPENVINO:
        with pytest.raises(ValueError, match="openvino"):
            Pipeline(model=str(model), backend="openvino")
        return
    import json

    first, want = run(model, "openvino")
    assert first["verification"] == "checked" and "torch_module" not in first
    second, got = run(model, "openvino")
    assert second["conversion"] == "cached" and second["verification"] == "remembered", second
    assert second["verified_max_diff"] == first["verified_max_diff"] and second["verify_s"] == 0
    # Nothing needed the torch module's weights: it was not built (the entry told the token-type input).
    assert second["torch_module"] == "not built"
    assert_close(got, reference(model))
    auto, got = run(model, "auto")
    assert auto["backend"] == "openvino" and auto["torch_module"] == "not built"
    assert_close(got, want)
    verified = Path(first["conversion_cache"]) / "verified.json"
    record = json.loads(verified.read_text())
    for field, other in (("cpu", "another-cpu"), ("files", {"model.xml": "0", "model.bin": "0"}), ("torch", "0.0")):
        verified.write_text(json.dumps({**record, "identity": {**record["identity"], field: other}}))
        again, got = run(model, "openvino")
        assert again["verification"] == "checked" and "torch_module" not in again, (field, again)
        assert_close(got, want)


# Staging folders left by writers killed mid-save (issue 48, item 9). A conversion is written into a
# `.converting-*` folder beside its entry and renamed into place when whole; a writer killed before
# the rename left that folder (the model's size) for ever, outside the 16-entry bound. Each is now
# named for its writer (pid, start time, boot and pid namespace) and removed once the writer is
# proven dead -- never a live writer's -- or, where no proof can be had, once untouched for a day.

# Converts the model in argv[1] into $POOLING_PIPELINE_CACHE as the engine does (ModelRunner), and
# stops for good right after OpenVINO has written the conversion into its staging folder.
CONVERT_AND_STOP_IN_STAGING = """
import sys, time
import openvino
from pooling_pipeline.core.shared.model_folder.load import load_model_spec
from pooling_pipeline.core.engine.model_runner import ModelRunner

write = openvino.save_model

def write_then_stop(model, path, *args, **kwargs):
    write(model, path, *args, **kwargs)
    print("staged", path, flush=True)
    time.sleep(600)

openvino.save_model = write_then_stop
ModelRunner(load_model_spec(sys.argv[1]), "cpu", "auto", backend="openvino")
"""

# An engine's shape in miniature: a child of the caller (argv[1]) that leaves through the parent
# watchdog (core/runtime.exit_with_parent) when the caller dies, here while it is saving a
# conversion into the cache folder argv[2]. Started by CALLER.
SAVE_UNDER_WATCHDOG = """
import os, sys, time
from pooling_pipeline.core.shared.runtime import exit_with_parent
from pooling_pipeline.core.engine.openvino_model import save_entry

class StopsWhileWriting:
    @staticmethod
    def save_model(model, path, compress_to_fp16):
        with open(path, "wb") as f:
            f.write(bytes(1 << 20))
        print("staged", path, flush=True)
        time.sleep(600)

exit_with_parent(int(sys.argv[1]))
save_entry(StopsWhileWriting, object(), sys.argv[2], "key")
"""
CALLER = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]])
time.sleep(600)
"""


def staging_folders(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.name.startswith(".converting-")) if parent.is_dir() else []


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def read_line(proc, timeout_s: float = 300.0) -> str:
    """The child's next line of output; a child that says nothing in time (it failed) fails the test."""
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    assert line, f"the child said nothing (exit code {proc.poll()}): {proc.stderr.read() if proc.poll() else ''}"
    return line.strip()


def sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def put_staging(parent: Path, prefix: str, name: str = "x") -> Path:
    folder = parent / f"{prefix}{name}"
    folder.mkdir(parents=True)
    (folder / "model.bin").write_bytes(bytes(1 << 20))
    return folder


@pytest.mark.slow
def test_a_conversion_interrupted_while_saving_leaves_nothing_behind(cache, model):
    """Writers SIGKILLed mid-save (each after OpenVINO wrote the whole conversion into its staging
    folder): while one lives, its folder is kept by every sweep (two processes may convert at once);
    once it is dead, the next conversion in the cache removes what it left -- the next writer's, and
    the last start's, which then holds its entry only."""
    from pooling_pipeline.core.engine.openvino_model import MAX_CACHE_ENTRIES, prune_cache
    from pooling_pipeline.core.shared import staging

    if not HAVE_OPENVINO:
        with pytest.raises(ValueError, match="openvino"):
            Pipeline(model=str(model), backend="openvino")
        return
    parent = cache / "openvino"
    env = {**os.environ, "POOLING_PIPELINE_CACHE": str(cache)}
    left: list[Path] = []
    for _ in range(2):
        writer = subprocess.Popen([sys.executable, "-c", CONVERT_AND_STOP_IN_STAGING, str(model)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            folder = Path(read_line(writer).split(" ", 1)[1]).parent
            assert folder.parent == parent and staging.owner_of(folder.name) == staging.process_owner(writer.pid)
            # The previous writer's folder went when this one's conversion started; this one's lives.
            assert staging_folders(parent) == [folder], (left, staging_folders(parent))
            assert prune_cache(str(parent), MAX_CACHE_ENTRIES) == [] and folder.is_dir()
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.communicate()
        assert staging_folders(parent) == [folder]  # what the kill left
        left.append(folder)
    leaked = disk_bytes(parent)
    engine, got = run(model, "openvino")
    assert engine["conversion"] == "converted"
    entry = Path(engine["conversion_cache"])
    assert staging_folders(parent) == [], staging_folders(parent)
    assert [p.name for p in parent.iterdir()] == [entry.name]
    used = disk_bytes(parent)
    assert used == disk_bytes(entry) and leaked >= disk_bytes(entry / "model.bin"), (leaked, used)
    print(f"cache: {leaked} bytes after an interrupted save, {used} after the next conversion (its entry)")
    assert_close(got, reference(model))


@pytest.mark.slow
def test_an_engine_whose_caller_dies_mid_save_removes_its_own_staging(tmp_path):
    """The caller SIGTERMed alone: the engine leaves through its parent watchdog, in the middle of a
    save, and removes its staging folder on the way (no sweep is needed for this one)."""
    parent = tmp_path / "openvino"
    caller = subprocess.Popen([sys.executable, "-c", CALLER, SAVE_UNDER_WATCHDOG, str(parent / "entry")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        folder = Path(read_line(caller).split(" ", 1)[1]).parent
        assert staging_folders(parent) == [folder] and disk_bytes(folder) == 1 << 20
    finally:
        caller.send_signal(signal.SIGTERM)
        caller.communicate()
    deadline = time.monotonic() + 120  # the watchdog looks every 0.5 s; this only bounds a failure
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not folder.exists() and not (parent / "entry").exists()


def test_a_staging_folder_of_a_live_writer_is_kept_and_of_a_dead_one_removed(tmp_path):
    """Ownership by pid and start time: the folders of this process and of a live child stay; those
    of a child that exited, of one killed and not yet reaped (a zombie), and of a dead writer whose
    pid a live process holds now (it started at another time) go."""
    from pooling_pipeline.core.engine.openvino_model import prune_cache
    from pooling_pipeline.core.shared import staging

    me = staging.current_owner()
    assert me is not None  # (Linux: /proc)
    live, exited, zombie = sleeper(), sleeper(), sleeper()
    try:
        owners = {name: staging.process_owner(p.pid) for name, p in
                  (("live", live), ("exited", exited), ("zombie", zombie))}
        assert all(o is not None and o.scope == me.scope for o in owners.values()), owners
        exited.kill()
        exited.wait()
        zombie.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 60  # killed: a zombie until waited for (the bound is for a failure only)
        while staging.liveness(owners["zombie"]) == staging.ALIVE and time.monotonic() < deadline:
            time.sleep(0.01)
        reused = owners["live"]._replace(start=owners["live"].start - 1)  # its pid, another process's start
        kept = [put_staging(tmp_path, staging.name_prefix(me)), put_staging(tmp_path, staging.name_prefix(owners["live"]))]
        gone = [put_staging(tmp_path, staging.name_prefix(owners["exited"])),
                put_staging(tmp_path, staging.name_prefix(owners["zombie"])), put_staging(tmp_path, staging.name_prefix(reused))]
        before = disk_bytes(tmp_path)
        assert sorted(prune_cache(str(tmp_path), keep=16)) == sorted(p.name for p in gone)
        assert staging_folders(tmp_path) == sorted(kept)
        assert disk_bytes(tmp_path) == before - len(gone) * (1 << 20)
        live.kill()
        live.wait()
        assert staging.remove_stale_staging(str(tmp_path)) == [kept[1].name]  # now dead too
        assert staging_folders(tmp_path) == [kept[0]]
    finally:
        for p in (live, exited, zombie):
            p.kill()
            p.wait()


def test_a_staging_folder_whose_writer_cannot_be_proven_dead_goes_only_when_old(tmp_path, monkeypatch):
    """A folder of a writer in another boot or pid namespace (a cache shared by containers or
    machines), or of an older name form, is removed only once nothing in it has changed for a day;
    on a system without /proc (no writer proven) even a dead pid's folder waits for that age."""
    from pooling_pipeline.core.shared import staging

    me = staging.current_owner()
    dead = sleeper()
    dead.kill()
    dead.wait()
    elsewhere = staging.Owner(dead.pid, 1, "0" * 12)
    folders = {"elsewhere": put_staging(tmp_path, staging.name_prefix(elsewhere)),
               "older form": put_staging(tmp_path, staging.PREFIX, "a1b2c3d4"),
               "being written": put_staging(tmp_path, staging.name_prefix(elsewhere), "y")}
    now = time.time()
    old = now - staging.STALE_UNPROVEN_S - 60
    for name, folder in folders.items():
        os.utime(folder, (old, old))
        if name != "being written":  # its file is still being written
            os.utime(folder / "model.bin", (old, old))
    assert staging.remove_stale_staging(str(tmp_path), now=old + 3600) == []  # an hour old: kept
    assert sorted(staging.remove_stale_staging(str(tmp_path), now=now)) == sorted(
        folders[name].name for name in ("elsewhere", "older form"))
    assert staging_folders(tmp_path) == [folders["being written"]]
    unproven = put_staging(tmp_path, staging.name_prefix(me._replace(pid=dead.pid)), "z")
    monkeypatch.setattr(staging, "current_owner", lambda: None)  # as without /proc
    assert staging.remove_stale_staging(str(tmp_path)) == [] and unproven.is_dir()
    assert sorted(staging.remove_stale_staging(str(tmp_path), now=now + staging.STALE_UNPROVEN_S + 60)) == sorted(
        p.name for p in (folders["being written"], unproven))
