"""The `generate` command as a pipeline of steps, each in its own module, each handing its result to the next.

plan_tables (a table IN's columns, a table OUT's journal: ``tables.py``) → open_input (OUT checked, IN opened, the engine starting in a thread: ``startup.py``) → check_input (every line
of IN checked: ``checks.py``) → prepare_input (the records tokenized as a stream, the first chunks before the
first token) → run_engine (the step loop, a writer thread on OUT: ``write.py``) → report (summary, exit code)
→ finish_table (a table OUT written from its journal).
The hand-offs, the options and the exit codes are in ``handoff.py``.
"""
from __future__ import annotations

from contextlib import ExitStack

from rich.console import Console

from llmcli.cli.generate.check_input import check_input
from llmcli.cli.generate.handoff import EndRun, GenerateOptions
from llmcli.cli.generate.open_input import open_input
from llmcli.cli.generate.prepare_input import prepare_input
from llmcli.cli.generate.report import report
from llmcli.cli.generate.run_engine import run_engine
from llmcli.cli.generate.tables import finish_table, plan_tables
from llmcli.cli.usage_error import UsageError

__all__ = ["GenerateOptions", "UsageError", "run_generate"]


def run_generate(opts: GenerateOptions, console: Console) -> int:
    """Run the command; returns the exit code. Raises UsageError (and ConfigError) for exit code 2.

    A step that ends the run early (bad input, nothing to run, a closed pipe) has said why and raises EndRun;
    whatever the steps opened (OUT's lock, IN, the engine, the preparing thread) is closed on every way out.
    """
    tables = plan_tables(opts, console)
    with ExitStack() as resources:
        try:
            opened = open_input(tables, console, resources)
            checked = check_input(opened)
            prepared = prepare_input(checked, resources)
            outcome = run_engine(prepared)
            code = report(outcome)
        except EndRun as end:
            code = end.code
        return finish_table(tables, code, console)  # a table OUT, written while its journal is still locked
