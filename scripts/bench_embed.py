#!/usr/bin/env python
"""The reference embedding benchmark: the pipeline against what people use today, side by side.

Everything runs in this one process and one run, on the same real text (built from the Python
standard library's docstrings, see pipeline/corpus.py), so the ratios hold on a noisy shared
machine. Each measurement is repeated and the median is reported.

    python scripts/bench_embed.py                          # all workloads, 3 repeats
    python scripts/bench_embed.py --cases a d --repeats 5  # some of them
    python scripts/bench_embed.py --device cuda --dtype float16
    python scripts/bench_embed.py --device cuda --model DIR --cases b --medium-chars 2400 4000   # another model

Workloads: (a) short sentences, (b) medium texts, (c) long documents of 50k-140k tokens kept to
256 tokens, (d) mixed: mostly sentences, some medium texts and a few long documents, shuffled.
Measured on each, in turn:

* pipeline            -- `Pipeline.embed(texts)`, the whole process group;
* pipeline, token ids -- the same inputs already tokenized (what tokenization costs it);
* sentence-transformers `encode` (batch 32);
* transformers loop   -- what one writes by hand: tokenizer(batch, padding, truncation), forward,
                         mean pooling, normalize, in input order (batch 32);
* forward limit       -- the model's forward pass and pooling alone on the inputs already
                         tokenized, sorted by length and cut under the engine's token budget:
                         what the pipeline could reach if everything else were free.

Prints a markdown table of throughputs and ratios and the pipeline's own stage statistics, and
writes `<out>/bench_embed.json` and, when matplotlib is installed (`pip install -e ".[bench]"`),
`<out>/bench_embed.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import bench_peers
import corpus
import numpy as np

from pooling_pipeline import Pipeline  # noqa: E402
from pooling_pipeline.call_stats import format_stats  # noqa: E402
from pooling_pipeline.core.shared.model_folder.model_path import default_model_path  # noqa: E402

CHARS_PER_TOKEN = 4.0  # measured on the docstring corpus with the bundled tokenizer (printed below)
LABELS = {"a": "(a) short sentences", "b": "(b) medium texts", "c": "(c) long docs -> 256", "d": "(d) mixed"}
PEER_KEYS = {name: key for key, (name, _) in bench_peers.PEERS.items()}  # --peers name -> method key
PEER_NAMES = tuple(PEER_KEYS)


def build_cases(selected: list[str], n_short: int, n_medium: int, n_long: int,
                medium_chars: tuple[int, int] = (600, 4000)) -> dict[str, list[str]]:
    cases = {}
    if "a" in selected:
        cases["a"] = corpus.sentences(n_short, seed=1)
    if "b" in selected:
        cases["b"] = corpus.medium_texts(n_medium, seed=2, min_chars=medium_chars[0], max_chars=medium_chars[1])
    if "c" in selected:
        cases["c"] = corpus.long_documents(n_long, int(50_000 * CHARS_PER_TOKEN), int(140_000 * CHARS_PER_TOKEN), seed=3)
    if "d" in selected:
        mixed = (corpus.sentences(n_short // 2, seed=4)
                 + corpus.medium_texts(n_medium // 2, seed=5, min_chars=600, max_chars=4000)
                 + corpus.long_documents(max(1, n_long // 10), int(20_000 * CHARS_PER_TOKEN),
                                         int(60_000 * CHARS_PER_TOKEN), seed=6))
        random.Random(7).shuffle(mixed)
        cases["d"] = mixed
    return cases


def length_sorted_batches(token_lists: list[list[int]], max_num_seqs: int, max_tokens: int) -> list[list[list[int]]]:
    order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    batches, current = [], []
    for i in order:
        longest = len(token_lists[i])  # sorted: the newest is the longest
        if current and (len(current) >= max_num_seqs or longest * (len(current) + 1) > max_tokens):
            batches.append(current)
            current = []
        current.append(token_lists[i])
    if current:
        batches.append(current)
    return batches


def padding_of(batches: list[list[list[int]]]) -> tuple[float, int]:
    """(real / padded tokens, number of batches) of these batches, each padded to its longest row."""
    real = sum(len(row) for batch in batches for row in batch)
    padded = sum(max(map(len, batch)) * len(batch) for batch in batches)
    return real / padded, len(batches)


def mean_pool_normalize(torch, hidden, mask):
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=1)


def forward_limit(model, token_lists: list[list[int]], max_num_seqs: int, max_tokens: int, device) -> float:
    """Seconds for the forward pass + pooling alone, on length-sorted batches built beforehand."""
    import torch

    tensors = []
    for batch in length_sorted_batches(token_lists, max_num_seqs, max_tokens):
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, toks in enumerate(batch):
            ids[row, : len(toks)] = torch.tensor(toks)
            mask[row, : len(toks)] = 1
        tensors.append((ids.to(device), mask.to(device)))
    start = time.perf_counter()
    with torch.inference_mode():
        for ids, mask in tensors:
            hidden = model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)).last_hidden_state
            mean_pool_normalize(torch, hidden, mask).cpu()
    return time.perf_counter() - start


def transformers_loop(tokenizer, model, texts: list[str], batch_size: int, max_length: int, device) -> None:
    """The loop people write by hand with transformers alone."""
    import torch

    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(texts[start:start + batch_size], padding=True, truncation=True, max_length=max_length,
                            return_tensors="pt").to(device)
            hidden = model(**enc).last_hidden_state
            mean_pool_normalize(torch, hidden, enc["attention_mask"]).cpu()


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def draw_chart(results: list[dict], methods: list[str], labels: dict[str, str], path: Path,
               model_name: str = "all-MiniLM-L6-v2") -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    # A peer that was skipped or failed on some workload has no bar (its throughput is not known).
    methods = [m for m in methods if all(m in r["docs_per_s"] for r in results)]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        speedups = [r["docs_per_s"][method] / r["docs_per_s"]["sentence_transformers"] for r in results]
        xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(results))]
        ax.bar(xs, speedups, width, label=labels[method])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(results)), [LABELS[r["case"]] for r in results])
    ax.set_ylabel("throughput / sentence-transformers")
    ax.set_title(f"Embedding throughput ({model_name}), higher is better")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def pipeline_key(backend: str, token_ids: bool = False) -> str:
    return f"pipeline ({backend})" + (", token ids" if token_ids else "")


BACKEND_SPECS = ("torch", "openvino", "auto", "openvino:bfloat16", "auto:bfloat16")


def open_pipeline(backend: str, args) -> Pipeline:
    """`backend` is a backend name, or name:dtype (openvino:bfloat16) to override --dtype."""
    name, _, dtype = backend.partition(":")
    return Pipeline(model=args.model, device=args.device, dtype=dtype or args.dtype, backend=name)


def limit_model(pipe: Pipeline, torch_model, tokenizer):
    """What the forward limit runs for this pipeline: its engine's OpenVINO compilation (the same
    conversion, cached, and precision) when it runs OpenVINO, else the torch model."""
    engine = pipe.stats()["engine"]
    if engine.get("backend") != "openvino":
        return torch_model
    from pooling_pipeline.core.engine.openvino_model import to_openvino

    compiled, _ = to_openvino(torch_model, pipe.model_spec, output="last_hidden_state", base=False,
                              token_types="token_type_ids" in tokenizer.model_input_names,
                              threads=int(engine["torch_threads"]), precision=engine["precision"])
    return compiled


def embed_vectors(pipe: Pipeline, inputs) -> np.ndarray:
    return np.stack([out.embedding for out in pipe.embed(inputs, use_tqdm=False)])


def ratio(results_row: dict, numerator: str, denominator: str) -> str:
    s = results_row["seconds"]
    return f"{s[denominator] / s[numerator]:.2f}x" if numerator in s and denominator in s else "-"


def peer_cell(results_row: dict, key: str, peers_by_key: dict) -> str:
    peer = peers_by_key[key]
    if peer.skipped:
        return "skipped"
    return f"{results_row['docs_per_s'][key]:.1f}" if key in results_row["docs_per_s"] else "error"


def print_tables(results: list[dict], backends: list[str], peers: list, repeats: int) -> None:
    peers_by_key = {p.key: p for p in peers}
    peer_labels = [p.label for p in peers]
    print("| workload | docs | kept tokens | pipeline docs/s | pipeline, token ids docs/s | sentence-transformers docs/s | "
          + "".join(f"{label} docs/s | " for label in peer_labels)
          + "transformers loop docs/s | forward limit docs/s | pipeline / ST | "
          + "".join(f"pipeline / {label} | " for label in peer_labels)
          + "pipeline / transformers loop | own forward limit docs/s | pipeline / own limit | token ids / own limit "
          + "| max abs(cos - 1) vs ST | engine busy |")
    print("|---|---|---|---|---|---|" + "---|" * (2 * len(peers)) + "---|---|---|---|---|---|---|---|---|")
    for r in results:
        per_s = r["docs_per_s"]
        for b in backends:
            p, ids, own = pipeline_key(b), pipeline_key(b, token_ids=True), f"forward_limit ({b})"
            print(f"| {LABELS[r['case']]}, {p} | {r['docs']} | {r['kept_tokens']} | {per_s[p]:.1f} | {per_s[ids]:.1f} | "
                  f"{per_s['sentence_transformers']:.1f} | "
                  + "".join(f"{peer_cell(r, peer.key, peers_by_key)} | " for peer in peers)
                  + f"{per_s['transformers_loop']:.1f} | {per_s['forward_limit']:.1f} | {ratio(r, p, 'sentence_transformers')} | "
                  + "".join(f"{ratio(r, p, peer.key)} | " for peer in peers)
                  + f"{ratio(r, p, 'transformers_loop')} | {per_s[own]:.1f} | {r['seconds'][own] / r['seconds'][p]:.2f} | "
                  f"{r['seconds'][own] / r['seconds'][ids]:.2f} | {r['max_cos_deviation'][p]:.1e} | "
                  f"{r['per_backend'][b]['engine_busy']:.0%} |")
    print(f"\nmedian of {repeats} repeats; 'forward limit' is torch's forward pass, 'own forward limit' the "
          "pipeline's backend's (OpenVINO: the engine's compilation)")
    if not peers:
        return
    print("\n| peer | environment | load + export s | workload | docs/s | max abs(cos - 1) vs ST float32 |")
    print("|---|---|---|---|---|---|")
    for peer in peers:
        if peer.skipped:
            print(f"| {peer.label} | skipped: {peer.skipped} | | | | |")
            continue
        v = peer.info["versions"]
        env = (f"sentence-transformers {v.get('sentence-transformers')}, "
               + ", ".join(f"{name} {v[name]}" for name in ("optimum-intel", "optimum-onnx", "openvino", "onnxruntime")
                           if name in v) + f"; {peer.info['detail']}")
        for i, r in enumerate(results):
            cells = (f"{r['docs_per_s'][peer.key]:.1f} | {r['max_cos_deviation'][peer.key]:.1e}"
                     if peer.key in r["docs_per_s"] else f"error: {r['peer_errors'].get(peer.key)} |")
            first = f"{env} | {peer.info['load_s']:.1f}" if i == 0 else " | "
            print(f"| {peer.label} | {first} | {LABELS[r['case']]} | {cells} |")




def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["a", "b", "c", "d"], choices=list(LABELS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backends", default="auto",
                    type=lambda v: bench_peers.parse_list(v, BACKEND_SPECS, "--backends"),
                    help="the pipeline's backends, a comma list of " + ", ".join(BACKEND_SPECS)
                         + " (name:dtype overrides --dtype): one pipeline row each")
    ap.add_argument("--peers", default="openvino,openvino-f32,onnx,onnx-int8",
                    type=lambda v: bench_peers.parse_list(v, PEER_NAMES, "--peers"),
                    help="the CPU peers, a comma list of " + ", ".join(PEER_NAMES) + " (sentence-transformers' "
                         "backends; openvino runs OpenVINO's default precision, bfloat16 on a CPU with bfloat16 "
                         "units, openvino-f32 float32), or none")
    ap.add_argument("--peer-python", default=None,
                    help="the interpreter of an environment with the peers' packages (README, Benchmark); "
                         "default: this one, where they are skipped if they do not import")
    ap.add_argument("--model", default=None, help="a local model directory (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--n-short", type=int, default=2000)
    ap.add_argument("--n-medium", type=int, default=200)
    ap.add_argument("--n-long", type=int, default=50)
    ap.add_argument("--medium-chars", type=int, nargs=2, default=[600, 4000], metavar=("MIN", "MAX"),
                    help="length range of case (b)'s texts, in characters (2400 4000: all kept to a 512-token model's limit)")
    ap.add_argument("--batch-size", type=int, default=32, help="for sentence-transformers, its peers and the transformers loop")
    ap.add_argument("--out", default="bench-out", help="directory for bench_embed.json, bench_embed.png and the peers' logs")
    ap.add_argument("--no-decoder", action="store_true", help="skip the tiny Qwen3 decoder-embedder row")
    ap.add_argument("--no-static", action="store_true", help="skip the static-embedding (model2vec-shaped) rows")
    ap.add_argument("--static-only", action="store_true", help="only the static-embedding rows")
    return ap


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if not args.backends:
        ap.error("--backends: at least one")
    if args.static_only:
        static_rows(args)
        return

    import torch
    from sentence_transformers import SentenceTransformer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = args.model or default_model_path()
    cases = build_cases(args.cases, args.n_short, args.n_medium, args.n_long, tuple(args.medium_chars))
    work = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    pipes: dict[str, Pipeline] = {}
    peers: list = []
    try:
        startup_s = {}
        for backend in args.backends:
            start = time.perf_counter()
            pipes[backend] = open_pipeline(backend, args)
            startup_s[backend] = time.perf_counter() - start
        first = pipes[args.backends[0]]
        engine = first.stats()["engine"]
        threads = int(engine["torch_threads"])
        torch.set_num_threads(threads)  # the references get the engine's threads (the peers too, below)
        torch_dtype = getattr(torch, engine["dtype"])
        st = SentenceTransformer(model_path, device=engine["device"], model_kwargs={"dtype": torch_dtype})
        model, tokenizer, max_length = st[0].auto_model, st.tokenizer, st.max_seq_length
        # Every row's vectors are compared with ST's own in float32, on the engine's device: on a GPU run ST on
        # the CPU would take longer than the whole run (2,000 BERT-base documents of 512 tokens: many minutes).
        st_fp32 = st if engine["dtype"] == "float32" else SentenceTransformer(model_path, device=engine["device"])
        peers = bench_peers.start_peers([PEER_KEYS[name] for name in args.peers], args.peer_python, model_path, work, out,
                                        threads=threads, max_seq_length=max_length, batch_size=args.batch_size)
        for peer in peers:
            peer.wait_ready()
            print(f"peer {peer.label}: " + (f"skipped: {peer.skipped}" if peer.skipped else
                                            f"loaded in {peer.info['load_s']:.1f} s ({peer.info['detail']})"), flush=True)
        budget = int(engine["max_num_batched_tokens"])
        print(f"model {model_path}\nengine {engine}\ncpu plan {first.cpu_plan.as_dict()}\n"
              f"startup {', '.join(f'{b} {s:.1f} s' for b, s in startup_s.items())}")
        limits = {backend: limit_model(pipe, model, tokenizer) for backend, pipe in pipes.items()}
        results = [measure_case(name, texts, args, pipes, st, st_fp32, peers, work, tokenizer, model, max_length, budget,
                                limits) for name, texts in cases.items()]
        cpu_plan = first.cpu_plan.as_dict()
    finally:
        for pipe in pipes.values():
            pipe.close()
        for peer in peers:
            peer.close()
        shutil.rmtree(work, ignore_errors=True)

    print()
    print_tables(results, args.backends, peers, args.repeats)
    print(f"torch threads {torch.get_num_threads()} for the references and the peers, engine {engine}")

    decoder = None if args.no_decoder else decoder_row(args)
    static = None if args.no_static else static_rows(args)

    methods = ([pipeline_key(b, ids) for b in args.backends for ids in (False, True)] + ["sentence_transformers"]
               + [p.key for p in peers] + ["transformers_loop", "forward_limit"])
    labels = {**{m: m for m in methods}, "sentence_transformers": "sentence-transformers",
              "transformers_loop": "transformers loop", "forward_limit": "forward limit",
              **{p.key: p.label for p in peers}}
    record = {"decoder": decoder, "static": static, "model": model_path, "repeats": args.repeats, "engine": engine,
              "backends": args.backends,
              "cpu_plan": cpu_plan, "peers": {p.key: {"label": p.label, "skipped": p.skipped, **p.info} for p in peers},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "startup_s": startup_s, "results": results}
    (out / "bench_embed.json").write_text(json.dumps(record, indent=2))
    print(f"record: {out / 'bench_embed.json'}")
    if draw_chart(results, methods, labels, out / "bench_embed.png", Path(model_path).name):
        print(f"chart: {out / 'bench_embed.png'}")
    else:
        print("no chart: matplotlib is not installed (pip install -e \".[bench]\")")


def measure_case(name: str, texts: list[str], args, pipes: dict, st, st_fp32, peers: list, work: Path,
                 tokenizer, model, max_length: int, budget: int, limits: dict) -> dict:
    """One workload, every method in turn, in this order: the pipeline per backend, ST, its peers,
    the transformers loop, the forward limit."""
    token_lists = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    if name == "c":
        full = tokenizer(texts[:3], add_special_tokens=False)["input_ids"]
        sizes = [len(t) for t in full]
        print(f"case c: first documents have {sizes} tokens, {sum(map(len, texts[:3])) / sum(sizes):.2f} chars/token")
    warm = texts[: min(len(texts), 64)]
    for pipe in pipes.values():
        pipe.embed(warm, use_tqdm=False)
    st.encode(warm, batch_size=args.batch_size)
    transformers_loop(tokenizer, model, warm, args.batch_size, max_length, st.device)
    for limit in {id(m): m for m in [model, *limits.values()]}.values():  # warmed like the pipelines
        forward_limit(limit, token_lists[:64], next(iter(pipes.values())).max_num_seqs, budget, st.device)

    seconds, deviation, per_backend, peer_errors, full_stats = {}, {}, {}, {}, {}
    for backend, pipe in pipes.items():
        runs: dict[str, list] = {"busy": [], "stats": [], "vectors": []}

        def run_pipeline(inputs, pipe=pipe, runs=runs):
            runs["vectors"].append(embed_vectors(pipe, inputs))
            stats = pipe.stats()
            runs["busy"].append(stats["engine_busy_fraction"])
            runs["stats"].append(stats)

        key = pipeline_key(backend)
        seconds[key] = median_time(lambda: run_pipeline(texts), args.repeats)
        seconds[pipeline_key(backend, token_ids=True)] = median_time(
            lambda pipe=pipe: pipe.embed(token_lists, use_tqdm=False), args.repeats)
        stats = full_stats[backend] = runs["stats"][len(runs["stats"]) // 2]
        per_backend[backend] = {"engine_busy": statistics.median(runs["busy"]),
                                "padding_efficiency": stats["padding_efficiency"],
                                "stages": stats["stages"], "queue_depths": stats["queue_depths"]}
        deviation[key] = runs["vectors"][-1]  # compared once the reference is known
    st_runs = []
    seconds["sentence_transformers"] = median_time(
        lambda: st_runs.append(st.encode(texts, batch_size=args.batch_size)), args.repeats)
    reference = st_runs[-1] if st_fp32 is st else st_fp32.encode(texts, batch_size=args.batch_size)
    deviation = {k: bench_peers.max_cos_deviation(v, reference) for k, v in deviation.items()}
    texts_file = work / f"texts-{name}.json"
    texts_file.write_text(json.dumps(texts))
    for peer in peers:
        if peer.skipped:
            continue
        timed = peer.time(texts_file, args.repeats)
        if isinstance(timed, str):
            peer_errors[peer.key] = timed
            continue
        seconds[peer.key] = statistics.median(timed[0])
        deviation[peer.key] = bench_peers.max_cos_deviation(timed[1], reference)
    seconds["transformers_loop"] = median_time(
        lambda: transformers_loop(tokenizer, model, texts, args.batch_size, max_length, st.device), args.repeats)
    first = next(iter(pipes.values()))
    seconds["forward_limit"] = statistics.median(
        forward_limit(model, token_lists, first.max_num_seqs, budget, st.device) for _ in range(args.repeats))
    for backend, limit in limits.items():  # each pipeline against its own backend's forward pass
        seconds[f"forward_limit ({backend})"] = seconds["forward_limit"] if limit is model else statistics.median(
            forward_limit(limit, token_lists, first.max_num_seqs, budget, st.device) for _ in range(args.repeats))
    print(f"case {name} done: " + "  ".join(f"{k} {v:.2f}s" for k, v in seconds.items())
          + "".join(f"  {k}: {e}" for k, e in peer_errors.items()), flush=True)
    # The limit's batches, beside the pipeline's padding: it sorts the whole case at once.
    limit_padding = padding_of(length_sorted_batches(token_lists, first.max_num_seqs, budget))
    print(f"  forward limit: padding efficiency {limit_padding[0]:.1%} over {limit_padding[1]} batches")
    for backend, stats in full_stats.items():
        print(f"  pipeline ({backend}):")
        for line in format_stats(stats):
            print(f"    {line}")
    return {"case": name, "docs": len(texts), "kept_tokens": sum(map(len, token_lists)), "seconds": seconds,
            "docs_per_s": {k: len(texts) / v for k, v in seconds.items()}, "max_cos_deviation": deviation,
            "per_backend": per_backend, "peer_errors": peer_errors,
            "forward_limit_padding": {"padding_efficiency": limit_padding[0], "batches": limit_padding[1]}}


def decoder_row(args) -> dict:
    """A decoder embedder's speed on record: a tiny Qwen3-Embedding-shaped model (last-token pooling,
    EOS appended, instruction prompt) on the short sentences, pipeline against sentence-transformers."""
    from sentence_transformers import SentenceTransformer
    from tiny_models import build_tiny_decoder_embedder

    path = build_tiny_decoder_embedder()
    texts = corpus.sentences(args.n_short, seed=1)
    st = SentenceTransformer(path, device="cpu")
    with Pipeline(model=path, device=args.device, dtype=args.dtype) as pipe:
        pipe.embed(texts[:64], prompt_name="query", use_tqdm=False)
        st.encode(texts[:64], prompt_name="query", batch_size=args.batch_size)
        seconds = {"pipeline": median_time(lambda: pipe.embed(texts, prompt_name="query", use_tqdm=False),
                                           args.repeats),
                   "sentence_transformers": median_time(
                       lambda: st.encode(texts, prompt_name="query", batch_size=args.batch_size), args.repeats)}
        busy = pipe.stats()["engine_busy_fraction"]
    print("\n| decoder embedder (tiny Qwen3, 2 layers, 64 wide) | docs | pipeline docs/s | "
          "sentence-transformers docs/s | pipeline / ST | engine busy |")
    print("|---|---|---|---|---|---|")
    print(f"| (a) short sentences, query prompt | {len(texts)} | {len(texts) / seconds['pipeline']:.1f} | "
          f"{len(texts) / seconds['sentence_transformers']:.1f} | "
          f"{seconds['sentence_transformers'] / seconds['pipeline']:.2f}x | {busy:.0%} |")
    return {"model": path, "docs": len(texts), "seconds": seconds, "engine_busy": busy}


def static_rows(args) -> list[dict]:
    """A static embedding model (potion-base-8M's shape: ST's StaticEmbedding over a 30k WordPiece
    vocabulary, 256 wide, Normalize) on the short sentences and the medium texts, whole (no
    truncation, as ST): the pipeline against ST's `encode`, and against what tokenizing alone costs
    (the `tokenizers` library's batch call in this process, on the same texts, which is ST's own
    tokenization): with no transformer to run, the pipeline should be limited by tokenization."""
    from sentence_transformers import SentenceTransformer
    from tiny_models import build_static_embedding

    path = build_static_embedding()
    st = SentenceTransformer(path, device="cpu")
    tokenizer = st[0].tokenizer
    cases = {"(a) short sentences": corpus.sentences(args.n_short * 5, seed=1),
             "(b) medium texts": corpus.medium_texts(args.n_medium * 5, seed=2, min_chars=args.medium_chars[0],
                                                         max_chars=args.medium_chars[1])}
    rows = []
    with Pipeline(model=path, device=args.device) as pipe:
        workers = pipe.cpu_plan.render_workers
        for label, texts in cases.items():
            pipe.embed(texts[:256], use_tqdm=False)
            st.encode(texts[:256], batch_size=args.batch_size)
            got = np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False)])
            deviation = float(np.abs(got - st.encode(texts, batch_size=args.batch_size)).max())
            seconds = {"pipeline": median_time(lambda texts=texts: pipe.embed(texts, use_tqdm=False), args.repeats),
                       "sentence_transformers": median_time(
                           lambda texts=texts: st.encode(texts, batch_size=args.batch_size), args.repeats),
                       "tokenize_only": median_time(
                           lambda texts=texts: tokenizer.encode_batch(texts, add_special_tokens=False), args.repeats)}
            rows.append({"case": label, "docs": len(texts), "seconds": seconds, "max_abs_diff": deviation,
                         "engine_busy": pipe.stats()["engine_busy_fraction"], "render_workers": workers})
    print("\n| static embedding (potion-base-8M shape, 256 wide, float32) | docs | pipeline docs/s | "
          "ST docs/s | pipeline / ST | tokenizing alone docs/s | pipeline / tokenizing alone | max |diff| | engine busy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        s = row["seconds"]
        n = row["docs"]
        print(f"| {row['case']} | {n} | {n / s['pipeline']:.0f} | {n / s['sentence_transformers']:.0f} | "
              f"{s['sentence_transformers'] / s['pipeline']:.2f}x | {n / s['tokenize_only']:.0f} | "
              f"{s['tokenize_only'] / s['pipeline']:.2f}x | {row['max_abs_diff']:.1e} | {row['engine_busy']:.0%} |")
    print(f"(render workers: {rows[0]['render_workers'] if rows else '-'}; tokenizing alone is one `tokenizers` batch "
          "call in this process, with the library's own threads off as in the workers)")
    return rows


if __name__ == "__main__":
    main()
