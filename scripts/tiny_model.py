"""A tiny BERT built on the fly (random weights, the bundled tokenizer): a model whose forward pass
costs almost nothing, so the CPU side of the pipeline -- tokenization, transport, scheduling --
is what gets measured. That is what a GPU engine looks like from the CPU."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The tiny model stands for a GPU engine, so it gets a GPU's batch shape (the CPU budget of 2048
# tokens is tuned for a real model's forward pass, not for a step that is mostly overhead).
TINY_BATCH_SHAPE = {"max_num_seqs": 256, "max_num_batched_tokens": 16384}


def build_tiny_model(target: str | Path | None = None) -> str:
    import torch
    from transformers import BertConfig, BertModel

    from core.config import default_model_path

    target = Path(target or tempfile.mkdtemp(prefix="tiny-bert-"))
    torch.manual_seed(0)
    # As small as a BERT gets: embeddings, layer norm and pooler, no transformer layer, 16 wide.
    # Its forward pass costs ~4 us per short request on one CPU thread (one 16-wide layer would
    # cost ~10 us, and ~250 us at 256 tokens): close to what a GPU engine costs the CPU, which
    # launches the work and waits. The whole engine path still runs: admission, scheduling,
    # padding, the transformers forward, pooling, normalization.
    config = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=0, num_attention_heads=1,
                        intermediate_size=16, max_position_embeddings=512)
    BertModel(config).save_pretrained(target)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(default_model_path()) / name, target / name)
    return str(target)
