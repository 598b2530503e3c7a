"""The vocabulary of options, each defined once, and the one way they are checked.

Task names, error modes and long-input modes are `Literal` types used by the wire structs, the
API, the launcher and the Ray integration alike. Option structs declare their constraints with
msgspec (`Literal`, `Meta(ge=1)`), and `checked` builds one from plain values, turning msgspec's
validation error into the `TypeError` / `ValueError` a user expects, naming the option. The
options a user sets (`PipelineOptions`, `CallOptions`) are declared with these in pipeline/options.py.
"""

from __future__ import annotations

import re
import typing
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

# What the engine runs. "score" is a cross-encoder's pair task; bi-encoder scores are "embed";
# "sparse_embed" is SPLADE's vocabulary-sized vector, returned as (token ids, weights).
Task = Literal["embed", "token_embed", "classify", "token_classify", "score", "sparse_embed"]
TASKS: tuple[str, ...] = typing.get_args(Task)
EMBEDDING_TASKS = ("embed", "token_embed")
TOKEN_TASKS = ("token_embed", "token_classify")
# errors="raise": the first bad request ends the call; "return": it becomes an error output.
ErrorsMode = Literal["raise", "return"]
ERRORS_MODES: tuple[str, ...] = typing.get_args(ErrorsMode)
# What happens to a text longer than the tokens kept: cut it, refuse it, or embed it in chunks.
LongInputs = Literal["truncate", "error", "chunk"]
# Ends the message of a request refused for its length under long_inputs='error' (a server answers it
# with its "payload too large" status: pooling_pipeline.serve).
TOO_LONG_MARK = "(long_inputs='error')"
LONG_INPUTS: tuple[str, ...] = typing.get_args(LongInputs)
# The refusal as the frontend raises it: "request i: ValueError: <what> has [at least ]N tokens, more than ...".
_TOO_LONG = re.compile(r"request (\d+): (?:ValueError: )?.*? has (at least )?(\d+) tokens, more than the \d+ this "
                       r"call keeps " + re.escape(TOO_LONG_MARK))


def too_long(what: str, tokens: int, exact: bool, max_tokens: int) -> str:
    """The render workers' refusal of an input over the tokens kept (long_inputs='error'); `exact`
    False: `tokens` is a lower bound (only a prefix was tokenized)."""
    return f"{what} has {'' if exact else 'at least '}{tokens} tokens, more than the {max_tokens} this call keeps " \
           f"{TOO_LONG_MARK}"


class TooLong(NamedTuple):
    """A `too_long` refusal read back from its error (a server names the input in its own terms)."""

    index: int  # the request's index in its call
    tokens: int
    exact: bool


def read_too_long(message: str) -> TooLong | None:
    """The request, length and exactness of a `too_long` refusal; None for any other error."""
    match = _TOO_LONG.match(message)
    return None if match is None else TooLong(int(match[1]), int(match[3]), match[2] is None)


TruncationSide = Literal["left", "right"]
# What runs the model's transformer: torch, or OpenVINO on a CPU (core/engine/openvino_model.py); "auto":
# OpenVINO on a CPU where it is installed and passes its start-up check for this model, else torch.
Backend = Literal["auto", "torch", "openvino"]
Quantize = Literal["int8"]
# The engine's precision, the caller's aliases resolved (pipeline/options.py's DTYPE_ALIASES).
EngineDtype = Literal["auto", "float32", "float16", "bfloat16"]

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
# A count of tokens a caller sets (tokens kept of a prompt, of a query or a document, shared by
# chunks). Far beyond any model's max length (the longest pooling models take 32K-128K tokens; a
# model's own maximum is checked where it is known), and within the int32 lengths messages carry.
MAX_TOKENS = 1 << 24
TokenCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]

S = typing.TypeVar("S", bound=msgspec.Struct)
MAX_SHOWN_CHARS = 200  # of a refused value, in its error


def checked(struct_type: type[S], values: dict[str, Any], where: str = "") -> S:
    """`struct_type(**values)`, validated against its declared types and constraints.

    A wrong type raises TypeError, a wrong value ValueError; both name the option (prefixed with
    `where`, e.g. "pooling_params[3].") and say what it must be.
    """
    try:
        return msgspec.convert(values, struct_type)
    except msgspec.ValidationError as e:
        raise _readable(e, struct_type, values, where) from None


def _readable(error: msgspec.ValidationError, struct_type: type, values: dict, where: str) -> Exception:
    message = str(error)
    name = message.rpartition("- at `$.")[2].rstrip("`") if "- at `$." in message else None
    if name is None or name not in values:  # raised by __post_init__: its message says it all
        return ValueError(f"{where}{message}" if where else message)
    fields = {f.name: f.type for f in msgspec.inspect.type_info(struct_type).fields}
    what = describe(fields[name]) if name in fields else "valid"
    kind = TypeError if ", got `" in message else ValueError
    given = repr(values[name])
    if len(given) > MAX_SHOWN_CHARS:  # (a 1 MB template is not printed whole)
        given = f"{given[:MAX_SHOWN_CHARS]}... ({len(given)} characters)"
    return kind(f"{where}{name} must be {what}, got {given}")


def describe(t: msgspec.inspect.Type) -> str:
    """A type as a person would say it: "a positive int or None", "one of 'raise', 'return'"."""
    mi = msgspec.inspect
    if isinstance(t, mi.Metadata):  # a described option: the type it wraps
        return describe(t.type)
    if isinstance(t, mi.UnionType):
        return " or ".join(describe(x) for x in t.types)
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(repr(v) for v in t.values)
    if isinstance(t, mi.NoneType):
        return "None"
    if isinstance(t, mi.BoolType):
        return "a bool"
    if isinstance(t, mi.IntType):
        if t.le is not None:
            return f"an int in [{t.ge if t.ge is not None else '...'}, {t.le}]"
        return {1: "a positive int", 0: "a non-negative int"}.get(t.ge, "an int" + (f" >= {t.ge}" if t.ge is not None else ""))
    if isinstance(t, mi.FloatType):
        if t.le is not None:
            low = f"({t.gt:g}" if t.gt is not None else f"[{t.ge:g}" if t.ge is not None else "(..."
            return f"a number in {low}, {t.le:g}]"
        return "a positive number" if t.gt == 0 else "a number"
    if isinstance(t, mi.StrType):
        if t.pattern:
            return f"a str matching {t.pattern!r}"
        if t.max_length is not None:
            return (f"a str of {t.min_length} to {t.max_length} characters" if t.min_length
                    else f"a str of at most {t.max_length} characters")
        return "a str"
    if isinstance(t, mi.StructType):
        return f"a {t.cls.__name__}"
    if isinstance(t, mi.ListType):
        return f"a list of {describe(t.item_type)}"
    return "valid"


# ---- per-request options ----------------------------------------------------------------------


class RequestOption(NamedTuple):
    """A per-request option, declared once. The caller gives it as a call option (`CallOptions`
    places it in the signatures): one value for every prompt, a list with one per prompt, or None.
    The frontend checks each request's value and resolves it (`pipeline.request_options`). With a
    `column`, the resolved value is an int that travels by name in `RenderOptions` and that the
    render worker's packer copies into the engine's request column of the same name
    (`core.shared.schema.REQUEST_COLUMNS`): such an option needs no code between the call and the engine.
    Without one, the frontend resolves it into the RenderOptions that rendering reads (pooling
    params, prompt text)."""

    name: str
    doc: str  # the call option's one-line description
    shown: str  # the call option's type, as signatures show it
    column: int | None = None  # its int column's default (what a row that does not carry it holds)


REQUEST_OPTIONS: tuple[RequestOption, ...] = (
    RequestOption("pooling_params", "one PoolingParams for every prompt, a list with one per prompt, or None (the "
                  "defaults)", "PoolingParams | Sequence[PoolingParams] | None"),
    RequestOption("priority", "lower runs first among waiting requests: one int, a list with one per prompt, or "
                  "None (0); results stay in input order", "int | Sequence[int] | None", column=0),
    RequestOption("prompt", "a prompt text put in front of each text, instead of prompt_name (it wins over it; '' "
                  "for none)", "str | Sequence[str | None] | None"),
    RequestOption("prompt_name", "a prompt of the model's config_sentence_transformers.json, put in front of each "
                  "text (default: the model's default_prompt_name)", "str | Sequence[str | None] | None"),
    # Its column is the route's index in ModelSpec.routes (-1: none named), resolved from the name.
    RequestOption("route", "which of the model's routes each text takes (ST's encode(task=...): 'query', "
                  "'document' or another route its Router declares); one for every prompt, a list with one per "
                  "prompt, or None (the model's default route)", "str | Sequence[str | None] | None", column=-1),
)
COLUMN_OPTIONS: tuple[RequestOption, ...] = tuple(o for o in REQUEST_OPTIONS if o.column is not None)
