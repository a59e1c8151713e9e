"""Parse and validate one wire batch (DESIGN §3), column by column."""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from stepscope import schema
from stepscope.schema import MAX_ID_CHARS

MAX_ROWS_PER_SECTION = 200_000
MAX_BUNDLE_BATCHES = 1024
"""Most batches in one node bundle (a node's ranks, each with a few batches after an outage)."""

Columns = dict[str, list[Any]]
"""Column name → values, nulls as None, ready for a bulk insert."""

_NONE = type(None)
# Checked with set(map(type, values)): a C-speed pass per column. bool is not an int here.
_ALLOWED_TYPES: dict[schema.Dtype, frozenset[type]] = {
    "str": frozenset({str, _NONE}),
    "int": frozenset({int, _NONE}),
    "float": frozenset({float, int, _NONE}),
}
_COLUMNAR_SECTIONS = {"steps": schema.STEPS, "collectives": schema.COLLECTIVES, "gpu": schema.GPU}
_WIRE_COLUMNS = {
    t.name: {c.name: c for c in t.wire_columns}
    for t in (schema.STEPS, schema.COLLECTIVES, schema.GPU)
}
_REQUIRED_WIRE = {
    t.name: tuple(name for name in t.required if name in _WIRE_COLUMNS[t.name])
    for t in _COLUMNAR_SECTIONS.values()
}
_TOP_LEVEL = {"schema", "job", "source", "seq", "events", *_COLUMNAR_SECTIONS}
_JOB_FIELDS = {c.name: c.dtype for c in schema.JOBS.columns}
_SOURCE_FIELDS: dict[str, schema.Dtype] = {
    "rank": "int",
    "local_rank": "int",
    "node": "str",
    "pid": "int",
    "incarnation": "str",
    "mesh": "json",
    "attributes": "json",
}
MAX_SOURCE_ATTRIBUTES = 64
MAX_SOURCE_ATTRIBUTE_CHARS = 1024
MAX_MESH_DIMS = 8
MAX_MESH_DIM_CHARS = 64
_EVENT_FIELDS = {c.name: c.dtype for c in schema.EVENTS.wire_columns}
_JSON_TYPES: dict[schema.Dtype, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "json": (dict,),
}


class BatchError(ValueError):
    """A batch that is rejected whole; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, *, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Batch:
    """A validated batch; each section's columns include job_id and rank."""

    job: dict[str, Any]
    source: dict[str, Any]
    seq: int
    sections: dict[str, Columns] = field(default_factory=dict)


def decode_body(body: bytes, *, content_encoding: str | None, max_bytes: int) -> Any:
    """JSON value of a (possibly gzip-encoded) body, refusing bodies that inflate past max_bytes."""
    body = inflate(body, content_encoding=content_encoding, max_bytes=max_bytes)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        where = _non_finite_number(body)
        if where is not None:  # NaN or Infinity, as JavaScript and Python's json write them
            raise BatchError(f"{where} must hold finite numbers (got NaN or Infinity)") from exc
        raise BatchError(f"body is not valid JSON: {exc}", status=400) from exc


def inflate(body: bytes, *, content_encoding: str | None, max_bytes: int) -> bytes:
    """The body without its gzip Content-Encoding; 413 past `max_bytes` inflated."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "gzip":
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            body = inflater.decompress(body, max_bytes + 1)
        except zlib.error as exc:
            raise BatchError(f"body is not valid gzip: {exc}", status=400) from exc
        if len(body) > max_bytes or inflater.unconsumed_tail:
            raise BatchError(f"decompressed body exceeds {max_bytes} bytes", status=413)
    elif encoding != "identity":
        raise BatchError(f"unsupported Content-Encoding {encoding!r} (use gzip)", status=415)
    return body


def _non_finite_number(body: bytes) -> str | None:
    """Where the first NaN or ±Infinity is in a body that only they make invalid JSON."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where or "body"
        if isinstance(value, dict):
            stack.extend((f"{where}.{k}".lstrip("."), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return None


def _check_scalar(where: str, value: Any, dtype: schema.Dtype, *, required: bool) -> None:
    if value is None:
        if required:
            raise BatchError(f"{where} is required")
        return
    if isinstance(value, bool) or not isinstance(value, _JSON_TYPES[dtype]):
        raise BatchError(f"{where} must be of type {dtype}, got {type(value).__name__}")
    if isinstance(value, str) and not value.strip():
        raise BatchError(f"{where} must not be empty")
    if isinstance(value, str) and "\x00" in value:
        raise BatchError(f"{where} must not contain NUL characters")


def _check_object(
    where: str, obj: Any, fields: dict[str, schema.Dtype], required: set[str]
) -> None:
    if not isinstance(obj, dict):
        raise BatchError(f"{where} must be an object")
    unknown = set(obj) - set(fields)
    if unknown:
        raise BatchError(f"{where} has unknown field(s): {', '.join(sorted(unknown))}")
    for name, dtype in fields.items():
        _check_scalar(f"{where}.{name}", obj.get(name), dtype, required=name in required)


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_NUMPY_FROM_VALUES = 256
"""Columns this long are checked with numpy; shorter ones faster in plain Python."""


def _numbers_ok(spec: schema.Column, present: list[Any]) -> str | None:
    """What is wrong with the non-null numbers of a column, or None."""
    if not present:
        return None
    non_negative = spec.unit in ("s", "bytes") and spec.name != "ts"
    if len(present) < _NUMPY_FROM_VALUES:
        low, high = min(present), max(present)
        if spec.dtype == "int" and (low < _INT64_MIN or high > _INT64_MAX):
            return "holds an integer out of the 64-bit range"
        try:
            finite = spec.dtype == "int" or all(map(math.isfinite, present))
        except OverflowError:
            return "holds a number out of the float range"
        if not finite:
            return "must hold finite numbers"
    else:
        try:
            array = np.array(present, dtype=np.float64 if spec.dtype == "float" else np.int64)
        except OverflowError:
            return "holds a number out of the 64-bit range"
        if spec.dtype == "float" and not np.isfinite(array).all():
            return "must hold finite numbers"
        low, high = array.min(), array.max()
    if non_negative and low < 0:
        return "must not be negative"
    return _plausible(spec, low, high)


def _plausible(spec: schema.Column, low: float, high: float) -> str | None:
    """What makes a column's range impossible (a broken clock), or None."""
    if spec.name == "ts" and not 0 <= low <= high < schema.MAX_EPOCH_S:
        return "must be Unix epoch seconds between 1970 and 2106"
    if spec.unit == "s" and spec.name != "ts" and high > schema.MAX_DURATION_S:
        return f"holds a duration over {schema.MAX_DURATION_S / 86_400:.0f} days"
    return None


def _column(section: str, spec: schema.Column, values: Any) -> list[Any]:
    """The values of one column after its type and value rules, or BatchError naming it."""
    where = f"{section}.{spec.name}"
    if not isinstance(values, list):
        raise BatchError(f"{where} must be a list")
    types = set(map(type, values))
    if not types <= _ALLOWED_TYPES[spec.dtype]:
        bad = sorted(t.__name__ for t in types - _ALLOWED_TYPES[spec.dtype])
        raise BatchError(f"{where} must hold values of type {spec.dtype}, found {', '.join(bad)}")
    has_null = _NONE in types
    if has_null and spec.required:
        raise BatchError(f"{where} must not contain null")
    if spec.dtype == "str":
        if "\x00" in "".join(filter(None, values)):  # PostgreSQL cannot store it
            raise BatchError(f"{where} must not contain NUL characters")
        return values
    problem = _numbers_ok(spec, [v for v in values if v is not None] if has_null else values)
    if problem:
        raise BatchError(f"{where} {problem}")
    if spec.dtype == "float" and int in types:
        # Store floats as floats (PostgreSQL's binary COPY is typed).
        return [None if v is None else float(v) for v in values]
    return values


def _columnar(section: str, table: schema.Table, payload: Any) -> Columns | None:
    if not isinstance(payload, dict):
        raise BatchError(f"{section} must be an object of columns")
    if not payload:
        return None
    wire = _WIRE_COLUMNS[table.name]
    unknown = set(payload) - set(wire)
    if unknown:
        raise BatchError(f"{section} has unknown column(s): {', '.join(sorted(unknown))}")
    missing = [name for name in _REQUIRED_WIRE[table.name] if name not in payload]
    if missing:
        raise BatchError(f"{section} is missing required column(s): {', '.join(missing)}")
    not_lists = [name for name, v in payload.items() if not isinstance(v, list)]
    if not_lists:
        raise BatchError(f"{section}.{not_lists[0]} must be a list of values, one per row")
    lengths = {name: len(v) for name, v in payload.items()}
    num_rows = max(lengths.values())
    if any(n != num_rows for n in lengths.values()):
        raise BatchError(f"{section} columns differ in length: {lengths}")
    if num_rows > MAX_ROWS_PER_SECTION:
        raise BatchError(
            f"{section} has {num_rows} rows, more than {MAX_ROWS_PER_SECTION}", status=413
        )
    if num_rows == 0:
        return None
    return {name: _column(section, wire[name], values) for name, values in payload.items()}


def _check_source_attributes(attributes: Any) -> None:
    """source.attributes: a few scalars (a rank's scheduler names and GPU identity)."""
    if attributes is None:
        return
    if len(attributes) > MAX_SOURCE_ATTRIBUTES:
        raise BatchError(
            f"source.attributes has {len(attributes)} keys, more than {MAX_SOURCE_ATTRIBUTES}"
        )
    for key, value in attributes.items():
        if not isinstance(value, str | int | float | bool) and value is not None:
            raise BatchError(f"source.attributes.{key} must be a string, number or boolean")
        if len(key) > MAX_SOURCE_ATTRIBUTE_CHARS or len(str(value)) > MAX_SOURCE_ATTRIBUTE_CHARS:
            raise BatchError(
                f"source.attributes.{key[:64]} is longer than {MAX_SOURCE_ATTRIBUTE_CHARS} "
                "characters"
            )


def _check_mesh(mesh: Any) -> None:
    """source.mesh: {dim: [coordinate, size]}, a few short names, 0 <= coordinate < size."""
    if mesh is None:
        return
    if len(mesh) > MAX_MESH_DIMS:
        raise BatchError(f"source.mesh has {len(mesh)} dimensions, more than {MAX_MESH_DIMS}")
    for dim, place in mesh.items():
        if not dim.strip() or len(dim) > MAX_MESH_DIM_CHARS:
            raise BatchError(
                f"source.mesh dimension names must be 1 to {MAX_MESH_DIM_CHARS} characters, "
                f"got {dim[: MAX_MESH_DIM_CHARS + 1]!r}"
            )
        ok = (
            isinstance(place, list)
            and len(place) == 2
            and all(type(v) is int for v in place)
            and 0 <= place[0] < place[1]
        )
        if not ok:
            raise BatchError(
                f"source.mesh.{dim} must be [coordinate, size], integers with "
                f"0 <= coordinate < size, got {orjson.dumps(place).decode()[:100]}"
            )


def _with_group(columns: Columns) -> Columns:
    """Collectives with a group in every row: DEFAULT_GROUP where the batch gives none."""
    groups = columns.get("group")
    if groups is None:
        groups = [schema.DEFAULT_GROUP] * len(columns["op"])
    elif None in groups:
        groups = [schema.DEFAULT_GROUP if g is None else g for g in groups]
    return {**columns, "group": groups}


def _events(payload: Any) -> Columns | None:
    if not isinstance(payload, list):
        raise BatchError("events must be a list of objects")
    if not payload:
        return None
    if len(payload) > MAX_ROWS_PER_SECTION:
        raise BatchError(f"events has more than {MAX_ROWS_PER_SECTION} entries", status=413)
    required = set(schema.EVENTS.required)
    for i, event in enumerate(payload):
        _check_object(f"events[{i}]", event, _EVENT_FIELDS, required)
        if event["kind"] not in schema.EVENT_KINDS:
            raise BatchError(f"events[{i}].kind must be one of {', '.join(schema.EVENT_KINDS)}")
        if not math.isfinite(event["ts"]):
            raise BatchError(f"events[{i}].ts must be a finite number")
        lifecycle = schema.LIFECYCLE_ATTRIBUTES.get(event["kind"])
        if lifecycle is not None:
            _check_lifecycle(f"events[{i}].attributes", event.get("attributes"), lifecycle)
    return {
        "ts": [float(e["ts"]) for e in payload],
        "kind": [e["kind"] for e in payload],
        "message": [e.get("message") for e in payload],
        "attributes": [orjson.dumps(e.get("attributes") or {}).decode() for e in payload],
    }


def _check_lifecycle(
    where: str, attributes: Any, fields: dict[str, tuple[schema.Dtype, bool]]
) -> None:
    """A lifecycle event's attributes: the named ones typed, finite and not negative."""
    if not isinstance(attributes, dict):
        raise BatchError(f"{where} must be an object")
    for name, (dtype, required) in fields.items():
        value = attributes.get(name)
        _check_scalar(f"{where}.{name}", value, dtype, required=required)
        if dtype in ("int", "float") and value is not None:
            if not math.isfinite(value) or value < 0:
                raise BatchError(f"{where}.{name} must be a finite number >= 0")
        if dtype == "str" and value is not None and len(value) > MAX_ID_CHARS:
            raise BatchError(f"{where}.{name} is longer than {MAX_ID_CHARS} characters")


def parse_batch(doc: Any) -> Batch:
    """Validate a decoded wire batch as a whole; raise BatchError naming the first bad field."""
    if not isinstance(doc, dict):
        raise BatchError("batch must be a JSON object")
    unknown = set(doc) - _TOP_LEVEL
    if unknown:
        raise BatchError(f"unknown top-level field(s): {', '.join(sorted(unknown))}")
    if doc.get("schema") != schema.WIRE_SCHEMA_VERSION:
        raise BatchError(f"schema must be {schema.WIRE_SCHEMA_VERSION}, got {doc.get('schema')!r}")
    job, source, seq = doc.get("job"), doc.get("source"), doc.get("seq")
    _check_object("job", job, _JOB_FIELDS, {"job_id"})
    _check_object("source", source, _SOURCE_FIELDS, {"rank", "incarnation"})
    _check_scalar("seq", seq, "int", required=True)
    assert isinstance(job, dict)
    assert isinstance(source, dict)
    assert isinstance(seq, int)
    for where, text in (
        ("job.job_id", job["job_id"]),
        ("source.incarnation", source["incarnation"]),
    ):
        if len(text) > MAX_ID_CHARS:
            raise BatchError(f"{where} is longer than {MAX_ID_CHARS} characters")
    if source["rank"] < 0 or seq < 0:
        raise BatchError("source.rank and seq must not be negative")
    _check_mesh(source.get("mesh"))
    _check_source_attributes(source.get("attributes"))

    sections: dict[str, Columns] = {}
    for name, table in _COLUMNAR_SECTIONS.items():
        columns = _columnar(name, table, doc[name]) if name in doc else None
        if columns is not None:
            sections[name] = columns
    if "collectives" in sections:
        sections["collectives"] = _with_group(sections["collectives"])
        bad_ops = set(sections["collectives"]["op"]) - set(schema.COLLECTIVE_OPS)
        if bad_ops:
            raise BatchError(f"collectives.op has unknown op(s): {', '.join(sorted(bad_ops))}")
    events = _events(doc["events"]) if "events" in doc else None
    if events is not None:
        sections["events"] = events
    for columns in sections.values():
        num_rows = len(next(iter(columns.values())))
        columns["job_id"] = [job["job_id"]] * num_rows
        columns["rank"] = [source["rank"]] * num_rows
    return Batch(job=dict(job), source=dict(source), seq=seq, sections=sections)


def parse_document(doc: Any) -> Batch | list[Batch | BatchError]:
    """A rank's batch, or a node's bundle `{"batches": [batch, ...]}` (`stepscope run`'s relay:
    one request for the node's ranks). A bundle's batches are validated one by one: a bad one
    is rejected alone, with the error it would get on its own."""
    if not isinstance(doc, dict) or "batches" not in doc:
        return parse_batch(doc)
    if len(doc) != 1:
        unknown = sorted(set(doc) - {"batches"})
        raise BatchError(f"a bundle holds only batches; unknown field(s): {', '.join(unknown)}")
    items = doc["batches"]
    if not isinstance(items, list) or not items:
        raise BatchError("batches must be a non-empty list of batches")
    if len(items) > MAX_BUNDLE_BATCHES:
        raise BatchError(
            f"a bundle holds {len(items)} batches, more than {MAX_BUNDLE_BATCHES}", status=413
        )
    parsed: list[Batch | BatchError] = []
    for item in items:
        try:
            parsed.append(parse_batch(item))
        except BatchError as exc:
            parsed.append(exc)
    return parsed
