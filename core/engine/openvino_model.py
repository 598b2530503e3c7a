"""The OpenVINO backend: the model's transformer, converted once from the very torch module the
torch backend runs (`openvino.convert_model`, dynamic batch and sequence), cached on disk, compiled
for the CPU in float32 and called where the torch module was (`OpenVINOModel`).

Only the transformer changes hands: pooling, Dense / Normalize modules, SPLADE, token vectors and
activations stay the torch backend's own code (a few percent of a step on CPU), so every task keeps
one implementation. Why OpenVINO, measured side by side on this project's 2-core CPU (MiniLM-L6,
float32, batches of 16-256 tokens): OpenVINO 1.2-1.4x the torch eager forward at max |diff| 1e-6;
torch.compile 1.16-1.21x after a 35 s first compile; ONNX Runtime (plain export) 0.86-1.34x.

The cache never serves anything but a conversion of the model on disk: an entry is keyed by the
whole content of every file that can shape the transformer's graph (`graph_files`, fingerprinted by
`content_hash.model_files`: a rewrite in place cannot keep the key), carries the sha256 of each
file it wrote (`checksums.json`), checked when it is read; a damaged entry is removed and rebuilt,
naming it; a cache that cannot be read or written never stops a run (the conversion is made in
memory and served, with one warning naming the path). A converted model is also checked against the
torch module (`verify`) -- padded rows, ids across the whole vocabulary, two shapes -- so a
conversion that computes something else is refused (or, under backend="auto", the torch backend runs
instead) rather than giving different results. The check's result is remembered in the entry for the
library versions and CPU it ran with (`VerifiedChecks`), so a start from a cached entry whose
checksums hold does not repeat it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from types import SimpleNamespace

import numpy as np
import torch

from pooling_pipeline.core.shared import staging as staging_folders
from pooling_pipeline.core.shared.content_hash import cache_root, content_sha256, file_sha256, model_files

log = logging.getLogger("engine")

# Bumped when what is cached changes meaning (the wrapper's inputs or outputs, the key, the checksums).
CACHE_LAYOUT = 3
# The files of a transformer's folder that cannot shape its converted graph (see `graph_files`).
NOT_IN_THE_GRAPH = ("tokenizer", "special_tokens_map", "added_tokens", "vocab.", "merges.txt", "spiece.model",
                    "sentencepiece", "chat_template", "config_sentence_transformers.json", "modules.json")
CHECKSUMS = "checksums.json"  # in each entry: its key, and {file name: sha256} of what was written
VERIFIED = "verified.json"  # in each entry: the checks against the torch module it passed (VerifiedChecks)
# Conversions kept; beyond this the least recently used go (a model deleted or changed leaves its
# entry behind, and each conversion is as large as the model).
MAX_CACHE_ENTRIES = 16
# A converted model must give the torch module's outputs to within this much (relative to the
# largest output), at every real position of the probe: MiniLM measures ~1e-7.
VERIFY_TOLERANCE = 1e-5
# The bfloat16 compilation (dtype="bfloat16", opt-in) against the torch module in float32: a sanity
# bound, as bfloat16 keeps 8 bits of mantissa (MiniLM measures ~1e-2 per token, cosine 1 - 5e-5
# pooled); the conversion itself is checked in float32 first, to VERIFY_TOLERANCE.
BF16_TOLERANCE = 5e-2


class BackendUnavailable(RuntimeError):
    """The backend cannot run this model here: not installed, or its conversion failed or does not
    match the torch module (backend="auto" then runs the torch backend)."""


def openvino_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("openvino") is not None


class _Transformer(torch.nn.Module):
    """What is converted: the transformer's forward with plain tensor inputs and one output
    (`last_hidden_state`, or `logits` for the models whose head is part of the transformer)."""

    def __init__(self, module: torch.nn.Module, output: str, token_types: bool) -> None:
        super().__init__()
        self.module, self.output, self.token_types = module, output, token_types

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.token_types:
            kwargs["token_type_ids"] = token_type_ids
        return getattr(self.module(**kwargs), self.output)


class OpenVINOModel:
    """Stands in for the transformers module in `ModelRunner.launch`: called with the same keyword
    tensors, it returns an object with the same output attribute, as a CPU torch tensor."""

    def __init__(self, compiled, output: str, inputs: list[str], base: bool) -> None:
        self.request = compiled.create_infer_request()
        self.output, self.inputs, self.is_base = output, inputs, base

    # Per token, a position whose attention sees only masked keys (a padded position of a short
    # row beyond ModernBERT's sliding window) comes out NaN here where torch gives finite filler.
    # At padding neither means anything, but NaN * 0 poisons a masked sum: the runner zeroes the
    # positions past each row's length (`clear_padding`). Positions a result reads are checked
    # by `verify`.
    undefined_padding = True

    def __call__(self, **kwargs) -> SimpleNamespace:
        feed = {name: np.ascontiguousarray(kwargs[name].numpy(), dtype=np.int64) for name in self.inputs}
        result = self.request.infer(feed)  # (copies its outputs: they outlive the next call)
        return SimpleNamespace(**{self.output: torch.from_numpy(result[0])})

    @property
    def base_model(self) -> OpenVINOModel:
        """An LLM reranker's base model (its hidden states): what was converted for it."""
        if not self.is_base:
            raise RuntimeError("this is a bug: the converted model is not the base model")
        return self


def to_openvino(model: torch.nn.Module, spec, *, output: str, base: bool, token_types: bool, threads: int,
                precision: str = "f32", cache_root: str | None = None) -> tuple[OpenVINOModel, dict]:
    """Converts (or loads the cached conversion of) `model` (float32) -- or its `base_model` when
    `base` --, compiles it for the CPU in `precision` ("f32", or "bf16" where the CPU has bfloat16
    units) and checks it against the torch module. -> (the model, start-up info: conversion
    seconds or cache hit, compile seconds, the verified max difference). Raises
    BackendUnavailable when it cannot be had."""
    try:
        import openvino as ov
    except ImportError as e:
        raise BackendUnavailable("backend 'openvino' needs the openvino package: pip install "
                                 "'pooling-pipeline[openvino]'") from e
    module = _Transformer(model.base_model if base else model, output, token_types).eval()
    inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if token_types else [])
    key = cache_key(spec, ov.__version__, output=output, base=base, inputs=inputs)
    folder = os.path.join(cache_root or default_cache_root(), "openvino", key)
    info: dict = {"backend": "openvino", "openvino_version": ov.__version__, "conversion_cache": folder,
                  "omp_wait_policy": omp_wait_policy()}
    started = time.perf_counter()
    warnings: list[str] = []  # told to the caller at start-up (this process's log is not the caller's)
    converted, cached, saved = cached_conversion(ov, folder, key, lambda: _convert(ov, module, inputs, spec), warnings)
    seconds = round(time.perf_counter() - started, 3)
    if cached:
        info.update(conversion="cached", conversion_s=0.0, load_s=seconds)
    else:
        info.update(conversion="converted", conversion_s=seconds)
    if not saved:
        info["conversion_cache"] = NOT_CACHED
    if warnings:  # (start-up info is flat: one line each)
        info["warnings"] = "\n".join(warnings)
    started = time.perf_counter()
    runner = OpenVINOModel(compile_for_cpu(ov, converted, threads, "f32"), output, inputs, base)
    info["compile_s"] = round(time.perf_counter() - started, 3)
    # A cached entry whose checksums held was checked against the torch module at an earlier start
    # with these library versions on this CPU: that check is remembered in the entry, not repeated.
    checks = VerifiedChecks(folder, key, ov.__version__) if info["conversion_cache"] == folder else None
    probes: list = []

    def checked(runner: OpenVINOModel, name: str, tolerance: float) -> float:
        if checks is not None and checks.known(name) is not None:
            return checks.known(name)
        if not probes:
            probes.extend(probe_batches(module, spec, inputs))
        worst = verify(runner, probes, spec, tolerance)
        if checks is not None:
            checks.remember(name, worst)
        return worst

    started = time.perf_counter()
    info["verified_max_diff"] = checked(runner, "f32", VERIFY_TOLERANCE)
    if precision == "bf16":
        if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
            raise BackendUnavailable("this CPU has no bfloat16 units (OpenVINO's CPU capabilities lack BF16)")
        compiled = time.perf_counter()
        runner = OpenVINOModel(compile_for_cpu(ov, converted, threads, "bf16"), output, inputs, base)
        info["compile_s"] = round(info["compile_s"] + time.perf_counter() - compiled, 3)
        info["verified_bf16_max_diff"] = checked(runner, "bf16", BF16_TOLERANCE)
    elif precision != "f32":
        raise RuntimeError(f"this is a bug: OpenVINO precision {precision!r}")
    info["verify_s"] = round(time.perf_counter() - started, 3)
    info["verification"] = "remembered" if not probes else "checked"
    info["precision"] = precision
    return runner, info


def omp_wait_policy() -> str:
    """How torch's OpenMP threads wait after a parallel loop in this process (read by OpenMP when torch
    loaded): "PASSIVE" where the engine runs OpenVINO (pipeline/backends.engine_openmp_env says why)."""
    return os.environ.get("OMP_WAIT_POLICY", "default (spin, then sleep)")


class VerifiedChecks:
    """The checks against the torch module that a cache entry passed (`verified.json` in it: its
    largest difference per compiled precision), valid for the entry's key and files (its checksums,
    verified before this), the library versions and the CPU they ran with. A check made of other
    files (an entry copied in, its checksums rewritten), with another OpenVINO, torch or
    transformers, or on another CPU (a cache folder shared between machines), is made again."""

    def __init__(self, folder: str, key: str, openvino_version: str) -> None:
        import transformers

        self.path = os.path.join(folder, VERIFIED)
        try:
            with open(os.path.join(folder, CHECKSUMS), encoding="utf-8") as f:
                files = json.load(f).get("files")
        except (OSError, ValueError, AttributeError):
            files = None
        self.identity = {"key": key, "files": files, "openvino": openvino_version, "torch": torch.__version__,
                         "transformers": transformers.__version__, "cpu": cpu_signature(),
                         "tolerance": VERIFY_TOLERANCE, "bf16_tolerance": BF16_TOLERANCE}
        try:
            with open(self.path, encoding="utf-8") as f:
                saved = json.load(f)
            self.passed = dict(saved["passed"]) if saved.get("identity") == self.identity else {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.passed = {}

    def known(self, precision: str) -> float | None:
        value = self.passed.get(precision)
        return float(value) if isinstance(value, (int, float)) and np.isfinite(value) else None

    def remember(self, precision: str, worst: float) -> None:
        self.passed[precision] = worst
        staging = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(staging, "w", encoding="utf-8") as f:
                json.dump({"identity": self.identity, "passed": self.passed}, f)
            os.replace(staging, self.path)
        except OSError:  # a read-only cache: the next start checks again
            pass


def cpu_signature() -> str:
    """The CPU's model and instruction-set flags (what OpenVINO compiles for), as a short digest."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
        lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
        described = "\n".join(dict.fromkeys(lines))
    except OSError:
        import platform

        described = f"{platform.machine()} {platform.processor()}"
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def checked_cached_conversion(spec, *, output: str, threads: int, precision: str,
                              warnings: list[str]) -> tuple[OpenVINOModel, dict, bool] | None:
    """The cached conversion of the model's transformer (not an LLM reranker's base model),
    compiled, when its entry's checksums hold and it passed the check against the torch module
    with these library versions on this CPU (`VerifiedChecks`) -- then the torch module need not
    be built at all: importing transformers' modeling code and loading the weights was half of a
    start. -> (the model, start-up info, whether it takes token_type_ids), or None (no such entry,
    or it must be checked: the caller builds the torch module and goes through `to_openvino`). A
    damaged entry is removed, and what is to be told to the caller about it added to `warnings`."""
    try:
        import openvino as ov
    except ImportError:
        return None
    started = time.perf_counter()
    found = []
    for token_types in (False, True):  # the inputs are part of the key: the entry tells which it took
        inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if token_types else [])
        key = cache_key(spec, ov.__version__, output=output, base=False, inputs=inputs)
        folder = os.path.join(default_cache_root(), "openvino", key)
        if os.path.isdir(folder):
            found.append((key, folder, inputs, token_types))
    if len(found) != 1:
        return None
    key, folder, inputs, token_types = found[0]
    checks = VerifiedChecks(folder, key, ov.__version__)
    if checks.known("f32") is None or (precision == "bf16" and checks.known("bf16") is None):
        return None
    converted = read_entry(ov, folder, key, warnings)
    if converted is None:  # damaged (and removed, named in `warnings`): the caller converts anew
        return None
    touch_entry(folder)
    info: dict = {"backend": "openvino", "openvino_version": ov.__version__, "conversion_cache": folder,
                  "omp_wait_policy": omp_wait_policy(),
                  "conversion": "cached", "conversion_s": 0.0, "load_s": round(time.perf_counter() - started, 3)}
    started = time.perf_counter()
    runner = OpenVINOModel(compile_for_cpu(ov, converted, threads, precision), output, inputs, False)
    info.update(compile_s=round(time.perf_counter() - started, 3), verified_max_diff=checks.known("f32"),
                verify_s=0.0, verification="remembered", precision=precision, torch_module="not built")
    if precision == "bf16":
        info["verified_bf16_max_diff"] = checks.known("bf16")
    return runner, info, token_types


def compile_for_cpu(ov, converted, threads: int, precision: str, streams: int = 1):
    """The converted model compiled for the CPU on `threads` threads, in `streams` inference streams
    that share them (more than one only for a caller that runs that many requests at once)."""
    return ov.Core().compile_model(converted, "CPU", {
        # One stream, the engine's threads: a step is one request and waits for its result; the
        # throughput hint's several streams measured 0.5-0.75x with one request at a time.
        **({"PERFORMANCE_HINT": "LATENCY"} if streams == 1 else {"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": streams}),
        "INFERENCE_NUM_THREADS": max(1, threads),
        # Explicit: on a CPU with bfloat16 units OpenVINO's default is bfloat16 (what
        # sentence-transformers' OpenVINO backend runs, at cosine 1 - 3e-5), never chosen silently.
        "INFERENCE_PRECISION_HINT": precision,
    })


def _convert(ov, module: torch.nn.Module, inputs: list[str], spec):
    token = min(1000, spec.vocab_size - 1)
    ids = torch.full((2, 8), token, dtype=torch.long)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0  # a padded row, so the trace keeps the attention mask's path
    example = {"input_ids": ids, "attention_mask": mask}
    if "token_type_ids" in inputs:
        example["token_type_ids"] = torch.zeros(2, 8, dtype=torch.long)
    try:
        with torch.no_grad():
            return ov.convert_model(module, example_input=example,
                                    input=[(name, ov.PartialShape([-1, -1]), ov.Type.i64) for name in inputs])
    except Exception as e:  # a family the converter cannot trace
        raise BackendUnavailable(f"OpenVINO could not convert model {spec.path!r}: {type(e).__name__}: {e}") from e


NOT_CACHED = "not cached (see the warning)"  # a start-up's conversion_cache when the cache cannot be written


def cached_conversion(ov, folder: str, key: str, convert, warnings: list[str]) -> tuple[object, bool, bool]:
    """The conversion for `key`: read from `folder` (and marked used) or made by `convert()`,
    saved there and the cache pruned to its MAX_CACHE_ENTRIES most recently used entries ->
    (the converted model, whether it came from the cache, whether the cache holds it now). A
    conversion starts by removing the staging folders of writers that died mid-save (core/shared/staging.py)."""
    converted = read_entry(ov, folder, key, warnings)
    if converted is not None:
        touch_entry(folder)  # used now: what prune_cache keeps
        return converted, True, True
    staging_folders.remove_stale_staging(os.path.dirname(folder))
    converted = convert()
    saved = save_entry(ov, converted, folder, key, warnings)
    prune_cache(os.path.dirname(folder), MAX_CACHE_ENTRIES)
    return converted, False, saved


def read_entry(ov, folder: str, key: str, warnings: list[str]):
    """The cached conversion in `folder`, or None when there is none to serve: missing, or damaged
    (written for another key, a file whose sha256 is not the one written, a truncated or unreadable
    file) -- a damaged entry is removed, naming it, so this start converts again and caches anew."""
    if not os.path.isdir(folder):
        return None
    try:
        with open(os.path.join(folder, CHECKSUMS), encoding="utf-8") as f:
            entry = json.load(f)
        written = entry.get("files") if isinstance(entry, dict) else None
        if not isinstance(written, dict) or not {"model.xml", "model.bin"} <= set(written):
            raise ValueError(f"{CHECKSUMS} does not list model.xml and model.bin")
        if entry.get("key") != key:
            raise ValueError(f"it was written for another model or version ({entry.get('key')!r})")
        for name, digest in written.items():
            if content_sha256(os.path.join(folder, name)) != digest:
                raise ValueError(f"{name} is not what was written (sha256 differs)")
        return ov.Core().read_model(os.path.join(folder, "model.xml"))
    except Exception as e:  # (OpenVINO raises RuntimeError on a truncated file)
        warnings.append(_remove_damaged(folder, f"{type(e).__name__}: {e}"))
        return None


def _remove_damaged(folder: str, why: str) -> str:
    try:
        shutil.rmtree(folder)
        message = f"the cached OpenVINO conversion {folder} is damaged ({why}): removed; converting the model again"
    except OSError as e:
        message = (f"the cached OpenVINO conversion {folder} is damaged ({why}) and cannot be removed ({e}): "
                   "converting the model again in memory, not serving it")
    log.warning("%s", message)
    return message


def save_entry(ov, converted, folder: str, key: str, warnings: list[str] | None = None) -> bool:
    """Writes the conversion and its checksums beside its final place and renames it there: a
    reader sees a whole entry or none; a concurrent start that converted too keeps the first one.
    A cache that cannot be written (not a folder, read-only, full, past a file-size limit) still
    serves this run from memory: False, with one warning naming the path. The staging folder is
    named for this process (core/shared/staging.py), so one left by a writer killed mid-save is removed
    by the next conversion or prune in this cache."""
    parent = os.path.dirname(folder)
    staging = None
    try:
        os.makedirs(parent, exist_ok=True)
        staging = staging_folders.make_staging(parent)
        ov.save_model(converted, os.path.join(staging, "model.xml"), compress_to_fp16=False)
        checksums = {name: file_sha256(os.path.join(staging, name)) for name in ("model.xml", "model.bin")}
        with open(os.path.join(staging, CHECKSUMS), "w", encoding="utf-8") as f:
            json.dump({"key": key, "files": checksums}, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.rename(staging, folder)
            staging_folders.release(staging)
            staging = None
        except OSError:
            if not os.path.isdir(folder):  # not another process that got there first: it failed
                raise
        return True
    except Exception as e:  # OSError, or OpenVINO's RuntimeError from a failed write
        message = (f"could not cache the OpenVINO conversion in {folder} ({type(e).__name__}: {e}): this run serves "
                   "it from memory and the next start converts again")
        log.warning("%s", message)
        if warnings is not None:
            warnings.append(message)
        return False
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
            staging_folders.release(staging)


def touch_entry(folder: str) -> None:
    try:
        os.utime(folder)  # when it was last used: what prune_cache goes by
    except OSError:
        pass


def prune_cache(parent: str, keep: int) -> list[str]:
    """Removes all but the `keep` most recently used conversions in `parent`, and the staging folders
    of writers that died mid-save (core/shared/staging.py); -> the removed names."""
    removed = staging_folders.remove_stale_staging(parent)
    try:
        entries = [e for e in os.scandir(parent) if e.is_dir() and not e.name.startswith(".")]
    except OSError:
        return removed
    entries.sort(key=lambda e: e.stat().st_mtime_ns, reverse=True)
    for entry in entries[keep:]:
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.name)
    return removed


def clear_padding(values: torch.Tensor, real: torch.Tensor) -> None:
    """Zeroes per-token `values` [rows, positions, ...] where `real` [rows, positions] is False."""
    if values.dim() >= 3:
        values.masked_fill_(~real.reshape(*real.shape, *([1] * (values.dim() - 2))), 0.0)


def probe_batches(module: _Transformer, spec, inputs: list[str]) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
    """What `verify` checks against: (the inputs, the positions a result reads, the torch module's
    output) for each probe -- padded rows, a shape the conversion was not traced with, one past any
    local attention window, and for ColBERT queries one whose expansion tokens are not attended
    to (their vectors are returned all the same). Computed once per start."""
    rng = np.random.default_rng(0)
    longest = max(4, min(probe_width(module.module.config), spec.max_model_len))
    # Ids drawn across the whole vocabulary (a damaged row of any common token shows), and the
    # probes are wide enough to hold many of them.
    top = spec.vocab_size - 1
    shapes = []  # (rows, width, tokens per row, attended tokens per row)
    for rows, width in ((3, min(11, longest)), (2, longest)):
        lengths = np.linspace(width, 2, rows).astype(np.int64)
        shapes.append((rows, width, lengths, lengths))
    expansion = getattr(spec.multi_vector, "query_expansion", None)
    if expansion is not None and not expansion.attend:
        width = max(2, min(expansion.length, spec.max_model_len))
        shapes.append((3, width, np.full(3, width), np.array([width, max(1, width // 2), 1])))
    probes = []
    for rows, width, lengths, attended in shapes:
        ids = torch.from_numpy(rng.integers(0, top + 1, (rows, width)))
        positions = torch.arange(width)[None, :]
        real = positions < torch.from_numpy(lengths)[:, None]
        kwargs = {"input_ids": ids, "attention_mask": (positions < torch.from_numpy(attended)[:, None]).long()}
        if "token_type_ids" in inputs:
            kwargs["token_type_ids"] = torch.zeros_like(ids)
        with torch.inference_mode():
            probes.append((kwargs, real, module(**kwargs).float()))
    return probes


def verify(runner: OpenVINOModel, probes: list, spec, tolerance: float = VERIFY_TOLERANCE) -> float:
    """The compiled model against the torch module on `probe_batches`: the largest difference at
    every position a result can read, relative to the largest output. Above `tolerance`, or not
    finite there, it is refused."""
    worst = 0.0
    for kwargs, real, want in probes:
        got = getattr(runner(**kwargs), runner.output).float()
        if got.shape != want.shape:
            raise BackendUnavailable(f"OpenVINO's conversion of {spec.path!r} gives shape {tuple(got.shape)}, "
                                     f"the torch module {tuple(want.shape)}")
        if spec.head != "sequence_classification":  # per token: the positions a result reads
            got, want = got[real], want[real]
        scale = max(1.0, float(want.abs().max()))
        diff = float((got - want).abs().max()) / scale
        if not np.isfinite(diff) or diff > tolerance:
            raise BackendUnavailable(f"OpenVINO's conversion of {spec.path!r} differs from the torch module by "
                                     f"{diff:.2e} (relative; the limit is {tolerance:.0e})")
        worst = max(worst, diff)
    return worst


def probe_width(config) -> int:
    """The longer probe's width: 48 tokens, or past the model's local attention window (ModernBERT's
    local_attention, Mistral's sliding_window) so a padded row's positions beyond its reach -- the
    case where attention sees only padding -- are in the check; at most 512 (the probe stays cheap)."""
    windows = [getattr(config, name, None) for name in ("local_attention", "sliding_window")]
    windows = [w for w in windows if isinstance(w, int) and not isinstance(w, bool) and w > 0]
    return min(512, max([48] + [w + 16 for w in windows]))


def default_cache_root() -> str:
    return cache_root()


def cache_key(spec, openvino_version: str, **what) -> str:
    """The conversion's identity: the whole content of every file of the transformer that can shape
    its graph (`graph_files`), what the spec makes of it, the libraries that shape the converted
    graph, and what was converted. The start-up check backs it up. Not the folder's name: a copy,
    a rename or another revision of the same files (a hub snapshot is named by its commit) reuses it."""
    import transformers

    identity = {"layout": CACHE_LAYOUT, "files": graph_files(spec), "openvino": openvino_version,
                "torch": torch.__version__, "transformers": transformers.__version__,
                "module": {"model_type": spec.model_type, "architectures": list(spec.architectures),
                           "model_class": spec.model_class, "head": spec.head, "num_labels": spec.num_labels,
                           "trust_remote_code": spec.trust_remote_code},
                "what": what}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return f"{spec.model_type or 'model'}-{digest}"


def graph_files(spec) -> dict[str, str]:
    """{file: sha256} of the transformer's folder, less what cannot shape the converted graph: the
    tokenizer's files, sentence-transformers' prompts and similarity, and the subfolders (the other
    modules' own: 1_Pooling/, 2_Dense/, ColBERT's and SPLADE's heads, a Router's routes, exported
    onnx/ or openvino/ copies). So the same transformer under another pooling, head config or
    prompt reuses its conversion (a 0.6B decoder converts in minutes). Its config, weights and
    sentence_bert_config.json (model_args, config_args) stay in; which module class reads them
    (modules.json) is in the key as the spec's model_class and head. A model that runs its own
    code keeps every file (the code may read any of them). A PEFT adapter's files are in (its weights
    are merged into what is converted), and so are its base model's where they are a folder of their own."""
    files = _graph_files_in(spec.path, spec.trust_remote_code)
    if spec.adapter is not None and spec.adapter.base_path != spec.path:
        files.update({f"adapter-base/{name}": digest
                      for name, digest in _graph_files_in(spec.adapter.base_path, spec.trust_remote_code).items()})
    return files


def _graph_files_in(folder: str, trust_remote_code: bool) -> dict[str, str]:
    # (The subfolders are not even read: an onnx/ export of several hundred MB is not hashed for nothing.)
    files = model_files(folder, recursive=trust_remote_code)
    if trust_remote_code:
        return files
    return {name: digest for name, digest in files.items() if not name.lower().startswith(NOT_IN_THE_GRAPH)}
