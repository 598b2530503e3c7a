"""A Pipeline's whole life, many times over: opened and closed in a loop, dropped without close(),
its caller exiting or SIGTERMed mid-call, a whole group SIGKILLed (its directory removed by the next
group), and the stale-directory rule itself. Each test runs in its own short temporary directory
(TMPDIR), so the group directories it counts are its own."""

import gc
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
from helpers import running, wait_gone

from pooling_pipeline import Pipeline
from pooling_pipeline.group_dir import DIR_PREFIX, OWNER_FILE, STALE_UNOWNED_AGE_S, process_start, remove_stale_dirs

# Each round is a whole start and close (~2-3 s here). The checks are exact (no thread, descriptor,
# child or directory more than after the warm-up round), so a leak of one per round fails after the
# first round already; 3 rounds keep a leak of one every few rounds in reach (it was 10).
OPEN_CLOSE_ROUNDS = 3


@pytest.fixture
def tmpdir_base(monkeypatch):
    """A short TMPDIR of this test's own (a socket path must stay under 108 bytes)."""
    base = tempfile.mkdtemp(prefix="pl-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", base)
    monkeypatch.setenv("TMPDIR", base)
    yield base
    shutil.rmtree(base, ignore_errors=True)  # (a failed test leaves nothing behind; the test asserted)


def _group_dirs(base: str) -> list[str]:
    return sorted(n for n in os.listdir(base) if n.startswith(DIR_PREFIX))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _live_children() -> list[int]:
    return [p.pid for p in psutil.Process().children(recursive=True) if running(p.pid)]


@pytest.mark.slow
def test_opening_and_closing_a_pipeline_in_a_loop_accumulates_nothing(tmpdir_base):
    def round_trip():
        with Pipeline(num_render_workers=1) as pipe:
            assert len(pipe.embed(["one round"], use_tqdm=False)) == 1

    round_trip()  # the first round starts what stays for the process's life (zmq, tokenizer caches)
    threads, fds = threading.active_count(), _open_fds()
    before = set(_live_children())  # other tests' groups (a session's shared Pipeline) are not this test's
    for _ in range(OPEN_CLOSE_ROUNDS):
        round_trip()
    assert wait_gone([pid for pid in _live_children() if pid not in before], 10.0) == []
    assert threading.active_count() <= threads, [t.name for t in threading.enumerate()]
    assert _open_fds() <= fds
    assert _group_dirs(tmpdir_base) == []


@pytest.mark.slow
def test_a_pipeline_dropped_without_close_stops_its_children_and_removes_its_directory(tmpdir_base):
    pipe = Pipeline(num_render_workers=1)
    assert len(pipe.embed(["dropped"], use_tqdm=False)) == 1
    stream = pipe.embed_stream(iter(["a", "b", "c"] * 50))
    next(stream)  # a call in flight too
    pids = [pipe.pids["engine"], *pipe.pids["workers"]]
    group_dir = str(pipe._group.dir)
    del pipe, stream
    gc.collect()
    assert wait_gone(pids, 15.0) == []
    assert not os.path.exists(group_dir)
    assert _group_dirs(tmpdir_base) == []


@pytest.mark.slow
def test_a_close_whose_shutdown_send_fails_still_ends_the_children_and_the_sockets(tmpdir_base, monkeypatch):
    """close() raises what went wrong, but only after the children are gone and the context is
    closed: a context left open hangs the process when the garbage collector finds it."""
    from pooling_pipeline import process_group

    pipe = Pipeline(num_render_workers=1)
    pids = [pipe.pids["engine"], *pipe.pids["workers"]]
    group = pipe._group

    def failing_send(sock, routing_id, frames):
        raise RuntimeError("the shutdown send failed")

    monkeypatch.setattr(process_group, "send_to", failing_send)
    with pytest.raises(RuntimeError, match="the shutdown send failed"):
        pipe.close()
    assert group.ctx.closed
    assert wait_gone(pids, 15.0) == []
    assert _group_dirs(tmpdir_base) == []


_MID_CALL = """
import itertools, json, os, sys, threading, time
from pooling_pipeline import Pipeline
pipe = Pipeline(num_render_workers=1)
got = []
def endless():
    for out in pipe.embed_stream(itertools.cycle(["a text to embed", "another one"])):
        got.append(out)
threading.Thread(target=endless, daemon=True).start()
main_stream = pipe.embed_stream(itertools.cycle(["held open by the main thread"]))
next(main_stream)
while len(got) < 20:
    time.sleep(0.05)
print(json.dumps({"pids": [pipe.pids["engine"], *pipe.pids["workers"]], "dir": str(pipe._group.dir)}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["end of script", "sys.exit", "SIGTERM"])
def test_the_caller_exiting_or_sigtermed_mid_call_leaves_no_process_and_no_directory(tmp_path, tmpdir_base, how):
    """Two calls running (a daemon thread's stream, the main thread's stream held open) when the
    interpreter exits -- at the end of the script or by sys.exit -- or when SIGTERM kills it."""
    ending = {"end of script": "", "sys.exit": "sys.exit(3)\n", "SIGTERM": "time.sleep(600)\n"}[how]
    script = tmp_path / "caller.py"
    script.write_text(_MID_CALL + ending)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        report = json.loads(proc.stdout.readline())
        started = time.monotonic()
        if how == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        exit_s = time.monotonic() - started
    finally:
        proc.kill()
        proc.wait()
    assert code == {"end of script": 0, "sys.exit": 3, "SIGTERM": -signal.SIGTERM}[how]
    assert exit_s < 30, f"the exit took {exit_s:.0f} s"
    assert wait_gone(report["pids"], 5.0) == []
    deadline = time.monotonic() + 5
    while os.path.exists(report["dir"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(report["dir"])


_CTRL_C = """
import itertools, json, signal
import numpy as np
from pooling_pipeline import Pipeline
signal.signal(signal.SIGINT, signal.default_int_handler)  # (as in a terminal: a test runner may ignore SIGINT)
pipe = Pipeline(num_render_workers=1)
children = [pipe.pids["engine"], *pipe.pids["workers"]]
texts = ["a text to embed", "another one"]
before = np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False)])
try:
    for n, _ in enumerate(pipe.embed_stream(itertools.cycle(texts))):
        if n == 50:
            print(json.dumps({"pids": children, "dir": str(pipe._group.dir)}), flush=True)
except KeyboardInterrupt:
    pass
after = np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False)])
print(json.dumps({"same_children": [pipe.pids["engine"], *pipe.pids["workers"]] == children,
                  "max_diff": float(np.abs(after - before).max())}), flush=True)
for n, _ in enumerate(pipe.embed_stream(itertools.cycle(texts))):
    if n == 50:
        print("streaming again", flush=True)
"""


def _line_within(proc: subprocess.Popen, timeout_s: float) -> str:
    """The script's next line of output, or "" when none came within `timeout_s` (the process is then
    killed, so that a caller stuck in a call fails the test rather than hanging it). Lines are read by a
    thread: a readline may have buffered more than one line, which a select on the pipe would not see."""
    lines = getattr(proc, "lines", None)
    if lines is None:
        lines = proc.lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in iter(proc.stdout.readline, "")], daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        os.killpg(proc.pid, signal.SIGKILL)
        return ""


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_interrupts_the_call_and_leaves_the_group_to_the_caller(tmp_path, tmpdir_base):
    """A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the caller's call stops
    with KeyboardInterrupt, and the render worker and the engine, which leave the signal to their
    owner, go on serving the next call. A second Ctrl-C, not caught, ends the interpreter, whose exit
    closes the group. (Before: the children died of the first one, and the next call failed.)"""
    script = tmp_path / "caller.py"
    script.write_text(_CTRL_C)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, start_new_session=True)
    try:
        report = json.loads(_line_within(proc, 120) or "{}")
        assert report, proc.communicate(timeout=60)[1][-3000:]
        os.killpg(proc.pid, signal.SIGINT)
        line = _line_within(proc, 120)
        assert line, proc.communicate(timeout=60)[1][-3000:]
        after = json.loads(line)
        assert _line_within(proc, 120) == "streaming again\n"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert after["same_children"]  # no child died of the first Ctrl-C (none was restarted)
    assert after["max_diff"] <= 1e-5  # and the next call's vectors are the same
    assert proc.returncode == -signal.SIGINT, err[-3000:]  # the uncaught KeyboardInterrupt ended the interpreter
    assert err.count("Traceback") == 1 and err.rstrip().endswith("KeyboardInterrupt"), err[-3000:]
    assert wait_gone(report["pids"], 10.0) == []
    assert not os.path.exists(report["dir"])


# ---- directories of dead groups ------------------------------------------------------------


def _fake_group_dir(base: str, name: str, owner: dict | None, age_s: float = 0.0) -> str:
    path = os.path.join(base, DIR_PREFIX + name)
    os.mkdir(path, 0o700)
    open(os.path.join(path, "engine0.log"), "w").close()
    if owner is not None:
        with open(os.path.join(path, OWNER_FILE), "w") as f:
            json.dump(owner, f)
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_only_directories_of_groups_whose_owner_is_gone_are_removed(tmpdir_base):
    me = os.getpid()
    start = process_start(me)
    assert start is not None  # (Linux: /proc)
    dead = _fake_group_dir(tmpdir_base, "dead", {"pid": _dead_pid(), "start": "1"})
    reused = _fake_group_dir(tmpdir_base, "reused", {"pid": me, "start": str(int(start) - 1)})  # pid reused since
    old_unowned = _fake_group_dir(tmpdir_base, "oldunowned", None, age_s=STALE_UNOWNED_AGE_S + 60)
    live = _fake_group_dir(tmpdir_base, "live", {"pid": me, "start": start})
    young_unowned = _fake_group_dir(tmpdir_base, "young", None)  # a group making its directory right now
    dead_but_served = _fake_group_dir(tmpdir_base, "served", {"pid": _dead_pid(), "start": "1"})
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # its frontend lives (another pid namespace)
    listener.bind(os.path.join(dead_but_served, "results"))
    listener.listen()
    other_name = os.path.join(tmpdir_base, "not-ours-dead")
    os.mkdir(other_name)
    try:
        removed = remove_stale_dirs(tmpdir_base)
        assert sorted(removed) == sorted([dead, reused, old_unowned])
        for path in (dead, reused, old_unowned):
            assert not os.path.exists(path)
        for path in (live, young_unowned, dead_but_served, other_name):
            assert os.path.isdir(path)
    finally:
        listener.close()


@pytest.mark.slow
def test_a_new_group_removes_the_directory_of_a_whole_group_killed_at_once(tmp_path, tmpdir_base):
    """SIGKILL of the caller's whole process group: nobody is left to remove the directory (the
    children die with their parent); the next group to start removes it, and keeps a live one."""
    script = tmp_path / "victim.py"
    script.write_text(
        "import json, time\n"
        "from pooling_pipeline import Pipeline\n"
        "pipe = Pipeline(num_render_workers=1)\n"
        "print(json.dumps({'pids': [pipe.pids['engine'], *pipe.pids['workers']], 'dir': str(pipe._group.dir)}),"
        " flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True)
    try:
        report = json.loads(proc.stdout.readline())
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone(report["pids"], 5.0) == []
    assert os.path.isdir(report["dir"]), "the whole group died at once: its directory is left"
    with Pipeline(num_render_workers=1) as live:
        assert not os.path.exists(report["dir"])
        with Pipeline(num_render_workers=1) as second:  # a live group's directory is kept
            assert live._group.dir.is_dir() and second._group.dir.is_dir()
            assert len(live.embed(["still served"], use_tqdm=False)) == 1
