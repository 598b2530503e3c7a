#!/usr/bin/env python
"""Throughput of the pipeline vs sentence-transformers vs the model's forward pass alone.

All three run in this one process and one run, side by side, on the same real text (built from
the Python standard library's docstrings, see pipeline/corpus.py), so the ratios hold on a noisy
shared machine. Each measurement is repeated and the median is reported.

    python scripts/bench_embed.py                 # all cases, 3 repeats
    python scripts/bench_embed.py --cases a c --repeats 5

Cases: (a) short sentences, (b) medium texts, (c) long documents of 50k-140k tokens truncated
to 256 tokens. The "limit" is the model's forward pass alone on the inputs already tokenized and
truncated, sorted by length and cut into batches under the same token budget as the engine's:
what the pipeline could reach if tokenization, transport and scheduling were free.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from core.config import default_model_path  # noqa: E402
from pipeline import Pipeline, corpus  # noqa: E402

CHARS_PER_TOKEN = 4.0  # measured on the docstring corpus with the bundled tokenizer (printed below)


def build_cases(selected: list[str], n_short: int, n_medium: int, n_long: int) -> dict[str, list[str]]:
    cases = {}
    if "a" in selected:
        cases["a"] = corpus.sentences(n_short, seed=1)
    if "b" in selected:
        cases["b"] = corpus.medium_texts(n_medium, seed=2, min_chars=600, max_chars=4000)
    if "c" in selected:
        cases["c"] = corpus.long_documents(n_long, int(50_000 * CHARS_PER_TOKEN), int(140_000 * CHARS_PER_TOKEN), seed=3)
    return cases


def forward_limit(model, token_lists: list[list[int]], max_num_seqs: int, max_tokens: int, device: str) -> float:
    """Seconds for the forward pass + pooling alone, on length-sorted batches built beforehand."""
    import torch

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
    tensors = []
    for batch in batches:
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
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=1)
            pooled.cpu()
    return time.perf_counter() - start


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--n-short", type=int, default=2000)
    ap.add_argument("--n-medium", type=int, default=200)
    ap.add_argument("--n-long", type=int, default=50)
    ap.add_argument("--st-batch-size", type=int, default=32)
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    model_path = default_model_path()
    cases = build_cases(args.cases, args.n_short, args.n_medium, args.n_long)
    start = time.perf_counter()
    pipe = Pipeline(device=args.device, dtype=args.dtype)
    startup_s = time.perf_counter() - start
    engine = pipe.stats()["engine"]
    torch.set_num_threads(int(engine["torch_threads"]))  # the reference gets the engine's threads
    torch_dtype = getattr(torch, engine["dtype"])
    st = SentenceTransformer(model_path, device=args.device if args.device != "auto" else engine["device"],
                             model_kwargs={"dtype": torch_dtype})
    model = st[0].auto_model
    budget = int(engine["max_num_batched_tokens"])
    print(f"model {model_path}\nengine {engine}\ncpu plan {pipe.cpu_plan.as_dict()}\nstartup {startup_s:.1f} s")

    rows = []
    try:
        for name, texts in cases.items():
            token_lists = st.tokenizer(texts, truncation=True, max_length=st.max_seq_length)["input_ids"]
            tokens = sum(map(len, token_lists))
            if name == "c":
                full = st.tokenizer(texts[:3], add_special_tokens=False)["input_ids"]
                sizes = [len(t) for t in full]
                print(f"case c: first documents have {sizes} tokens, {sum(map(len, texts[:3])) / sum(sizes):.2f} chars/token")
            pipe.embed(texts[: min(len(texts), 64)], use_tqdm=False)  # warm-up
            st.encode(texts[: min(len(texts), 64)], batch_size=args.st_batch_size)
            busy = []

            def run_pipeline():
                pipe.embed(texts, use_tqdm=False)
                busy.append(pipe.stats()["engine_busy_fraction"])

            t_pipe = median_time(run_pipeline, args.repeats)
            t_st = median_time(lambda: st.encode(texts, batch_size=args.st_batch_size), args.repeats)
            t_limit = statistics.median(
                forward_limit(model, token_lists, pipe.max_num_seqs, budget, st.device) for _ in range(args.repeats))
            rows.append((name, len(texts), tokens, t_pipe, t_st, t_limit, statistics.median(busy)))
            print(f"case {name} done: pipeline {t_pipe:.2f}s  sentence-transformers {t_st:.2f}s  limit {t_limit:.2f}s", flush=True)
    finally:
        pipe.close()

    print()
    print("| case | docs | kept tokens | pipeline docs/s | sentence-transformers docs/s | forward limit docs/s "
          "| pipeline / ST | pipeline / limit | engine busy |")
    print("|---|---|---|---|---|---|---|---|---|")
    labels = {"a": "(a) short sentences", "b": "(b) medium texts", "c": "(c) long docs -> 256"}
    for name, n, tokens, t_pipe, t_st, t_limit, busy in rows:
        print(f"| {labels[name]} | {n} | {tokens} | {n / t_pipe:.1f} | {n / t_st:.1f} | {n / t_limit:.1f} "
              f"| {t_st / t_pipe:.2f}x | {t_limit / t_pipe:.2f} | {busy:.0%} |")
    print(f"\nmedian of {args.repeats} repeats; torch threads {torch.get_num_threads()} for the references, "
          f"engine {engine}")


if __name__ == "__main__":
    main()
