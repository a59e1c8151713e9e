"""The OpenAPI document: the API's routes plus `POST /v1/ingest`, a plain Starlette route.

The ingest endpoint validates batches column by column itself (DESIGN §3); its request
schema here is generated from stepscope.schema for readers and clients, not used to parse.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, create_model

from stepscope import schema
from stepscope.api.schemas import (
    ErrorRead,
    IngestBundleItemRead,
    IngestBundleResultRead,
    IngestResultRead,
)
from stepscope.collector.validate import MAX_BUNDLE_BATCHES, MAX_MESH_DIMS, MAX_ROWS_PER_SECTION
from stepscope.schema import MAX_ID_CHARS

_PYTHON_TYPES: dict[str, Any] = {"str": str, "int": int, "float": float, "json": dict[str, Any]}


def _describe(column: schema.Column) -> str | None:
    unit = f"[{column.unit}]" if column.unit else ""
    return " ".join(filter(None, (column.doc, unit))) or None


def _columns_model(table: schema.Table) -> type[BaseModel]:
    """Columnar form of a section: one equally long list per column."""
    fields: dict[str, Any] = {}
    for c in table.wire_columns:
        item = _PYTHON_TYPES[c.dtype] if c.required else _PYTHON_TYPES[c.dtype] | None
        fields[c.name] = (
            list[item],  # type: ignore[valid-type]
            Field(
                ... if c.required else None,
                max_length=MAX_ROWS_PER_SECTION,
                description=_describe(c),
            ),
        )
    name = f"Wire{table.name.capitalize()}Columns"
    return create_model(name, __config__=ConfigDict(extra="forbid"), **fields)


def _object_model(name: str, columns: tuple[schema.Column, ...], required: set[str]) -> Any:
    fields: dict[str, Any] = {
        c.name: (
            _PYTHON_TYPES[c.dtype] if c.name in required else _PYTHON_TYPES[c.dtype] | None,
            Field(... if c.name in required else None, description=_describe(c)),
        )
        for c in columns
    }
    return create_model(name, __config__=ConfigDict(extra="forbid"), **fields)


def _source_model() -> Any:
    fields: dict[str, Any] = {
        "rank": (int, Field(ge=0, description="Global rank")),
        "local_rank": (int | None, None),
        "node": (str | None, Field(None, description="Host name")),
        "pid": (int | None, None),
        "incarnation": (
            str,
            Field(max_length=MAX_ID_CHARS, description="Unique per process start (a UUID)"),
        ),
        "mesh": (
            dict[str, Annotated[list[int], Field(min_length=2, max_length=2)]] | None,
            Field(
                None,
                max_length=MAX_MESH_DIMS,
                description="DeviceMesh coordinates: {dim: [coordinate, size]}, "
                "0 <= coordinate < size (a pipeline stage: pp)",
            ),
        ),
    }
    return create_model("WireSource", __config__=ConfigDict(extra="forbid"), **fields)


def ingest_batch_model() -> type[BaseModel]:
    """The wire batch (DESIGN §3) as a pydantic model, for the OpenAPI document."""
    job = _object_model("WireJob", schema.JOBS.columns, {"job_id"})
    event = _object_model("WireEvent", schema.EVENTS.wire_columns, set(schema.EVENTS.required))
    fields: dict[str, Any] = {
        "schema_version": (
            int,
            Field(alias="schema", ge=schema.WIRE_SCHEMA_VERSION, le=schema.WIRE_SCHEMA_VERSION),
        ),
        "job": (job, ...),
        "source": (_source_model(), ...),
        "seq": (int, Field(ge=0, description="Per (rank, incarnation) batch number")),
        "steps": (_columns_model(schema.STEPS) | None, None),
        "collectives": (_columns_model(schema.COLLECTIVES) | None, None),
        "gpu": (_columns_model(schema.GPU) | None, None),
        "events": (list[event] | None, None),  # type: ignore[valid-type]
    }
    return create_model(
        "IngestBatch",
        __config__=ConfigDict(extra="forbid", populate_by_name=True),
        __doc__="One rank's new records in columnar form; (job_id, rank, incarnation, seq) "
        "makes a resend idempotent. Gzip the body with Content-Encoding: gzip.",
        **fields,
    )


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorRead"}}},
    }


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document with the ingest endpoint added (cached on the app)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    batch = ingest_batch_model().model_json_schema(
        by_alias=True, ref_template="#/components/schemas/{model}"
    )
    components.update(batch.pop("$defs", {}))
    components["IngestBatch"] = batch
    components["IngestBundle"] = {
        "title": "IngestBundle",
        "description": "A node's batches in one request (stepscope run's node relay); each is "
        "stored whole or rejected alone.",
        "type": "object",
        "properties": {
            "batches": {
                "type": "array",
                "items": {"$ref": "#/components/schemas/IngestBatch"},
                "minItems": 1,
                "maxItems": MAX_BUNDLE_BATCHES,
            }
        },
        "required": ["batches"],
        "additionalProperties": False,
    }
    for model in (IngestResultRead, IngestBundleItemRead, IngestBundleResultRead, ErrorRead):
        components[model.__name__] = model.model_json_schema(
            ref_template="#/components/schemas/{model}"
        )
    doc["paths"]["/v1/ingest"] = {
        "post": {
            "tags": ["collector"],
            "summary": "Ingest a batch, or a node's bundle of batches",
            "description": "Store one rank's batch of records, whole or not at all; or a node's "
            "bundle, each batch stored whole or rejected alone, with one result per batch in "
            "order (scope ingest).",
            "operationId": "ingest_v1_ingest_post",
            "security": [{"HTTPBearer": []}],
            "parameters": [
                {
                    "name": "Content-Encoding",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string", "enum": ["gzip", "identity"]},
                }
            ],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "oneOf": [
                                {"$ref": "#/components/schemas/IngestBatch"},
                                {"$ref": "#/components/schemas/IngestBundle"},
                            ]
                        }
                    }
                },
            },
            "responses": {
                "200": {
                    "description": "Stored (or recognised as a resend); for a bundle, each "
                    "batch's result",
                    "content": {
                        "application/json": {
                            "schema": {
                                "oneOf": [
                                    {"$ref": "#/components/schemas/IngestResultRead"},
                                    {"$ref": "#/components/schemas/IngestBundleResultRead"},
                                ]
                            }
                        }
                    },
                },
                "400": _error("Not JSON, or not valid gzip"),
                "401": _error("No or unknown bearer token (auth on)"),
                "403": _error("The token lacks the ingest scope"),
                "413": _error("Body or section too large"),
                "415": _error("Not application/json, or an unsupported Content-Encoding"),
                "422": _error("A field is wrong (named in detail); nothing was stored"),
            },
        }
    }
    app.openapi_schema = doc
    return doc
