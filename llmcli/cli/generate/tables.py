"""Tables around `generate`: IN's and OUT's formats and a table's columns before the run, a table OUT after it.

Before step 1 (``plan_tables``): a table IN's columns are read and mapped (a misspelled column is one line
and exit 2 before the model loads), and a table OUT is swapped for its JSONL journal. After the report
(``finish_table``, OUT's lock still held): the table is written from the journal once every row is answered.
"""
from __future__ import annotations

import dataclasses
import os

from rich.console import Console

from llmcli.cli.generate.handoff import EXIT_FAILED, EXIT_OK, GenerateOptions, TablePlan
from llmcli.cli.io.table_formats import TABLE_FORMATS, input_format, open_input_table, output_format
from llmcli.cli.io.table_writer import TableNotWritten, finalize, open_journal
from llmcli.cli.io.tables import resolve_columns
from llmcli.cli.progress import say
from llmcli.cli.usage_error import UsageError


def plan_tables(opts: GenerateOptions, console: Console) -> TablePlan:
    """What the run reads and writes; UsageError when the formats or the columns cannot work."""
    in_fmt = input_format(opts.input, opts.input_format) if opts.input else "jsonl"
    out_fmt = output_format(opts.output)
    flags = opts.columns
    if in_fmt not in TABLE_FORMATS:
        if flags.given():
            raise UsageError(f"{flags.given()[0]} maps the columns of a table IN (Parquet, CSV, TSV, Arrow, a "
                             f"saved dataset); IN {opts.input} is read as JSONL (--input-format names its format)")
        if out_fmt != "jsonl":
            raise UsageError(f"a {out_fmt} OUT is written from a table IN (Parquet, CSV, TSV, Arrow, a saved "
                             f"dataset); for the JSONL IN {opts.input} write JSONL")
        return TablePlan(opts)
    if opts.input == "-":
        raise UsageError(f"a {in_fmt} IN must be a file or a folder, not -")
    table = open_input_table(opts.input, in_fmt)
    columns = resolve_columns(table, flags)
    if columns.settings and not opts.quiet:
        say(console, "each row's own settings from its columns " + ", ".join(columns.settings)
                     + " (an empty cell leaves the command line's)")
    if out_fmt == "jsonl":
        return TablePlan(opts, table, columns)
    if os.path.exists(opts.output) and os.path.samefile(opts.output, opts.input):
        raise UsageError(f"IN and OUT are the same file ({opts.output}); give OUT another name")
    journal = open_journal(opts.output, opts.resume, opts.overwrite)
    return TablePlan(dataclasses.replace(opts, output=journal), table, columns, opts.output, out_fmt)


def finish_table(plan: TablePlan, code: int, console: Console) -> int:
    """Write the table OUT when the run answered every row (exit 0 or 1); the exit code to leave with."""
    if plan.out is None or code not in (EXIT_OK, EXIT_FAILED):
        if plan.out is not None and code not in (EXIT_OK, EXIT_FAILED) and code != 2:
            say(console, f"OUT {plan.out} is written once every row is answered: the same command with --resume "
                         "finishes the run and writes it")
        return code
    try:
        rows = finalize(plan.out, plan.out_format, plan.table, plan.columns, plan.opts.reasoning_field,
                        ordered=plan.opts.ordered)
    except TableNotWritten as exc:
        say(console, str(exc))
        return EXIT_FAILED
    except OSError as exc:
        say(console, f"error: cannot write OUT {plan.out}: {exc.strerror or exc} (its journal is kept: the same "
                     "command with --resume writes it)")
        return EXIT_FAILED
    if not plan.opts.quiet:
        say(console, f"wrote {plan.out}: {rows} rows")
    return code
