"""A table OUT (Parquet, CSV, TSV, Arrow): a JSONL journal while the run goes, one table file at the end.

The run writes, locks, fingerprints and resumes the journal ``.OUT.llmcli/journal.jsonl`` exactly as it
would a JSONL OUT, each line naming the row it answers (``_row``). Once every row of IN is answered, the
table is built from IN's own columns (the id and the kept columns, in their own types) and the journal's
answers, in input order (or the journal's, with ``--unordered``), written beside OUT and renamed over it: OUT
is whole or absent, never torn. The journal stays, so ``--resume`` after rows are appended to IN runs only
the new ones.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Iterator

from llmcli.cli.io.table_formats import TableFile
from llmcli.cli.io.tables import ROW_FIELD, TableColumns
from llmcli.cli.usage_error import UsageError

RESULT_COLUMNS = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "error")


class TableNotWritten(Exception):
    """The journal does not answer every row yet: OUT is left as it was, ``--resume`` finishes it."""


def journal_folder(out: str) -> Path:
    p = Path(out)
    return p.parent / f".{p.name}.llmcli"


def journal_path(out: str) -> Path:
    return journal_folder(out) / "journal.jsonl"


def open_journal(out: str, resume: bool, overwrite: bool) -> str:
    """The journal of table OUT, its folder made; a table OUT is refused as a JSONL one would be."""
    if out == "-":
        raise UsageError("-o - writes JSONL; a table OUT needs a file name")
    folder, journal, p = journal_folder(out), journal_path(out), Path(out)
    if p.is_dir():
        raise UsageError(f"OUT {out} is a folder")
    if not Path(os.path.realpath(p)).parent.is_dir():
        raise UsageError(f"the folder of OUT {out} does not exist")
    exists = p.exists() and p.stat().st_size > 0
    if exists and not resume and not overwrite:
        raise UsageError(f"OUT {out} exists and is not empty; pass --resume to continue it or --overwrite to "
                         "replace it")
    if exists and resume and not journal.exists():
        raise UsageError(f"--resume: OUT {out} has no journal ({journal}) to tell which rows it answers; "
                         "--overwrite replaces it")
    try:
        folder.mkdir(exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot make OUT's journal folder {folder}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(os.lstat(folder).st_mode) or not folder.is_dir():
        raise UsageError(f"{folder} is not a folder of llmcli's (a link or a file); remove it")
    return str(journal)


def _read_journal(journal: Path, reasoning_field: str) -> Any:
    """The journal's answers as an Arrow table in the journal's order (columns: row, text, ... error)."""
    import pyarrow as pa
    import pyarrow.json as pjson

    usage = pa.struct([("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64())])
    error = pa.struct([("message", pa.string()), ("field", pa.string())])
    schema = pa.schema([(ROW_FIELD, pa.int64()), ("text", pa.string()), (reasoning_field, pa.string()),
                        ("finish_reason", pa.string()), ("usage", usage), ("error", error)])
    if journal.stat().st_size == 0:
        return schema.empty_table()
    parse = pjson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    return pjson.read_json(journal, parse_options=parse, read_options=pjson.ReadOptions(block_size=1 << 24))


def _results(answers: Any, reasoning_field: str) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.compute as pc

    usage, error = answers["usage"], answers["error"]
    field = pc.struct_field(error, "field")
    message = pc.struct_field(error, "message")
    said = pc.if_else(pc.is_null(field), message, pc.binary_join_element_wise(field, message, ": "))
    columns = {"text": answers["text"], "finish_reason": answers["finish_reason"],
               "prompt_tokens": pc.struct_field(usage, "prompt_tokens"),
               "completion_tokens": pc.struct_field(usage, "completion_tokens"),
               "error": pc.if_else(pc.is_null(message), pa.nulls(len(answers), pa.string()), said)}
    if answers[reasoning_field].null_count < len(answers):
        columns[reasoning_field] = answers[reasoning_field]
    return {name: col.combine_chunks() if hasattr(col, "combine_chunks") else col for name, col in columns.items()}


def finalize(out: str, fmt: str, table: TableFile, columns: TableColumns, reasoning_field: str,
             ordered: bool = True) -> int:
    """Write table OUT from IN and the journal; returns its rows. TableNotWritten if a row is unanswered.

    ``ordered``: rows in input order, IN read a batch at a time; else in the journal's order, which is the
    order the answers finished in (``--unordered``), IN's id and kept columns held in memory to be taken."""
    import pyarrow as pa
    import pyarrow.compute as pc

    answers = _read_journal(journal_path(out), reasoning_field)
    by_row = answers.take(pc.sort_indices(answers[ROW_FIELD]))
    total = _count_rows(table)
    if len(answers) != total or (total and not pc.all(pc.equal(by_row[ROW_FIELD],
                                                               pa.array(range(total), pa.int64()))).as_py()):
        raise TableNotWritten(f"OUT {out} is not written yet: its journal answers {len(answers)} of {total} rows "
                              "(the same command with --resume finishes the run and writes it)")
    if ordered:
        answers = by_row
    results = _results(answers, reasoning_field)
    read = list(dict.fromkeys([c for c in (columns.id, *columns.kept) if c is not None]))
    tmp = journal_folder(out) / f"writing{Path(out).suffix}"
    writer = _TableSink(tmp, fmt)
    try:
        batches = table.batches(read or table.columns[:1]) if ordered else _taken(table, read, answers[ROW_FIELD])
        start = 0
        for batch in batches:
            n = batch.num_rows
            rows = answers[ROW_FIELD].slice(start, n) if not ordered else pa.array(range(start, start + n), pa.int64())
            ids = batch.column(columns.id) if columns.id is not None else rows
            cols = {"id": ids, **{out_name: batch.column(name) for name, out_name in columns.kept.items()},
                    **{name: col.slice(start, n) for name, col in results.items()}}
            writer.write(pa.RecordBatch.from_arrays([_array(c) for c in cols.values()], names=list(cols)))
            start += n
        if writer.empty:
            writer.write(_empty_batch(results, columns))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    os.replace(tmp, out)
    _sync_folder(Path(out).parent)
    return total


TAKE_ROWS = 65536  # rows per batch of an --unordered table


def _taken(table: TableFile, read: list[str], rows: Any) -> Iterator[Any]:
    """IN's ``read`` columns (IN's first column when none) in the order of ``rows``, a batch at a time."""
    import pyarrow as pa

    if not len(rows):
        return
    whole = pa.Table.from_batches(list(table.batches(read or table.columns[:1])))
    for start in range(0, len(rows), TAKE_ROWS):
        yield from whole.take(rows.slice(start, TAKE_ROWS)).combine_chunks().to_batches()


def _array(col: Any) -> Any:
    return col.combine_chunks() if hasattr(col, "combine_chunks") else col


def _count_rows(table: TableFile) -> int:
    return sum(batch.num_rows for batch in table.batches(table.columns[:1]))


def _empty_batch(results: dict[str, Any], columns: TableColumns) -> Any:
    import pyarrow as pa

    cols = {"id": pa.array([], pa.int64()), **{name: col.slice(0, 0) for name, col in results.items()}}
    return pa.RecordBatch.from_arrays(list(cols.values()), names=list(cols))


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _TableSink:
    """One table file written a batch at a time (Parquet row groups, CSV lines, Arrow IPC batches)."""

    def __init__(self, path: Path, fmt: str) -> None:
        self.path, self.fmt, self._writer, self._file = path, fmt, None, open(path, "wb")

    @property
    def empty(self) -> bool:
        return self._writer is None

    def write(self, batch: Any) -> None:
        if self.fmt in ("csv", "tsv"):
            batch = _flat(batch)
        if self._writer is None:
            self._writer = self._open(batch.schema)
        self._writer.write(batch) if self.fmt != "parquet" else self._writer.write_batch(batch)

    def _open(self, schema: Any) -> Any:
        import pyarrow as pa

        if self.fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetWriter(self._file, schema)
        if self.fmt in ("csv", "tsv"):
            import pyarrow.csv as pcsv

            return pcsv.CSVWriter(self._file, schema,
                                  write_options=pcsv.WriteOptions(delimiter="\t" if self.fmt == "tsv" else ","))
        return pa.ipc.new_file(self._file, schema)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


def _flat(batch: Any) -> Any:
    """Nested cells (lists, structs) as JSON text: CSV has no other way to hold them."""
    import orjson
    import pyarrow as pa

    cols = []
    for col in batch.columns:
        if pa.types.is_nested(col.type):
            col = pa.array([None if v is None else orjson.dumps(v, default=str).decode() for v in col.to_pylist()],
                           pa.string())
        cols.append(col)
    return pa.RecordBatch.from_arrays(cols, names=batch.schema.names)
