"""A PEFT adapter merged into the transformer's weights once, at load (ModelSpec.adapter).

sentence-transformers (ST) with peft runs the adapter unmerged: transformers' `from_pretrained`
loads the base model and injects the adapter's layers beside the ones they adapt. The engine loads
the same base weights, applies the adapter with peft's own `PeftModel.from_pretrained` and merges
it (`merge_and_unload`): one plain transformers module, so every step, the OpenVINO conversion
(which then converts the merged weights) and int8 quantization see no adapter at all. The merge is
checked against the unmerged model on a probe before it is used, so a merge that computes
something else is refused rather than run.

transformers' own adapter loading is bypassed: with peft installed, its `from_pretrained` of a
folder holding adapter_config.json injects that adapter itself, unmerged. So the base loads from a
view of its folder without the adapter files, and peft applies the adapter to merge it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import torch

from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.model_folder.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS

# The merged model must give the unmerged one's outputs to within this much (relative to the largest
# output) on the probe. Merging only reorders float32 sums: a LoRA on a tiny BERT measures ~3e-7.
MERGE_TOLERANCE = 1e-5
PROBE_TOKENS = 16


def load_merged(model_class, spec: ModelSpec, config, dtype: torch.dtype) -> torch.nn.Module:
    """The base model (`spec.adapter.base_path`) with the adapter in `spec.path` merged into its
    weights, in `dtype`. Merged in float32 (what ST computes on a CPU), then cast."""
    from peft import PeftConfig, PeftModel

    with _without_adapter(spec.adapter.base_path) as base_dir:
        base = model_class.from_pretrained(base_dir, config=config, dtype=torch.float32,
                                           trust_remote_code=spec.trust_remote_code).eval()
    # As transformers' `load_adapter` (ST's path) injects it: by its own config, whatever task_type
    # it names (peft's task classes would add a classifier to modules_to_save that ST leaves as it is).
    adapter_config = PeftConfig.from_pretrained(spec.path)
    adapter_config.task_type = None
    adapted = PeftModel.from_pretrained(base, spec.path, config=adapter_config, is_trainable=False).eval()
    probe = _probe(spec.vocab_size)
    unmerged = _first_output(adapted, probe)
    merged = adapted.merge_and_unload().eval()
    diff = float((_first_output(merged, probe) - unmerged).abs().max()) / max(1.0, float(unmerged.abs().max()))
    if not diff <= MERGE_TOLERANCE:  # (NaN too)
        raise ValueError(f"model {spec.path!r}: its {spec.adapter.peft_type} adapter merged into the weights gives "
                         f"outputs {diff:.2e} (relative) from the unmerged adapter's; the limit is "
                         f"{MERGE_TOLERANCE:.0e}, so the model is refused")
    return merged.to(dtype)


@contextlib.contextmanager
def _without_adapter(folder: str) -> Iterator[str]:
    """`folder`, or where it holds adapter files, a temporary view of it without them (links to
    every other entry), so transformers loads the base weights alone."""
    if not os.path.isfile(os.path.join(folder, ADAPTER_CONFIG)):
        yield folder
        return
    view = tempfile.mkdtemp(prefix="pooling-pipeline-base-")
    try:
        for entry in os.scandir(folder):
            if entry.name not in (ADAPTER_CONFIG, *ADAPTER_WEIGHTS):
                os.symlink(os.path.abspath(entry.path), os.path.join(view, entry.name))
        yield view
    finally:
        shutil.rmtree(view, ignore_errors=True)


def _probe(vocab_size: int) -> dict[str, torch.Tensor]:
    """Two rows, the second padded: ids spread over the vocabulary."""
    ids = (torch.arange(2 * PROBE_TOKENS).reshape(2, PROBE_TOKENS) * 7919 + 1) % vocab_size
    mask = torch.ones_like(ids)
    mask[1, PROBE_TOKENS // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@torch.inference_mode()
def _first_output(model: torch.nn.Module, probe: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's first output (hidden states or logits), at the real positions where it is per token."""
    out = model(**probe)[0].float()
    return out[probe["attention_mask"].bool()] if out.dim() == 3 else out
