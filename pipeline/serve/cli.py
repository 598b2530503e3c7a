"""`pipeline-serve`: one model's process group behind HTTP.

    pipeline-serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] [pipeline options]

Every `Pipeline` option is a flag here too, read from its declaration (`options.PipelineOptions`). The
group starts before the socket is bound, so a reachable server is a ready one (`GET /health`). SIGTERM
(or Ctrl-C) drains: no new connections, the requests in flight are answered, then the group is closed
and the command exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from pooling_pipeline.cli_flags import declared_flag, positive_int, positive_seconds
from pooling_pipeline.options import PipelineOptions, declared

log = logging.getLogger("pipeline.serve")

# Pipeline options that are not flags: the model is its own flag; a simulated device takes a preset name.
NOT_FLAGS = ("sim_device",)
DEFAULT_PORT = 8000


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pipeline-serve", description=__doc__,
                                 formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=100))
    d = " (default: %(default)s)"
    ap.add_argument("--model", default=None,
                    help="local model directory or hub id 'org/name' (default: bundled all-MiniLM-L6-v2)")
    ap.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="the names a request's `model` may give (default: --model as given, or all-MiniLM-L6-v2)")
    http = ap.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 serves other machines" + d)
    http.add_argument("--port", type=int, default=DEFAULT_PORT, help="port; 0 picks a free one (printed)" + d)
    http.add_argument("--api-key", default=os.environ.get("PIPELINE_API_KEY"),
                      help="a Bearer token every route but the health checks (GET /health, / and /ping) asks for "
                           "(default: $PIPELINE_API_KEY, else none)")
    http.add_argument("--max-body-bytes", type=positive_int, default=64 << 20,
                      help="a larger request body is answered 413 before it is read" + d)
    http.add_argument("--max-client-batch-size", type=positive_int, default=2048,
                      help="inputs in one request; more is a 413 (OpenAI takes 2,048; a request larger than the "
                           "pipeline's window is fed through it)" + d)
    http.add_argument("--max-queue-wait-s", type=positive_seconds, default=10.0,
                      help="seconds a request waits for room in the pipeline's window before its 429" + d)
    http.add_argument("--auto-truncate", action="store_true",
                      help="cut over-long inputs where the request does not say (default: refuse them, naming them)")
    http.add_argument("--rerank-dialect", choices=("vllm", "infinity"), default="vllm",
                      help="the answer of POST /rerank to a body with `documents` (TEI's own has `texts`): vllm (each "
                           "document {\"text\": ...}: vLLM's, litellm's hosted_vllm/) or infinity (each document a "
                           "string: Infinity's, litellm's infinity/); /v1/rerank and /v2/rerank stay vLLM's, "
                           "Jina's and Cohere's" + d)
    http.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                      help="image inputs may name files under this directory (default: none; base64 and data: URIs only)")
    http.add_argument("--graceful-shutdown-s", type=positive_seconds, default=60.0,
                      help="on SIGTERM, how long requests in flight may take to finish" + d)
    http.add_argument("--timeout-keep-alive", type=positive_seconds, default=5.0,
                      help="seconds an idle keep-alive connection stays open (uvicorn's flag)" + d)
    http.add_argument("--timeout-header", type=positive_seconds, default=60.0,
                      help="seconds a request's line and headers may take from its first byte (a connection's "
                           "first request: from its open); later, 408 and closed (nginx's client_header_timeout)" + d)
    http.add_argument("--timeout-body", type=positive_seconds, default=60.0,
                      help="seconds a request body may go without a byte; later, 408 and closed (nginx's "
                           "client_body_timeout)" + d)
    http.add_argument("--min-body-rate", type=positive_int, default=16 << 10, metavar="BYTES_PER_S",
                      help="after its first --timeout-body seconds a body must average this many bytes a second, "
                           "else 408 (Apache's MinRate: a body sent a byte a second is not held for ever)" + d)
    http.add_argument("--timeout-send", type=positive_seconds, default=60.0,
                      help="seconds a client may take no byte of its answers; later the connection is aborted, with "
                           "the request it had sent next and that request's body (nginx's send_timeout)" + d)
    http.add_argument("--max-connections", type=positive_int, default=1024,
                      help="open connections; a request on one opened past them is a 503 and the connection closed "
                           "(uvicorn's --limit-concurrency), the health checks excepted" + d)
    http.add_argument("--max-held-body-bytes", type=positive_int, default=256 << 20,
                      help="bytes of request bodies held at once, all connections together (a body is held from its "
                           "first byte to its answer); a body that would pass it is a 503; at least --max-body-bytes" + d)
    http.add_argument("--access-log", action="store_true", help="log every request (costs CPU per request)")
    http.add_argument("--http-protocol", choices=("pipeline", "uvicorn"), default="pipeline",
                      help="pipeline: this server's own HTTP/1.1 connection (httptools' parser; requests go to the "
                           "app directly); uvicorn: uvicorn's httptools protocol and the app through ASGI" + d)
    pipe = ap.add_argument_group("Pipeline options (as Pipeline(...) takes them)")
    for name in declared(PipelineOptions):
        if name not in NOT_FLAGS:
            declared_flag(pipe, "--" + name.replace("_", "-"), PipelineOptions, name)
    pipe.add_argument("--sim-device", type=_sim_device, default=None, metavar="PRESET|A,B",
                      help="device=sim only: the simulated device, a preset name or 'A,B' (seconds per step, per "
                           "padded token)")
    return ap


def _sim_device(value: str) -> str | tuple[float, float]:
    if "," not in value:
        return value
    try:
        a, b = (float(x) for x in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sim-device A,B takes two numbers, got {value!r}") from None
    return a, b


def _pipeline_options(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in declared(PipelineOptions)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    stop = _StopSignals()
    from pooling_pipeline.api import Pipeline  # (after the flags: --help answers without torch)

    try:
        pipe = Pipeline(args.model, **_pipeline_options(args))
    except (ValueError, TypeError) as e:
        print(f"pipeline-serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 128 + (stop.signum or signal.SIGINT)
    try:
        return _serve(pipe, args, stop)
    finally:
        pipe.close()


def _serve(pipe, args: argparse.Namespace, stop: _StopSignals) -> int:
    import uvicorn

    from pooling_pipeline.serve.app import ServeSettings
    from pooling_pipeline.serve.protocol import protocol_factory
    from pooling_pipeline.serve.routes import make_app

    names = tuple(args.served_model_name or [args.model or "all-MiniLM-L6-v2"])
    try:
        app = make_app(pipe, ServeSettings(
            served_model_names=names, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
            max_client_batch_size=args.max_client_batch_size, rerank_dialect=args.rerank_dialect,
            max_queue_wait_s=args.max_queue_wait_s, auto_truncate=args.auto_truncate,
            allowed_local_media_path=args.allowed_local_media_path, timeout_header_s=args.timeout_header,
            timeout_body_s=args.timeout_body, min_body_rate=args.min_body_rate, timeout_send_s=args.timeout_send,
            max_connections=args.max_connections,
            max_held_body_bytes=args.max_held_body_bytes))
    except ValueError as e:
        print(f"pipeline-serve: error: {e}", file=sys.stderr)
        return 2
    # (no proxy-header middleware: it cost ~5 us a request in the benchmark's profile, for clients behind a
    # proxy this server does not know of; no Server header)
    # uvicorn runs the server (socket, signals, graceful shutdown); the per-request protocol is ours
    # unless asked (protocol.py says why)
    http = protocol_factory(app, access_log=args.access_log) if args.http_protocol == "pipeline" else "httptools"
    config = uvicorn.Config(app, host=args.host, port=args.port, http=http, lifespan="off",
                            proxy_headers=False, server_header=False,
                            access_log=args.access_log, timeout_graceful_shutdown=args.graceful_shutdown_s,
                            timeout_keep_alive=args.timeout_keep_alive,
                            # (uvicorn's own protocol: its connection cap; the read deadlines and the body
                            # budget are this server's protocol's)
                            limit_concurrency=args.max_connections if args.http_protocol == "uvicorn" else None,
                            log_level="info" if args.access_log else "warning")
    server = uvicorn.Server(config)
    stop.serving = True
    _event_loop_run(_run(server, args.host))
    # uvicorn re-raises the signal that stopped it after restoring our handler: it only records it.
    return 0


async def _run(server, host: str) -> None:
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        port = server.servers[0].sockets[0].getsockname()[1]
        # (a test or a supervisor reads this line for the port when it asked for --port 0)
        print(f"pipeline-serve: ready on http://{host}:{port}", flush=True)
    await task


def _event_loop_run(coro) -> None:
    """uvloop where installed (the `serve` extra: its loop costs less per request), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


class _StopSignals:
    """SIGTERM / SIGINT before the server runs stop the start-up (KeyboardInterrupt); while it runs,
    uvicorn takes them (drain) and hands them back here when it is done, to be recorded only."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.serving = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        first = self.signum is None
        self.signum = signum
        if first and not self.serving:
            raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
