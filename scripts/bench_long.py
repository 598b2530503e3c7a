#!/usr/bin/env python
"""Long inputs: what truncation costs, end to end against sentence-transformers, text vs token ids.

    python scripts/bench_long.py                 # 3 repeats, medians

1. Render cost of one ~100k-token document kept to 256 / 512 tokens: the worker's planner
   (a whitespace-aligned prefix) vs full tokenization then truncation (what transformers does).
2. End to end, 50 documents of 50k-140k tokens truncated to 256: the pipeline vs
   sentence-transformers `encode`.
3. The same documents through the pipeline as text vs as token ids tokenized beforehand: how much
   of the pipeline's time tokenization still costs (1.0 = none).
All in one process and one run; real text from the Python standard library's docstrings.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import corpus
from bench_embed import median_time  # noqa: E402  (this folder is on sys.path when run as a script)

from pooling_pipeline import Pipeline  # noqa: E402
from pooling_pipeline.core.shared.model_folder.load import load_model_spec  # noqa: E402
from pooling_pipeline.core.shared.model_folder.model_path import default_model_path  # noqa: E402
from pooling_pipeline.workers.render import load_tokenizer  # noqa: E402
from pooling_pipeline.workers.truncation import TruncatingTokenizer  # noqa: E402

CHARS_PER_TOKEN = 4.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-long", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    tokenizer = load_tokenizer(load_model_spec(default_model_path()))
    encoder = TruncatingTokenizer(tokenizer)
    docs100k = [corpus.long_document(int(100_000 * CHARS_PER_TOKEN), seed=s) for s in range(5)]
    print(f"documents for the render test: {[len(tokenizer.encode(d).ids) for d in docs100k[:2]]} tokens ...")
    render_rows = []
    for keep in (256, 512):
        def planned():
            for d in docs100k:
                encoder.encode(d, keep)

        def full():
            for d in docs100k:
                enc = tokenizer.encode(d)
                enc.truncate(keep)

        t_plan = median_time(planned, args.repeats) / len(docs100k)
        t_full = median_time(full, args.repeats) / len(docs100k)
        assert all(encoder.encode(d, keep) == _full(tokenizer, d, keep) for d in docs100k)  # exact
        render_rows.append((keep, t_plan, t_full))

    import torch
    from sentence_transformers import SentenceTransformer

    docs = corpus.long_documents(args.n_long, int(50_000 * CHARS_PER_TOKEN), int(140_000 * CHARS_PER_TOKEN), seed=3)
    pipe = Pipeline(device=args.device)
    try:
        engine = pipe.stats()["engine"]
        torch.set_num_threads(int(engine["torch_threads"]))
        st = SentenceTransformer(default_model_path(), device=engine["device"])
        ids = [{"prompt_token_ids": t} for t in st.tokenizer(docs, truncation=True, max_length=256)["input_ids"]]
        pipe.embed(docs[:8], use_tqdm=False)  # warm-up
        st.encode(docs[:8])
        # Text and token ids alternate, so drift on a shared machine falls on both alike.
        text_times, ids_times = [], []
        for _ in range(args.repeats + 2):
            text_times.append(median_time(lambda: pipe.embed(docs, use_tqdm=False), 1))
            ids_times.append(median_time(lambda: pipe.embed(ids, use_tqdm=False), 1))
        t_text, t_ids = statistics.median(text_times), statistics.median(ids_times)
        t_st = median_time(lambda: st.encode(docs, batch_size=32), args.repeats)
    finally:
        pipe.close()

    print()
    print("| measurement | pipeline | reference | ratio | target |")
    print("|---|---|---|---|---|")
    for keep, t_plan, t_full in render_rows:
        print(f"| render one 100k-token document, keep {keep} tokens | planner {t_plan * 1e3:.2f} ms "
              f"| full tokenization {t_full * 1e3:.1f} ms | {t_full / t_plan:.0f}x faster | >= 100x |")
    n = len(docs)
    print(f"| {n} docs of 50k-140k tokens -> 256, end to end | {n / t_text:.1f} docs/s "
          f"| sentence-transformers {n / t_st:.1f} docs/s | {t_st / t_text:.2f}x | >= 3.5x |")
    print(f"| same docs: text vs pre-tokenized ids through the pipeline | text {n / t_text:.1f} docs/s "
          f"| token ids {n / t_ids:.1f} docs/s | {t_ids / t_text:.2f} | >= 0.97 |")
    print(f"\nmedian of {args.repeats} repeats; engine {engine}")


def _full(tokenizer, text: str, keep: int) -> list[int]:
    tokenizer.enable_truncation(max_length=keep)
    try:
        return tokenizer.encode(text).ids
    finally:
        tokenizer.no_truncation()


if __name__ == "__main__":
    main()
