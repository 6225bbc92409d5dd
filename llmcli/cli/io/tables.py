"""A table input as records: its columns mapped onto a JSONL record's fields, row by row.

The rows are copied, a record batch at a time, into a temporary JSONL file (one line per row, so line N is
row N), as stdin is: from there on a table is read, checked, fingerprinted and resumed exactly as a JSONL
input is. A row's kept columns ride after a tab on its line and come back as ``InputRecord.carry``; errors
name the row and the column (``tickets.parquet: row 4, column body: is empty``).
"""
from __future__ import annotations

import base64
import difflib
import os
import re
import tempfile
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Iterator

import orjson

from llmcli.cli.io.records import STRUCTURED_FIELDS, InputRecord, parse_line
from llmcli.cli.io.value_checks import SAMPLING_FIELDS
from llmcli.cli.io.source import InputFile, RawLine
from llmcli.cli.io.table_formats import TableFile
from llmcli.cli.usage_error import UsageError

# Columns named as a record's settings fields are that row's settings, as the fields of a JSONL record are.
SETTINGS_COLUMNS = (*SAMPLING_FIELDS, *STRUCTURED_FIELDS, "chat_template_kwargs", "reasoning_effort")
# Fields an output row has of its own: a kept column of one of these names is written as input_<name>.
OUTPUT_FIELDS = frozenset({"id", "text", "finish_reason", "usage", "error", "choices", "prompt_token_ids",
                           "token_ids", "logprobs", "prompt_logprobs", "metrics", "reasoning", "reasoning_content",
                           "tool_calls", "prompt_tokens", "completion_tokens"})
ROW_FIELD = "_row"  # a table OUT's journal: the 0-based row each line answers


@dataclass
class ColumnFlags:
    """The command line's column mapping (None: not given)."""

    prompt_column: str | None = None
    messages_column: str | None = None
    id_column: str | None = None
    system_prompt: str | None = None
    keep_columns: list[str] | None = None  # ["all"]: every column

    def given(self) -> list[str]:
        """The flags set, as written on the command line."""
        names = {"prompt_column": "--prompt-column", "messages_column": "--messages-column",
                 "id_column": "--id-column", "system_prompt": "--system-prompt", "keep_columns": "--keep-columns"}
        return [flag for name, flag in names.items() if getattr(self, name) is not None]


@dataclass
class TableColumns:
    """Which column gives each field of a row's record, and which are kept (input name -> output name)."""

    prompt: str | None
    messages: str | None
    id: str | None
    system_prompt: str | None
    settings: list[str]
    kept: dict[str, str] = field(default_factory=dict)
    text_cells: bool = False  # CSV / TSV: settings and messages cells are JSON text (16, {"type": ...})

    def read(self) -> list[str]:
        """The columns to read, each once, in table order of first use."""
        wanted = [self.id, self.prompt, self.messages, *self.settings, *self.kept]
        return list(dict.fromkeys(c for c in wanted if c is not None))

    def record(self, row: dict[str, Any]) -> dict[str, Any]:
        """The JSONL record of one row."""
        obj: dict[str, Any] = {}
        if self.id is not None:
            obj["id"] = row[self.id]
        if self.prompt is not None:
            text = row[self.prompt]
            if self.system_prompt is not None:
                obj["messages"] = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": text}]
            else:
                obj["prompt"] = text
        else:
            messages = row[self.messages]
            if isinstance(messages, str):
                messages = _json_or_text(messages)
            if self.system_prompt is not None and isinstance(messages, list) and not (
                    messages and isinstance(messages[0], dict) and messages[0].get("role") == "system"):
                messages = [{"role": "system", "content": self.system_prompt}, *messages]
            obj["messages"] = messages
        for name in self.settings:
            value = row[name]
            if self.text_cells and isinstance(value, str):
                value = _json_or_text(value) if value else None
            if value is not None:  # an empty cell leaves the setting to the command line
                obj[name] = value
        return obj

    def column_of(self, name: str | None) -> str | None:
        """The column a record field (dotted, as an error names it) came from."""
        if name is None:
            return None
        head = re.match(r"[A-Za-z_]*", name).group(0)
        rest = name[len(head):]
        if head == "prompt" and self.prompt is not None:
            return self.prompt
        if head == "messages":
            return self.prompt if self.prompt is not None else f"{self.messages}{rest}"
        if head == "id" and self.id is not None:
            return self.id
        return name


def _json_or_text(cell: str) -> Any:
    try:
        return orjson.loads(cell)
    except orjson.JSONDecodeError:
        return cell


def resolve_columns(table: TableFile, flags: ColumnFlags) -> TableColumns:
    """The mapping for ``table``; a flag naming a column it lacks is one UsageError naming the nearest."""
    have = table.columns
    if flags.prompt_column is not None and flags.messages_column is not None:
        raise UsageError("--prompt-column and --messages-column: give only one")
    for flag, name in (("--prompt-column", flags.prompt_column), ("--messages-column", flags.messages_column),
                       ("--id-column", flags.id_column)):
        if name is not None:
            _need(table, flag, name)
    prompt, messages = flags.prompt_column, flags.messages_column
    if prompt is None and messages is None:
        if "prompt" in have:
            prompt = "prompt"
        elif "messages" in have:
            messages = "messages"
        else:
            raise UsageError(f"IN {table.path} has no prompt or messages column; name the one to run with "
                             f"--prompt-column or --messages-column (its columns: {_listed(have)})")
    ident = flags.id_column if flags.id_column is not None else ("id" if "id" in have else None)
    used = {prompt, messages, ident}
    settings = [c for c in have if c in SETTINGS_COLUMNS and c not in used]
    keep = flags.keep_columns or []
    if keep == ["all"]:
        keep = list(have)
    for name in keep:
        _need(table, "--keep-columns", name)
    kept = {name: (f"input_{name}" if name in OUTPUT_FIELDS else name) for name in keep
            if not (name == ident and name == "id")}  # the output's id already holds it
    return TableColumns(prompt, messages, ident, flags.system_prompt, settings, kept,
                        text_cells=table.format in ("csv", "tsv"))


def _need(table: TableFile, flag: str, name: str) -> None:
    if name in table.columns:
        return
    near = difflib.get_close_matches(name, table.columns, n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]!r}?" if near else f" (its columns: {_listed(table.columns)})"
    raise UsageError(f"{flag} {name}: IN {table.path} has no column {name!r}{hint}")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")


def _json_default(value: Any) -> Any:
    """Cells JSON has no type for: decimals as their digits, bytes as text (or base64 when not UTF-8)."""
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode()
        except UnicodeDecodeError:
            return base64.b64encode(value).decode()
    return str(value)


def table_lines(table: TableFile, columns: TableColumns, rows_in_carry: bool) -> Iterator[bytes]:
    """One JSONL line per row: the record, then (after a tab) what the row carries to its output."""
    row_index = 0
    dump = orjson.dumps
    option = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
    for batch in table.batches(columns.read()):
        for row in batch.to_pylist():
            line = dump(columns.record(row), default=_json_default, option=option)
            carry: dict[str, Any] = {out: row[name] for name, out in columns.kept.items()} if not rows_in_carry \
                else {ROW_FIELD: row_index}
            if carry:
                line += b"\t" + dump(carry, default=_json_default, option=option)
            yield line + b"\n"
            row_index += 1


class TableInput(InputFile):
    """A table input as the JSONL file the run reads: spooled once, read twice, deleted on close.

    ``rows_in_carry``: OUT is a table, built at the end from IN's own columns, so each output line needs only
    the row it answers; else (a JSONL OUT) the kept columns ride with each record to its output line.
    """

    def __init__(self, table: TableFile, columns: TableColumns, rows_in_carry: bool) -> None:
        self.columns = columns
        spool = tempfile.NamedTemporaryFile(prefix="llmcli-table-", delete=False)
        try:
            with spool:
                buffer: list[bytes] = []
                for line in table_lines(table, columns, rows_in_carry):
                    buffer.append(line)
                    if len(buffer) >= 4096:
                        spool.write(b"".join(buffer))
                        buffer.clear()
                spool.write(b"".join(buffer))
            super().__init__(spool.name)  # opened, then unlinked below: gone with the process, however it ends
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001 - pyarrow's errors: a damaged part, a bad CSV row
            raise UsageError(f"cannot read IN {table.path}: {str(exc).strip().splitlines()[0]}") from None
        finally:
            os.unlink(spool.name)

    def parse(self, raw: RawLine) -> InputRecord:
        """The record of a spooled row, its errors naming the row and the column."""
        data, _, carry = raw.data.partition(b"\t")
        rec = parse_line(RawLine(raw.number, data))
        rec.columns = self.columns.column_of
        if rec.error is not None:
            rec.fail(rec.error.field, rec.error.message)  # said again in the table's words
        if carry:
            rec.carry = orjson.loads(carry)
        return rec
