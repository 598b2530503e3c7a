"""Which HTTP stack and JSON encoder should `pipeline-serve` use? Measured side by side in one run.

Part 1, server cost per request: each stack serves the same trivial endpoint (a POST of a ~200-byte JSON body
`{"input": "...", "model": "m"}`, answered with OpenAI's embedding list for one 384-float vector, ~8 kB),
one worker process each, driven by one aiohttp client process at concurrency 16. The server's CPU time
(user + system of its process tree, read with psutil around a fixed number of requests) is the number that
counts: on a 2-core machine the client and the server share the cores, so requests/s is the client's and
the server's cost together (reported too, with p99 latency). The stacks are measured in rotation, repeat by
repeat, so a load that comes and goes on the machine falls on all of them alike; medians of the repeats.

Part 2, encoding in the process (timeit): a batch of 32 x 384 float32 embeddings as OpenAI's JSON list with
json (stdlib), orjson, msgspec.json, pydantic (FastAPI's response_model path) and as base64 (OpenAI's
encoding_format="base64"); what each prints for a float32 and whether every value round-trips float32
exactly; and the decoding of a 32-text request body.

    python scripts/bench_http_stack.py --repeats 7      # ~1 minute on 2 busy cores (docs/serving-stack.md)
    python scripts/bench_http_stack.py --requests 1000 --repeats 3 --skip-encoding   # a quick look

Needs: uvicorn[standard] (httptools, uvloop), aiohttp, psutil, orjson; starlette, fastapi (+ pydantic) and
granian for their rows (a stack whose package is missing is reported as skipped).

No `from __future__ import annotations` here: FastAPI reads the endpoint's annotations, and the pydantic models
it names are defined inside a function (pydantic is not a dependency of the module's other rows).
"""

import argparse
import asyncio
import base64
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import timeit
import urllib.request
from pathlib import Path

import msgspec
import numpy as np

DIM = 384
BATCH = 32
CONCURRENCY = 16
PATH = "/v1/embeddings"
# ~200 bytes on the wire: a sentence of a typical query's length, and the model's name.
REQUEST_BODY = json.dumps({"input": "a short sentence about the weather in the mountains this weekend, and whether the roads "
                                    "over the pass will be open for the cars that go up to the lakes", "model": "m"}).encode()
SERVE_TIMEOUT_S = 30  # a stack that does not answer within this is reported with its log tail


# -- the endpoint's work, shared by every stack: decode the request, encode one embedding list --

class EmbedRequest(msgspec.Struct):
    input: str | list[str]
    model: str | None = None


class Embedding(msgspec.Struct):
    object: str
    index: int
    embedding: list[float] | str | msgspec.Raw


class Usage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    object: str
    data: list[Embedding]
    model: str
    usage: Usage


REQUEST_DECODER = msgspec.json.Decoder(EmbedRequest)
ENCODER = msgspec.json.Encoder()
VECTOR = np.random.default_rng(0).standard_normal(DIM).astype(np.float32)
VECTOR /= np.linalg.norm(VECTOR)


def openai_struct(rows, model: str, as_base64: bool = False, as_raw: bool = False) -> EmbeddingList:
    """OpenAI's embedding list; each row as floats (float32 widened to float64), as base64 of its '<f4' bytes, or
    (as_raw) already encoded."""
    data = [Embedding(object="embedding", index=i, embedding=row if as_raw else
                      base64.b64encode(row.astype("<f4").tobytes()).decode() if as_base64 else row.tolist())
            for i, row in enumerate(rows)]
    return EmbeddingList(object="list", data=data, model=model, usage=Usage(prompt_tokens=len(rows), total_tokens=len(rows)))


def openai_dict(rows, model: str) -> dict:
    """The same list as plain dicts; `rows` items are lists of floats or ndarrays (orjson's numpy path)."""
    return {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)],
            "model": model, "usage": {"prompt_tokens": len(rows), "total_tokens": len(rows)}}


def response_body(model: str | None) -> bytes:
    return ENCODER.encode(openai_struct(VECTOR[None, :], model or "m"))


# -- the apps --

async def raw_app(scope, receive, send):
    """A raw ASGI app: no framework, the body read from the receive channel, msgspec both ways."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    payload = response_body(REQUEST_DECODER.decode(body).model)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


async def rsgi_app(scope, protocol):
    """Granian's own interface (RSGI), the same work."""
    body = await protocol()
    payload = response_body(REQUEST_DECODER.decode(body).model)
    protocol.response_bytes(status=200, headers=[("content-type", "application/json")], body=payload)


def starlette_app(idiomatic: bool):
    """Starlette: msgspec in a Response, or as its docs write it (request.json(), JSONResponse: stdlib json)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def embeddings(request):
        if idiomatic:
            model = (await request.json()).get("model") or "m"
            return JSONResponse(openai_dict([VECTOR.tolist()], model))
        return Response(response_body(REQUEST_DECODER.decode(await request.body()).model), media_type="application/json")
    return Starlette(routes=[Route(PATH, embeddings, methods=["POST"])])


def pydantic_models():
    """OpenAI's request and embedding list as pydantic models (FastAPI's way), built on first use."""
    from pydantic import BaseModel

    class Request(BaseModel):
        input: str | list[str]
        model: str | None = None

    class Item(BaseModel):
        object: str
        index: int
        embedding: list[float]

    class Usage(BaseModel):
        prompt_tokens: int
        total_tokens: int

    class Answer(BaseModel):
        object: str
        data: list[Item]
        model: str
        usage: Usage

    def answer(rows: np.ndarray, model: str) -> Answer:
        data = [Item(object="embedding", index=i, embedding=row.tolist()) for i, row in enumerate(rows)]
        return Answer(object="list", data=data, model=model, usage=Usage(prompt_tokens=len(rows), total_tokens=len(rows)))
    return Request, Answer, answer


def fastapi_app(idiomatic: bool):
    """FastAPI with a pydantic model for the request; the response as msgspec bytes, or as its docs write it
    (a pydantic response model, which FastAPI validates and serializes)."""
    from fastapi import FastAPI
    from fastapi.responses import Response
    Request, Answer, answer = pydantic_models()
    app = FastAPI()
    if idiomatic:
        @app.post(PATH, response_model=Answer)
        async def embeddings(request: Request) -> Answer:
            return answer(VECTOR[None, :], request.model or "m")
    else:
        @app.post(PATH)
        async def embeddings(request: Request) -> Response:
            return Response(response_body(request.model), media_type="application/json")
    return app


# name -> (label, the packages it needs); every stack runs one worker process, access log off.
STACKS = {
    "raw-httptools": ("raw ASGI, uvicorn (httptools + uvloop)", ["uvicorn", "httptools", "uvloop"]),
    "raw-h11": ("raw ASGI, uvicorn (h11 + asyncio)", ["uvicorn", "h11"]),
    "starlette": ("Starlette + msgspec, uvicorn (httptools + uvloop)", ["uvicorn", "starlette"]),
    "starlette-json": ("Starlette + JSONResponse, uvicorn (httptools + uvloop)", ["uvicorn", "starlette"]),
    "fastapi": ("FastAPI (pydantic request) + msgspec, uvicorn (httptools + uvloop)", ["uvicorn", "fastapi"]),
    "fastapi-model": ("FastAPI (pydantic request + response_model), uvicorn (httptools + uvloop)", ["uvicorn", "fastapi"]),
    "granian": ("raw ASGI, granian (uvloop)", ["granian", "uvloop"]),
    "granian-rsgi": ("RSGI, granian (uvloop)", ["granian", "uvloop"]),
}
UVICORN_APPS = {"raw-httptools": (lambda: raw_app, "httptools", "uvloop"), "raw-h11": (lambda: raw_app, "h11", "asyncio"),
                "starlette": (lambda: starlette_app(False), "httptools", "uvloop"),
                "starlette-json": (lambda: starlette_app(True), "httptools", "uvloop"),
                "fastapi": (lambda: fastapi_app(False), "httptools", "uvloop"),
                "fastapi-model": (lambda: fastapi_app(True), "httptools", "uvloop")}


def serve(stack: str, port: int) -> None:
    """Runs one uvicorn stack in this process (the server child)."""
    import uvicorn
    build, http, loop = UVICORN_APPS[stack]
    uvicorn.run(build(), host="127.0.0.1", port=port, http=http, loop=loop, workers=None, log_level="warning",
                access_log=False, lifespan="on")


def server_command(stack: str, port: int) -> list[str]:
    if stack.startswith("granian"):
        interface, target = ("rsgi", "rsgi_app") if stack == "granian-rsgi" else ("asgi", "raw_app")
        return [sys.executable, "-m", "granian", "--interface", interface, "--host", "127.0.0.1", "--port", str(port),
                "--workers", "1", "--loop", "uvloop", "--no-access-log", "--log-level", "warning",
                "--working-dir", str(Path(__file__).parent), f"{Path(__file__).stem}:{target}"]
    return [sys.executable, __file__, "--serve", stack, "--port", str(port)]


class Server:
    """One stack's server process (its own process group, so a granian worker goes with it)."""

    def __init__(self, stack: str, log_dir: Path):
        self.stack, self.label = stack, STACKS[stack][0]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.log_path = log_dir / f"{stack}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(server_command(stack, self.port), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{self.port}{PATH}", data=REQUEST_BODY,
                                                 headers={"content-type": "application/json"})
                with urllib.request.urlopen(request, timeout=2) as answer:
                    msgspec.json.decode(answer.read(), type=EmbeddingList)
                    return
            except OSError:
                time.sleep(0.2)
        exited = self.proc.poll()
        self.stop()
        what = f"exited ({exited})" if exited is not None else f"did not answer within {SERVE_TIMEOUT_S} s"
        raise RuntimeError(f"{self.label} {what}; its log ({self.log_path}) ends:\n" + self.log_path.read_text()[-2000:])

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server and its children (granian's worker process) so far."""
        import psutil
        root = psutil.Process(self.proc.pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            times = proc.cpu_times()
            total += times.user + times.system
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# -- the client (a child process: one line of JSON in per run, one line out) --

async def drive(port: int, requests: int, concurrency: int) -> dict:
    """`requests` POSTs over `concurrency` keep-alive connections; wall seconds, latencies, errors by kind."""
    import aiohttp
    url = f"http://127.0.0.1:{port}{PATH}"
    headers = {"content-type": "application/json"}
    todo = iter(range(requests))  # shared by the workers: each request is taken once
    latencies: list[float] = []
    errors: dict[str, int] = {}

    async def worker(session):
        for _ in todo:
            start = time.perf_counter()
            try:
                async with session.post(url, data=REQUEST_BODY, headers=headers) as answer:
                    body = await answer.read()
                    if answer.status != 200 or not body.startswith(b'{"object":"list"'):
                        errors[f"HTTP {answer.status}"] = errors.get(f"HTTP {answer.status}", 0) + 1
            except (aiohttp.ClientError, OSError) as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            latencies.append(time.perf_counter() - start)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    latencies.sort()
    return {"wall_s": wall, "p50_ms": 1e3 * latencies[len(latencies) // 2],
            "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))], "errors": errors}


def client_loop() -> None:
    try:
        import uvloop
        uvloop.install()  # the same client for every stack; uvloop so that it costs the shared cores less
    except ImportError:
        pass
    for line in sys.stdin:
        job = json.loads(line)
        print(json.dumps(asyncio.run(drive(job["port"], job["requests"], job["concurrency"]))), flush=True)


class Client:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, __file__, "--client"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def run(self, port: int, requests: int, concurrency: int) -> dict:
        self.proc.stdin.write(json.dumps({"port": port, "requests": requests, "concurrency": concurrency}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the client process exited ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def missing_packages(stack: str) -> list[str]:
    import importlib.util
    return [name for name in STACKS[stack][1] if importlib.util.find_spec(name) is None]


def bench_servers(stacks: list[str], requests: int, repeats: int, log_dir: Path) -> list[dict]:
    """Every stack started at once (idle servers cost nothing), then measured in rotation."""
    rows, servers = [], []
    for stack in stacks:
        missing = missing_packages(stack)
        if missing:
            rows.append({"stack": STACKS[stack][0], "skipped": "not installed: " + ", ".join(missing)})
        else:
            servers.append(Server(stack, log_dir))
    client = Client()
    try:
        for server in list(servers):
            try:
                server.wait_ready()
            except RuntimeError as exc:  # reported as a row; the other stacks are still measured
                print(exc, file=sys.stderr)
                rows.append({"stack": server.label, "skipped": str(exc).splitlines()[0]})
                servers.remove(server)
                continue
            client.run(server.port, max(requests // 4, 200), CONCURRENCY)  # warm-up: imports, connections, caches
        runs: dict[str, list[dict]] = {server.stack: [] for server in servers}
        for repeat in range(repeats if servers else 0):
            for server in servers[repeat % len(servers):] + servers[:repeat % len(servers)]:
                cpu_before = server.cpu_s()
                result = client.run(server.port, requests, CONCURRENCY)
                result["server_cpu_s"] = server.cpu_s() - cpu_before
                runs[server.stack].append(result)
        for server in servers:
            rows.append(summarize(server.label, runs[server.stack], requests))
    finally:
        client.close()
        for server in servers:
            server.stop()
    return rows


def summarize(label: str, runs: list[dict], requests: int) -> dict:
    errors: dict[str, int] = {}
    for run in runs:
        for kind, count in run["errors"].items():
            errors[kind] = errors.get(kind, 0) + count
    return {"stack": label,
            "server_cpu_us": 1e6 * statistics.median(run["server_cpu_s"] for run in runs) / requests,
            "server_cpu_range": [1e6 * f(run["server_cpu_s"] for run in runs) / requests for f in (min, max)],
            "requests_s": statistics.median(requests / run["wall_s"] for run in runs),
            "p99_ms": statistics.median(run["p99_ms"] for run in runs), "errors": errors}


# -- part 2: encoding and decoding in the process --

def encoders() -> dict:
    """name -> function(batch of float32 rows) -> bytes, as a server would answer OpenAI's /v1/embeddings."""
    import orjson
    found = {
        "json (stdlib), floats": lambda rows: json.dumps(openai_dict([r.tolist() for r in rows], "m"),
                                                         separators=(",", ":")).encode(),
        "orjson, floats": lambda rows: orjson.dumps(openai_dict([r.tolist() for r in rows], "m")),
        "orjson, float32 ndarray (OPT_SERIALIZE_NUMPY)": lambda rows: orjson.dumps(openai_dict(list(rows), "m"),
                                                                                   option=orjson.OPT_SERIALIZE_NUMPY),
        "msgspec.json, floats (Struct)": lambda rows: ENCODER.encode(openai_struct(rows, "m")),
        # msgspec's structs with each row's text from orjson (msgspec has no float32 type; Raw is spliced in as is).
        "msgspec.json, rows as orjson float32 (msgspec.Raw)": lambda rows: ENCODER.encode(openai_struct(
            [msgspec.Raw(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY)) for row in rows], "m", as_raw=True)),
        "base64 '<f4' + msgspec.json": lambda rows: ENCODER.encode(openai_struct(rows, "m", as_base64=True)),
    }
    try:
        _, _, answer = pydantic_models()
    except ImportError:
        return found
    found["pydantic (FastAPI response_model), floats"] = lambda rows: answer(rows, "m").model_dump_json().encode()
    return found


def float_texts(encoders_: dict, value: np.float32) -> dict[str, str]:
    """What each encoder prints for one float32 value."""
    one = np.full((1, 1), value, dtype=np.float32)
    return {name: encode(one).split(b'"embedding":')[1].split(b"}")[0].decode() for name, encode in encoders_.items()}


def round_trips(encoders_: dict, values: np.ndarray) -> dict[str, bool]:
    """Whether np.float32(json value) == the original for every value, read back with json, orjson and msgspec."""
    import orjson
    decoders = {"json": json.loads, "orjson": orjson.loads, "msgspec": msgspec.json.decode}
    exact = {}
    for name, encode in encoders_.items():
        body = encode(values[None, :])
        ok = True
        for decode in decoders.values():
            embedding = decode(body)["data"][0]["embedding"]
            back = (np.frombuffer(base64.b64decode(embedding), "<f4") if "base64" in name
                    else np.array(embedding).astype(np.float32))
            ok = ok and back.dtype == np.float32 and np.array_equal(back.view(np.uint32), values.view(np.uint32))
        exact[name] = ok
    return exact


def random_float32(count: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, size=4 * count, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return {"embedding-like (normal / sqrt(384))": (rng.standard_normal(count) / np.sqrt(DIM)).astype(np.float32),
            "any finite float32 (random bits)": bits[np.isfinite(bits)][:count]}


def per_call_us(function, number: int, repeats: int) -> float:
    return 1e6 * statistics.median(timeit.repeat(function, number=number, repeat=repeats)) / number


def bench_encoding(number: int, repeats: int) -> dict:
    rng = np.random.default_rng(1)
    batch = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    batch /= np.linalg.norm(batch, axis=1, keepdims=True)
    found = encoders()
    encode_rows = [{"encoder": name, "us": per_call_us(lambda f=f: f(batch), number, repeats), "bytes": len(f(batch))}
                   for name, f in found.items()]
    checks = {label: round_trips(found, values) for label, values in random_float32(100_000, 2).items()}
    printed = float_texts(found, batch[0, 0])
    # the part of the float rows' cost that is numpy's, not the encoder's
    tolist_us = per_call_us(lambda: [row.tolist() for row in batch], number, repeats)
    return {"tolist_us": tolist_us, "encode": encode_rows, "round_trip": checks, "printed": printed, "value": float(batch[0, 0]),
            "decode": bench_decoding(number, repeats)}


def bench_decoding(number: int, repeats: int) -> list[dict]:
    """A 32-text request body (~3 kB), decoded by each library the way its server would."""
    import orjson
    texts = [f"document {i}: a sentence of ordinary length about a topic, as a query or a passage might be"
             for i in range(BATCH)]
    body = json.dumps({"input": texts, "model": "m"}).encode()
    decoders = {"json (stdlib)": lambda: json.loads(body), "orjson": lambda: orjson.loads(body),
                "msgspec.json (Struct)": lambda: REQUEST_DECODER.decode(body)}
    try:
        Request, _, _ = pydantic_models()
        decoders["pydantic model_validate_json (FastAPI)"] = lambda: Request.model_validate_json(body)
    except ImportError:
        pass
    return [{"decoder": name, "us": per_call_us(f, number, repeats), "bytes": len(body)} for name, f in decoders.items()]


# -- the report --

def print_tables(server_rows: list[dict], encoding: dict | None, args) -> None:
    print(f"\n{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end; "
          f"{args.requests} requests x {args.repeats} repeats per stack, concurrency {CONCURRENCY}, "
          f"request {len(REQUEST_BODY)} B, response {len(response_body('m'))} B\n")
    print("| stack | server CPU us / request | (min-max) | requests/s | p99 ms | errors |")
    print("|---|---:|---:|---:|---:|---|")
    for row in server_rows:
        if "skipped" in row:
            print(f"| {row['stack']} | skipped: {row['skipped']} | | | | |")
        else:
            low, high = row["server_cpu_range"]
            print(f"| {row['stack']} | {row['server_cpu_us']:.0f} | {low:.0f}-{high:.0f} | {row['requests_s']:.0f} | "
                  f"{row['p99_ms']:.1f} | "
                  f"{row['errors'] or 'none'} |")
    if encoding is None:
        return
    print(f"\n| {BATCH} x {DIM} float32, OpenAI's list | us / response | bytes | "
          + " | ".join(f"float32 exact: {label}" for label in encoding["round_trip"]) + " |")
    print("|---|---:|---:|" + "---|" * len(encoding["round_trip"]))
    for row in encoding["encode"]:
        exact = [("yes" if checks[row["encoder"]] else "NO") for checks in encoding["round_trip"].values()]
        print(f"| {row['encoder']} | {row['us']:.0f} | {row['bytes']} | " + " | ".join(exact) + " |")
    print(f"\n(the 'floats' rows include ndarray.tolist() of the {BATCH} rows: {encoding['tolist_us']:.0f} us)")
    print(f"\nfloat32 {encoding['value']!r} (widened to float64) is printed as:")
    for name, text in encoding["printed"].items():
        print(f"  {name}: {text}")
    print("\n| request body, 32 texts | us / body | bytes |\n|---|---:|---:|")
    for row in encoding["decode"]:
        print(f"| {row['decoder']} | {row['us']:.1f} | {row['bytes']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacks", default=",".join(STACKS), help="comma-separated, of: " + ", ".join(STACKS))
    parser.add_argument("--requests", type=int, default=4000, help="requests per repeat per stack")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--log-dir", default="/tmp/bench_http_stack", help="the servers' logs")
    parser.add_argument("--skip-encoding", action="store_true")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.port)
    if args.client:
        return client_loop()
    stacks = args.stacks.split(",")
    unknown = sorted(set(stacks) - set(STACKS))
    if unknown:
        parser.error(f"unknown stacks {unknown}; known: {list(STACKS)}")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    server_rows = bench_servers(stacks, args.requests, args.repeats, log_dir)
    encoding = None if args.skip_encoding else bench_encoding(number=50, repeats=7)
    print_tables(server_rows, encoding, args)


if __name__ == "__main__":
    main()
