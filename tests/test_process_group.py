"""The process group's life: start, close, failures of a step or of the engine, scripts without a main guard."""

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import corpus
import numpy as np
import pytest
from helpers import stream_until_killed, wait_gone

from pooling_pipeline import EngineDeadError, EngineRestartedError, Pipeline, PipelineError, StepError


@pytest.mark.slow
def test_close_stops_every_process_and_removes_the_socket_dir():
    pipe = Pipeline()
    pids = pipe.pids
    all_pids = [pids["engine"], *pids["workers"]]
    sock_dir = pipe._group.dir
    assert stat.S_IMODE(os.stat(sock_dir).st_mode) == 0o700
    assert sorted(p.name for p in sock_dir.iterdir() if p.name.startswith("work-") or p.name == "results")
    assert len(pipe.embed(["hello"], use_tqdm=False)) == 1
    pipe.close()
    assert wait_gone(all_pids, 5.0) == []
    assert not sock_dir.exists()
    with pytest.raises(PipelineError, match="closed"):
        pipe.embed(["hello"], use_tqdm=False)
    pipe.close()  # closing twice is fine


@pytest.mark.slow
def test_works_from_a_plain_script_without_main_guard_and_cleans_up_at_exit(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import json\n"
        "from pooling_pipeline import Pipeline\n"
        "pipe = Pipeline()\n"  # no `if __name__ == '__main__'`, no close(): the exit must clean up
        "out = pipe.embed(['from a plain script'], use_tqdm=False)\n"
        "print(json.dumps({'dim': int(out[0].embedding.shape[0]), 'pids': pipe.pids}))\n"
    )
    env = dict(os.environ)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=180,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["dim"] == 384
    assert wait_gone([report["pids"]["engine"], *report["pids"]["workers"]], 5.0) == []


@pytest.mark.slow
def test_caller_killed_with_sigkill_takes_the_group_down(tmp_path):
    script = tmp_path / "victim.py"
    script.write_text(
        "import json, sys, time\n"
        "from pooling_pipeline import Pipeline\n"
        "pipe = Pipeline()\n"
        "print(json.dumps(pipe.pids), flush=True)\n"
        "time.sleep(600)\n"
    )
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        pids = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone([pids["engine"], *pids["workers"]], 5.0) == []


@pytest.mark.slow
def test_step_failure_raises_naming_the_requests_and_the_next_call_works(faulty_pipe, st_model):
    pipe, _ = faulty_pipe  # the session's (test_long_inputs fails its steps too; each call's stats are its own)
    good = corpus.sentences(40, seed=41)
    bad = "A zebra walks into the engine core."
    with pytest.raises(StepError, match="fault token") as info:
        pipe.embed(good + [bad] + good, use_tqdm=False)
    assert 40 in info.value.indices  # the culprit is named among the aborted step's requests
    assert len(info.value.request_ids) == len(info.value.indices) == len(set(info.value.request_ids))
    assert str(info.value.request_ids[info.value.indices.index(40)]) in str(info.value)
    outs = pipe.embed(good, use_tqdm=False)  # the engine kept no trace: the next call works
    np.testing.assert_allclose(np.stack([o.embedding for o in outs]), st_model.encode(good), atol=1e-5, rtol=0)
    assert pipe.stats()["requests"] == len(good)


@pytest.mark.slow
def test_engine_that_cannot_start_is_a_clear_error(tmp_path, model_path):
    import shutil

    broken = tmp_path / "broken-weights"
    shutil.copytree(model_path, broken)
    (broken / "model.safetensors").write_bytes(b"this is not a safetensors file")
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="engine core failed to start"):
        Pipeline(model=str(broken))
    assert time.monotonic() - start < 60
    # Nothing of that group is left (checked again by the session's orphan check).


@pytest.fixture
def spawned(monkeypatch) -> list[int]:
    """The pids of every child the process groups of a test start."""
    from pooling_pipeline.process_group import ProcessGroup

    pids: list[int] = []
    spawn = ProcessGroup._spawn

    def recorded(self, *args, **kwargs):
        child = spawn(self, *args, **kwargs)
        pids.append(child.proc.pid)
        return child

    monkeypatch.setattr(ProcessGroup, "_spawn", recorded)
    return pids


@pytest.mark.slow
def test_a_refusal_the_engine_finds_at_start_up_is_raised_as_the_value_error_it_is(monkeypatch, model_path, spawned):
    """device='cuda' where no GPU is visible: only the engine's torch can tell (the caller never
    imports torch), and it refuses with a ValueError. The caller raises that ValueError with the
    engine's message (not an EngineDeadError), and no child outlives the failed start."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # (the children inherit it: no GPU on any machine)
    with pytest.raises(ValueError) as info:
        Pipeline(model_path, device="cuda", num_render_workers=1)
    assert str(info.value) == "device 'cuda' was asked for but CUDA is not available"  # the engine's own words
    assert not isinstance(info.value, EngineDeadError)
    assert info.value.__notes__ == ["(raised by the engine core at start-up)"]
    assert len(spawned) == 2 and wait_gone(spawned) == []


@pytest.mark.slow
def test_a_start_cut_short_by_ctrl_c_kills_the_children_still_loading_at_once(monkeypatch, model_path, spawned):
    """Ctrl-C while the model loads reaches the children too, and they leave it to the caller: they neither die
    of it nor can be asked to stop before their Ready, so close() kills them at once (they hold no work). The
    grace period for an orderly exit is an hour here: a close that waited on them would not return."""
    from pooling_pipeline import process_group

    monkeypatch.setattr(process_group, "SHUTDOWN_GRACE_S", 3600.0)

    def interrupted(self) -> None:
        raise KeyboardInterrupt  # (where a terminal's Ctrl-C lands: the caller waiting for the Ready messages)

    monkeypatch.setattr(process_group.ProcessGroup, "wait_ready", interrupted)
    raised: list[BaseException] = []

    def start() -> None:
        try:
            Pipeline(model_path, num_render_workers=1)
        except BaseException as e:
            raised.append(e)

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    starting.join(120)  # (a bound for a close that waits out the grace period, not a timing)
    assert not starting.is_alive(), "close() waited for children that had not said Ready"
    assert len(raised) == 1 and isinstance(raised[0], KeyboardInterrupt)
    assert len(spawned) == 2 and wait_gone(spawned, 5.0) == []


@pytest.mark.slow
def test_a_ctrl_c_taken_while_a_child_is_spawned_leaves_no_child_behind(monkeypatch, model_path):
    """The spawn blocks SIGINT in its own thread only: another thread takes a Ctrl-C, and Python raises the
    KeyboardInterrupt in the main thread at its next bytecode. Raised inside Popen after the fork, it lost the
    Popen object, and the child (which leaves SIGINT to its owner) lived on, unknown to close(), until this
    process exited. Now the interrupt comes once the child is in the group's list, and the failed start ends it."""
    pids: list[int] = []
    waits = threading.Event()
    other = threading.Thread(target=waits.wait, daemon=True)  # (started before the spawn: SIGINT not blocked there)
    other.start()
    execute_child = subprocess.Popen._execute_child

    def forked_then_interrupted(self, *args, **kwargs):
        execute_child(self, *args, **kwargs)
        pids.append(self.pid)
        if len(pids) == 1:
            signal.pthread_kill(other.ident, signal.SIGINT)  # a Ctrl-C, taken by a thread that does not block it
            until = time.monotonic() + 3.0  # (before: its handler raised at one of these bytecodes, inside Popen)
            while time.monotonic() < until:
                time.sleep(0.01)

    from pooling_pipeline.process_group import ProcessGroup

    known: list[int] = []  # the children close() ends
    close = ProcessGroup.close

    def recorded(self) -> None:
        known.extend(child.proc.pid for child in self.children)
        close(self)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", forked_then_interrupted)
    monkeypatch.setattr(ProcessGroup, "close", recorded)
    try:
        with pytest.raises(KeyboardInterrupt):
            Pipeline(model_path, num_render_workers=1)
    finally:
        waits.set()
    left = wait_gone(pids, 10.0)
    for pid in left:  # (so that a failure leaves nothing behind either)
        os.kill(pid, signal.SIGKILL)
    # (a lost child may still die of the start's end -- its directory is removed -- but unknown, unreaped)
    assert len(pids) == 1 and pids[0] in known and left == []


def _bidirectional_gemma3(target) -> str:
    """EmbeddingGemma's shape, tiny: a Gemma 3 text model with bidirectional attention, mean pooled,
    saved by sentence-transformers."""
    import torch
    import transformers as tf
    from model_zoo import qwen_tokenizer
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    tok = qwen_tokenizer()
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=512,
                                 pad_token_id=eot, eos_token_id=eot, bos_token_id=eot, sliding_window=16,
                                 use_bidirectional_attention=True)
    hf_dir = target / "hf-gemma3"
    tf.Gemma3TextModel(config).save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    path = target / "st-gemma3-bidirectional"
    SentenceTransformer(modules=[Transformer(str(hf_dir)), Pooling(32, "mean")], device="cpu").save(str(path))
    return str(path)


@pytest.mark.slow
def test_a_model_openvino_cannot_convert_is_a_value_error_at_start_up(tmp_path, monkeypatch, spawned):
    """The issue's case: backend='openvino' on EmbeddingGemma's bidirectional Gemma 3, which OpenVINO
    cannot convert (only trying tells): a ValueError naming the backend and the model, as the docs
    promise, and no child left. (Without the openvino package the caller refuses it before any start.)"""
    import importlib.util

    monkeypatch.setenv("POOLING_PIPELINE_CACHE", str(tmp_path / "cache"))
    model = _bidirectional_gemma3(tmp_path)
    have_openvino = importlib.util.find_spec("openvino") is not None
    with pytest.raises(ValueError, match="^backend='openvino' cannot run model .*st-gemma3-bidirectional.*: OpenVINO "
                       if have_openvino else "needs the openvino package"):
        Pipeline(model, backend="openvino", num_render_workers=1)
    assert wait_gone(spawned) == []


@pytest.mark.slow
def test_a_model_description_larger_than_a_command_line_argument_starts(tmp_path, model_path, st_model):
    """A 200 KB prompt in config_sentence_transformers.json: each child's config (the whole model
    description) travels in a 0600 file of the group's private directory, not as one argument (Linux
    refuses an argument over 128 KB: 'Argument list too long')."""
    import shutil

    path = tmp_path / "big-prompt"
    shutil.copytree(model_path, path)
    config = json.loads((path / "config_sentence_transformers.json").read_text())
    config["prompts"] = {**config.get("prompts", {}), "huge": "word " * 40_000}
    (path / "config_sentence_transformers.json").write_text(json.dumps(config))
    with Pipeline(model=str(path), num_render_workers=1) as pipe:
        configs = sorted(pipe._group.dir.glob("*.json"))
        assert configs and all(stat.S_IMODE(c.stat().st_mode) == 0o600 for c in configs)
        outs = pipe.embed(["a sentence"], use_tqdm=False)
    assert np.abs(outs[0].embedding - st_model.encode(["a sentence"])[0]).max() <= 1e-5


@pytest.mark.slow
def test_engine_killed_mid_call_raises_within_seconds_and_is_restarted():
    pipe = Pipeline()
    try:
        engine_pid = pipe.pids["engine"]
        workers = pipe.pids["workers"]
        texts = corpus.sentences(200, seed=51)
        took = stream_until_killed(pipe, engine_pid, texts, EngineRestartedError, "engine core exited")
        assert took < 1.0 + 5.0
        assert len(pipe.embed(["x"], use_tqdm=False)) == 1  # the group restarted it (tests/test_engine_restart.py)
        assert pipe.pids["workers"] == workers and pipe.pids["engine"] != engine_pid
        children = [pipe.pids["engine"], *workers]
    finally:
        pipe.close()
    assert wait_gone(children, 5.0) == []


@pytest.mark.slow
def test_installs_one_namespace_and_runs_next_to_a_users_own_core_workers_and_pipeline(tmp_path):
    """A user's project often has its own `core/` (Django apps), `workers/` or `pipeline.py`: none
    of them may shadow this package's modules, in the caller or in the children it starts."""
    for name in ("core", "workers"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the user\\'s own {name} was imported')\n")
        (tmp_path / name / "messages.py").write_text("raise ImportError('the user\\'s own module was imported')\n")
    (tmp_path / "pipeline.py").write_text("raise ImportError(\"the user's own pipeline.py was imported\")\n")
    script = tmp_path / "job.py"
    script.write_text(
        "import importlib.util, json, sys\n"
        "sys.path.remove(sys.path[0])\n"  # look at what is installed, not at this directory
        "generic = [n for n in ('core', 'workers', 'pipeline') if importlib.util.find_spec(n) is not None]\n"
        "sys.path.insert(0, '')\n"
        "from pooling_pipeline import Pipeline, PoolingParams\n"
        "with Pipeline() as pipe:\n"
        "    out = pipe.embed(['a text'], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)\n"
        "print(json.dumps({'generic': generic, 'dim': int(out[0].embedding.shape[0])}))\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"generic": [], "dim": 8}


@pytest.mark.slow
def test_close_asks_every_child_even_when_one_cannot_be_reached():
    """One worker's socket failing must not keep the engine and the other workers from their
    orderly shutdown (they would be SIGKILLed after the grace period)."""
    pipe = Pipeline(num_render_workers=2)
    group = pipe._group
    group.work[0].close()  # sending Shutdown to worker 0 now raises ZMQError
    pipe.close()
    assert group.engine.proc.returncode == 0
    assert group.workers[1].proc.returncode == 0
    assert wait_gone([group.workers[0].proc.pid], 5.0) == []


@pytest.mark.slow
def test_a_group_closed_right_after_it_started_shuts_every_child_down_in_order():
    """A child's connection to the frontend's control socket can attach after its Ready arrived;
    a Shutdown sent then found no peer (EAGAIN) and the engine was SIGKILLed after the grace
    period (1 start-and-close in ~8). close() asks again for a short while."""
    for _ in range(4):
        pipe = Pipeline(num_render_workers=1)
        group = pipe._group
        pipe.close()
        assert group.engine.proc.returncode == 0
        assert group.workers[0].proc.returncode == 0


@pytest.mark.slow
def test_a_forked_child_can_neither_use_nor_tear_down_the_parents_group(tmp_path):
    """The exit handler and the sockets belong to the process that made the group: a forked child
    that exits normally leaves the parent's ipc directory alone (a later worker restart needs it),
    and using the inherited Pipeline there is a clear error at once (it used to hang)."""
    script = tmp_path / "forker.py"
    script.write_text(
        "import json, os, signal, sys, time\n"
        "from pooling_pipeline import Pipeline, PipelineError\n"
        "pipe = Pipeline()\n"
        "sock_dir = str(pipe._group.dir)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    start = time.monotonic()\n"
        "    try:\n"
        "        pipe.embed(['from the child'], use_tqdm=False)\n"
        "        message = 'no error'\n"
        "    except PipelineError as e:\n"
        "        message = str(e)\n"
        "    with open(sys.argv[1], 'w') as f:\n"
        "        json.dump({'message': message, 'seconds': time.monotonic() - start}, f)\n"
        "    sys.exit(0)\n"  # a normal exit: the child's exit handlers run
        "deadline = time.monotonic() + 60\n"
        "while os.waitpid(pid, os.WNOHANG) == (0, 0):\n"
        "    if time.monotonic() > deadline:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "        os.waitpid(pid, 0)\n"
        "        break\n"
        "    time.sleep(0.05)\n"
        "dir_kept = os.path.isdir(sock_dir)\n"
        "os.kill(pipe.pids['workers'][0], signal.SIGKILL)\n"  # the replacement's log file lives in the dir
        "outs = pipe.embed(['after the fork'] * 50, use_tqdm=False)\n"
        "report = {'dir_kept': dir_kept, 'outs': len(outs), 'restarts': pipe.stats()['worker_restarts'],\n"
        "          'pids': pipe.pids, 'dir': sock_dir}\n"
        "pipe.close()\n"
        "report['dir_removed'] = not os.path.exists(sock_dir)\n"
        "print(json.dumps(report))\n"
    )
    child_report = tmp_path / "child.json"
    result = subprocess.run([sys.executable, str(script), str(child_report)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    child = json.loads(child_report.read_text())
    assert "forked child" in child["message"] and child["seconds"] < 30
    assert report["dir_kept"] and report["outs"] == 50 and report["dir_removed"]
    assert wait_gone([report["pids"]["engine"], *report["pids"]["workers"]], 5.0) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_caller_killed_by_a_signal_leaves_no_socket_dir(tmp_path, sig):
    """A frontend killed by SIGTERM (or SIGKILL) never runs its exit handlers: the children,
    which watch it, remove the private directory as they exit."""
    script = tmp_path / "victim.py"
    script.write_text(
        "import json, time\n"
        "from pooling_pipeline import Pipeline\n"
        "pipe = Pipeline()\n"
        "print(json.dumps({'pids': pipe.pids, 'dir': str(pipe._group.dir)}), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        report = json.loads(proc.stdout.readline())
        assert os.path.isdir(report["dir"])
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == -sig
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone([report["pids"]["engine"], *report["pids"]["workers"]], 5.0) == []
    deadline = time.monotonic() + 5
    while os.path.exists(report["dir"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(report["dir"])


def test_too_few_file_descriptors_is_a_clear_error_not_an_abort():
    """Under `ulimit -n 24` libzmq used to abort the whole caller (exit code 134), leaving the
    ipc directory behind; the limit is checked before anything starts."""
    import pathlib
    import resource
    import shutil
    import tempfile

    # A short TMPDIR of its own (pytest's tmp_path under an xdist worker is too long for a socket path).
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pp-fd-"))
    try:
        script = "from pooling_pipeline import Pipeline, PipelineError\ntry:\n    Pipeline()\n" \
                 "except PipelineError as e:\n    print('refused:', e)\n"
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                                env={**os.environ, "TMPDIR": str(tmp)},
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (24, 24)))
        assert result.returncode == 0, result.stderr[-3000:]
        assert "refused: too few file descriptors" in result.stdout and "ulimit -n" in result.stdout
        assert list(tmp.iterdir()) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_temporary_directory_too_long_for_a_socket_path_is_a_clear_error(tmp_path, monkeypatch):
    import tempfile

    long_dir = tmp_path / ("t" * 90)
    long_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_dir))
    with pytest.raises(PipelineError, match="TMPDIR"):
        Pipeline()
    assert list(long_dir.iterdir()) == []
