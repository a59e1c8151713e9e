"""The SQL of an Arrow-native read through ADBC: typed columns of a job's rows, in key order.

One builder for the record tables (stepscope.store.frames) and the rollup tables
(stepscope.store.reads); the callers add their filters and bind their parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import pyarrow as pa

Kind = Literal["str", "int", "float", "json", "bytes"]
"""A stored column's type: schema.Dtype, or bytes (the rollups' packed matrices)."""

SQL_TYPES: dict[str, dict[Kind, str]] = {
    "sqlite": {"str": "TEXT", "int": "INTEGER", "float": "REAL", "json": "TEXT", "bytes": "BLOB"},
    "postgresql": {
        "str": "text",
        "int": "bigint",
        "float": "double precision",
        "json": "text",
        "bytes": "bytea",
    },
}
ARROW_TYPES: dict[Kind, pa.DataType] = {
    "str": pa.string(),
    "int": pa.int64(),
    "float": pa.float64(),
    "json": pa.string(),
    "bytes": pa.binary(),
}
_TYPED_VALUES: dict[Kind, str] = {
    "str": "''",
    "int": "0",
    "float": "0.0",
    "json": "''",
    "bytes": "X''",
}


def keyed_select(
    dialect: str,
    source: str,
    where: Sequence[str],
    columns: Mapping[str, Kind],
    keys: Sequence[str],
) -> str:
    """SELECT `columns` (then the keys not among them) FROM `source` WHERE all of `where`,
    ordered by `keys`.

    Keys (never NULL) are selected as stored, so the primary-key index gives the order; the
    other columns are CAST to their type. On SQLite, the first row holds typed values and
    NULL keys (which sort it first; SQLite merges it in without a sort): ADBC's SQLite driver
    types a column by its values in the first batch, where a NULL would make it int64 and a
    float or text later fail the read. The caller drops that row.
    """
    names = [*columns, *(k for k in keys if k not in columns)]
    sql_type = {n: SQL_TYPES[dialect][columns[n]] for n in columns}
    select = ", ".join(
        f'"{n}"' if n in keys else f'CAST("{n}" AS {sql_type[n]}) AS "{n}"' for n in names
    )
    sql = f"SELECT {select} FROM {source} WHERE {' AND '.join(where)}"
    if dialect == "sqlite":
        first = ", ".join(
            f'NULL AS "{n}"'
            if n in keys
            else f'CAST({_TYPED_VALUES[columns[n]]} AS {sql_type[n]}) AS "{n}"'
            for n in names
        )
        sql = f"SELECT {first} UNION ALL {sql}"
    sql += " ORDER BY " + ", ".join(str(names.index(k) + 1) for k in keys)
    return sql
