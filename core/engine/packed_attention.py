"""Packed (unpadded) steps for encoders: a step's rows back to back in one sequence of its T real
tokens, [1, T], each row's positions restarting at its start, attention kept inside each row by a
varlen kernel given the rows' offsets (cu_seqlens), as TEI and vLLM run encoders. A bucketed step
computes its padding too (~25% of the arithmetic on short texts, core/engine/step_shapes.py); a packed
one computes only its tokens.

The kernel is one of transformers' attention functions, registered under this project's names
(`AttentionInterface`), so the model's own modules run unchanged and call it with the rows'
offsets passed through the forward's attention kwargs (`cu_seq_lens_q`, `max_length_q`):
- `flash`: flash_attn's `flash_attn_varlen_func` (CUDA, float16 / bfloat16), where the package is
  importable;
- `nested`: torch's SDPA on nested jagged tensors (CUDA, no package needed; forced only, checked on
  the device: scripts/device_check.py);
- `reference`: one SDPA call per row (any device; the CPU's, and the tests').

Which families are exact packed: those whose transformers modules send attention through the
attention interface and take `position_ids` (PACKED_FAMILIES, with how their positions are
numbered); everything else (MPNet and DeBERTa's relative positions, T5's position buckets, decoders,
Funnel / BigBird, heads that pool the first token of the whole sequence) stays padded. The runner
also checks, at start-up, a packed probe against the padded forward (`check_packed`): a family that
does not give the same result is never run packed.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import torch

# POOLING_PIPELINE_ATTENTION=packed|padded forces the choice (refused where packed is not exact).
ATTENTION_ENV = "POOLING_PIPELINE_ATTENTION"
CHOICES = ("packed", "padded")

# model_type -> how a row's positions are numbered: "arange" (0, 1, ... from the row's start: BERT's
# position table, ModernBERT's rotary positions), "after_padding_idx" (RoBERTa's: padding_idx + 1,
# + 2, ... counting the row's non-pad tokens, as create_position_ids_from_input_ids does).
PACKED_FAMILIES = {
    "bert": "arange",
    "distilbert": "arange",
    "electra": "arange",
    "modernbert": "arange",
    "roberta": "after_padding_idx",
    "xlm-roberta": "after_padding_idx",
    "xlm-roberta-xl": "after_padding_idx",
    "camembert": "after_padding_idx",
}

KERNELS = ("flash", "nested", "reference")
ROUTER_REASON = "a Router model's routes share one transformer module (its attention kernel is switched on the module)"
NAMES = {kernel: f"pooling_pipeline_varlen_{kernel}" for kernel in KERNELS}


def flash_attn_importable() -> bool:
    """Whether flash_attn's varlen kernel can be imported (it needs CUDA and its compiled extension)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:  # (a wheel built for another torch / CUDA fails here)
        return False
    return True


def forced_choice() -> str | None:
    """POOLING_PIPELINE_ATTENTION's value (None when unset or empty); anything else is refused."""
    value = os.environ.get(ATTENTION_ENV, "").strip()
    if not value:
        return None
    if value not in CHOICES:
        raise ValueError(f"{ATTENTION_ENV}={value!r}: expected one of {', '.join(CHOICES)} (or unset: chosen at start-up)")
    return value


# ---- the choice, made once at start-up -------------------------------------------------------------

def why_not_packed(spec, *, torch_module: bool, quantized: bool, device_type: str, dtype: torch.dtype,
                   kernel: str | None, head_refusal: str | None) -> str | None:
    """Why this model cannot run packed exactly (None: it can, with `kernel`). Pure: the runner and
    the tests ask it with what the runner knows (`kernel`: what `packed_kernel` found, or None;
    `head_refusal`: its output head's `packed_refusal`, core/engine/heads.py)."""
    if spec.route_specs:
        return ROUTER_REASON
    if not torch_module:
        return "the model runs on OpenVINO, which compiles padded shapes (packed needs backend='torch')"
    if quantized:
        return "int8 dynamic quantization scales activations per batch (padding included)"
    if spec.unpadded_above is not None or spec.block_sparse_above is not None:
        return f"a {spec.model_type!r} model's output depends on its rows' padding (unpadded_above / block_sparse_above)"
    if spec.model_type not in PACKED_FAMILIES:
        return (f"model type {spec.model_type!r} is not among the packed families ({', '.join(sorted(PACKED_FAMILIES))}): "
                "its attention or positions are not the interface's (relative positions, position buckets, a decoder)")
    if head_refusal is not None:
        return head_refusal
    if kernel is None:
        return ("no varlen kernel on this device: flash_attn is not importable" if device_type == "cuda"
                else f"no varlen kernel on {device_type!r}")
    if kernel == "flash" and dtype not in (torch.float16, torch.bfloat16):
        return f"flash_attn's varlen kernel runs float16 / bfloat16, not {str(dtype).removeprefix('torch.')}"
    return None


def packed_kernel(device_type: str, dtype: torch.dtype, forced: bool, flash: bool | None = None) -> str | None:
    """The varlen kernel for this device: flash_attn's on CUDA in half precision where importable;
    forced on CUDA without it, torch's nested jagged SDPA; on a CPU (or any device, forced) the
    per-row reference. `flash`: whether flash_attn is importable (asked when None)."""
    if device_type == "cuda":
        if dtype in (torch.float16, torch.bfloat16) and (flash_attn_importable() if flash is None else flash):
            return "flash"
        return "nested" if forced else None
    return "reference"


# Measured on this project's 2-core CPU (docs/benchmarks.md "Packed attention"): all-MiniLM-L6-v2 on mixed
# short texts, packed with the per-row reference kernel against the padded step: packed was not faster.
CPU_PACKED_DEFAULT = False


def choose(spec, *, torch_module: bool, quantized: bool, device_type: str, dtype: torch.dtype,
           forced: str | None, head_refusal: str | None, flash: bool | None = None) -> tuple[str, str | None, str]:
    """(layout "packed" / "padded", kernel or None, why) for this runner, chosen once at start-up:
    packed on CUDA where flash_attn's varlen kernel runs a supported family; padded on a CPU (packed
    measured not faster there, CPU_PACKED_DEFAULT) and wherever unsure. `forced`
    (POOLING_PIPELINE_ATTENTION): "padded" always; "packed" where exact, else ValueError naming why."""
    if forced == "padded":
        return "padded", None, f"padded: forced ({ATTENTION_ENV}=padded)"
    kernel = packed_kernel(device_type, dtype, forced == "packed", flash)
    reason = why_not_packed(spec, torch_module=torch_module, quantized=quantized, device_type=device_type,
                            dtype=dtype, kernel=kernel, head_refusal=head_refusal)
    if forced == "packed":
        if reason is not None:
            raise ValueError(f"{ATTENTION_ENV}=packed cannot run model {spec.path!r} exactly: {reason}")
        return "packed", kernel, f"packed ({kernel} varlen kernel; forced: {ATTENTION_ENV}=packed)"
    if reason is not None:
        return "padded", None, f"padded: {reason}"
    if device_type == "cpu" and not CPU_PACKED_DEFAULT:
        return "padded", None, "padded: packed measured not faster on a CPU (docs/benchmarks.md)"
    return "packed", kernel, f"packed ({kernel} varlen kernel: no padding computed)"


# ---- the kernels, as transformers' attention functions ---------------------------------------------

def _rows(kwargs: dict) -> tuple[torch.Tensor, int]:
    offsets, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if offsets is None or longest is None:
        raise RuntimeError("a packed attention was called without the rows' offsets (cu_seq_lens_q, max_length_q): "
                           "this is a bug")
    return offsets, int(longest)


def _check_call(module, query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs: dict) -> None:
    """What the packed kernels do not do is refused, never approximated."""
    if query.shape[0] != 1:
        raise RuntimeError(f"a packed attention takes one sequence of packed rows, got {query.shape[0]}: this is a bug")
    if attention_mask is not None or kwargs.get("position_bias") is not None:
        raise RuntimeError("a packed attention was given a mask or a position bias: this is a bug")
    if getattr(module, "is_causal", False):
        raise RuntimeError(f"{type(module).__name__} is causal: packed attention is for encoders (this is a bug)")
    if key.shape[1] != query.shape[1]:
        raise RuntimeError("packed attention with grouped key/value heads is not supported: this is a bug")


def _window(kwargs: dict) -> int | None:
    """The largest |query - key| a sliding-window layer attends across (ModernBERT's local layers:
    transformers passes sliding_window = half window + 1, the flash convention), or None."""
    window = kwargs.get("sliding_window")
    return None if window is None else int(window) - 1


def flash_varlen(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """flash_attn's varlen kernel on the packed rows. In: [1, heads, T, dim]; out: [1, T, heads, dim]."""
    from flash_attn import flash_attn_varlen_func

    _check_call(module, query, key, attention_mask, kwargs)
    offsets, longest = _rows(kwargs)
    window = _window(kwargs)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, dim]
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=longest,
                                 max_seqlen_k=longest, dropout_p=0.0, softmax_scale=scaling, causal=False,
                                 window_size=(-1, -1) if window is None else (window, window))
    return out.unsqueeze(0), None


def nested_varlen(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """torch's SDPA on nested jagged tensors (one row each) built on the packed rows' offsets."""
    _check_call(module, query, key, attention_mask, kwargs)
    offsets, longest = _rows(kwargs)
    if _window(kwargs) is not None:
        raise RuntimeError("the nested kernel has no sliding window: this is a bug (the start-up check refuses it)")
    # [T, heads, dim] laid out contiguously, viewed as [rows, heads, j, dim] (SDPA takes nested tensors
    # that are contiguous once transposed back); the longest row given, so nothing reads the device for it.
    jagged = [torch.nested.nested_tensor_from_jagged(t[0].transpose(0, 1).contiguous(), offsets.long(),
                                                     max_seqlen=longest).transpose(1, 2)
              for t in (query, key, value)]
    out = torch.nn.functional.scaled_dot_product_attention(*jagged, scale=scaling)
    return out.transpose(1, 2).values().unsqueeze(0), None


def reference_varlen(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One SDPA call per row (a band mask for a sliding window): any device; the CPU's and the tests'."""
    _check_call(module, query, key, attention_mask, kwargs)
    offsets, _ = _rows(kwargs)
    window = _window(kwargs)
    bounds = offsets.tolist()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        band = None
        if window is not None:
            at = torch.arange(end - start, device=query.device)
            band = (at[:, None] - at[None, :]).abs() <= window
        parts.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], attn_mask=band, scale=scaling))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


FUNCTIONS = {"flash": flash_varlen, "nested": nested_varlen, "reference": reference_varlen}


def use_kernel(model: torch.nn.Module, kernel: str) -> str:
    """The model's attention switched to `kernel` (registered under its project name); -> the
    implementation it had, for `restore`."""
    from transformers import AttentionInterface

    name = NAMES[kernel]
    AttentionInterface.register(name, FUNCTIONS[kernel])
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    return before


def restore(model: torch.nn.Module, implementation: str) -> None:
    model.set_attn_implementation(implementation)


# ---- a step's packed inputs ------------------------------------------------------------------------

def positions(ids: np.ndarray, in_row: np.ndarray, numbering: str, pad_id: int) -> np.ndarray:
    """Each packed token's position id, as the padded forward numbers it in its row (`in_row`: the
    token's offset in its row)."""
    if numbering == "arange":
        return in_row
    # RoBERTa's create_position_ids_from_input_ids: pad_id + the count of the row's non-pad tokens
    # up to and including this one, and pad_id itself for a pad token (a row may hold the pad id).
    real = (ids != pad_id).astype(np.int64)
    counted = np.cumsum(real)
    first = in_row == 0
    before_row = np.repeat(counted[first] - real[first], np.diff(np.append(np.flatnonzero(first), len(ids))))
    return (counted - before_row) * real + pad_id


def probe_lengths(max_len: int) -> tuple[int, ...]:
    """The start-up check's rows: short ones of different lengths, and one long enough to pass a
    sliding window (ModernBERT's local layers attend 64 tokens each side) where the model allows."""
    return (7, 3, min(max_len, 160), 5)


def offsets(lengths: np.ndarray) -> np.ndarray:
    """cu_seqlens: [0, l0, l0 + l1, ...] (int32, as the varlen kernels take them)."""
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out
