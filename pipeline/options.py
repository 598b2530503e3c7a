"""What a user can set, declared once: `PipelineOptions` (the process group's shape, given to
`Pipeline(...)`) and `CallOptions` (one call's, given to `embed`, `score`, ...).

Each option is one field: its type (checked by msgspec through `core.shared.options.checked`, which
names the option in its error), its default and a one-line description (`Meta(description=...)`).
What takes options reads them from here rather than restating them: the API methods' and the
constructor's signatures, docstrings and argument binding (`OptionsSignature`, `takes_options`),
the async twins, `pipeline-run`'s flags and the Ray callable. Which call takes which options is
declared here too (`CALL_OPTIONS`), so a new option is one field and, where it applies, nothing
else. A per-request option (one value, or a list with one per prompt) is declared in
`core.shared.options.REQUEST_OPTIONS` with its description; its field here (`per_request(name)`) only
places it among the parameters. This module imports nothing heavy: the launcher reads it to build
its flags.
"""

import functools
import inspect
import operator
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from pooling_pipeline.core.shared.config import DEFAULT_MAX_IMAGE_PIXELS
from pooling_pipeline.core.shared.options import (
    MAX_TOKENS,
    REQUEST_OPTIONS,
    Backend,
    ErrorsMode,
    LongInputs,
    Quantize,
    Task,
    TokenCount,
    TruncationSide,
)

Meta = msgspec.Meta


def described(text: str, shown: str | None = None) -> msgspec.Meta:
    """An option's one-line description; `shown`: its type as a signature shows it, for an
    option whose declared type is `Any` (checked by the code that reads it, with its own errors)."""
    return Meta(description=text, extra={"shown": shown} if shown else None)


def per_request(name: str) -> Any:
    """The call option of a per-request option (`core.shared.options.REQUEST_OPTIONS`, where it is declared
    with its description): any value here, checked request by request (`pipeline.request_options`)."""
    option = _REQUEST_OPTIONS[name]
    return Annotated[Any, described(option.doc, shown=option.shown)]


_REQUEST_OPTIONS = {o.name: o for o in REQUEST_OPTIONS}

DTYPE_ALIASES = {"auto": "auto", "float32": "float32", "float": "float32", "fp32": "float32",
                 "float16": "float16", "half": "float16", "fp16": "float16",
                 "bfloat16": "bfloat16", "bf16": "bfloat16"}
Dtype = Literal["auto", "float32", "float", "fp32", "float16", "half", "fp16", "bfloat16", "bf16"]
# "sim": the simulated accelerator (core/shared/sim_device.py), a measurement instrument.
Device = Annotated[str, Meta(pattern=r"^(auto|cpu|sim|cuda(:\d{1,3})?)$")]
LogLevel = Annotated[str, Meta(pattern=r"^(?i:debug|info|warning|warn|error|critical)$")]


# ---- ranges -------------------------------------------------------------------------------------
# Every option has a range, declared with its type and checked in the caller before any process
# starts (`core.shared.options.checked`: a ValueError naming the option and its range). The bounds are
# what the processes can hold, far above what a machine needs:
#
# A render worker is a process of ~100 MB and 5 file descriptors: 256 of them take ~25 GB (the
# plan gives a GPU engine at most 16).
MAX_RENDER_WORKERS = 256
# A step of more sequences is never formed under the largest default token budget (16,384 padded
# tokens on a GPU); the windows derived from it (8x, 16x) stay within their own bounds.
MAX_NUM_SEQS = 1 << 14
# One step's activations grow with its padded tokens (a 1024-wide model: 4 GB of hidden states
# at this bound); it is 8x the longest max length of the pooling models people run (128K).
MAX_BATCHED_TOKENS = 1 << 20
# Requests in flight, all calls together. A call's reorder ring grows with the requests it holds
# (~49 bytes a slot: ~51 MB at this bound), and each holds its text until answered (bounded apart:
# frontend/call.py's MAX_INFLIGHT_CHARS).
MAX_INFLIGHT = 1 << 20
# An engine core allocates its request table for its whole window at start: 36 MB at this bound
# (measured: core.engine.columns.RequestTable(1 << 18)), and a full window holds a dict entry a request.
MAX_ENGINE_WINDOW = 1 << 18
# Each engine core is a process holding the whole model: one per GPU (a node has 8-16), or a
# share of the CPU's threads.
MAX_DATA_PARALLEL = 64
# torch threads beyond the hardware's only oversubscribe (the largest machines have 384-512);
# each costs its stack (4096 start here in +70 MB; 10**6 cannot be created and the import dies).
MAX_ENGINE_THREADS = 1024
# An image's decoded pixels cost 3 bytes each in a render worker: 3 GB at this bound.
MAX_IMAGE_PIXELS = 1 << 30
# Heartbeats come every second (core.shared.runtime.HEARTBEAT_INTERVAL_S): a child silent for less than
# two of them is on time. A step's time is seen in those heartbeats: a shorter limit is not measured.
MIN_HEARTBEAT_TIMEOUT_S, MIN_STEP_TIMEOUT_S = 2.0, 1.0
# A child's start (an interpreter, its imports, a model) takes more than a second.
MIN_STARTUP_TIMEOUT_S = 1.0
# Longer is "never" (about 31 years), which threading's waits cannot take (threading.TIMEOUT_MAX).
MAX_SECONDS = 1e9
# A chat template is Jinja text of a few KB; it travels with every message of a call.
MAX_TEMPLATE_CHARS = 1 << 20


def up_to(high: int, low: int = 1) -> Any:
    """An int option's range: [low, high]."""
    return Annotated[int, Meta(ge=low, le=high)]


def seconds(low: float) -> Any:
    """A duration option's range: [low, MAX_SECONDS] seconds."""
    return Annotated[float, Meta(ge=low, le=MAX_SECONDS)]


class PipelineOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How the process group is shaped, checked once when a Pipeline is built. The first six are
    also `Pipeline`'s positional parameters (after `model`), in this order."""

    num_render_workers: Annotated[up_to(MAX_RENDER_WORKERS) | None, described(
        "render worker processes (default: planned from the cores)")] = None
    max_num_seqs: Annotated[up_to(MAX_NUM_SEQS) | None, described(
        "sequences per engine step (default: by device, 64 on a CPU, 1024 on a GPU, where the token budget "
        "bounds a step)")] = None
    max_num_batched_tokens: Annotated[up_to(MAX_BATCHED_TOKENS) | None, described(
        "padded tokens in one engine step, at least the model's max length (default: by device, "
        "2048 on CPU, 16384 on GPU)")] = None
    max_inflight: Annotated[up_to(MAX_INFLIGHT) | None, described(
        "requests issued and not yet handed back, all calls together (default: 16 x max_num_seqs "
        f"per engine core, at most {MAX_INFLIGHT}; for a model whose rows carry images or audio, also at most "
        "128 MiB of their arrays)")] = None
    device: Annotated[Device, described("auto, cpu, cuda, cuda:N, or sim (the simulated accelerator)")] = "auto"
    dtype: Annotated[Dtype, described("model dtype (float, fp32, half, fp16 and bf16 are aliases)")] = "auto"
    backend: Annotated[Backend, described(
        "what runs the transformer: torch, openvino (CPU, float32 or with dtype bfloat16, the 'openvino' extra), or auto "
        "(openvino on a CPU where it is installed and runs the model within its start-up check, else torch)")] = "auto"
    quantize: Annotated[Quantize | None, described(
        "int8: the transformer's Linear layers dynamically quantized (torch backend, CPU); opt-in, it changes "
        "results (README: cosine and top-10 agreement)")] = None
    data_parallel_size: Annotated[up_to(MAX_DATA_PARALLEL), described(
        "engine cores on this machine, fed by the same render workers: one GPU each (cuda:0 .. "
        "cuda:N-1), or a share of the CPU threads; across machines use Ray")] = 1
    engine_window: Annotated[up_to(MAX_ENGINE_WINDOW) | None, described(
        f"requests admitted in each engine core (default: 8 x max_num_seqs, at most {MAX_ENGINE_WINDOW})")] = None
    engine_threads: Annotated[up_to(MAX_ENGINE_THREADS) | None, described(
        "torch threads of each CPU engine core (default: planned from the cores)")] = None
    # (io_processor and sim_device are checked by what reads them: workers.render.load_plugin,
    # core.shared.sim_device.resolve_sim_device, in the caller too)
    io_processor: Annotated[str | None, described(
        "a plugin 'package.module:ClassName' for task 'plugin' (its render runs in the workers, its "
        "post_process in the caller)")] = None
    trust_remote_code: Annotated[bool, described(
        "allow a model's own code (auto_map, custom activations); opt-in")] = False
    revision: Annotated[Annotated[str, Meta(min_length=1, max_length=255)] | None, described(
        "hub revision of a hub model id (a branch, tag or commit)")] = None
    sim_device: Annotated[Any, described(
        "device='sim' only: the simulated device, a preset name or (a, b) seconds (default: the "
        "minilm-h100 preset)", shown="str | tuple[float, float] | SimDevice | None")] = None
    startup_timeout_s: Annotated[seconds(MIN_STARTUP_TIMEOUT_S), described(
        "seconds the children may take to load and start")] = 300.0
    heartbeat_timeout_s: Annotated[seconds(MIN_HEARTBEAT_TIMEOUT_S), described(
        "seconds without a heartbeat after which a child is taken for stopped or wedged")] = 30.0
    step_timeout_s: Annotated[seconds(MIN_STEP_TIMEOUT_S), described(
        "seconds one piece of work (a batch, an engine step) may take before its process is taken "
        "for wedged")] = 600.0
    log_level: Annotated[LogLevel, described("the children's log level (a logging level's name)")] = "WARNING"
    image_decode: Annotated[Literal["exact", "draft"], described(
        "dual encoders: 'exact' decodes every image whole, as ST does; 'draft' (opt-in) decodes a JPEG at "
        "a reduced DCT scale that still covers the model's input, then resizes: a fraction of the "
        "cost for camera-size photos, slightly different pixels (README: its cosine to the exact path)")] = "exact"
    max_image_pixels: Annotated[up_to(MAX_IMAGE_PIXELS), described(
        "dual encoders: an image of more pixels is a per-request error before it is decoded (a "
        "decompression bomb); default PIL's warning threshold")] = DEFAULT_MAX_IMAGE_PIXELS


# How many of PipelineOptions' fields `Pipeline(...)` also takes by position (after `model`).
PIPELINE_POSITIONAL = 6


class CallOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one call was asked for: built and checked once (`checked`), carried to the Call.
    `task`, `plugin` and `pairs` come from the method called; the rest are the caller's."""

    task: Task  # what the engine runs
    plugin: bool = False  # prompts are raw items for the io_processor plugin
    pairs: bool = False  # prompts are (query, document) pairs for a cross-encoder
    pooling_params: per_request("pooling_params") = None
    truncate_prompt_tokens: Annotated[up_to(MAX_TOKENS, low=-1) | None, described(
        "tokens kept of each prompt, special tokens included; -1: the model's maximum (default: "
        "the PoolingParams' own, else the model's max_seq_length)")] = None
    use_tqdm: Annotated[bool, described("show a progress bar")] = True
    priority: per_request("priority") = None
    chat_template: Annotated[Annotated[str, Meta(max_length=MAX_TEMPLATE_CHARS)] | None, described(
        "the chat template conversations are rendered with (default: the tokenizer's)")] = None
    long_inputs: Annotated[LongInputs, described(
        "a text longer than the tokens kept: 'truncate' cuts it, 'error' fails it (naming it and its token "
        "count), 'chunk' embeds it in chunks pooled into one normalized, token-weighted mean (embed only); "
        "score: a pair (or a scored text) past the tokens kept, each side's max_tokens_per_* cut first")] = "truncate"
    chunk_overlap: Annotated[up_to(MAX_TOKENS, low=0), described(
        "long_inputs='chunk': tokens shared by neighbouring chunks")] = 0
    truncation_side: Annotated[TruncationSide | None, described(
        "'right' keeps the first tokens, 'left' the last (default: the tokenizer's side)")] = None
    max_tokens_per_query: Annotated[TokenCount | None, described(
        "cross-encoder pairs: content tokens kept of the query (before the pair's own truncation)")] = None
    max_tokens_per_doc: Annotated[TokenCount | None, described(
        "cross-encoder pairs: content tokens kept of the document")] = None
    errors: Annotated[ErrorsMode, described(
        "'raise': the first bad request raises, naming it, and the rest of the call is aborted; "
        "'return': its output has `.error` and no data, and the others go on")] = "raise"
    prompt_name: per_request("prompt_name") = None
    prompt: per_request("prompt") = None
    route: per_request("route") = None
    # (A new per-request option goes last: the API takes its options by position too.)

    def __post_init__(self) -> None:
        if self.long_inputs == "chunk" and self.task != "embed":
            raise ValueError(f"long_inputs='chunk' pools chunks into one embedding: it applies to 'embed', "
                             f"not {self.task!r}")


if {o.name for o in REQUEST_OPTIONS} - set(CallOptions.__struct_fields__):
    raise RuntimeError("a per-request option declared in core.shared.options is not placed in CallOptions: this is a bug")

# The caller's options (`task`, `plugin` and `pairs` are the API's), and which call takes which,
# in the order the methods list them. classify: chunks are pooled into embeddings only; score: a
# pair is truncated by max_tokens_per_query / max_tokens_per_doc and the model's length (or refused
# past it: long_inputs='error'; 'chunk' is refused), never rendered with a caller's chat template.
_CALLER = tuple(name for name in CallOptions.__struct_fields__ if name not in ("task", "plugin", "pairs"))
_TEXT = tuple(name for name in _CALLER if not name.startswith("max_tokens_per_"))
CALL_OPTIONS: dict[str, tuple[str, ...]] = {
    "embed": _TEXT,
    "encode": _TEXT,
    "classify": tuple(name for name in _TEXT if name != "chunk_overlap"),
    # (long_inputs last: score took its other options by position before it took this one)
    "score": tuple(name for name in _CALLER
                   if name not in ("chat_template", "long_inputs", "chunk_overlap", "truncation_side")) + ("long_inputs",),
}


# ---- reading the declarations -------------------------------------------------------------------

class Option(NamedTuple):
    """One declared option, as signatures, docstrings and command-line flags need it."""

    name: str
    default: Any
    description: str
    shown: str  # its type as a signature shows it: "int | None", "Literal['raise', 'return']"
    type: msgspec.inspect.Type  # the declared type, constraints included (e.g. IntType(ge=1))
    choices: tuple | None  # a Literal's values, in declared order (None if not a Literal)


@functools.cache
def declared(struct_type: type) -> dict[str, Option]:
    """Every field of an options struct, in declaration order."""
    hints = typing.get_type_hints(struct_type, include_extras=True)
    out = {}
    for field in msgspec.inspect.type_info(struct_type).fields:
        t, description, shown = field.type, "", None
        if isinstance(t, msgspec.inspect.Metadata):
            description = (t.extra_json_schema or {}).get("description", "")
            shown = (t.extra or {}).get("shown")
            t = t.type
        hint = _bare(hints[field.name])
        literal = next((a for a in (hint, *typing.get_args(hint)) if typing.get_origin(a) is Literal), None)
        default = field.default if field.default is not msgspec.NODEFAULT else inspect.Parameter.empty
        out[field.name] = Option(field.name, default, description, shown or spelled(hint), t,
                                 typing.get_args(literal) if literal is not None else None)
    return out


def defaults(struct_type: type) -> dict[str, Any]:
    """The declared default of each field that has one."""
    return {o.name: o.default for o in declared(struct_type).values() if o.default is not inspect.Parameter.empty}


def _bare(hint: Any) -> Any:
    """A type without its Annotated metadata (a union's members too)."""
    if typing.get_origin(hint) is Annotated:
        return _bare(hint.__origin__)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, map(_bare, typing.get_args(hint)))
    return hint


def spelled(hint: Any) -> str:
    """A type as an annotation reads: "int | None", "Literal['left', 'right']"."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(map(spelled, typing.get_args(hint)))
    if typing.get_origin(hint) is Literal:
        return f"Literal[{', '.join(map(repr, typing.get_args(hint)))}]"
    if hint is type(None):
        return "None"
    if hint is Any:
        return "Any"
    return getattr(hint, "__name__", str(hint))


class OptionsSignature:
    """A function's own parameters followed by declared options: the signature `inspect.signature`
    and `help()` show, the docstring's list of the options, and the binding of a call's arguments
    (an unknown keyword is the TypeError Python would raise, naming it; defaults filled in).

    `positional`: how many of the options may also be given by position (default: all, as the
    API has always taken them); `defaults`: defaults that differ from the declared ones here."""

    def __init__(self, fn: Callable, struct_type: type, names: Sequence[str], *, positional: int | None = None,
                 defaults: dict[str, Any] | None = None, returns: str | None = None, qualname: str | None = None) -> None:
        fields = declared(struct_type)
        own = [p for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
        positional = len(names) if positional is None else positional
        self.defaults = {name: fields[name].default for name in names} | dict(defaults or {})
        options = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD if i < positional
                                     else inspect.Parameter.KEYWORD_ONLY,
                                     default=self.defaults[name], annotation=fields[name].shown)
                   for i, name in enumerate(names)]
        self.signature = inspect.Signature(
            own + options, return_annotation=returns if returns is not None else inspect.signature(fn).return_annotation)
        self.own = [p.name for p in own]
        self._own_defaults = [p.default for p in own]
        self.names = tuple(names)
        self._names = frozenset(names)
        self.qualname = qualname or fn.__qualname__
        self.options_doc = "\n".join(
            f"    {name}={self.defaults[name]!r}\n" + textwrap.fill(fields[name].description, 96, initial_indent=" " * 8,
                                                               subsequent_indent=" " * 8)
            for name in names)

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict[str, Any]]:
        """(the own arguments, in order; every option's value, defaults filled in)."""
        # The usual call -- own arguments by position, options by keyword -- without inspect's binder
        # (~17 us a call).
        if len(args) <= len(self.own) and self._names.issuperset(kwargs):
            rest = self._own_defaults[len(args):]
            if inspect.Parameter.empty not in rest:
                return (*args, *rest), self.defaults | kwargs
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.qualname}() {e}") from None
        bound.apply_defaults()
        values = bound.arguments
        return tuple(values[name] for name in self.own), {name: values[name] for name in self.names}

    def dress(self, wrapper: Callable, doc: str | None, name: str | None = None) -> Callable:
        """Gives `wrapper` this signature, a docstring ending with the options, and its name."""
        wrapper.__signature__ = self.signature
        text = inspect.cleandoc(doc or "")
        wrapper.__doc__ = f"{text}\n\nOptions:\n{self.options_doc}" if self.names else text
        wrapper.__qualname__ = self.qualname
        wrapper.__name__ = name or self.qualname.rpartition(".")[2]
        return wrapper


def takes_options(struct_type: type, names: Sequence[str] | None = None, *, positional: int | None = None) -> Callable:
    """A function `fn(own..., **options)` that takes the declared options as parameters: its
    signature shows them, an unknown one is a TypeError, and `fn` gets every one of them."""
    def decorate(fn: Callable) -> Callable:
        sig = OptionsSignature(fn, struct_type, names or tuple(declared(struct_type)), positional=positional)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            own, options = sig.bind(args, kwargs)
            return fn(*own, **options)

        return sig.dress(wrapper, fn.__doc__)
    return decorate
