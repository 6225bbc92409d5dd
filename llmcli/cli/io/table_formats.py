"""Table files as a stream of Arrow record batches: which format a path is, its columns, and its rows in order.

Parquet (a file or a folder of parts), CSV / TSV (every cell read as the text it is: "00123" stays a string),
Arrow IPC (file or stream format) and a Hugging Face dataset saved with ``save_to_disk`` (its Arrow files,
read without importing ``datasets``). Batches are read one at a time, so memory does not grow with the file.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from llmcli.cli.usage_error import UsageError

INSTALL_HINT = "pip install 'llmcli[tables]'"
TABLE_FORMATS = ("parquet", "csv", "tsv", "arrow", "hf")
INPUT_FORMATS = ("auto", "jsonl", *TABLE_FORMATS)
_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv", ".tab": "tsv",
               ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow"}
OUTPUT_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv", ".arrow": "arrow",
                     ".feather": "arrow"}
BATCH_ROWS = 4096


def require_pyarrow(what: str) -> Any:
    """pyarrow, or a one-line UsageError naming the extra that installs it."""
    try:
        import pyarrow
    except ImportError:
        raise UsageError(f"{what} needs pyarrow, which is not installed: {INSTALL_HINT}") from None
    return pyarrow


def output_format(path: str) -> str:
    """"jsonl" or the table format OUT's extension names."""
    return OUTPUT_EXTENSIONS.get(Path(path).suffix.lower(), "jsonl") if path != "-" else "jsonl"


def input_format(path: str, given: str = "auto") -> str:
    """The format of IN: ``given`` unless "auto", else by extension (a folder by what it holds)."""
    if given != "auto":
        return given
    if path == "-":
        return "jsonl"
    p = Path(path)
    if p.is_dir():
        if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
            return "hf"
        kinds = {_EXTENSIONS[f.suffix.lower()] for f in p.iterdir() if f.suffix.lower() in _EXTENSIONS}
        if len(kinds) == 1:
            return kinds.pop()
        raise UsageError(f"IN {path} is a folder of no one table format (Parquet, CSV, TSV or Arrow parts, or a "
                         "saved dataset); give a file, or --input-format")
    return _EXTENSIONS.get(p.suffix.lower(), "jsonl")


@dataclass
class TableFile:
    """One table input: its format, the files that hold it in order, and its column names."""

    path: str
    format: str
    files: list[Path]
    columns: list[str]

    def batches(self, columns: list[str]) -> Iterator[Any]:
        """``columns`` of every row, as pyarrow RecordBatches in row order."""
        for file in self.files:
            yield from _READERS[self.format](file, columns)


def open_table(path: str, fmt: str) -> TableFile:
    """IN as a table of ``fmt`` (a TABLE_FORMATS name); UsageError if it cannot be read as one."""
    require_pyarrow(f"a {fmt} input")
    p = Path(path)
    if not p.exists():
        raise UsageError(f"cannot read IN {path}: No such file or directory")
    files = _files(p, fmt, path)
    if not files:
        raise UsageError(f"IN {path} holds no {fmt} files")
    try:
        columns = _SCHEMAS[fmt if fmt != "hf" else "arrow"](files[0])
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow's many error types: the file is not of this format
        raise UsageError(f"cannot read IN {files[0]} as {fmt}: {_first_line(exc)}") from None
    return TableFile(path, fmt, files, columns)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _files(p: Path, fmt: str, path: str) -> list[Path]:
    if fmt == "hf":
        return _saved_dataset_files(p, path)
    if not p.is_dir():
        return [p]
    wanted = {ext for ext, kind in _EXTENSIONS.items() if kind == fmt}
    # Parts in name order (part-00000, part-00001, ...): the order their writer meant.
    return sorted((f for f in p.iterdir() if f.suffix.lower() in wanted and not f.name.startswith((".", "_"))),
                  key=lambda f: f.name)


def _saved_dataset_files(p: Path, path: str) -> list[Path]:
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        raise UsageError(f"IN {path} is a dataset with splits ({', '.join(splits)}); give one split's folder, "
                         f"e.g. {os.path.join(path, splits[0] if splits else 'train')}")
    state = p / "state.json"
    if p.is_dir() and state.is_file():
        names = [entry["filename"] for entry in json.loads(state.read_text()).get("_data_files", [])]
        return [p / name for name in names]
    if p.is_file() and p.suffix.lower() in _EXTENSIONS:  # --input-format hf on one data file
        raise _Redirect(_EXTENSIONS[p.suffix.lower()], [p])
    if p.is_dir():  # --input-format hf on a folder of data files (a dataset repository's data/ folder)
        for fmt in ("parquet", "arrow", "csv", "tsv"):
            wanted = {ext for ext, kind in _EXTENSIONS.items() if kind == fmt}
            found = sorted(f for f in p.rglob("*") if f.suffix.lower() in wanted)
            if found:
                raise _Redirect(fmt, found)
    raise UsageError(f"IN {path} is not a dataset saved with save_to_disk (no state.json) nor a folder of "
                     "data files")


class _Redirect(Exception):
    """A folder given as hf holds plain data files of one format."""

    def __init__(self, fmt: str, files: list[Path]) -> None:
        super().__init__(fmt)
        self.fmt, self.files = fmt, files


def open_input_table(path: str, fmt: str) -> TableFile:
    """``open_table``, where an hf folder of plain data files is read as those files."""
    try:
        return open_table(path, fmt)
    except _Redirect as found:
        table = open_table(str(found.files[0]), found.fmt)
        return TableFile(path, found.fmt, found.files, table.columns)


# -- per format ---------------------------------------------------------------------------------------
def _parquet_schema(file: Path) -> list[str]:
    import pyarrow.parquet as pq

    return list(pq.ParquetFile(file).schema_arrow.names)


def _parquet_batches(file: Path, columns: list[str]) -> Iterator[Any]:
    import pyarrow.parquet as pq

    with pq.ParquetFile(file) as pf:
        yield from pf.iter_batches(batch_size=BATCH_ROWS, columns=columns)


def _csv_options(delimiter: str, names: list[str] | None = None) -> tuple[Any, Any, Any]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    read = pcsv.ReadOptions(block_size=1 << 20)
    parse = pcsv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
    # Every cell as the text it is: a type guessed from the first rows turns "00123" into 123.
    convert = pcsv.ConvertOptions(column_types={n: pa.string() for n in names or []}, strings_can_be_null=False,
                                  quoted_strings_can_be_null=False)
    return read, parse, convert


def _csv_schema(file: Path, delimiter: str = ",") -> list[str]:
    import pyarrow.csv as pcsv

    read, parse, convert = _csv_options(delimiter)
    with pcsv.open_csv(file, read_options=read, parse_options=parse, convert_options=convert) as reader:
        return list(reader.schema.names)


def _csv_batches(file: Path, columns: list[str], delimiter: str = ",") -> Iterator[Any]:
    import pyarrow.csv as pcsv

    read, parse, convert = _csv_options(delimiter, _csv_schema(file, delimiter))
    convert.include_columns = columns
    with pcsv.open_csv(file, read_options=read, parse_options=parse, convert_options=convert) as reader:
        for batch in reader:
            yield batch


def _arrow_reader(source: Any) -> Any:
    import pyarrow as pa

    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:  # the stream format (what save_to_disk writes)
        source.seek(0)
        return pa.ipc.open_stream(source)


def _arrow_schema(file: Path) -> list[str]:
    import pyarrow as pa

    with pa.memory_map(str(file)) as source:
        return list(_arrow_reader(source).schema.names)


def _arrow_batches(file: Path, columns: list[str]) -> Iterator[Any]:
    import pyarrow as pa

    # Memory-mapped: a batch's pages are read when touched and dropped by the OS, not held by the process.
    with pa.memory_map(str(file)) as source:
        reader = _arrow_reader(source)
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            batches: Iterator[Any] = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(reader)
        for batch in batches:
            yield batch.select(columns)


_SCHEMAS = {"parquet": _parquet_schema, "csv": _csv_schema, "tsv": lambda f: _csv_schema(f, "\t"),
            "arrow": _arrow_schema}
_READERS = {"parquet": _parquet_batches, "csv": _csv_batches, "tsv": lambda f, c: _csv_batches(f, c, "\t"),
            "arrow": _arrow_batches, "hf": _arrow_batches}
