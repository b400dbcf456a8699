"""The one JSON codec of the files the service writes and reads back."""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, TypeAdapter, ValidationError

from qed_ray.records.atomic import write_text
from qed_ray.records.file_reads import read_bytes
from qed_ray.spec.hints import short_repr

T = TypeVar("T")
# Tags pydantic puts in an error's location for the member of a union it tried; not field names.
_UNION_TAGS = ("int", "float", "str", "bool", "none", "list", "dict", "tuple")


class RecordError(ValueError):
    """A file the service wrote and reads back is missing, damaged or foreign; the message is one line naming the
    file and the problem (the field, where one is wrong)."""


def _nan_if_null(value: Any) -> Any:
    return math.nan if value is None else value


# A float that strict JSON writes as null when it is NaN or inf (unknown, undefined) and that reads null as NaN.
Num = Annotated[float, BeforeValidator(_nan_if_null)]


class Record(BaseModel):
    """Base of the record models: immutable, unknown keys and lax coercions (``"3"`` for an int) are errors; NaN
    is allowed (a :data:`Num` that is unknown)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


def strict_json(x):
    """NaN/inf -> None, dict keys -> str, tuples -> lists, recursively (``json.dumps`` then writes strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return x


@functools.cache
def adapter(kind: Any) -> TypeAdapter:
    """The (cached) pydantic adapter of a record type."""
    return TypeAdapter(kind)


def dump(record: Any, kind: Any = None) -> Any:
    """A record (of type ``kind``, default its own) as strict-JSON-ready Python: dicts, lists, numbers, strings;
    NaN as None."""
    return strict_json(adapter(kind or type(record)).dump_python(record, mode="json"))


def load_json(path: str | os.PathLike, error: type[Exception] = RecordError) -> Any:
    """A JSON file's content; raises ``error`` naming the file when it cannot be read as JSON."""
    path = Path(path)
    try:
        text = read_bytes(path, "record", error).decode()
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    if not text.strip():
        raise error(f"{path}: empty")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not JSON ({e.msg}: line {e.lineno} column {e.colno}; truncated or damaged)") \
            from None
    except (ValueError, RecursionError) as e:  # a number past Python's digit limit, nesting past the stack
        raise error(f"{path}: not a record of qed_ray ({type(e).__name__}: {short_repr(str(e))})") from None


def problem(e: ValidationError) -> str:
    """The first problem of a validation error as ``field.path: message (got ...)`` (and how many more)."""
    errors = e.errors()
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or not (
        "[" in str(p) or p in _UNION_TAGS))
    msg = str(first["msg"]).removeprefix("Value error, ")
    # A check of the record's own (a value error) says what it got; a missing field has nothing to show.
    got = "" if first["type"] in ("missing", "value_error") else f" (got {short_repr(first.get('input'))})"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{where + ': ' if where else ''}{msg}{got}{more}"


def parse(kind: type[T], data: Any, where: str | os.PathLike, error: type[Exception] = RecordError) -> T:
    """``data`` validated as ``kind``; raises ``error`` as ``<where>: <field>: <problem>``."""
    try:
        return adapter(kind).validate_python(data)
    except ValidationError as e:
        raise error(f"{where}: {problem(e)}") from None


def read_record(path: str | os.PathLike, kind: type[T], error: type[Exception] = RecordError) -> T:
    """The record in the JSON file ``path``, validated as ``kind`` (see the module notes for what is refused)."""
    return parse(kind, load_json(path, error), path, error)


def write_record(path: str | os.PathLike, record: Any, kind: Any = None, indent: int | None = 1) -> None:
    """Writes a record (of type ``kind``, default its own) atomically as strict JSON."""
    write_text(path, json.dumps(dump(record, kind), indent=indent, allow_nan=False))


def read_lines(path: str | os.PathLike, kind: type[T], error: type[Exception] = RecordError) -> list[T]:
    """The records of a JSON-lines file (one JSON value a line, blank lines skipped), each validated as ``kind``;
    raises ``error`` naming the file and the line."""
    path = Path(path)
    try:
        lines = read_bytes(path, "lines", error).decode().splitlines()
    except UnicodeDecodeError as e:
        raise error(f"{path}: cannot be read as UTF-8 text ({type(e).__name__})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise error(f"{path}: line {n}: not JSON ({type(e).__name__}; truncated or damaged)") from None
        out.append(parse(kind, raw, f"{path}: line {n}", error))
    return out
