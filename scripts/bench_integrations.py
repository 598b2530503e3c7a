#!/usr/bin/env python
"""The libraries that call an embedding model, driven by this project and by sentence-transformers
side by side in one run: the time each library takes to embed the same documents (LangChain's
`InMemoryVectorStore.from_texts`, LlamaIndex's `VectorStoreIndex`, KeyBERT's `extract_keywords`),
medians of several repeats, and the ratio. Needs the `integrations` extra.

    python scripts/bench_integrations.py                  # 2,000 documents, 3 repeats
    python scripts/bench_integrations.py --docs 500 --repeats 5

Both sides run float32 on the CPU with the bundled model (or --model); the pipeline is started
once, outside the timings (a library's user keeps it open), as the SentenceTransformer is loaded once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import corpus


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: kernels built, caches filled, on both sides alike
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import torch
    from langchain_core.vectorstores import InMemoryVectorStore
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from sentence_transformers import SentenceTransformer

    from pooling_pipeline import SentenceEncoder
    from pooling_pipeline.core.shared.model_folder.model_path import default_model_path
    from pooling_pipeline.integrations.llama_index import llama_index_embedding

    model_path = args.model or str(default_model_path())
    torch.set_num_threads(max(1, torch.get_num_threads()))
    docs = corpus.sentences(args.docs * 4 // 5, seed=7) + corpus.medium_texts(args.docs - args.docs * 4 // 5, seed=8)
    st = SentenceTransformer(model_path, device="cpu")

    class STEmbeddings:  # what a LangChain user writes around sentence-transformers
        def embed_documents(self, texts):
            return st.encode_document(list(texts)).tolist()

        def embed_query(self, text):
            return st.encode_query(text).tolist()

    nodes = [TextNode(text=text, id_=f"d{i}") for i, text in enumerate(docs)]
    rows = []
    with SentenceEncoder(model_path) as encoder:
        ours_llama, theirs_llama = llama_index_embedding(encoder), HuggingFaceEmbedding(model_name=model_path, device="cpu")
        cases = {
            "LangChain InMemoryVectorStore.from_texts": (
                lambda: InMemoryVectorStore.from_texts(docs, embedding=encoder),
                lambda: InMemoryVectorStore.from_texts(docs, embedding=STEmbeddings())),
            "LlamaIndex VectorStoreIndex(nodes)": (
                lambda: VectorStoreIndex([n.model_copy() for n in nodes], embed_model=ours_llama),
                lambda: VectorStoreIndex([n.model_copy() for n in nodes], embed_model=theirs_llama)),
        }
        try:
            from keybert import KeyBERT

            from pooling_pipeline.integrations.keyword_backends import keybert_backend

            few = docs[-max(1, args.docs // 20):]  # KeyBERT embeds every candidate word too: fewer documents
            ours_kb, theirs_kb = KeyBERT(model=keybert_backend(encoder)), KeyBERT(model=st)
            cases[f"KeyBERT extract_keywords ({len(few)} docs)"] = (
                lambda: ours_kb.extract_keywords(few, top_n=5), lambda: theirs_kb.extract_keywords(few, top_n=5))
        except ImportError:
            print("KeyBERT is not installed: its row is left out", file=sys.stderr)
        for name, (ours, theirs) in cases.items():
            rows.append((name, timed(ours, args.repeats), timed(theirs, args.repeats)))
    print(f"\n| library call ({args.docs} documents, float32, CPU) | pipeline (s) | sentence-transformers (s) | "
          f"pipeline speed / ST |")
    print("|---|---|---|---|")
    for name, ours_s, theirs_s in rows:
        print(f"| {name} | {ours_s:.2f} | {theirs_s:.2f} | {theirs_s / ours_s:.2f}x |")
    print(f"\nmedians of {args.repeats} repeats after one warm-up; torch threads {torch.get_num_threads()} for ST")
    return 0


if __name__ == "__main__":
    sys.exit(main())
