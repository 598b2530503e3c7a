"""Each request's per-request options (`core.shared.options.REQUEST_OPTIONS`), checked and resolved.

A per-request option is given once for every prompt or as a list with one per prompt.
`RequestValues` reads every such option of a call the same way: a list is checked entry by entry
when the call starts (and against the number of prompts, once known), and `at(index)` gives a
request's values. An option with an engine column needs nothing more than its declaration: its
value is checked as an int64 and travels as it is (`column_values`). The others -- and a column
option whose value the caller names rather than gives -- have their rule here (`SPECIAL_RULES`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgspec

from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.messages import PoolingParams
from pooling_pipeline.core.shared.options import COLUMN_OPTIONS, REQUEST_OPTIONS, checked
from pooling_pipeline.options import CallOptions

# The engine keeps every per-request column in int64 (and msgpack carries ints up to it).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# ST 6's SentenceTransformer, SparseEncoder and MultiVectorEncoder start every model from these empty
# prompts (their `_default_prompts`) and fill them from config_sentence_transformers.json, so
# "query" and "document" name a prompt (empty unless saved) on every such model; CrossEncoder has none.
PLACEHOLDER_PROMPTS = {"query": "", "document": ""}


class Rule(NamedTuple):
    """How one per-request option's value is checked and resolved."""

    check: Callable[[object, str], None]  # raises TypeError / ValueError naming `where` ("priority[3]")
    none: Any = None  # what the call's None stands for (a None entry of a list is checked as it is)
    resolve: Callable[[Any], int] | None = None  # a column option's checked value -> its int (None: as it is)


class RequestValues:
    """A call's per-request options, request by request: `shared` holds the options given once,
    `lists` those given with one value per prompt (`counts`: their lengths, to check against the
    number of prompts once it is known)."""

    def __init__(self, opts: CallOptions, spec: ModelSpec, count: int | None) -> None:
        self.spec = spec
        self.rules = _rules(opts, spec)
        self.shared: dict[str, Any] = {}
        self.lists: dict[str, Sequence] = {}
        for option in REQUEST_OPTIONS:
            name, rule, value = option.name, self.rules[option.name], getattr(opts, option.name)
            if isinstance(value, (list, tuple)):
                for i, entry in enumerate(value):
                    rule.check(entry, f"{name}[{i}]")
                if count is not None and len(value) != count:
                    raise ValueError(f"{name} has {len(value)} entries but there are {count} prompts")
                self.lists[name] = value
            else:
                value = rule.none if value is None else value
                rule.check(value, name)
                self.shared[name] = value
        self.counts = [(len(values), name) for name, values in self.lists.items()]
        self.prompts = model_prompts(spec)
        # A multi-vector model's route picks the prompt of a request that names none (the render
        # worker does, as ST's encode_query / encode_document): None there means "none named", '' none.
        self.route_decides = spec.multi_vector is not None
        name = spec.default_prompt_name
        self.default_prompt = None if self.route_decides or not name else self.prompts.get(name)

    def at(self, index: int) -> dict[str, Any]:
        """Request `index`'s value of every per-request option (there is an entry at `index` in
        every list: the caller checks `counts` first)."""
        if not self.lists:
            return self.shared
        return {**self.shared, **{name: values[index] for name, values in self.lists.items()}}

    def column_values(self, values: dict[str, Any]) -> dict[str, int]:
        """The options with an engine column, as the ints their RenderOptions fields carry."""
        out = {}
        for option in COLUMN_OPTIONS:
            resolve = self.rules[option.name].resolve
            out[option.name] = values[option.name] if resolve is None else resolve(values[option.name])
        return out

    def prompt_text(self, values: dict[str, Any]) -> str | None:
        """A request's prompt, resolved as ST's encode does: an explicit `prompt` wins, else
        `prompt_name` (looked up in the model's prompts, ST's placeholders among them), else the
        model's default_prompt_name. None for no prompt -- unless the model's route decides, where
        None is "none named" and a named empty prompt stays '' (no prompt, not the route's)."""
        prompt, name = values["prompt"], values["prompt_name"]
        text = prompt if prompt is not None else self.prompts[name] if name is not None else self.default_prompt
        return text if self.route_decides else text or None


def _rules(opts: CallOptions, spec: ModelSpec) -> dict[str, Rule]:
    """Every per-request option's rule for this call: its own, else an int64 with its column's default."""
    return {o.name: SPECIAL_RULES[o.name](opts, spec) if o.name in SPECIAL_RULES else Rule(check_int64, none=o.column)
            for o in REQUEST_OPTIONS}


def _params_rule(opts: CallOptions, spec: ModelSpec) -> Rule:
    return Rule(lambda p, where: check_params(p, where, opts.task, spec), none=PoolingParams())


def _prompt_rule(opts: CallOptions, spec: ModelSpec) -> Rule:
    return Rule(check_prompt)


def _prompt_name_rule(opts: CallOptions, spec: ModelSpec) -> Rule:
    prompts = model_prompts(spec)

    def check_name(value: object, where: str) -> None:
        check_prompt(value, where)
        if value is not None and value not in prompts:
            raise ValueError(f"{where}={value!r} is not among the model's prompts {sorted(prompts)}")

    return Rule(check_name)


def _route_rule(opts: CallOptions, spec: ModelSpec) -> Rule:
    return Rule(lambda name, where: check_route(name, where, spec), resolve=lambda name: route_index(spec, name))


# The per-request options that are not an int64 taken as it is: each one's rule for a call.
SPECIAL_RULES: dict[str, Callable[[CallOptions, ModelSpec], Rule]] = {
    "pooling_params": _params_rule, "prompt": _prompt_rule, "prompt_name": _prompt_name_rule, "route": _route_rule,
}


def refused_entries(opts: CallOptions) -> tuple[CallOptions, dict[int, str]]:
    """errors="return": a bad entry in the list of an int option with no rule of its own (a
    priority) fails its request only -- an error output naming it -- and the others go on; the
    options with such entries at their column's default, and the refused requests with why."""
    refused: dict[int, str] = {}
    changed: dict[str, list] = {}
    for option in COLUMN_OPTIONS:
        values = getattr(opts, option.name)
        if option.name in SPECIAL_RULES or not isinstance(values, (list, tuple)):
            continue
        values = list(values)
        for i, value in enumerate(values):
            try:
                check_int64(value, f"{option.name}[{i}]")
            except (TypeError, ValueError) as e:
                refused.setdefault(i, str(e))
                values[i] = option.column
                changed[option.name] = values
    return (msgspec.structs.replace(opts, **changed) if changed else opts), refused


def _request_named(where: str) -> str:
    """An entry of a per-request list ("priority[3]") names its request: "request 3: priority[3]"."""
    name, bracket, rest = where.partition("[")
    return f"request {rest[:-1]}: {where}" if bracket else where


def check_int64(value: object, where: str) -> None:
    where = _request_named(where)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{where} must be an int, got {value!r}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{where} must be in [{INT64_MIN}, {INT64_MAX}], got {value}")


def check_params(p: object, where: str, task: str, spec: ModelSpec) -> None:
    if not isinstance(p, PoolingParams):
        what = "a PoolingParams" if "[" in where else "a PoolingParams, a list of them or None"
        raise TypeError(f"{where} must be {what}, got {type(p).__name__}")
    # The caller may have built it with any values: check types and ranges as msgspec declares them.
    checked(PoolingParams, msgspec.structs.asdict(p), f"{where}.")
    p.verify(where, task, spec)


def check_prompt(value: object, where: str) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{where} must be a str or None, got {type(value).__name__}")


def model_prompts(spec: ModelSpec) -> dict[str, str]:
    """The model's prompts by name as ST 6 holds them (`SentenceTransformer(...).prompts`): the
    placeholders first, then the saved prompts (a saved "query" / "document" fills its placeholder)."""
    if "embed" in spec.tasks or "sparse_embed" in spec.tasks:
        return {**PLACEHOLDER_PROMPTS, **spec.prompts}
    return dict(spec.prompts)


# ---- routes (ST's Router) ----------------------------------------------------------------------


def check_route(name: object, where: str, spec: ModelSpec) -> None:
    """A task the model's Router resolves to one of its routes (ST's encode(task=...)), or None
    for its default route (a Router without one refuses it, as ST does)."""
    where = _request_named(where)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{where} must be a str or None, got {type(name).__name__}")
    if name is not None and not spec.routes:
        raise ValueError(f"{where}={name!r}: this model has no routes (it encodes every text the same way)")
    try:
        resolve_route(spec, name)
    except ValueError as e:
        raise ValueError(f"{where}={name!r}: {e}") from None


def resolve_route(spec: ModelSpec, task: str | None) -> str | None:
    """The route ST's Router takes for a text with this task (None: the model has no routes).
    ST's order: route_mappings' (task, "text") / (task, None), then (None, "text") / (None, None),
    a route named as the task, a route named "text", then -- with no task -- the default route."""
    if not spec.routes:
        return None
    if not spec.route_specs:  # query / document routes of one chain (ColBERT): none named is ST's no task
        if task is not None and task not in spec.routes:
            raise ValueError(f"no route for task {task!r}; the model's routes: {_routes_text(spec)}")
        return task
    if task is not None and task in spec.route_by_task:
        return spec.route_by_task[task]
    if spec.route_any_task is not None:
        return spec.route_any_task
    if task is not None and task in spec.routes:
        return task
    if "text" in spec.routes:
        return "text"
    if task is not None:
        raise ValueError(f"no route for task {task!r}; the model's routes: {_routes_text(spec)}")
    if spec.default_route is None:
        raise ValueError(f"no route was named and the model's Router has no default route; name one of "
                         f"{_routes_text(spec)} (ST: encode_query / encode_document / encode(task=...))")
    return spec.default_route


def _routes_text(spec: ModelSpec) -> str:
    return ", ".join(repr(name) for name in [*spec.routes, *sorted(set(spec.route_by_task) - set(spec.routes))])


def route_index(spec: ModelSpec, name: str | None) -> int:
    """A checked route's index in the model's routes: the `route` the worker and engine see;
    -1 when the model has none."""
    route = resolve_route(spec, name)
    return -1 if route is None else spec.routes.index(route)


def route_spec(spec: ModelSpec, name: str | None) -> ModelSpec:
    """The spec of the route a checked task takes (its truncation, its max length); the model's
    own spec when it has no routes."""
    route = resolve_route(spec, name) if spec.route_specs else None
    return spec if route is None else spec.route_specs[spec.routes.index(route)]
