"""Command-line flags made from the declared options (`options.py`): `pipeline-run` and
`pipeline-serve` read a Pipeline or call option's type, choices, default and description from its
declaration instead of restating them."""

from __future__ import annotations

import argparse

import msgspec

from pooling_pipeline.options import declared


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer is expected, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def positive_seconds(value: str) -> float:
    """A duration flag: a finite number above 0 (0, a negative or nan would turn a bound into none, or
    into an immediate refusal of everything)."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds is expected, got {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {value}")
    return seconds


def declared_flag(group, flag: str, struct_type: type, name: str, **given) -> None:
    """Adds `flag` for the declared option `name` (a Pipeline or call option: see the flag tables in
    job_spec.py); `given` (metavar, a narrower type, its own help) wins over what the declaration says."""
    mi = msgspec.inspect
    option = declared(struct_type)[name]
    t = option.type
    if isinstance(t, mi.UnionType):  # X | None: the flag's absence is the None
        t = next(x for x in t.types if not isinstance(x, mi.NoneType))
    kwargs: dict = {"default": option.default}
    if option.choices:
        kwargs["choices"] = option.choices
    elif isinstance(t, mi.BoolType):
        kwargs["action"] = "store_true"
    elif isinstance(t, mi.IntType):
        kwargs["type"] = positive_int if t.ge == 1 else int
    elif isinstance(t, mi.FloatType):
        kwargs["type"] = float
    text = given.pop("help", option.description.replace("%", "%%"))
    if option.default not in (None, False) and "default" not in text:
        text += " (default: %(default)s)"
    group.add_argument(flag, help=text, **(kwargs | given))
