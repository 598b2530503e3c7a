"""Render worker process: `python -m pooling_pipeline.workers.main <config file>` (a WorkerConfig
as JSON, written by the process group).

Takes RenderBatch from the frontend (addressed to this process: see runtime.addressed_socket),
renders it, pushes EngineInputBatch straight to the engine core the batch names (one PUSH socket
per engine core: data parallel engines are fed by the same workers) and per-request failures back
to the frontend. Started as its own module entry point (never forked from the caller), so it works
from scripts without a main guard and from notebooks. Every message carries the group's key; one
that does not is dropped.
"""

from __future__ import annotations

import gc
import os

# One tokenizer thread per worker: parallelism comes from the number of workers (see the CPU plan).
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import sys

import msgspec
import zmq

from pooling_pipeline.core.shared import messages as m
from pooling_pipeline.core.shared.config import WorkerConfig
from pooling_pipeline.core.shared.runtime import (
    BusyClock,
    DropLog,
    WorkCount,
    addressed_socket,
    exit_process,
    exit_with_parent,
    leave_owner_signals,
    release_free_memory,
    run_maybe_profiled,
    setup_logging,
    socket,
    socket_dir_of,
    start_heartbeat,
    take_group_key,
)
from pooling_pipeline.core.shared.serial import Decoder, Encoder

POLL_MS = 500
IMAGE_ROWS_PER_PART = 8  # (see parts_to_send_as_rendered)


def main(argv: list[str]) -> int:
    leave_owner_signals()  # Ctrl-C or a supervisor's SIGTERM to the whole group: the frontend's to handle
    with open(argv[1], "rb") as f:  # the config file the group wrote (see ProcessGroup._spawn)
        cfg = msgspec.json.decode(f.read(), type=WorkerConfig)
    key = take_group_key()
    log = setup_logging(cfg.log_level, f"worker{cfg.index}")
    exit_with_parent(cfg.parent_pid, socket_dir_of(cfg.output_endpoint))

    ctx = zmq.Context(1)
    to_front = socket(ctx, zmq.PUSH, cfg.output_endpoint, bind=False)
    encoder = Encoder(key)
    try:
        from pooling_pipeline.workers.render import build_renderer, load_plugin

        plugin = load_plugin(cfg.io_processor) if cfg.io_processor else None
        renderer = build_renderer(cfg.model, plugin, cfg.image_draft, cfg.max_image_pixels)
        # Loading parsed the tokenizer's files and serialized its backend twice: hand the freed heap
        # back (~4 MB of a worker's ~100 with the bundled model; more with a large vocabulary).
        gc.collect()
        release_free_memory()
    except Exception as e:
        log.exception("cannot load the tokenizer")
        to_front.send_multipart(encoder.encode(m.Ready.failed("worker", cfg.index, os.getpid(), e)))
        # (sent before the process ends: exit_process skips the interpreter's teardown)
        ctx.destroy(linger=2000)
        return 1

    work = addressed_socket(ctx, cfg.work_endpoint, cfg.routing_id)
    to_engines = [socket(ctx, zmq.PUSH, endpoint, bind=False) for endpoint in cfg.engine_endpoints]
    rule = renderer.tokenizer.rule
    to_front.send_multipart(encoder.encode(m.Ready(
        role="worker", index=cfg.index, pid=os.getpid(),
        info={"num_special_tokens": renderer.tokenizer.num_special_tokens,
              "prefix_truncation": rule.exact, "prefix_truncation_reason": rule.reason,
              "suffix_truncation": rule.suffix_exact,
              "truncation_side": str(getattr(renderer.hf, "truncation_side", "right"))},
    )))
    clock, count = BusyClock(), WorkCount()
    start_heartbeat(ctx, cfg.output_endpoint, "worker", cfg.index, clock, key, count)
    run_maybe_profiled(lambda: serve(cfg, renderer, work, to_engines, to_front, clock, count, log, key),
                       f"worker{cfg.index}")
    log.info("shutting down")
    ctx.destroy(linger=0)
    return 0


def serve(cfg: WorkerConfig, renderer, work: zmq.Socket, to_engines: list[zmq.Socket], to_front: zmq.Socket,
          clock: BusyClock, count: WorkCount, log, key: bytes) -> None:
    """The loop: RenderBatch in, EngineInputBatch (and RenderFailed) out, until Shutdown. `count`
    tells the frontend (in the heartbeat) how many messages arrived and were handled: what it
    sent and this worker never took is work lost on the way."""
    decoder, encoder = Decoder(m.WorkerInbound, key=key), Encoder(key)
    dropped = DropLog(log, "a malformed or foreign message")
    render_s = 0.0  # time spent rendering, not yet reported (it rides on the next EngineInputBatch)

    def handle(frames) -> bool:
        """One message; False for Shutdown."""
        nonlocal render_s
        try:
            msg = decoder.decode(frames)
            if isinstance(msg, m.Shutdown):
                return False
            if isinstance(msg, m.Probe):  # the frontend checking the connection: nothing to do
                return True
            msg.check()
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            dropped(e)
            return True
        if not 0 <= msg.engine < len(to_engines):  # well-formed, but names no engine core of the group
            dropped(ValueError(f"RenderBatch.engine={msg.engine} is outside [0, {len(to_engines)})"))
            return True
        to_engine = to_engines[msg.engine]
        failed = []
        for part in parts_to_send_as_rendered(msg):
            with clock:
                rows, part_failed = renderer.render(part)
                batches, refused = rows.messages(cfg.index, msg.call, cfg.max_message_items, cfg.model.vocab_size)
            render_s += clock.last_s
            if batches:  # the time rides on the next message to the engine
                batches[0].render_s, render_s = render_s, 0.0
            for batch in batches:  # chunk mode can make many inputs
                batch.resent = msg.resent
                to_engine.send_multipart(encoder.encode(batch))
            failed += part_failed + refused
        if failed:
            to_front.send_multipart(encoder.encode(m.RenderFailed(
                call=msg.call, indices=[index for index, _ in failed], errors=[error for _, error in failed])))
        return True

    while True:
        if not work.poll(POLL_MS):
            continue
        frames = work.recv_multipart(copy=False)
        count.received += 1
        try:
            if not handle(frames):
                return
        finally:
            count.finished += 1


def parts_to_send_as_rendered(batch: m.RenderBatch) -> list[m.RenderBatch]:
    """The batch, or for images and audio its parts of IMAGE_ROWS_PER_PART: an image costs 2-100 ms
    to decode and resize, so a batch of 64 would hold the engine idle for up to seconds at a call's
    start; each part goes to the engine as soon as it is rendered (the engine still batches what
    has arrived under its token budget)."""
    items = batch.items
    if items is None or len(items) <= IMAGE_ROWS_PER_PART or all(item.media is None for item in items):
        return [batch]
    return [msgspec.structs.replace(batch, indices=batch.indices[start:start + IMAGE_ROWS_PER_PART],
                                    items=items[start:start + IMAGE_ROWS_PER_PART])
            for start in range(0, len(items), IMAGE_ROWS_PER_PART)]


if __name__ == "__main__":
    exit_process(main(sys.argv))
