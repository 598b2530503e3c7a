"""The --keep-fields columns of Parquet chunks: one type per column for the whole job, and never a
value coerced or dropped.

The chunks of a job share one schema (pandas, pyarrow.dataset and `datasets` concatenate them), and
the first chunk with rows fixes it: a column cannot widen later without rewriting every chunk
before. So each column's type is one that nothing later can outgrow silently:

- a field read from Parquet inputs keeps the input column's own type (known before any chunk; the
  inputs must agree on it);
- a JSON field whose non-null values in the first chunk are all strings, all booleans, all integers
  (within int64) or all floats gets that type: string, bool, int64, double;
- any other JSON field -- null throughout the first chunk, objects, lists, numbers beyond int64, or a
  mix of types -- is a string column of each value's JSON text (null stays null), marked in the
  field's metadata (`pooling_pipeline.encoding: json`): lossless, whatever comes later.

A later value that does not fit its column (an int64 column meeting 150.5, a string column meeting a
number, `true` among integers) is refused, naming the field and the record (an input error), before
it is added: the records before it are kept.
"""

from __future__ import annotations

import json

from pooling_pipeline.jobs.job_errors import InputError

ENCODING_KEY = b"pooling_pipeline.encoding"
JSON_ENCODING = b"json"
INT64_RANGE = (-(2**63), 2**63 - 1)


def _is_int64(value) -> bool:
    return type(value) is int and INT64_RANGE[0] <= value <= INT64_RANGE[1]


# The columns a JSON value decides: (Arrow type name, whether a value belongs). `type(v) is ...`:
# a bool is not an int here (True is not 1), an int is not a float (150 is not 150.0).
SCALAR_KINDS = {
    "string": lambda v: type(v) is str,
    "bool": lambda v: type(v) is bool,
    "int64": _is_int64,
    "double": lambda v: type(v) is float,
}


class KeptColumn:
    """One kept field's column: its Arrow field, and how a value becomes (or is refused) a cell."""

    def __init__(self, name: str, field) -> None:
        self.name = name
        self.field = field
        self.json = (field.metadata or {}).get(ENCODING_KEY) == JSON_ENCODING
        self.fits = None if self.json else SCALAR_KINDS.get(str(field.type))

    def describe(self) -> str:
        return "JSON text" if self.json else str(self.field.type)

    def check(self, value, where: str) -> None:
        """Refuses a value its column would have to coerce."""
        if value is None or self.json or self.fits is None or self.fits(value):
            return
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise InputError(f"--keep-fields {self.name!r}: {where} has {shown} ({type(value).__name__}), but the column "
                         f"is {self.describe()}, fixed by the values of the job's first chunk; a value is never "
                         "coerced. Give the field one type in every record (a field whose types already mix "
                         "within the first chunk is kept as JSON text), or leave it out of --keep-fields")

    def array(self, values: list, wheres: list[str]):
        import pyarrow as pa

        if self.json:
            return pa.array([None if v is None else _json_text(self.name, v, w) for v, w in zip(values, wheres)],
                            pa.string())
        for value, where in zip(values, wheres):
            self.check(value, where)
        try:  # a Parquet input's own type (or an older job's): the values come from that type
            return pa.array(values, type=self.field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise InputError(f"--keep-fields {self.name!r}: values of {wheres[0]} .. {wheres[-1]} do not fit the "
                             f"column type {self.field.type} of the earlier chunks ({e})") from None


def _json_text(name: str, value, where: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise InputError(f"--keep-fields {name!r}: {where} has a {type(value).__name__}, which has no JSON text "
                         f"({e}); read the field from Parquet inputs only, or leave it out of --keep-fields") from None


def _field_for(name: str, values: list):
    """The column the first chunk's values decide (see the module's docstring)."""
    import pyarrow as pa

    present = [v for v in values if v is not None]
    types = {"string": pa.string(), "bool": pa.bool_(), "int64": pa.int64(), "double": pa.float64()}
    for kind, fits in SCALAR_KINDS.items():
        if present and all(fits(v) for v in present):
            return pa.field(name, types[kind])
    return pa.field(name, pa.string(), metadata={ENCODING_KEY: JSON_ENCODING})


class KeptColumns:
    """A job's kept fields. `input_types`: Parquet input column types; `schema`: that of the job's
    first chunk, when it has one (a resume), which fixes every column."""

    def __init__(self, names: list[str], input_types: dict | None = None, schema=None) -> None:
        import pyarrow as pa

        self.names = list(names)
        self.columns: dict[str, KeptColumn] = {}
        for name in self.names:
            if schema is not None and name in schema.names:
                self.columns[name] = KeptColumn(name, schema.field(name))
            elif input_types and name in input_types:
                self.columns[name] = KeptColumn(name, pa.field(name, input_types[name]))

    def check(self, fields: dict, where: str) -> None:
        """Refuses a record whose value does not fit its (already fixed) column."""
        for name, column in self.columns.items():
            column.check(fields.get(name), where)

    def arrays(self, values: dict[str, list], wheres: list[str]) -> list[tuple]:
        """(field, array) per kept field, for one chunk; the first chunk fixes the undecided columns."""
        out = []
        for name in self.names:
            if name not in self.columns:
                self.columns[name] = KeptColumn(name, _field_for(name, values[name]))
            column = self.columns[name]
            out.append((column.field, column.array(values[name], wheres)))
        return out
