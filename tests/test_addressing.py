"""Work and control messages reach only the group's own children: a process of the same user
that connects to a frontend socket by mistake receives nothing and the calls are unaffected; a
batch that never reaches its worker is noticed and re-sent (issue 25)."""

import threading

import corpus
import numpy as np
import pytest
import zmq

import pooling_pipeline.process_group as process_group
from pooling_pipeline import Pipeline

TOL = 1e-5
CALL_TIMEOUT_S = 120


def embed_with_timeout(pipe, texts, timeout_s=CALL_TIMEOUT_S):
    """The call in a thread: a hang fails the test instead of blocking the suite."""
    box = {}

    def run():
        try:
            box["outs"] = pipe.embed(texts, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"the call did not finish in {timeout_s} s (a batch was lost)"
    if "error" in box:
        raise box["error"]
    return box["outs"]


@pytest.mark.slow
def test_a_foreign_pull_socket_on_the_work_and_control_sockets_receives_nothing(st_model):
    texts = corpus.sentences(400, seed=81)
    with Pipeline(num_render_workers=2, max_inflight=64) as pipe:
        group = pipe._group
        ctx = zmq.Context()
        # A PULL socket on each socket the frontend sends on: with PUSH sockets they took every
        # other RenderBatch (and Abort/Shutdown), and the call waited for them forever.
        thieves = []
        for endpoint in [group.endpoints["control"], *(s.getsockopt_string(zmq.LAST_ENDPOINT) for s in group.work)]:
            for kind in (zmq.PULL, zmq.DEALER):
                sock = ctx.socket(kind)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
                thieves.append(sock)
        try:
            outs = embed_with_timeout(pipe, texts)
            got = np.stack([o.embedding for o in outs])
            np.testing.assert_allclose(got, st_model.encode(texts), atol=TOL, rtol=0)
            stolen = sum(1 for sock in thieves if sock.poll(200))
            assert stolen == 0, f"{stolen} foreign sockets received a message"
            assert pipe.stats()["group"]["worker_restarts"] == 0
        finally:
            for sock in thieves:
                sock.close(0)
            ctx.term()


@pytest.mark.slow
def test_a_batch_lost_on_the_way_to_an_idle_worker_is_sent_again(st_model, monkeypatch):
    """The first batch a worker is sent vanishes on the way (recorded as sent, never delivered):
    the worker's heartbeats show it idle without it, so it is handled as wedged, restarted, and
    the call's results are exact."""
    monkeypatch.setattr(process_group, "RESTART_BACKOFF_S", 0.0)
    real_send = process_group.send_to
    lost, armed = [], []

    def send_losing_the_first_batch(sock, routing_id, frames):
        if armed and not lost and any(sock is w for w in armed[0].work):
            lost.append(routing_id)
            return  # "sent": the frontend counts it, the worker never gets it
        real_send(sock, routing_id, frames)

    monkeypatch.setattr(process_group, "send_to", send_losing_the_first_batch)
    texts = corpus.sentences(60, seed=82)
    with Pipeline(num_render_workers=1) as pipe:
        armed.append(pipe._group)  # (after start-up: its probe of the worker goes through)
        outs = embed_with_timeout(pipe, texts, timeout_s=60)
        assert lost, "the test lost no batch"
        np.testing.assert_allclose(np.stack([o.embedding for o in outs]), st_model.encode(texts), atol=TOL, rtol=0)
        assert pipe.stats()["group"]["worker_restarts"] == 1


FLOOD = r"""
import socket, sys, time
import zmq

frame = b"x" * (8 << 20)
for endpoint in sys.argv[1:]:
    for kind in ("PUSH", "DEALER", "ROUTER", "RAW"):
        if kind == "RAW":  # bytes that are not even ZMTP
            raw = socket.socket(socket.AF_UNIX)
            raw.settimeout(2)
            try:
                raw.connect(endpoint[len("ipc://"):])
                for _ in range(40):
                    raw.sendall(frame)
            except OSError:
                pass
            raw.close()
            continue
        ctx = zmq.Context()
        sock = ctx.socket(getattr(zmq, kind))
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(endpoint)
        for _ in range(40):
            try:
                if kind == "ROUTER":
                    sock.send_multipart([b"anyone", frame])
                else:
                    sock.send(frame)
            except zmq.ZMQError:
                break
        time.sleep(0.5)
        sock.close()
        ctx.term()
"""


@pytest.mark.slow
def test_a_peer_writing_to_the_sending_sockets_cannot_grow_the_frontend(st_model):
    """Another process of the same user pushes 40 x 8 MB at every socket the frontend only sends on
    (the work and control ROUTERs), as PUSH, DEALER, ROUTER and raw bytes: the frontend reads
    nothing from them (a message over 256 bytes cuts the peer off), so its memory does not grow by
    what was pushed (320 MB a socket), and the calls are unaffected (issue 35, item 7)."""
    import subprocess
    import sys

    import psutil

    texts = corpus.sentences(200, seed=82)
    with Pipeline(num_render_workers=1) as pipe:
        embed_with_timeout(pipe, texts)
        group = pipe._group
        endpoints = [*(s.getsockopt_string(zmq.LAST_ENDPOINT) for s in group.controls),
                     *(s.getsockopt_string(zmq.LAST_ENDPOINT) for s in group.work)]
        before = psutil.Process().memory_info().rss
        subprocess.run([sys.executable, "-c", FLOOD, *endpoints], timeout=300, check=True)
        grown = psutil.Process().memory_info().rss - before
        assert grown < 64 * 2**20, f"the frontend grew by {grown / 2**20:.0f} MB"
        got = np.stack([o.embedding for o in embed_with_timeout(pipe, texts)])
        np.testing.assert_allclose(got, st_model.encode(texts), atol=TOL, rtol=0)
