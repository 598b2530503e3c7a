"""How the engine's backend and precision are told back to the user at start-up. (Which backend
a model may be asked for is its family's rule, checked in the caller: core/families/.)"""

from __future__ import annotations


def describe_checkpoint_precision(engine: dict) -> str | None:
    """The start-up notice for a model stored in half precision and run in float32 on a CPU (the
    engine's `checkpoint_dtype` facts), or None."""
    stored = engine.get("checkpoint_dtype")
    if stored is None or engine.get("dtype") != "float32":
        return None
    measured = engine.get("checkpoint_dtype_max_diff")
    distance = (f"measured on a probe batch: max |diff| {measured:.1e} between the two" if measured is not None
                else "not measured for this model")
    return (f"the model's weights are stored in {stored}: this runs them in float32 (dtype='auto' on a CPU; "
            f"more exact), where sentence-transformers computes in {stored} on a CPU ({distance}); pass "
            f"dtype='{stored}' for {stored} arithmetic like ST's")


def describe_backend(engine: dict) -> str:
    """One line on what runs the model, from the engine's start-up info (Pipeline.stats()["engine"])."""
    backend = engine.get("backend", "torch")
    if backend == "openvino":
        if engine.get("conversion") == "converted":
            how = f"converted in {engine.get('conversion_s', 0):.1f} s, cached in {engine.get('conversion_cache')}"
        else:
            how = f"conversion {engine.get('conversion', 'cached')}"
        checked = f"checked against torch: {engine.get('verified_max_diff', 0):.1e}"
        if engine.get("precision") == "bf16":
            checked += f", in bfloat16 {engine.get('verified_bf16_max_diff', 0):.1e}"
        towers = " image tower (text tower on torch)" if engine.get("image_tower") == "openvino" else ""
        return (f"backend openvino{towers} {engine.get('openvino_version', '').split('-')[0]} "
                f"{'bfloat16' if engine.get('precision') == 'bf16' else 'float32'} ({how}; compiled in "
                f"{engine.get('compile_s', 0):.1f} s; {checked})")
    extra = []
    if engine.get("quantize"):
        extra.append(f"quantize {engine['quantize']}")
    if engine.get("openvino_refused"):
        extra.append(f"openvino refused: {engine['openvino_refused']}")
    if engine.get("batching"):  # packed or padded rows, and why (core/packed_attention.choose)
        extra.append(f"batching: {engine['batching']}")
    if engine.get("dtype_auto"):  # what dtype="auto" chose on a GPU, and why (core/model_runner.choose_dtype)
        extra.append(f"dtype auto: {engine['dtype_auto']}")
    if engine.get("cuda_graphs_planned") is not None:  # the start-up capture (core/cuda_graphs.capture_plan)
        pool = f", the pool grew {engine['cuda_graphs_pool_mb']:.0f} MB" if "cuda_graphs_pool_mb" in engine else ""
        extra.append(f"CUDA graphs: {engine.get('cuda_graphs_startup_captured', 0)} of {engine['cuda_graphs_planned']} "
                     f"step shapes captured at start-up in {engine.get('cuda_graphs_capture_s', 0):.1f} s "
                     f"({engine.get('cuda_graphs_buffers_mb', 0):.0f} MB of buffers{pool})"
                     + (f"; {engine['cuda_graphs_left_eager']}" if engine.get("cuda_graphs_left_eager") else ""))
    where = f" {engine['dtype']} on {engine['device']}" if engine.get("dtype") and engine.get("device") else ""
    return f"backend {backend}{where}" + (f" ({'; '.join(extra)})" if extra else "")


def cpu_has_bfloat16_units() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), read from /proc/cpuinfo
    (no library import in the caller)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def describe_faster_precision(engine: dict) -> str | None:
    """A notice for a CPU with bfloat16 units running float32 (the default, held to
    sentence-transformers within 1e-5): what the opt-in bfloat16 would give and cost, or None."""
    if engine.get("device") != "cpu" or engine.get("dtype") != "float32" or engine.get("backend") == "sim" \
            or "static" in str(engine.get("model", "")) or not cpu_has_bfloat16_units():
        return None
    return ("this CPU has bfloat16 units: dtype='bfloat16' runs the transformer about 1.8x faster here (opt-in; "
            "it moves vectors by about 1 - cos 5e-5, measured on all-MiniLM-L6-v2: see docs/backends.md); the "
            "default stays float32, sentence-transformers' result within 1e-5")
