"""The `generate` command as a pipeline: check OUT, then read → prepare → engine → write.

The engine starts in a thread (``cli/startup.py``) while the input is
checked line by line (``cli/io/index.py``) and the first records are
tokenized (``cli/io/stream.py``); the step loop (``cli/runner.py``) hands
finished records to a writer thread (``cli/io/writer.py``).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from collections import deque
from itertools import chain
from pathlib import Path
from typing import Any

from rich.console import Console

from llmcli.cli.io.index import InputIndex, index_input
from llmcli.cli.io.prepare import Preparer, PreparedRequest
from llmcli.cli.io.records import InputRecord
from llmcli.cli.io.resume import ResumeError, scan_output
from llmcli.cli.io.source import InputFile, source_name
from llmcli.cli.io.stream import Item, PreparedStream
from llmcli.cli.io.background_writer import BackgroundWriter
from llmcli.cli.io.writer import RecordWriter, open_sink, reserve_stdout
from llmcli.cli.progress import GenerateProgress, GenerateSummary, say, summary_table
from llmcli.cli.runner import Runner, StopFlag
from llmcli.cli.startup import EngineStarter
from llmcli.models.hub import load_tokenizer

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
# Records prepared (tokenized, length-checked) before the first token: with --on-error fail a problem among
# them still means exit 2 and nothing generated. Later records are checked when the stream reaches them.
CHECK_AHEAD = int(os.environ.get("LLMCLI_CHECK_AHEAD", "16384"))


class UsageError(Exception):
    """The command cannot start as asked (exit code 2); the message says what to change."""


@dataclass
class GenerateOptions:
    input: str
    output: str
    engine: dict[str, Any]  # model and engine knobs for Config
    sampling: dict[str, Any] = field(default_factory=dict)  # command-line sampling defaults
    resume: bool = False
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


def _check_output(opts: GenerateOptions) -> set[str]:
    """Resume keys already answered in OUT; refuses to clobber a non-empty OUT by accident."""
    if opts.output == "-":
        if opts.resume:
            raise UsageError("--resume needs OUT to be a file (stdout cannot be read back)")
        return set()
    out = Path(opts.output)
    if out.is_dir():
        raise UsageError(f"OUT {out} is a folder")
    if not out.parent.is_dir():
        raise UsageError(f"the folder of OUT {out} does not exist")
    if opts.resume:
        try:
            return scan_output(out).answered
        except ResumeError as exc:
            raise UsageError(str(exc)) from None
    if out.exists() and out.stat().st_size > 0 and not opts.overwrite:
        raise UsageError(f"OUT {out} exists and is not empty; pass --resume to continue it "
                         "or --overwrite to replace it")
    return set()


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


def _report_errors(console: Console, source: str, bad: list[InputRecord], cap: int) -> None:
    for rec in bad[:cap]:
        say(console, rec.error.describe(source))
    if len(bad) > cap:
        say(console, f"... and {len(bad) - cap} more")


def _check_pool(ahead: list[Item], engine: Any) -> list[InputRecord]:
    """Requests that can never fit the KV pool are known once start-up has sized it (the engine's own rule);
    the records prepared ahead are checked now, the rest when admitted."""
    from llmcli.engine.sequence import RequestRejected

    too_big = []
    for i, (position, item) in enumerate(ahead):
        if not isinstance(item, PreparedRequest):
            continue
        try:
            for params in item.params:
                engine.check_fits(item.prompt_token_ids, params)
        except RequestRejected as exc:
            rec = item.record
            rec.fail(rec.prompt_field(), f"{exc} (--num-kvcache-blocks / --gpu-memory-utilization)")
            ahead[i] = (position, rec)
            too_big.append(rec)
    return too_big


def _start_engine(opts: GenerateOptions, scale: Any, config: Any, tokenizer: Any) -> EngineStarter:
    def build(cancelled: Any) -> Any:
        if scale.enabled:
            from llmcli.scaleout.data_parallel import DataParallelEngine

            return DataParallelEngine(config, scale, engine_kwargs=opts.engine, tokenizer=tokenizer)
        from llmcli.engine.llm_engine import LLMEngine

        engine = LLMEngine(config, tokenizer=tokenizer, cancelled=cancelled)
        engine.detokenize = False  # the writer thread decodes finished outputs in batches
        return engine

    # Ray wants to be started from the main thread (its signal handlers, its shutdown at exit).
    return EngineStarter(build, in_thread=not (scale.enabled and scale.backend == "ray"))


def _open_input(path: str) -> InputFile:
    try:
        return InputFile(path)
    except OSError as exc:
        raise UsageError(f"cannot read IN {path}: {exc.strerror or exc}") from None


def _config(opts: GenerateOptions, scale: Any) -> Any:
    if scale.enabled:
        from llmcli.scaleout.data_parallel import driver_config

        return driver_config(opts.engine, scale)
    from llmcli.config import Config

    return Config(**opts.engine)


def run_generate(opts: GenerateOptions, console: Console) -> int:
    """Run the command; returns the exit code. Raises UsageError (and ConfigError) for exit code 2."""
    started = time.perf_counter()
    scale = _scale_out(opts)
    answered = _check_output(opts)
    stdout = reserve_stdout() if opts.output == "-" else None
    config = _config(opts, scale)
    chat_template = opts.chat_template.read_text() if opts.chat_template else None
    # Batch encoding runs on the tokenizer's own threads; llmcli's worker processes are spawned, not forked.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    tokenizer_started = time.perf_counter()
    try:
        tokenizer = load_tokenizer(config.model_path, config.tokenizer)
    except Exception as exc:  # only an explicit --tokenizer raises
        raise UsageError(f"--tokenizer {config.tokenizer} could not be loaded: {exc}") from None
    tokenizer_s = time.perf_counter() - tokenizer_started
    source = _open_input(opts.input) if opts.input != "-" else None  # a missing IN: no engine started
    starter = _start_engine(opts, scale, config, tokenizer)
    stream: PreparedStream | None = None
    try:
        source = source or _open_input(opts.input)  # stdin is spooled while the engine starts
        preparer = Preparer(tokenizer, config.max_model_len, config.hf_config.vocab_size, opts.sampling,
                            chat_template)
        index = index_input(source, answered, preparer.check)
        code = _report_input(opts, console, index)
        if code is not None:
            return code
        # Chunks big enough for batch encoding, and a few of them ahead of what the engine holds waiting.
        window = 2 * config.max_num_seqs * opts.data_parallel_size
        stream = PreparedStream(source, index, preparer, chunk=min(1024, max(64, window)), ahead=4)
        ahead = stream.take(CHECK_AHEAD)
        found = [item for position, item in ahead if isinstance(item, InputRecord) and position not in index.bad]
        name = source_name(opts.input)
        if found:  # prompts too long once tokenized, chat templates that fail
            _report_errors(console, name, found, opts.max_errors_shown)
            if opts.on_error == "fail":
                say(console, f"{len(found)} input records are invalid; nothing was generated "
                             "(fix them, or pass --on-error skip to write error records instead)")
                return EXIT_USAGE
        input_s = time.perf_counter() - started
        engine = starter.result()
        if opts.verbose:
            _report_startup(console, engine, tokenizer_s, input_s, time.perf_counter() - started)
        too_big = _check_pool(ahead, engine)
        if too_big:
            _report_errors(console, name, too_big, opts.max_errors_shown)
            if opts.on_error == "fail":
                say(console, f"{len(too_big)} records can never fit the KV cache; nothing was generated")
                return EXIT_USAGE
        late: list[InputRecord] = []  # records the stream finds invalid after the first token: reported at the end
        items = chain(_consume(ahead), _late_errors(stream, index, late))
        return _run(opts, console, engine, config, items, late, len(index), index.total - len(index),
                    started, name, stdout)
    finally:
        if stream is not None:
            stream.close()
        starter.close()
        if source is not None:
            source.close()


def _consume(items: list[Item]) -> Any:
    """The items of a list, each let go of once the run has taken it."""
    queue = deque(items)
    items.clear()
    while queue:
        yield queue.popleft()


def _late_errors(stream: PreparedStream, index: InputIndex, late: list[InputRecord]) -> Any:
    for position, item in stream:
        if isinstance(item, InputRecord) and position not in index.bad:
            late.append(item)
        yield position, item


def _report_input(opts: GenerateOptions, console: Console, index: InputIndex) -> int | None:
    """What the checking pass found; an exit code when the run ends here."""
    bad, name = index.errors, source_name(opts.input)
    if bad and opts.on_error == "fail":
        # Nothing is generated from a malformed input: every problem is listed (the engine stops starting).
        _report_errors(console, name, bad, opts.max_errors_shown)
        say(console, f"{len(bad)} of {len(index)} input records are invalid; nothing was generated "
                     "(fix them, or pass --on-error skip to write error records instead)")
        return EXIT_USAGE
    if bad and not opts.quiet:
        _report_errors(console, name, bad, opts.max_errors_shown)
        say(console, f"{len(bad)} invalid records get error records in OUT")
    if not opts.quiet:
        say(console, f"{len(index)} records to run ({index.total - len(index)} already answered in OUT)")
    if not len(index):
        if opts.output != "-":
            Path(opts.output).touch()  # an empty input still leaves the OUT a script expects
        return EXIT_OK
    return None


def _report_startup(console: Console, engine: Any, tokenizer_s: float, input_s: float, ready_s: float) -> None:
    phases = {**getattr(engine, "startup_s", {}), "tokenizer": round(tokenizer_s, 3)}  # loaded here, not there
    listed = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
    say(console, f"start-up: {listed}; input checked and first records prepared after {input_s:.2f} s; "
                 f"engine ready after {ready_s:.2f} s")


def _run(opts: GenerateOptions, console: Console, engine: Any, config: Any, items: Any, late: list[InputRecord],
         total: int, skipped: int, started: float, source: str, stdout: Any) -> int:
    gen_started = time.perf_counter()
    show = not opts.quiet and (opts.progress if opts.progress is not None else console.is_terminal)
    if opts.overwrite and not opts.resume and opts.output != "-":
        Path(opts.output).write_bytes(b"")  # only now: a run refused for bad input leaves the old OUT alone
    # The step loop shares the GIL with the writer and the preparing thread: let it have it back sooner
    # when it returns from the device or a torch op (Python's default is 5 ms).
    sys.setswitchinterval(0.001)
    finish = engine.fill_texts if not getattr(engine, "detokenize", True) else None
    writer = BackgroundWriter(RecordWriter(open_sink(opts.output, stdout), ordered=opts.ordered), finish)
    window = 2 * config.max_num_seqs * opts.data_parallel_size  # enough waiting work for every replica
    try:
        with StopFlag() as stop, GenerateProgress(total, console, enabled=show) as progress:
            runner = Runner(engine, writer, progress, model=opts.engine["model"],
                            include_token_ids=opts.include_token_ids, window=window, stop=stop)
            counts = runner.run(items)
    except BrokenPipeError:
        say(console, "output closed before every record was written")
        return EXIT_FAILED
    finally:
        try:
            writer.drain()
            writer.close()
        except BrokenPipeError:
            pass
    stats = engine.stats
    # Records found invalid when their turn came (the ones found before the first token were listed then).
    _report_errors(console, source, late + runner.rejected, opts.max_errors_shown)
    if not opts.quiet:
        console.print(summary_table(GenerateSummary(
            total=total, answered=counts.answered, failed=counts.failed, skipped=skipped,
            prompt_tokens=stats.prompt_tokens, generated_tokens=stats.generated_tokens,
            wall_s=time.perf_counter() - started, generate_s=time.perf_counter() - gen_started,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            preemptions=stats.num_preemptions, interrupted=counts.interrupted)))
    if counts.interrupted:
        say(console, f"interrupted ({counts.signal_name}): {writer.written} records written; "
                     "run the same command with --resume to finish")
        return EXIT_INTERRUPTED if counts.signal_name == "SIGINT" else EXIT_TERMINATED
    return EXIT_FAILED if counts.failed else EXIT_OK
