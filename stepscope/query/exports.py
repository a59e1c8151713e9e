"""Streamed exports of a job's stored records in the canonical schema (DESIGN §2)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv
import pyarrow.parquet
import sqlalchemy as sa

from stepscope import schema
from stepscope.query.common import check_choice, require_job
from stepscope.store import frames, reads

TABLES = ("steps", "collectives", "gpu", "events", "findings")
FORMATS = ("parquet", "csv", "ndjson")
MEDIA_TYPES = {
    "parquet": "application/vnd.apache.parquet",
    "csv": "text/csv",
    "ndjson": "application/x-ndjson",
}
BATCH_ROWS = 65536
"""Rows read, converted and sent at a time: the export's memory does not grow with the job."""
TEXT_CHUNK_ROWS = 8192
"""Rows of csv or ndjson encoded and sent at a time: a chunk waits whole in the server's send
buffer, and a batch's text is ~5x its arrow size."""
READ_AHEAD = 2
"""Batches read while the previous ones are encoded (the read waits mostly on the database)."""
_ARROW_TYPES = {"str": pa.string(), "int": pa.int64(), "float": pa.float64(), "json": pa.string()}


def export(engine: sa.Engine, job_id: str, table: str, format: str) -> Iterator[bytes]:
    """The job's rows of `table` as a stream of `format` bytes, batch by batch.

    Columns are those of stepscope.schema (steps with `node` from the ranks table); JSON
    columns are JSON text in parquet and csv and JSON values in ndjson. Arguments and the
    job are checked now, before the first chunk.
    """
    check_choice("table", table, TABLES)
    check_choice("format", format, FORMATS)
    require_job(engine, job_id)
    return _encoded(_read_ahead(_batches(engine, job_id, table)), format, table)


def _spec(table: str) -> schema.Table:
    return (
        schema.FINDINGS if table == "findings" else schema.TABLES[frames.FRAME_TABLES[table].name]
    )


def _schema(table: str) -> pa.Schema:
    return pa.schema([(c.name, _ARROW_TYPES[c.dtype]) for c in _spec(table).columns])


def _batches(engine: sa.Engine, job_id: str, table: str) -> Iterator[pa.RecordBatch]:
    target = _schema(table)
    if table == "findings":
        rows = reads.read_findings(engine, job_id)
        columns = {
            c.name: [_json_text(r[c.name]) if c.dtype == "json" else r[c.name] for r in rows]
            for c in schema.FINDINGS.columns
        }
        yield pa.RecordBatch.from_pydict(columns, schema=target)
        return
    nodes = reads.read_nodes(engine, job_id) if table == "steps" else {}
    node_ranks = pa.array(list(nodes), type=pa.int64())
    node_names = pa.array(list(nodes.values()), type=pa.string())
    # job_id (the same in every row) is not read, and node comes from the ranks table
    stored = [n for n in frames.arrow_schema(table).names if n != "job_id"]
    for batch in frames.iter_batches(engine, table, job_id, columns=stored, batch_rows=BATCH_ROWS):
        columns = dict(zip(stored, batch.columns, strict=True))
        columns["job_id"] = pa.repeat(pa.scalar(job_id), batch.num_rows)
        if table == "steps":  # node of each row's rank; null for a rank the job has not seen
            at = pc.index_in(batch.column("rank"), value_set=node_ranks)
            columns["node"] = pc.take(node_names, at)
        yield pa.RecordBatch.from_arrays([columns[n] for n in target.names], schema=target)


_DONE = object()


def _read_ahead(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """`batches`, read by a thread up to READ_AHEAD batches ahead of the consumer; a reader
    error is raised in the consumer, and a consumer that stops early stops the thread."""
    ready: queue.Queue[Any] = queue.Queue(maxsize=READ_AHEAD)
    stopped = threading.Event()

    def put(item: Any) -> bool:
        while not stopped.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for batch in batches:
                if not put(batch):
                    return
            put(_DONE)
        except BaseException as exc:  # handed to the consumer
            put(exc)

    thread = threading.Thread(target=read, name="stepscope-export-read", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stopped.set()
        thread.join()


def _json_text(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def _encoded(batches: Iterator[pa.RecordBatch], format: str, table: str) -> Iterator[bytes]:
    if format == "ndjson":
        json_columns = [c.name for c in _spec(table).columns if c.dtype == "json"]
        for batch in _sliced(batches, TEXT_CHUNK_ROWS):
            yield _ndjson(batch, json_columns)
        return
    sink = _Sink()
    out = pa.PythonFile(sink, mode="w")
    target = _schema(table)
    writer: Any = (
        pyarrow.parquet.ParquetWriter(
            out, target, compression="snappy", use_dictionary=_dictionary_columns(table)
        )
        if format == "parquet"
        else pyarrow.csv.CSVWriter(out, target)
    )
    for batch in batches if format == "parquet" else _sliced(batches, TEXT_CHUNK_ROWS):
        writer.write_batch(batch)  # a parquet row group of each batch
        chunk = sink.drain()
        if chunk:
            yield chunk
    writer.close()
    yield sink.drain()


def _sliced(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        for start in range(0, batch.num_rows, rows):
            yield batch.slice(start, rows)


def _dictionary_columns(table: str) -> list[str]:
    """Columns of few distinct values (ids, names, kinds, rank), dictionary-encoded in
    parquet; the others (measurements, JSON) are not: trying a dictionary on measurements
    costs 3x the CPU of the whole encoding and makes the file larger."""
    return [c.name for c in _spec(table).columns if c.dtype == "str" or c.name == "rank"]


def _ndjson(batch: pa.RecordBatch, json_columns: list[str]) -> bytes:
    """One JSON object per row; JSON text columns embedded as JSON values."""
    if not json_columns:
        return pl.DataFrame(batch).write_ndjson().encode()
    rows = batch.to_pylist()
    for row in rows:
        for c in json_columns:
            if row[c] is not None:
                row[c] = orjson.Fragment(row[c])
    return b"".join(orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE) for row in rows)


class _Sink:
    """A write-only file that hands out what was written since the last drain."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._position = 0
        self.closed = False

    def write(self, data: bytes) -> int:
        self._chunks.append(bytes(data))
        self._position += len(data)
        return len(data)

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        return None

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True

    def drain(self) -> bytes:
        out, self._chunks = b"".join(self._chunks), []
        return out
