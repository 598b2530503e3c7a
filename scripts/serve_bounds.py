"""Measures what pipeline-serve's connection bounds hold against (docs/serving.md, "Load and faults"):

    python scripts/serve_bounds.py slowloris [--connections 200] [--timeout-header 4] [--every 2]
    python scripts/serve_bounds.py bodies [--clients 20] [--body-mib 64] [--max-held-body-bytes N]

`slowloris`: N connections each send a request line and then one header byte every `--every` seconds
(under the keep-alive timeout, which each byte used to restart); prints when each was closed and with
what, and the latencies of a client's ordinary requests before and during it.
`bodies`: N clients send a `--body-mib` body each, all at once; prints the server process's peak RSS
against its RSS before, and what each client was answered. The body is `{"input": 3}` and then
whitespace (valid JSON, a 400 once read whole): the HTTP side's memory, not the model's, is measured.
Each starts its own server on the simulated device and stops it (SIGTERM) when done.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter

import psutil

READY = re.compile(r"pipeline-serve: ready on http://([\d.]+):(\d+)")
EMBED = b'{"input": ["an ordinary request"]}'


def start_server(*flags: str) -> tuple[subprocess.Popen, str, int]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "pooling_pipeline.serve.cli", "--device", "sim", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stdout:
        match = READY.search(line)
        if match:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # (drained: the pipe never fills)
            return proc, match.group(1), int(match.group(2))
    raise SystemExit(f"pipeline-serve did not start (exit {proc.wait()})")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def read_response(reader: asyncio.StreamReader) -> int:
    """The status of one Content-Length framed response (its body read and dropped)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
    await reader.readexactly(int(length.group(1)) if length else 0)
    return int(head.split(b" ", 2)[1])


def post(body: bytes) -> bytes:
    return b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body), body)


def quantiles(ms: list[float]) -> str:
    if not ms:
        return "none"
    ms = sorted(ms)
    return (f"n={len(ms)} p50={statistics.median(ms):.1f} ms p99={ms[min(len(ms) - 1, int(len(ms) * 0.99))]:.1f} ms "
            f"max={ms[-1]:.1f} ms")


# -- slowloris --


async def slow_client(host: str, port: int, every_s: float, bound_s: float) -> tuple[float, str]:
    """One header byte every `every_s` until the server answers or closes: (seconds open, what it got)."""
    reader, writer = await asyncio.open_connection(host, port)
    opened = time.monotonic()
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    got = b""
    while time.monotonic() - opened < bound_s:
        try:
            got = await asyncio.wait_for(reader.read(1 << 16), every_s)
            break
        except asyncio.TimeoutError:
            writer.write(b"X")
    held = time.monotonic() - opened
    writer.close()
    what = "still open" if held >= bound_s else (got.split(b"\r\n", 1)[0].decode() or "closed, no answer")
    return held, what


async def ordinary_client(host: str, port: int, stop: asyncio.Event, out: list[float]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    while not stop.is_set():
        t = time.perf_counter()
        writer.write(post(EMBED))
        if await read_response(reader) != 200:
            raise SystemExit("an ordinary request failed")
        out.append((time.perf_counter() - t) * 1e3)
        await asyncio.sleep(0.01)
    writer.close()


async def slowloris(host: str, port: int, args) -> None:
    before: list[float] = []
    stop = asyncio.Event()
    task = asyncio.ensure_future(ordinary_client(host, port, stop, before))
    await asyncio.sleep(3)
    stop.set()
    await task
    print(f"ordinary requests before: {quantiles(before)}")
    during: list[float] = []
    stop = asyncio.Event()
    task = asyncio.ensure_future(ordinary_client(host, port, stop, during))
    bound_s = 10 * args.timeout_header + 30
    results = await asyncio.gather(*[slow_client(host, port, args.every, bound_s) for _ in range(args.connections)])
    stop.set()
    await task
    held = sorted(seconds for seconds, _ in results)
    print(f"{args.connections} slowloris connections (a header byte every {args.every:g} s, --timeout-header "
          f"{args.timeout_header:g}, --timeout-keep-alive 5): ended by {dict(Counter(what for _, what in results))}; "
          f"held open {held[0]:.2f} / {statistics.median(held):.2f} / {held[-1]:.2f} s (min / median / max)")
    print(f"ordinary requests during: {quantiles(during)}")


# -- bodies --


async def upload(host: str, port: int, body: bytes) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body))
    view = memoryview(body)
    for i in range(0, len(body), 1 << 20):
        writer.write(view[i:i + (1 << 20)])
        await writer.drain()
    status = await read_response(reader)
    writer.close()
    return status


def sample_rss(pid: int, stop: threading.Event, peak: list[int]) -> None:
    process = psutil.Process(pid)
    while not stop.is_set():
        peak[0] = max(peak[0], process.memory_info().rss)
        time.sleep(0.01)


async def bodies(host: str, port: int, pid: int, args) -> None:
    body = b'{"input": 3}' + b" " * ((args.body_mib << 20) - 12)
    main = psutil.Process(pid)
    before = main.memory_info().rss
    children_before = sum(p.memory_info().rss for p in main.children(recursive=True))
    peak, stop = [before], threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(pid, stop, peak))
    sampler.start()
    t = time.monotonic()
    statuses = await asyncio.gather(*[upload(host, port, body) for _ in range(args.clients)])
    seconds = time.monotonic() - t
    stop.set()
    sampler.join()
    children_after = sum(p.memory_info().rss for p in main.children(recursive=True))
    mib = 1 << 20
    print(f"{args.clients} clients x {args.body_mib} MiB bodies at once, --max-held-body-bytes "
          f"{args.max_held_body_bytes // mib} MiB: answered {dict(Counter(statuses))} in {seconds:.1f} s")
    print(f"server process RSS: {before / mib:.0f} MiB before, peak {peak[0] / mib:.0f} MiB "
          f"(+{(peak[0] - before) / mib:.0f} MiB; bound stated: +2 x the budget = {2 * args.max_held_body_bytes // mib} MiB); "
          f"its children {children_before / mib:.0f} -> {children_after / mib:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("slowloris")
    s.add_argument("--connections", type=int, default=200)
    s.add_argument("--timeout-header", type=float, default=4.0)
    s.add_argument("--every", type=float, default=2.0, help="seconds between a slow client's header bytes")
    b = sub.add_parser("bodies")
    b.add_argument("--clients", type=int, default=20)
    b.add_argument("--body-mib", type=int, default=64)
    b.add_argument("--max-held-body-bytes", type=int, default=256 << 20)
    args = ap.parse_args()
    if args.what == "slowloris":
        proc, host, port = start_server("--timeout-header", str(args.timeout_header))
    else:
        proc, host, port = start_server("--max-body-bytes", str(args.body_mib << 20),
                                        "--max-held-body-bytes", str(args.max_held_body_bytes))
    try:
        if args.what == "slowloris":
            asyncio.run(slowloris(host, port, args))
        else:
            asyncio.run(bodies(host, port, proc.pid, args))
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
