"""Step 1 of `generate`: OUT locked and checked, the tokenizer loaded, IN opened and the engine started in a thread."""
from __future__ import annotations

import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from llmcli.cli.generate.checks import check_out, check_out_not_model
from llmcli.cli.generate.handoff import GenerateOptions, Job, Opened, TablePlan
from llmcli.cli.generate.startup import EngineStarter
from llmcli.cli.fd_limit import ensure_open_files
from llmcli.cli.io.lock import OutputLock, OutputLocked
from llmcli.cli.io.source import InputFile, is_stream, stdin_open
from llmcli.cli.io.tables import TableInput
from llmcli.cli.io.writer import reserve_stdout
from llmcli.cli.progress import say
from llmcli.cli.usage_error import UsageError
from llmcli.engine.engine_api import EngineAPI
from llmcli.models.hub import load_tokenizer


def open_input(tables: TablePlan, console: Console, resources: ExitStack) -> Opened:
    """Everything the checks need, opened in the order that fails cheapest first; ``resources`` closes it all."""
    opts = tables.opts
    lock = _lock_output(opts, console, resources)
    started = time.perf_counter()
    scale = _scale_out(opts)
    ensure_open_files(int(opts.engine.get("tensor_parallel_size") or 1), scale.data_parallel_size)
    resumed = check_out(opts.output, opts.input, opts.resume, opts.overwrite)
    if opts.input == "-" and not stdin_open():
        raise UsageError("IN is - but stdin is closed; give IN as a file, or pipe the input in")
    stdout = reserve_stdout() if opts.output == "-" else None
    config = _config(opts, scale)
    chat_template = _read_template(opts.chat_template) if opts.chat_template else None
    # Batch encoding runs on the tokenizer's own threads; llmcli's worker processes are spawned, not forked.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    tokenizer_started = time.perf_counter()
    check_out_not_model(opts.output, config.model_path, config.tokenizer)
    tokenizer = load_tokenizer(config.model_path, config.tokenizer)  # a broken one: ModelConfigError, exit 2
    if tokenizer is None:
        say(console, f"warning: {config.model_path} has no tokenizer files: texts cannot be decoded, so each record "
                     "carries its token_ids (and text records cannot run)")
    job = Job(opts, console, config, tokenizer, chat_template, started, time.perf_counter() - tokenizer_started)
    inputs = resources.enter_context(ExitStack())  # entered before the engine: IN is closed after it
    # A missing IN: no engine started. stdin, a pipe or a table is copied while the engine starts.
    source = _open(opts.input, inputs) if not is_stream(opts.input) and tables.table is None else None
    starter = _start_engine(opts, scale, config, tokenizer)
    resources.callback(starter.close)
    source = source or _open(opts.input, inputs, tables)
    return Opened(job, source, starter, resumed, stdout, lock)


def _lock_output(opts: GenerateOptions, console: Console, resources: ExitStack) -> OutputLock | None:
    """OUT is locked for the whole run, so a second run on the same OUT is refused instead of doubling it."""
    if opts.output == "-":
        return None
    try:
        lock = OutputLock(opts.output).acquire()
    except OutputLocked as exc:
        raise UsageError(str(exc)) from None
    resources.callback(lock.release)
    if lock.warning:
        say(console, lock.warning)
    return lock


def _scale_out(opts: GenerateOptions) -> Any:
    """The replicas asked for; Ray must be importable when it is the backend."""
    from llmcli.config import ConfigError
    from llmcli.scaleout.data_parallel import ScaleOut
    from llmcli.scaleout.ray_pool import INSTALL_HINT, ray_available

    if opts.ray_address and opts.distributed_backend == "local":
        raise UsageError("--ray-address needs --distributed-backend ray (or leave --distributed-backend out)")
    backend = opts.distributed_backend or ("ray" if opts.ray_address else "local")
    try:
        scale = ScaleOut(opts.data_parallel_size, backend, opts.ray_address)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    if scale.backend == "ray" and not ray_available():
        raise UsageError(f"--distributed-backend ray needs Ray, which is not installed: {INSTALL_HINT}")
    return scale


def _config(opts: GenerateOptions, scale: Any) -> Any:
    if scale.enabled:
        from llmcli.scaleout.data_parallel import driver_config

        return driver_config(opts.engine, scale)
    from llmcli.config import Config

    return Config(**opts.engine)


def _read_template(path: Path) -> str:
    from llmcli.cli.text_files import TextFileError, read_text

    try:
        return read_text(path, f"--chat-template {path}")
    except TextFileError as exc:
        raise UsageError(str(exc)) from None


def _open(path: str, closes: ExitStack, tables: TablePlan | None = None) -> InputFile:
    if tables is not None and tables.table is not None:
        table = TableInput(tables.table, tables.columns, rows_in_carry=tables.out is not None)
        closes.callback(table.close)
        return table
    try:
        source = InputFile(path)
    except IsADirectoryError:
        raise UsageError(f"IN {path} is a folder; give a JSONL file") from None
    except OSError as exc:
        if path == "-":
            raise UsageError(f"IN is - but stdin cannot be read ({exc.strerror or exc}); give IN as a file, "
                             "or pipe the input in") from None
        raise UsageError(f"cannot read IN {path}: {exc.strerror or exc}") from None
    closes.callback(source.close)
    return source


def _start_engine(opts: GenerateOptions, scale: Any, config: Any, tokenizer: Any) -> EngineStarter:
    def build(cancelled: Callable[[], bool]) -> EngineAPI:
        if scale.enabled:
            from llmcli.scaleout.data_parallel import DataParallelEngine

            return DataParallelEngine(config, scale, engine_kwargs=opts.engine, tokenizer=tokenizer)
        from llmcli.engine.llm_engine import LLMEngine

        engine = LLMEngine(config, tokenizer=tokenizer, cancelled=cancelled)
        engine.detokenize = False  # the writer thread decodes finished outputs in batches
        return engine

    # Ray wants to be started from the main thread (its signal handlers, its shutdown at exit).
    return EngineStarter(build, in_thread=not (scale.enabled and scale.backend == "ray"))
