"""What flows through `generate`: its options, the exit codes, and what each step hands to the next."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console

from llmcli.cli.generate.startup import EngineStarter
from llmcli.cli.io.fingerprint import Fingerprint
from llmcli.cli.io.index import InputIndex
from llmcli.cli.io.lock import OutputLock
from llmcli.cli.io.prepare import Preparer, PreparedRequest
from llmcli.cli.io.records import InputRecord
from llmcli.cli.io.resume import ResumeState
from llmcli.cli.io.source import InputFile
from llmcli.cli.io.table_formats import TableFile
from llmcli.cli.io.tables import ColumnFlags, TableColumns
from llmcli.cli.runner import BudgetGuess, RunCounts
from llmcli.engine.engine_api import EngineAPI

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a tool that stopped because its reader left


@dataclass
class GenerateOptions:
    input: str
    output: str
    engine: dict[str, Any]  # model and engine knobs for Config
    sampling: dict[str, Any] = field(default_factory=dict)  # command-line sampling defaults
    resume: bool = False
    force_resume: bool = False  # resume even if IN is not the input that produced OUT
    overwrite: bool = False
    ordered: bool = True
    on_error: str = "fail"  # "fail" | "skip"
    include_token_ids: bool = False
    chat_template: Path | None = None
    max_errors_shown: int = 20
    progress: bool | None = None  # None: only when stderr is a terminal
    quiet: bool = False
    verbose: bool = False  # start-up phases on stderr
    data_parallel_size: int = 1  # engine replicas fed from this one input
    distributed_backend: str | None = None  # "local" (processes on this machine) | "ray"; None: ray with an address
    ray_address: str | None = None  # an existing Ray cluster (implies "ray")
    strict: bool = False  # unknown record fields are input errors instead of warnings
    chat_template_kwargs: dict[str, Any] | None = None  # --chat-template-kwargs (records' own win per key)
    reasoning_parser: str = "auto"  # "auto" | "qwen3" | "none"
    reasoning_field: str = "reasoning"  # or vLLM's older name, "reasoning_content"
    include_metrics: bool = False
    input_format: str = "auto"  # "auto" (by IN's extension) | "jsonl" | a table format (cli/io/table_formats.py)
    columns: ColumnFlags = field(default_factory=ColumnFlags)  # a table IN's column mapping


@dataclass
class TablePlan:
    """Step 0 → 1: the formats of IN and OUT; a table IN's columns, and a table OUT's journal and final name.

    With a table OUT, ``opts.output`` is its journal (``cli/io/table_writer.py``): every step reads, writes,
    locks and resumes that, and the table is written from it at the end (``out``)."""

    opts: GenerateOptions  # the options the run goes on with
    table: TableFile | None = None  # IN, when it is a table
    columns: TableColumns | None = None
    out: str | None = None  # the table OUT, when OUT is one
    out_format: str = "jsonl"


class EndRun(Exception):
    """The run ends at this step with ``code``; what made it end has already been said on stderr."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@dataclass(frozen=True)
class Job:
    """What every step reads and none changes: the options and what was loaded for them."""

    opts: GenerateOptions
    console: Console
    config: Any  # Config, or the data-parallel driver's
    tokenizer: Any
    chat_template: str | None  # --chat-template's text
    started: float  # perf_counter() when the run began: wall time and start-up report
    tokenizer_s: float  # how long loading the tokenizer took


@dataclass
class Opened:
    """Step 1 → 2: OUT checked, IN open, the engine starting in a thread."""

    job: Job
    source: InputFile
    starter: EngineStarter
    resumed: ResumeState  # what OUT already answers
    stdout: Any  # the private stdout of ``-o -``, else None
    lock: OutputLock | None  # OUT's lock, which also takes OUT's inode once OUT is created


@dataclass
class RunPlan:
    """What the checks before the first token found, for the run and its reports."""

    resumed: ResumeState
    fp: Fingerprint
    total: int  # records to run
    skipped: int  # records OUT already answers
    source: str  # IN's name in messages
    reasoning: str | None
    stdout: Any
    lock: OutputLock | None = None


@dataclass
class Checked:
    """Step 2 → 3: every line of IN checked and indexed; the run planned."""

    job: Job
    source: InputFile
    starter: EngineStarter
    index: InputIndex
    preparer: Preparer
    plan: RunPlan


@dataclass
class Prepared:
    """Step 3 → 4: the engine started and the records as a prepared stream, its first chunks checked."""

    job: Job
    plan: RunPlan
    engine: EngineAPI  # an LLMEngine, or with -dp a DataParallelEngine
    items: Iterator[tuple[int, PreparedRequest | InputRecord]]
    late: list[InputRecord]  # records the stream finds invalid after the first token, filled as it runs
    guess: BudgetGuess


@dataclass
class Outcome:
    """Step 4 → 5: what the run did, once OUT is closed."""

    job: Job
    plan: RunPlan
    counts: RunCounts
    stats: Any  # the engine's stats at the end
    written: int  # records written to OUT
    generate_s: float  # the progress clock: first token to last record
    rejected: list[InputRecord]  # records found invalid when their turn came
