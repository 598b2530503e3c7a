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
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import corpus

from pooling_pipeline import Pipeline  # noqa: E402
from pooling_pipeline.call_stats import format_stats  # noqa: E402
from pooling_pipeline.core.model_layout import default_model_path  # noqa: E402

CHARS_PER_TOKEN = 4.0  # measured on the docstring corpus with the bundled tokenizer (printed below)
LABELS = {"a": "(a) short sentences", "b": "(b) medium texts", "c": "(c) long docs -> 256", "d": "(d) mixed"}
METHODS = ("pipeline", "pipeline_token_ids", "sentence_transformers", "transformers_loop", "forward_limit")
METHOD_LABELS = {"pipeline": "pipeline", "pipeline_token_ids": "pipeline, token ids",
                 "sentence_transformers": "sentence-transformers", "transformers_loop": "transformers loop",
                 "forward_limit": "forward limit"}


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


def draw_chart(results: list[dict], path: Path, model_name: str = "all-MiniLM-L6-v2") -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(METHODS)
    for k, method in enumerate(METHODS):
        speedups = [r["docs_per_s"][method] / r["docs_per_s"]["sentence_transformers"] for r in results]
        xs = [i + (k - (len(METHODS) - 1) / 2) * width for i in range(len(results))]
        ax.bar(xs, speedups, width, label=METHOD_LABELS[method])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(results)), [LABELS[r["case"]] for r in results])
    ax.set_ylabel("throughput / sentence-transformers")
    ax.set_title(f"Embedding throughput ({model_name}), higher is better")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["a", "b", "c", "d"], choices=list(LABELS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="a local model directory (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--n-short", type=int, default=2000)
    ap.add_argument("--n-medium", type=int, default=200)
    ap.add_argument("--n-long", type=int, default=50)
    ap.add_argument("--medium-chars", type=int, nargs=2, default=[600, 4000], metavar=("MIN", "MAX"),
                    help="length range of case (b)'s texts, in characters (2400 4000: all kept to a 512-token model's limit)")
    ap.add_argument("--batch-size", type=int, default=32, help="for sentence-transformers and the transformers loop")
    ap.add_argument("--out", default="bench-out", help="directory for bench_embed.json and bench_embed.png")
    ap.add_argument("--no-decoder", action="store_true", help="skip the tiny Qwen3 decoder-embedder row")
    return ap


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    model_path = args.model or default_model_path()
    cases = build_cases(args.cases, args.n_short, args.n_medium, args.n_long, tuple(args.medium_chars))
    start = time.perf_counter()
    pipe = Pipeline(model=model_path, device=args.device, dtype=args.dtype)
    startup_s = time.perf_counter() - start
    engine = pipe.stats()["engine"]
    torch.set_num_threads(int(engine["torch_threads"]))  # the references get the engine's threads
    torch_dtype = getattr(torch, engine["dtype"])
    st = SentenceTransformer(model_path, device=engine["device"], model_kwargs={"dtype": torch_dtype})
    model, tokenizer, max_length = st[0].auto_model, st.tokenizer, st.max_seq_length
    budget = int(engine["max_num_batched_tokens"])
    print(f"model {model_path}\nengine {engine}\ncpu plan {pipe.cpu_plan.as_dict()}\nstartup {startup_s:.1f} s")

    results = []
    try:
        for name, texts in cases.items():
            token_lists = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
            tokens = sum(map(len, token_lists))
            if name == "c":
                full = tokenizer(texts[:3], add_special_tokens=False)["input_ids"]
                sizes = [len(t) for t in full]
                print(f"case c: first documents have {sizes} tokens, {sum(map(len, texts[:3])) / sum(sizes):.2f} chars/token")
            warm = texts[: min(len(texts), 64)]
            pipe.embed(warm, use_tqdm=False)
            st.encode(warm, batch_size=args.batch_size)
            transformers_loop(tokenizer, model, warm, args.batch_size, max_length, st.device)
            runs: dict[str, list] = {"busy": [], "stats": []}

            def run_pipeline(inputs):
                pipe.embed(inputs, use_tqdm=False)
                stats = pipe.stats()
                runs["busy"].append(stats["engine_busy_fraction"])
                runs["stats"].append(stats)

            seconds = {
                "pipeline": median_time(lambda: run_pipeline(texts), args.repeats),
                "pipeline_token_ids": median_time(lambda: pipe.embed(token_lists, use_tqdm=False), args.repeats),
                "sentence_transformers": median_time(lambda: st.encode(texts, batch_size=args.batch_size), args.repeats),
                "transformers_loop": median_time(
                    lambda: transformers_loop(tokenizer, model, texts, args.batch_size, max_length, st.device), args.repeats),
                "forward_limit": statistics.median(
                    forward_limit(model, token_lists, pipe.max_num_seqs, budget, st.device) for _ in range(args.repeats)),
            }
            stats = runs["stats"][len(runs["stats"]) // 2]
            results.append({"case": name, "docs": len(texts), "kept_tokens": tokens, "seconds": seconds,
                            "docs_per_s": {k: len(texts) / v for k, v in seconds.items()},
                            "engine_busy": statistics.median(runs["busy"]),
                            "padding_efficiency": stats["padding_efficiency"],
                            "stages": stats["stages"], "queue_depths": stats["queue_depths"]})
            print(f"case {name} done: " + "  ".join(f"{METHOD_LABELS[k]} {v:.2f}s" for k, v in seconds.items()), flush=True)
            for line in format_stats(stats):
                print(f"  {line}")
    finally:
        pipe.close()

    print()
    print("| workload | docs | kept tokens | " + " | ".join(f"{METHOD_LABELS[k]} docs/s" for k in METHODS)
          + " | pipeline / ST | pipeline / transformers loop | pipeline / limit | token ids / limit | engine busy |")
    print("|---|---|---|" + "---|" * len(METHODS) + "---|---|---|---|---|")
    for r in results:
        s = r["seconds"]
        print(f"| {LABELS[r['case']]} | {r['docs']} | {r['kept_tokens']} | "
              + " | ".join(f"{r['docs_per_s'][k]:.1f}" for k in METHODS)
              + f" | {s['sentence_transformers'] / s['pipeline']:.2f}x | {s['transformers_loop'] / s['pipeline']:.2f}x"
              f" | {s['forward_limit'] / s['pipeline']:.2f} | {s['forward_limit'] / s['pipeline_token_ids']:.2f}"
              f" | {r['engine_busy']:.0%} |")
    print(f"\nmedian of {args.repeats} repeats; torch threads {torch.get_num_threads()} for the references, "
          f"engine {engine}")

    decoder = None if args.no_decoder else decoder_row(args)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"decoder": decoder, "model": model_path, "repeats": args.repeats, "engine": engine,
              "cpu_plan": pipe.cpu_plan.as_dict(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "startup_s": startup_s, "results": results}
    (out / "bench_embed.json").write_text(json.dumps(record, indent=2))
    print(f"record: {out / 'bench_embed.json'}")
    if draw_chart(results, out / "bench_embed.png", Path(model_path).name):
        print(f"chart: {out / 'bench_embed.png'}")
    else:
        print("no chart: matplotlib is not installed (pip install -e \".[bench]\")")


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


if __name__ == "__main__":
    main()
