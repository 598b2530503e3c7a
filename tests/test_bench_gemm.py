"""scripts/bench_gemm.py: its argument checks and its count of the model's work per token."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertModel

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_gemm.py"


@pytest.mark.parametrize("flag", ["--rows", "--width", "--repeats"])
def test_a_non_positive_size_is_exit_2_naming_it(flag):
    done = subprocess.run([sys.executable, str(SCRIPT), flag, "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert flag in done.stderr


def test_flops_per_token_count_the_encoder_layers_and_attention_not_the_pooler():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_gemm
    finally:
        sys.path.remove(str(SCRIPT.parent))
    hidden, inner, layers, width = 32, 64, 2, 16
    model = BertModel(BertConfig(hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers,
                                 num_attention_heads=4, vocab_size=100))
    per_layer_weights = 4 * hidden * hidden + 2 * hidden * inner  # q, k, v, output; up, down
    expected = 2 * layers * per_layer_weights + 4 * width * hidden * layers
    assert bench_gemm.model_flops_per_token(torch, model, width) == expected
