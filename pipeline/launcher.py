"""`pipeline-run`: embed a corpus from files into chunked .npy arrays on disk.

    pipeline-run                                   # the bundled sample, default model -> ./pipeline-out
    pipeline-run --input docs.jsonl --text-field body --id-field url --output out/
    cat lines.txt | pipeline-run --input - --output out/

Inputs are streamed (never loaded whole): JSONL (one object per line, the text under
--text-field, the id under --id-field, else the line number) or plain text (one record per line).
The output directory holds embeddings-NNNNN.npy (float32 [rows, dim]) with ids-NNNNN.json beside
each, and manifest.json; `pipeline.load_results(DIR)` reads them back in input order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

SAMPLE = Path(__file__).resolve().parent / "data" / "sample.jsonl"


def read_records(paths: list[str], text_field: str, id_field: str | None, limit: int | None) -> Iterator[tuple[str, str]]:
    """(id, text) pairs from the inputs, one line at a time."""
    count = 0
    for path in paths:
        stream = sys.stdin if path == "-" else open(path, encoding="utf-8")
        name = "stdin" if path == "-" else path
        try:
            is_jsonl = path != "-" and path.endswith((".jsonl", ".json", ".ndjson"))
            for line_no, line in enumerate(stream, start=1):
                if limit is not None and count >= limit:
                    return
                line = line.rstrip("\n")
                if is_jsonl or (path == "-" and line.startswith("{")):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        raise ValueError(f"{name} line {line_no}: not valid JSON ({e})") from None
                    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                        raise ValueError(f"{name} line {line_no}: no string field {text_field!r}")
                    rid = str(record[id_field]) if id_field and id_field in record else f"{name}:{line_no}"
                    text = record[text_field]
                else:
                    rid, text = f"{name}:{line_no}", line
                count += 1
                yield rid, text
        finally:
            if stream is not sys.stdin:
                stream.close()


def model_hash(model_dir: str) -> str:
    """sha256 over the model's config and weight files (names and bytes)."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file() and path.suffix in (".json", ".safetensors", ".bin", ".txt", ".model"):
            digest.update(path.name.encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def load_results(directory: str | Path) -> tuple[list[str], np.ndarray]:
    """Reads a pipeline-run output directory back: (ids, array [rows, dim]) in input order."""
    directory = Path(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    ids: list[str] = []
    arrays = []
    for chunk in manifest["chunks"]:
        arrays.append(np.load(directory / chunk["data"]))
        ids.extend(json.loads((directory / chunk["ids"]).read_text()))
    data = np.concatenate(arrays) if arrays else np.zeros((0, manifest.get("dim", 0)), dtype=np.float32)
    return ids, data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pipeline-run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", default=[str(SAMPLE)], help="JSONL or text files, or - for stdin")
    ap.add_argument("--output", default="pipeline-out")
    ap.add_argument("--model", default=None, help="local model directory (default: bundled all-MiniLM-L6-v2)")
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--id-field", default="id")
    ap.add_argument("--workers", type=int, default=None, help="render workers (default: planned from the cores)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--truncate", type=int, default=None, help="keep at most this many tokens per record")
    ap.add_argument("--limit", type=int, default=None, help="stop after this many records")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunk-rows", type=int, default=65536, help="rows per output file")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    from pipeline import Pipeline

    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids: list[str] = []
    rows: list[np.ndarray] = []
    chunks: list[dict] = []
    total = 0
    records = read_records(args.input, args.text_field, args.id_field, args.limit)
    id_buffer: deque[str] = deque()  # ids of records handed to the pipeline, not yet written

    def texts() -> Iterator[str]:
        for rid, text in records:
            id_buffer.append(rid)  # ids are consumed in the same order the results come back
            yield text

    def flush() -> None:
        if not rows:
            return
        index = len(chunks)
        data_name, ids_name = f"embeddings-{index:05d}.npy", f"ids-{index:05d}.json"
        np.save(out_dir / data_name, np.stack(rows).astype(np.float32, copy=False))
        (out_dir / ids_name).write_text(json.dumps(ids))
        chunks.append({"data": data_name, "ids": ids_name, "rows": len(rows)})
        rows.clear()
        ids.clear()

    start = time.perf_counter()
    with Pipeline(model=args.model, num_render_workers=args.workers, max_num_seqs=args.max_num_seqs,
                  device=args.device, dtype=args.dtype) as pipe:
        dim = None
        for out in pipe.embed_stream(texts(), truncate_prompt_tokens=args.truncate, use_tqdm=not args.quiet):
            rows.append(out.embedding)
            ids.append(id_buffer.popleft())
            dim = out.embedding.shape[0]
            total += 1
            if len(rows) >= args.chunk_rows:
                flush()
        flush()
        stats = pipe.stats()
        spec = pipe.model_spec
    wall = time.perf_counter() - start
    manifest = {
        "version": __import__("pipeline").__version__,
        "task": "embed",
        "model": spec.path,
        "model_sha256": model_hash(spec.path),
        "params": {"truncate_prompt_tokens": args.truncate, "max_num_seqs": args.max_num_seqs,
                   "pooling": spec.pooling, "normalize": spec.normalize},
        "inputs": args.input,
        "rows": total,
        "dim": dim,
        "chunks": chunks,
        "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    print(f"embedded {total} records in {wall:.1f} s ({total / max(stats['wall_s'], 1e-9):.1f} records/s, "
          f"{stats['tokens_per_s']:.0f} tokens/s, engine busy {stats['engine_busy_fraction']:.0%}) -> {out_dir}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
