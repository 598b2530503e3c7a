"""The attention mask an encoder gets on an accelerator: 4-D and boolean, built in the engine.

Given the usual 2-D padding mask, transformers' masking utilities ask whether it has any padding
(`padding_mask.all()`, to drop the mask where there is none): a device-to-host read, so each
step's launch waits for the previous step's end and launching ahead only overlaps collation. A
4-D mask is passed through as it is, so the engine builds it (`keys[:, None, None, :]`: every
query attends to the row's real tokens, as the 2-D path gives a bidirectional encoder) and no
step reads the device. Whether a model takes it to the same result is checked once, at start-up,
on a padded probe batch (`choose_mask`); a model that does not (a causal decoder, whose mask must
also be causal; an eager attention that only takes 2-D masks) keeps the 2-D mask.
"""

from __future__ import annotations

import os

import torch

# cuDNN's SDPA builds (and caches per thread) an execution graph for every new (batch, length,
# mask) shape, reported at 50-400 ms a build; on sm90 torch prefers it for a padded, masked half-
# precision call. The engine turns it off on CUDA -- the memory-efficient and flash kernels take
# any shape at once -- unless this is set to 1 (to measure it: scripts/device_check.py does).
CUDNN_SDPA_ENV = "POOLING_PIPELINE_CUDNN_SDPA"

# The probe's rows: lengths that differ, so each row has its own padding.
PROBE_LENGTHS = (7, 3, 5)
# The 4-D mask must give the 2-D path's result within this (relative to the output's largest value).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def bidirectional_mask(lengths: torch.Tensor, longest: int) -> torch.Tensor:
    """[rows, 1, 1, longest] bool: each row's real tokens (its first `lengths` positions)."""
    keys = torch.arange(longest, device=lengths.device)[None, :] < lengths[:, None]
    return keys[:, None, None, :]


@torch.inference_mode()
def choose_mask(model: torch.nn.Module, output_name: str, device: torch.device, dtype: torch.dtype,
                vocab_size: int, pad_id: int, token_types: bool) -> tuple[bool, str]:
    """(whether the model takes the 4-D mask, what to report): its output with the 4-D mask against
    the 2-D one on a padded probe batch."""
    lengths = torch.tensor(PROBE_LENGTHS, device=device)
    longest = int(max(PROBE_LENGTHS))
    positions = torch.arange(longest, device=device)[None, :]
    real = positions < lengths[:, None]
    ids = torch.where(real, (positions * 7 + 11 + torch.arange(len(PROBE_LENGTHS), device=device)[:, None])
                      % max(vocab_size - 1, 1) + 1, torch.full_like(positions, pad_id))
    extra = {"token_type_ids": torch.zeros_like(ids)} if token_types else {}
    try:
        flat = getattr(model(input_ids=ids, attention_mask=real.long(), **extra), output_name)
        four = getattr(model(input_ids=ids, attention_mask=bidirectional_mask(lengths, longest), **extra), output_name)
    except Exception as e:  # an attention that takes only 2-D masks
        return False, f"2-D (the model refuses a 4-D mask: {type(e).__name__})"
    if flat.shape != four.shape:
        return False, "2-D (a 4-D mask changes the output's shape)"
    if flat.dim() >= 3 and flat.shape[1] == longest:  # per-token outputs: the real positions only
        flat, four = flat[real], four[real]
    scale = float(flat.float().abs().max()) or 1.0
    diff = float((flat.float() - four.float()).abs().max()) / scale
    if diff > TOLERANCE.get(dtype, 1e-5):
        return False, f"2-D (a 4-D bidirectional mask differs by {diff:.1e}: a causal or custom attention)"
    return True, "4-D bool (built in the engine: no device read per step)"


def sdpa_backends() -> str:
    """Turns cuDNN's SDPA off in this process (the engine's, on CUDA) unless CUDNN_SDPA_ENV=1, and
    says which SDPA backends torch may pick from."""
    if os.environ.get(CUDNN_SDPA_ENV) != "1" and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    checks = {"flash": "flash_sdp_enabled", "efficient": "mem_efficient_sdp_enabled", "math": "math_sdp_enabled",
              "cudnn": "cudnn_sdp_enabled"}
    enabled = [name for name, check in checks.items() if getattr(torch.backends.cuda, check, lambda: False)()]
    return "sdpa: " + ", ".join(enabled) + ("" if "cudnn" in enabled else " (cuDNN off)")
