"""Loads the model on its device and turns a batch of engine inputs into per-request outputs."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from pooling_pipeline.core.engine import packed_attention
from pooling_pipeline.core.engine.attention_mask import TOLERANCE, choose_mask, sdpa_backends
from pooling_pipeline.core.engine.checkpoint_precision import checkpoint_distance, half_checkpoint_dtype
from pooling_pipeline.core.engine.columns import Requests, probe_batch
from pooling_pipeline.core.engine.cuda_graphs import CudaGraphs, EagerStandIn, GraphedForward, capture_plan
from pooling_pipeline.core.engine.device_copies import finish_step, record_end, start_events, to_device, to_host, use_device
from pooling_pipeline.core.engine.heads import OutputHead, StepRows, head_for_st_chain
from pooling_pipeline.core.engine.openvino_model import clear_padding
from pooling_pipeline.core.engine.sparse_outputs import sparse_outputs
from pooling_pipeline.core.engine.static_runner import StaticEmbeddingRunner
from pooling_pipeline.core.engine.step_cost import probe_step_cost
from pooling_pipeline.core.engine.step_runner import PendingStep
from pooling_pipeline.core.engine.step_shapes import bucket_shape, padded_to
from pooling_pipeline.core.shared.config import ENCODER_ONLY_CLASSES, ModelSpec

log = logging.getLogger("engine")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """The engine's torch device for `device` ("auto", "cpu", "cuda", "cuda:N"): a CUDA one with its
    index, made this thread's current device before any other CUDA call (device_copies.use_device)."""
    if device == "auto":
        return use_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    return use_device(torch.device(device))


# Families whose activations pass float16's range (65,504) and come out inf / NaN there. T5-style
# encoders: transformers clamps their hidden states in float16 (modeling_t5's "clamp inf values")
# and pretrained T5 / mT5 are known to give NaNs in it; they were trained in bfloat16. Gemma:
# EmbeddingGemma's card says its "activations do not support float16", and transformers' Gemma
# models scale their embeddings by sqrt(hidden) in the model's dtype. Never run in float16 here.
FLOAT16_OVERFLOWS = frozenset({"t5", "mt5", "umt5", "longt5", "switch_transformers",
                               "gemma", "gemma2", "gemma3", "gemma3_text"})


def bfloat16_units(device: torch.device) -> bool:
    """Whether a CUDA device computes bfloat16 natively: compute capability 8.0 (Ampere) or newer, or
    ROCm. (torch.cuda.is_bf16_supported() says True on older GPUs too, through emulation: slow.)"""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device)[0] >= 8


def resolve_dtype(dtype: str, device: torch.device, config_dtype: object, model_type: str = "") -> torch.dtype:
    return choose_dtype(dtype, device, config_dtype, model_type)[0]


def choose_dtype(dtype: str, device: torch.device, config_dtype: object, model_type: str = "") -> tuple[torch.dtype, str | None]:
    """The dtype the model runs in, and what `auto` chose on an accelerator and why (None: nothing to
    say). `auto`: float32 on a CPU (half precision is slower there on most CPUs); on CUDA bfloat16
    where the device has bfloat16 units (float32's range: nothing overflows), the checkpoint's
    float16 kept, float16 only on a GPU without bfloat16 units -- and never float16 for a family
    that overflows in it (FLOAT16_OVERFLOWS): float32 then, said. dtype="float16" for such a family
    is refused."""
    overflows = model_type in FLOAT16_OVERFLOWS
    if dtype == "float16" and overflows:
        raise ValueError(f"dtype='float16' cannot run a {model_type!r} model: its activations overflow float16's "
                         "range (inf / NaN vectors); pass dtype='bfloat16' (on a GPU with bfloat16 units) or "
                         "dtype='float32'")
    if dtype != "auto":
        return DTYPES[dtype], None
    if device.type != "cuda":
        return torch.float32, None
    checkpoint = half_checkpoint_dtype(config_dtype)
    stored = str(checkpoint or torch.float32).removeprefix("torch.")
    if bfloat16_units(device):
        chosen = torch.float16 if checkpoint == torch.float16 and not overflows else torch.bfloat16
        units = "bfloat16 units"
    else:
        chosen = torch.float32 if overflows else torch.float16
        units = "no bfloat16 units"
    major, minor = (0, 0) if torch.version.hip else torch.cuda.get_device_capability(device)
    capability = "ROCm" if torch.version.hip else f"compute capability {major}.{minor}"
    why = f"; not float16: a {model_type!r} model overflows in float16" if overflows else ""
    return chosen, (f"{str(chosen).removeprefix('torch.')} for a {stored} checkpoint on {device} ({capability}, "
                    f"{units}){why}")


def _model_class(spec: ModelSpec):
    """The transformers class sentence-transformers would load for this model."""
    import transformers

    if spec.model_class == "masked_lm":
        return transformers.AutoModelForMaskedLM
    if spec.model_class == "causal_lm":  # an LLM reranker (ST's transformer_task "text-generation")
        return transformers.AutoModelForCausalLM
    if spec.model_class == "encoder_only":  # T5 style: the encoder alone embeds
        return getattr(transformers, ENCODER_ONLY_CLASSES[spec.model_type])
    return {"none": transformers.AutoModel,
            "sequence_classification": transformers.AutoModelForSequenceClassification,
            "token_classification": transformers.AutoModelForTokenClassification}[spec.head]


def load_transformer(spec: ModelSpec, config, dtype: torch.dtype) -> torch.nn.Module:
    """The transformers module sentence-transformers would load, in `dtype`; a PEFT adapter merged
    into its weights (core/engine/peft_merge.py)."""
    if spec.adapter is not None:
        from pooling_pipeline.core.engine.peft_merge import load_merged

        return load_merged(_model_class(spec), spec, config, dtype)
    return _model_class(spec).from_pretrained(spec.path, config=config, dtype=dtype,
                                              trust_remote_code=spec.trust_remote_code)


def tokenizer_makes_token_types(spec: ModelSpec) -> bool:
    """Whether the model's tokenizer, as transformers loads it (the render workers' too), makes
    token_type_ids: they are among its model_input_names (its class's, or tokenizer_config.json's)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    return "token_type_ids" in tokenizer.model_input_names


class ModelRunner:
    routes: list | None = None  # a Router model: a runner per route, in ModelSpec.routes order

    def __init__(self, spec: ModelSpec, device: str, dtype: str, shared_model=None, *, backend: str = "torch",
                 threads: int = 1, quantize: str | None = None, device_steps: bool | None = None,
                 cuda_graphs: bool | None = None, attention: str | None = None,
                 output_head: Callable[[ModelSpec], type[OutputHead]] = head_for_st_chain) -> None:
        """`output_head`: the family's choice of head for a spec (core/engine/heads.py; each route's own
        for a Router). `backend`: "torch", "openvino" (the transformer compiled by OpenVINO; refused clearly
        when it cannot run this model) or "auto" (OpenVINO on a CPU where it runs this model
        within its check, else torch); `quantize`: None, or "int8" (the transformer's Linear layers
        dynamically quantized; torch backend only). `device_steps`: run steps as on an accelerator
        -- shapes from buckets (core/engine/step_shapes.py), a 4-D mask where the model takes it
        (core/engine/attention_mask.py), nothing read back from the device before a step's end -- by
        default where the device is not the CPU (the tests turn it on for a CPU). `cuda_graphs`: the
        forward replayed from CUDA graphs, one per step shape (core/engine/cuda_graphs.py), by default on
        CUDA where the device steps run with the 4-D mask (on a CPU, asked for: the tests' stand-in).
        `attention`: "packed" (a step's rows back to back, a varlen attention kernel:
        core/engine/packed_attention.py; refused where not exact), "padded", or None: POOLING_PIPELINE_ATTENTION
        where set, else chosen here (packed on CUDA where flash_attn's varlen kernel runs the family)."""
        from transformers import AutoConfig

        if spec.route_specs:
            self._init_routes(spec, device, dtype, backend=backend, threads=threads, quantize=quantize,
                              device_steps=device_steps, cuda_graphs=cuda_graphs, attention=attention,
                              output_head=output_head)
            return
        self.spec = spec
        head_type = output_head(spec)
        self.device = resolve_device(device)
        config = AutoConfig.from_pretrained(spec.base_path, trust_remote_code=spec.trust_remote_code)
        self.dtype, dtype_auto = choose_dtype(dtype, self.device, getattr(config, "dtype", None), spec.model_type)
        openvino_precision = self._openvino_precision(backend, quantize)
        self._cache_warnings: list[str] = []  # a damaged cache entry met on the way: told to the caller
        cached = (self._checked_cached_conversion(config, threads, openvino_precision, head_type)
                  if openvino_precision is not None and shared_model is None else None)
        if cached is not None:  # a conversion checked before: no torch module is built
            self.model, cached_info, token_types = cached
        else:
            # No attention implementation is forced: transformers picks SDPA where the model supports
            # it and its own otherwise (MPNet has no SDPA), as sentence-transformers does. OpenVINO
            # converts (and checks against) the float32 module, whatever precision it compiles for.
            self.model = shared_model if shared_model is not None else load_transformer(
                spec, config, torch.float32 if openvino_precision else self.dtype).to(self.device).eval()
        self.pad_token_id = int(getattr(config, "pad_token_id", 0) or 0)
        # As ST: token type ids go to the model exactly when its tokenizer makes them and its
        # forward takes them (GPT-Neo's forward takes them and adds their embedding to every
        # position, but GPT-2 tokenizers make none). inspect.signature sees through the decorators
        # transformers wraps forward() in.
        if cached is not None:  # what the conversion was made with
            self.uses_token_types = token_types
        elif hasattr(self.model, "forward"):
            self.uses_token_types = ("token_type_ids" in inspect.signature(self.model.forward).parameters
                                     and tokenizer_makes_token_types(spec))
        else:  # a Router route sharing a transformer the OpenVINO backend converted already
            self.uses_token_types = "token_type_ids" in self.model.inputs
        self.head = head_type.for_runner(spec, self)
        # Steps as on a CPU until `_device_steps` (below) says otherwise: the start-up probes run steps.
        self.shapes_bucketed, self.mask_4d, self.graphed = False, False, None
        self.packed = None  # padded rows until `_choose_rows` (below) says otherwise: the start-up probes run steps
        # A half-precision checkpoint run in float32 on a CPU: ST computes it in its own dtype there.
        checkpoint = half_checkpoint_dtype(getattr(config, "dtype", None))
        precision_note = (checkpoint_distance(self, checkpoint)
                          if checkpoint is not None and self.dtype == torch.float32 and self.device.type == "cpu"
                          and shared_model is None else {})
        self.backend_info: dict = {"backend": "torch", **precision_note,
                                   **({"dtype_auto": dtype_auto} if dtype_auto else {})}
        if quantize is not None and shared_model is None:
            self.model = quantized(self.model, quantize)
            self.backend_info["quantize"] = quantize
        if cached is not None:
            self.backend_info = cached_info
        elif openvino_precision is not None:
            self._use_openvino(backend, threads, reuse=shared_model, precision=openvino_precision)
            self.backend_info.update(precision_note)
        if spec.adapter is not None and shared_model is None:  # said at start-up: a PEFT adapter is in the weights
            self.backend_info["adapter"] = (f"{spec.adapter.peft_type} merged into {spec.adapter.base_path}"
                                            + (" (the cached conversion of the merge)" if cached is not None else ""))
        self._choose_rows(attention, shared=shared_model is not None)
        self._device_steps(device_steps if device_steps is not None else self.device.type != "cpu", cuda_graphs)
        if self._cache_warnings:  # (start-up info is flat: one line each)
            told = [self.backend_info["warnings"]] if self.backend_info.get("warnings") else []
            self.backend_info["warnings"] = "\n".join(self._cache_warnings + told)

    def _choose_rows(self, attention: str | None, shared: bool) -> None:
        """Packed or padded rows, chosen once (core/packed_attention.choose), then checked on a probe
        against the padded forward: a model that does not give the same result stays padded (or,
        forced, is refused). Said in backend_info["batching"] and the log."""
        self.packed = None
        forced = packed_attention.forced_choice() if attention is None else attention
        if forced not in (None, *packed_attention.CHOICES):
            raise ValueError(f"attention must be one of {packed_attention.CHOICES} or None, got {forced!r}")
        layout, kernel, why = packed_attention.choose(
            self.spec, torch_module=isinstance(self.model, torch.nn.Module), quantized="quantize" in self.backend_info,
            device_type=self.device.type, dtype=self.dtype, forced=forced, head_refusal=self.head.packed_refusal)
        if layout == "packed" and shared:  # (the kernel is switched on the module: its other runner would use it)
            problem = "the transformer module is shared with another runner"
        elif layout == "packed":
            problem = self._use_packed(kernel)
        else:
            problem = None
        if problem is not None:
            if forced == "packed":
                raise ValueError(f"{packed_attention.ATTENTION_ENV}=packed cannot run model {self.spec.path!r} "
                                 f"exactly: {problem}")
            why = f"padded: {problem}"
        self.backend_info["batching"] = why
        log.info("rows: %s", why)

    def _use_packed(self, kernel: str) -> str | None:
        """The model switched to the packed kernel where a probe of rows of different lengths (and a
        pair's token types) gives the padded forward's hidden states within the dtype's tolerance
        (core/attention_mask.TOLERANCE); else the model as it was and what differed."""
        lengths = np.asarray(packed_attention.probe_lengths(self.spec.max_model_len), dtype=np.int64)
        vocab = max(self.spec.vocab_size - 1, 1)
        ids = ((np.arange(int(lengths.sum())) * 7 + 11) % vocab + 1).astype(np.int64)
        pair_start = np.where(np.arange(len(lengths)) % 2 == 1, lengths // 2, -1)  # odd rows: a pair's second text
        padded = np.full((len(lengths), int(lengths.max())), self.pad_token_id, dtype=np.int64)
        real = np.arange(padded.shape[1])[None, :] < lengths[:, None]
        padded[real] = ids
        types = (np.arange(padded.shape[1])[None, :] >= pair_start[:, None]) & (pair_start[:, None] >= 0) & real
        padded_inputs = {"input_ids": to_device(padded, self.device),
                         "attention_mask": to_device(real.astype(np.int64), self.device)}
        if self.uses_token_types:
            padded_inputs["token_type_ids"] = to_device(types.astype(np.int64), self.device)
        with torch.inference_mode():
            expected = self.model(**padded_inputs).last_hidden_state[to_device(real, self.device)].float()
            before = packed_attention.use_kernel(self.model, kernel)
            self.packed = PackedRows(kernel, packed_attention.PACKED_FAMILIES[self.spec.model_type])
            try:
                got = self.model(**self._packed_inputs(ids, lengths, pair_start)).last_hidden_state[0].float()
            except Exception as e:  # (a kernel that cannot run here: the model as it was)
                got, error = None, f"the packed probe failed ({type(e).__name__}: {e})"
        if got is not None:
            scale = float(expected.abs().max()) or 1.0
            diff = float((got - expected).abs().max()) / scale
            error = (None if diff <= TOLERANCE.get(self.dtype, 1e-5)
                     else f"a packed probe differs from the padded forward by {diff:.1e} (relative)")
        if error is not None:
            packed_attention.restore(self.model, before)
            self.packed = None
        return error

    def _packed_inputs(self, ids: np.ndarray, lengths: np.ndarray, pair_start: np.ndarray) -> dict:
        """The forward's inputs for rows of `lengths` tokens packed in one sequence (`ids` back to
        back): positions restarting per row, token types per row (`pair_start`: where a pair's
        second text starts, -1 for none), the rows' offsets for the varlen kernel -- all built on
        the host, nothing read from the device."""
        if len(lengths) == 0 or lengths.min() < 1:
            raise ValueError(f"a packed step needs rows of at least one token, got lengths {lengths.tolist()}: "
                             "this is a bug")
        ids = ids.astype(np.int64, copy=False)
        in_row = positions_in_row(lengths)
        positions = packed_attention.positions(ids, in_row, self.packed.numbering, self.pad_token_id)
        offsets = to_device(packed_attention.offsets(lengths), self.device)
        longest = int(lengths.max())
        inputs = {"input_ids": to_device(ids, self.device)[None], "position_ids": to_device(positions, self.device)[None],
                  "cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": longest, "max_length_k": longest}
        if self.uses_token_types:
            pair = np.repeat(pair_start, lengths)
            types = ((in_row >= pair) & (pair >= 0)).astype(np.int64)
            inputs["token_type_ids"] = to_device(types, self.device)[None]
        return inputs

    def _device_steps(self, on: bool, cuda_graphs: bool | None) -> None:
        """Steps as on an accelerator (see __init__), or as on a CPU (nothing padded, the 2-D mask)."""
        on = on and isinstance(self.model, torch.nn.Module)  # (an OpenVINO model has shapes of its own)
        if self.spec.unpadded_above is not None:  # (a bucketed shape pads every row: not for these rows)
            self.backend_info["batching"] = (f"rows over {self.spec.unpadded_above} tokens run unpadded, in forwards "
                                             "of one length (padding changes this model's output)")
            on = False
        self.shapes_bucketed = on
        if self.device.type == "cuda":
            self.backend_info["attention"] = sdpa_backends()
        if on and self.packed is not None:  # (packed steps have no padded shape: eager, counted in graph_stats)
            self.shapes_bucketed = False
            wanted = cuda_graphs if cuda_graphs is not None else self.device.type == "cuda"
            if wanted:
                self.backend_info["cuda_graphs"] = "off: packed steps run eager (counted as eager steps)"
            return
        if not on:
            return
        self.backend_info["step_shapes"] = "buckets (core/engine/step_shapes.py)"
        if self.head.own_forward is None:
            self.mask_4d, how = choose_mask(self.model, self.head.reads, self.device, self.dtype, self.spec.vocab_size,
                                            self.pad_token_id, self.uses_token_types)
            self.backend_info["attention_mask"] = how
        wanted = cuda_graphs if cuda_graphs is not None else self.device.type == "cuda"
        if not wanted:
            self.backend_info["cuda_graphs"] = "off"
        elif not self.mask_4d:  # (the 2-D mask's check reads the device: no graph can hold it)
            self.backend_info["cuda_graphs"] = ("off: the model takes no 4-D mask" if self.head.own_forward is None
                                                else f"off: {self.head.own_forward}")
        else:
            graphs = CudaGraphs(self.device) if self.device.type == "cuda" else EagerStandIn()
            self.graphed = GraphedForward(lambda inputs: getattr(self.model(**inputs), self.head.reads), graphs,
                                          half=self.dtype != torch.float32)
            self.backend_info["cuda_graphs"] = "on" if graphs.name == "cuda" else "on (a CPU stand-in: eager replays)"

    def graph_stats(self) -> dict:
        """The CUDA graphs' counts (captured, replays, eager steps; why they were turned off), or {}.
        Packed steps run eager: counted as such where graphs would have run."""
        if getattr(self, "packed", None) is not None and "cuda_graphs" in self.backend_info:
            return {"captured": 0, "replays": 0, "eager_steps": self.packed.steps}
        return self.graphed.stats() if getattr(self, "graphed", None) is not None else {}

    def capture_graphs(self, shapes: list[tuple[int, int]]) -> dict:
        """The CUDA graphs of these bucketed step shapes captured now, before serving (the engine's
        start: core/cuda_graphs.capture_plan), each through a synthetic step of its shape; the start-up
        facts, or {} where the forward is not graphed (a Router's routes capture as they go)."""
        if getattr(self, "graphed", None) is None:
            return {}
        token = min(1000, self.spec.vocab_size - 1)
        return capture_plan(self.graphed, shapes,
                            lambda rows, length: self.run(probe_batch(rows, length, token, self.spec.tasks[0])))

    def end_startup(self) -> None:
        """Serving starts: a step shape without a graph runs eager from now on, counted."""
        if getattr(self, "graphed", None) is not None:
            self.graphed.seal()

    def _checked_cached_conversion(self, config, threads: int, precision: str, head_type: type[OutputHead]):
        """OpenVINO's cached conversion when it can stand in for the torch module from the start
        (core/openvino_model.checked_cached_conversion), else None. Not for what needs the torch
        module's own weights at start-up: an LLM reranker's score rows, the distance of a half-
        precision checkpoint to float32, a model running its own code (which `auto` keeps on torch)."""
        from pooling_pipeline.core.engine.openvino_model import checked_cached_conversion

        if (head_type.base_model or self.spec.trust_remote_code or self.spec.unpadded_above is not None
                or (half_checkpoint_dtype(getattr(config, "dtype", None)) is not None and self.dtype == torch.float32)):
            return None
        return checked_cached_conversion(self.spec, output=head_type.reads, threads=threads, precision=precision,
                                         warnings=self._cache_warnings)

    def _openvino_precision(self, backend: str, quantize: str | None) -> str | None:
        """What OpenVINO is to compile for ("f32", "bf16"), or None where the torch backend runs."""
        precision = {torch.float32: "f32", torch.bfloat16: "bf16"}.get(self.dtype)
        if backend == "openvino" and (self.device.type != "cpu" or quantize is not None or precision is None):
            raise ValueError("backend='openvino' runs on the CPU in float32 or bfloat16: not with device "
                             f"{str(self.device)!r}, dtype {str(self.dtype).removeprefix('torch.')!r}"
                             f"{', quantize=' + repr(quantize) if quantize else ''}")
        if backend == "torch" or self.device.type != "cpu" or quantize is not None:
            return None
        return precision

    def _use_openvino(self, backend: str, threads: int, reuse, precision: str) -> None:
        """Runs the transformer through OpenVINO (core/engine/openvino_model.py) from now on; under "auto",
        where OpenVINO cannot have this model (or is not installed), the torch module stays (in
        the dtype asked for)."""
        from pooling_pipeline.core.engine.openvino_model import BackendUnavailable, OpenVINOModel, to_openvino

        if isinstance(reuse, OpenVINOModel):  # a Router's route on a transformer converted already
            self.backend_info = {"backend": "openvino", "conversion": "shared"}
            return
        if backend == "auto" and type(self.model).__module__.startswith("transformers_modules"):
            # The model's own code (trust_remote_code) may branch on the data -- a check of the
            # input, a path for long inputs -- and a conversion traces one path only. The torch
            # module runs it as written; backend="openvino" converts it anyway.
            self._keep_torch("the model runs its own code (trust_remote_code), which a traced conversion may "
                             "not follow")
            return
        if self.spec.unpadded_above is not None:
            # Funnel pools with Python-side shapes, BigBird picks its attention by length: a traced
            # conversion would follow the probe's length only.
            reason = (f"a {self.spec.model_type!r} model runs each length its own way (see launch), which a traced "
                      "conversion does not follow")
            if backend == "openvino":
                raise ValueError(f"backend='openvino' cannot run model {self.spec.path!r}: {reason}")
            self._keep_torch(reason)
            return
        try:
            self.model, info = to_openvino(self.model, self.spec, output=self.head.reads, base=self.head.base_model,
                                           token_types=self.uses_token_types, threads=threads, precision=precision)
        except Exception as e:  # BackendUnavailable, or OpenVINO itself failing (a runtime error, memory)
            reason = str(e) if isinstance(e, BackendUnavailable) else f"OpenVINO failed: {type(e).__name__}: {e}"
            if backend == "openvino":
                raise ValueError(f"backend='openvino' cannot run model {self.spec.path!r}: {reason}") from e
            log.warning("backend 'auto': the torch backend runs %s (%s)", self.spec.path, reason)
            self._keep_torch(reason)
            if not isinstance(e, BackendUnavailable):  # a failure, not a refusal: told to the caller too
                self.backend_info["warnings"] = (f"backend 'auto': OpenVINO failed, the torch backend runs the model "
                                                 f"({reason})")
            return
        self.backend_info = info

    def _keep_torch(self, reason: str) -> None:
        """backend="auto" without OpenVINO: the torch module runs, in the dtype asked for."""
        self.model = self.model.to(self.dtype)
        self.backend_info = {"backend": "torch", "openvino_refused": reason}

    def step_cost(self, max_tokens: int) -> tuple[float, float]:
        """The start-up probe of one step's fixed cost and its cost per padded token:
        (overhead_s, per_token_s), from synthetic batches (see `step_cost.probe_step_cost`)."""
        token = min(1000, self.spec.vocab_size - 1)

        def run(num_rows: int, num_tokens: int) -> None:
            self.run(probe_batch(num_rows, num_tokens, token, self.spec.tasks[0]))

        return probe_step_cost(run, max_tokens, self.spec.max_model_len)

    def run(self, batch: Requests) -> tuple[list | np.ndarray, int]:
        """Runs a batch start to finish: one result per request -- a float32 array, or (token ids,
        weights) for sparse_embed; an [n, dim] matrix when they are all vectors of one size --
        and the number of padded tokens computed."""
        results, padded, _ = self.finish(self.launch(batch))
        return results, padded

    @torch.inference_mode()
    def launch(self, batch: Requests) -> PendingStep:
        """Starts a step: collation, the forward pass and pooling are queued on the device, and
        their results' copies back to pinned host memory too. On CUDA this returns while the device
        works, so the engine can collate the next batch meanwhile; on a CPU it returns when done."""
        if self.routes is not None:
            return self._launch_routes(batch)
        if self.packed is not None:
            return self._launch_packed(batch)
        if self.spec.unpadded_above is not None:
            return self._launch_unpadded(batch)
        return self._launch_padded(batch)

    def _launch_unpadded(self, batch: Requests) -> PendingStep:
        """A model whose output for a row depends on its padding (ModelSpec.unpadded_above: Funnel,
        BigBird's block-sparse attention): each row longer than `unpadded_above` runs in a forward
        of rows of its own length only, the shorter ones together, so each text gets the vector ST
        gives it alone, whatever it was batched with."""
        lengths = batch.lengths
        key = np.where(lengths > self.spec.unpadded_above, lengths, 0)
        if (key == key[0]).all():
            return self._launch_attention(batch)
        groups = [np.flatnonzero(key == k) for k in np.unique(key).tolist()]
        return self._launch_groups(batch, groups, lambda rows: self._launch_attention(batch.select(rows)))

    def _launch_attention(self, batch: Requests) -> PendingStep:
        """BigBird's attention type set for this forward (ModelSpec.block_sparse_above), as
        transformers picks it for one text alone, then the forward."""
        above = self.spec.block_sparse_above
        if above is not None:
            longest = int(batch.lengths.max())
            self.model.base_model.set_attention_type("block_sparse" if longest > above else "original_full")
        return self._launch_padded(batch)

    def _launch_padded(self, batch: Requests) -> PendingStep:
        """One forward of the batch's rows, padded to the longest."""
        started = time.perf_counter()
        n = len(batch)
        ids, real = batch.padded(self.pad_token_id)  # one masked assignment, no loop over requests
        lengths_np = np.ascontiguousarray(batch.lengths)
        if self.shapes_bucketed:  # (rows of one pad token and columns of padding, dropped below)
            shape = bucket_shape(n, ids.shape[1], max(self.spec.max_model_len, ids.shape[1]))
            ids, lengths_np = padded_to(ids, lengths_np, shape, self.pad_token_id)
        max_len = ids.shape[1]
        types = None
        if self.uses_token_types:
            starts = np.full(len(ids), -1, np.int64)
            starts[:n] = batch.token_type_start  # zeros, then ones from the start (a pair's second text)
            types = ((np.arange(max_len)[None, :] >= starts[:, None]) & (starts[:, None] >= 0)
                     & (np.arange(max_len)[None, :] < lengths_np[:, None])).astype(np.int64)
        begin, end = start_events(self.device)
        input_ids = to_device(ids, self.device)
        lengths = to_device(lengths_np, self.device)
        mask = self.head.attention_mask((torch.arange(max_len, device=self.device)[None, :] < lengths[:, None]).long(),
                                        batch, lengths_np)
        kwargs = {"input_ids": input_ids,
                  "attention_mask": mask.bool()[:, None, None, :] if self.mask_4d else mask}
        if types is not None:
            kwargs["token_type_ids"] = to_device(types, self.device)
        if self.head.own_forward is not None:  # (an LLM reranker: its scores at each row's last real token)
            output = self.head.forward(self.model, kwargs, lengths)
        elif self.graphed is not None:
            output = self.graphed(kwargs)
        else:
            output = self.model(**kwargs)
            if getattr(self.model, "undefined_padding", False):
                clear_padding(getattr(output, self.model.output), torch.from_numpy(real))
            output = getattr(output, self.head.reads)
        # (a bucket's added rows dropped)
        tensors, finish = self.head.outputs(StepRows(output[:n], mask[:n], lengths[:n], lengths_np[:n], batch,
                                                     ids=ids[:n], real=real, bucketed=self.shapes_bucketed))
        # Copies back start now and overlap whatever the host does next (pinned memory on CUDA).
        host = [to_host(t) for t in tensors]
        record_end(end, self.device)
        return PendingStep(ids.size, host, finish, started, begin, end)

    def _launch_packed(self, batch: Requests) -> PendingStep:
        """One forward of the batch's rows packed in one sequence of their real tokens (no padding
        computed, core/engine/packed_attention.py); the hidden states laid out per row as the padded
        path's (zeros past each row's end, which every pooling masks), so that the pooling, heads
        and finish are the padded path's own."""
        started = time.perf_counter()
        n = len(batch)
        lengths_np = np.ascontiguousarray(batch.lengths)
        begin, end = start_events(self.device)
        inputs = self._packed_inputs(batch.token_ids, lengths_np, batch.token_type_start)
        hidden = self.model(**inputs).last_hidden_state[0]  # [tokens, hidden]
        self.packed.steps += 1
        longest = int(lengths_np.max())
        at = np.repeat(np.arange(n) * longest, lengths_np) + positions_in_row(lengths_np)
        rows = hidden.new_zeros(n * longest, hidden.shape[1]).index_copy_(0, to_device(at, self.device), hidden)
        lengths = to_device(lengths_np, self.device)
        mask = (torch.arange(longest, device=self.device)[None, :] < lengths[:, None]).long()
        tensors, finish = self.head.outputs(StepRows(rows.view(n, longest, -1), mask, lengths, lengths_np, batch))
        host = [to_host(t) for t in tensors]
        record_end(end, self.device)
        return PendingStep(len(at), host, finish, started, begin, end)

    def finish(self, step: PendingStep) -> tuple[list, int, float]:
        """Waits for a launched step: (results, padded tokens, device seconds it took)."""
        return finish_step(step)

    def _init_routes(self, spec: ModelSpec, device: str, dtype: str, device_steps: bool | None = None,
                     cuda_graphs: bool | None = None, attention: str | None = None,
                     output_head: Callable[[ModelSpec], type[OutputHead]] = head_for_st_chain, **backend) -> None:
        """A Router model: one runner per route; routes on the same transformer directory share
        its loaded weights (ST's saved Router refers to a shared module once), others each load theirs.
        Its rows stay padded (the packed kernel is switched on a module its routes share)."""
        if (packed_attention.forced_choice() if attention is None else attention) == "packed":
            raise ValueError(f"{packed_attention.ATTENTION_ENV}=packed cannot run model {spec.path!r} exactly: "
                             f"{packed_attention.ROUTER_REASON}")
        self.spec = spec
        self.device = resolve_device(device)
        loaded: dict[str, torch.nn.Module] = {}
        self.routes = []
        for route in spec.route_specs:
            if route.input_module == "sparse_static_embedding":
                self.routes.append(StaticEmbeddingRoute(route, self.device))
                continue
            if route.input_module == "static_embedding":
                self.routes.append(StaticEmbeddingRunner(route, self.device))
                continue
            runner = ModelRunner(route, device, dtype, shared_model=loaded.get(route.path), device_steps=device_steps,
                                 cuda_graphs=cuda_graphs, attention="padded", output_head=output_head, **backend)
            loaded.setdefault(route.path, runner.model)
            self.routes.append(runner)
        self.dtype = next(r.dtype for r in self.routes if isinstance(r, ModelRunner))
        self.backend_info = next(r.backend_info for r in self.routes if isinstance(r, ModelRunner))
        self.backend_info["batching"] = f"padded: {packed_attention.ROUTER_REASON}"
        self.default_route = spec.routes.index(spec.default_route) if spec.default_route is not None else -1

    def _launch_routes(self, batch: Requests) -> PendingStep:
        """Each request runs its own route (a row's `route`; -1: the model's default route): the
        batch's rows grouped by route, each group launched on its route, the results put back in
        the batch's order."""
        route = np.where(batch.route < 0, self.default_route, batch.route)
        if (route < 0).any():
            raise ValueError(f"request {int(batch.indices[np.argmax(route < 0)])} names no route and the model "
                             f"has no default route (routes: {self.spec.routes})")
        if (route == route[0]).all():  # the usual case: one route for the whole batch
            return self.routes[int(route[0])].launch(batch)
        groups = [np.flatnonzero(route == r) for r in np.unique(route).tolist()]
        return self._launch_groups(batch, groups, lambda rows: self.routes[int(route[rows[0]])].launch(batch.select(rows)))

    def _launch_groups(self, batch: Requests, groups: list[np.ndarray], launch) -> PendingStep:
        """One step of several launches, one per group of the batch's rows (`launch(rows)`), their
        results put back in the batch's order."""
        started = time.perf_counter()
        begin, end = start_events(self.device)
        steps = [launch(rows) for rows in groups]
        record_end(end, self.device)

        def finish(arrays: list[np.ndarray]) -> list:
            out: list = [None] * len(batch)
            at = 0
            for rows, step in zip(groups, steps):
                part = step.finish(arrays[at:at + len(step.host)])
                at += len(step.host)
                for i, row in enumerate(rows.tolist()):
                    out[row] = part[i]
            return out

        return PendingStep(sum(step.padded for step in steps), [t for step in steps for t in step.host], finish,
                           started, begin, end)

class PackedRows:
    """A runner's packed steps: the varlen kernel, how its family numbers positions, steps run."""

    __slots__ = ("kernel", "numbering", "steps")

    def __init__(self, kernel: str, numbering: str) -> None:
        self.kernel, self.numbering, self.steps = kernel, numbering, 0


def positions_in_row(lengths: np.ndarray) -> np.ndarray:
    """Each packed token's offset in its row (rows of `lengths` tokens back to back)."""
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def quantized(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """The model with its Linear layers dynamically quantized to int8 (weights int8 per channel,
    activations quantized per batch): opt-in, it changes results (see the README's figures)."""
    if mode != "int8":
        raise ValueError(f"quantize must be None or 'int8', got {mode!r}")
    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


class StaticEmbeddingRoute:
    """ST's SparseStaticEmbedding as a route: each token id present in the request (once or more)
    gets its saved weight, every other id 0 -- no transformer runs."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        from pooling_pipeline.core.engine.pooling import _load_weights

        self.spec = spec
        self.device = device
        self.weight = _load_weights(spec.path)["weight"].float().to(device)

    @torch.inference_mode()
    def launch(self, batch: Requests) -> PendingStep:
        started = time.perf_counter()
        begin, end = start_events(self.device)  # (the copies back are waited for through these events)
        # The tokens before a row's pool_start do not count (an empty text's placeholder token):
        # left out on the host, so the device indexes with plain index tensors (no boolean mask,
        # whose size the device would have to report back).
        counted = (np.arange(len(batch.token_ids)) - np.repeat(batch.starts, batch.lengths)
                   >= np.repeat(batch.pool_start, batch.lengths))
        ids = to_device(batch.token_ids[counted].astype(np.int64), self.device)
        rows = to_device(np.repeat(np.arange(len(batch)), batch.lengths)[counted], self.device)
        presence = torch.zeros(len(batch), self.weight.shape[0], device=self.device)
        presence[rows, ids] = 1.0
        tensors, finish = sparse_outputs(presence * self.weight, self.spec.max_active_dims,
                                         on_device=self.device.type != "cpu")
        host = [to_host(t) for t in tensors]
        record_end(end, self.device)
        return PendingStep(int(batch.lengths.sum()), host, finish, started, begin, end)
