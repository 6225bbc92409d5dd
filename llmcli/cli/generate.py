"""The `generate` command as a pipeline: check OUT, then read → prepare → engine → write.

The engine starts in a thread (``cli/startup.py``) while the input is
checked line by line (``cli/io/index.py``, with the checks of
``cli/checks.py``) and the first records are tokenized
(``cli/io/stream.py``); the step loop (``cli/runner.py``) hands finished
records to a writer thread (``cli/io/background_writer.py``).
"""
from __future__ import annotations

import os
import stat
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

from rich.console import Console

from llmcli.cli.checks import (FieldCheck, InputMatch, check_out, check_pool, refuse_duplicates, report_errors,
                               template_of)
from llmcli.cli.io.background_writer import BackgroundWriter
from llmcli.cli.io.fingerprint import Fingerprint, write_sidecar
from llmcli.cli.io.index import InputIndex, index_input
from llmcli.cli.io.lock import OutputLock, OutputLocked
from llmcli.cli.io.logprobs_format import TokenBytes
from llmcli.cli.io.output_checks import describe_write_failure
from llmcli.cli.io.prepare import OPENAI_COMPLETIONS_MAX_TOKENS, PLAIN_MAX_TOKENS, Preparer, PreparedRequest
from llmcli.cli.io.reasoning import choose_parser
from llmcli.cli.io.records import InputRecord
from llmcli.cli.io.resume import ResumeState
from llmcli.cli.io.source import InputFile, is_stream, source_name, stdin_open
from llmcli.cli.io.stream import Item, PreparedStream
from llmcli.cli.io.writer import OutputWriteError, RecordWriter, open_sink, reserve_stdout
from llmcli.cli.progress import GenerateProgress, GenerateSummary, say, summary_table
from llmcli.cli.runner import BudgetGuess, Runner, StopFlag, token_budget
from llmcli.cli.startup import EngineStarter
from llmcli.cli.usage_error import UsageError
from llmcli.config import env_number
from llmcli.models.hub import load_tokenizer

__all__ = ["GenerateOptions", "UsageError", "run_generate"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a tool that stopped because its reader left
# Records prepared (tokenized, length-checked) before the first token: with --on-error fail a problem among
# them still means exit 2 and nothing generated. Later records are checked when the stream reaches them.
CHECK_AHEAD = 16384  # LLMCLI_CHECK_AHEAD overrides


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


@dataclass
class RunPlan:
    """What the checks before the first token hand to the run."""

    resumed: ResumeState
    fp: Fingerprint
    total: int  # records to run
    skipped: int  # records OUT already answers
    source: str  # IN's name in messages
    reasoning: str | None
    stdout: Any
    lock: OutputLock | None = None  # OUT's lock, which also takes OUT's inode once OUT is created


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


def _read_template(path: Path) -> str:
    from llmcli.cli.text_files import TextFileError, read_text

    try:
        return read_text(path, f"--chat-template {path}")
    except TextFileError as exc:
        raise UsageError(str(exc)) from None


def _open_input(path: str) -> InputFile:
    try:
        return InputFile(path)
    except IsADirectoryError:
        raise UsageError(f"IN {path} is a folder; give a JSONL file") from None
    except OSError as exc:
        if path == "-":
            raise UsageError(f"IN is - but stdin cannot be read ({exc.strerror or exc}); give IN as a file, "
                             "or pipe the input in") from None
        raise UsageError(f"cannot read IN {path}: {exc.strerror or exc}") from None


def _start_output(opts: GenerateOptions, run: RunPlan) -> None:
    """OUT is about to be (re)started or continued: empty it for --overwrite and record which input it answers."""
    if opts.output == "-":
        return
    try:
        if opts.overwrite:
            Path(opts.output).write_bytes(b"")  # only now: a run refused for bad input leaves the old OUT alone
        else:
            Path(opts.output).touch()  # an empty input still leaves the OUT a script expects
        if run.lock is not None:
            run.lock.lock_output()
        if os.path.isfile(opts.output):  # not for /dev/null or a pipe
            write_sidecar(opts.output, run.fp)
    except OutputLocked as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot start OUT {opts.output}: {exc.strerror or exc}"
                         + (f" ({exc.filename})" if exc.filename else "")) from None


def run_generate(opts: GenerateOptions, console: Console) -> int:
    """Run the command; returns the exit code. Raises UsageError (and ConfigError) for exit code 2.

    OUT is locked for the whole run, so a second run on the same OUT is refused instead of doubling it.
    """
    if opts.output == "-":
        return _generate(opts, console)
    try:
        lock = OutputLock(opts.output).acquire()
    except OutputLocked as exc:
        raise UsageError(str(exc)) from None
    try:
        if lock.warning:
            say(console, lock.warning)
        return _generate(opts, console, lock)
    finally:
        lock.release()


def _generate(opts: GenerateOptions, console: Console, lock: OutputLock | None = None) -> int:
    started = time.perf_counter()
    scale = _scale_out(opts)
    resumed = check_out(opts.output, opts.input, opts.resume, opts.overwrite)
    if opts.input == "-" and not stdin_open():
        raise UsageError("IN is - but stdin is closed; give IN as a file, or pipe the input in")
    stdout = reserve_stdout() if opts.output == "-" else None
    config = _config(opts, scale)
    chat_template = _read_template(opts.chat_template) if opts.chat_template else None
    # Batch encoding runs on the tokenizer's own threads; llmcli's worker processes are spawned, not forked.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    tokenizer_started = time.perf_counter()
    try:
        tokenizer = load_tokenizer(config.model_path, config.tokenizer)
    except Exception as exc:  # only an explicit --tokenizer raises
        raise UsageError(f"--tokenizer {config.tokenizer} could not be loaded: {exc}") from None
    tokenizer_s = time.perf_counter() - tokenizer_started
    # A missing IN: no engine started. stdin or a pipe is copied while the engine starts.
    source = _open_input(opts.input) if not is_stream(opts.input) else None
    starter = _start_engine(opts, scale, config, tokenizer)
    stream: PreparedStream | None = None
    try:
        source = source or _open_input(opts.input)  # stdin is spooled while the engine starts
        preparer = Preparer(tokenizer, config.max_model_len, config.hf_config.vocab_size, opts.sampling,
                            chat_template, opts.chat_template_kwargs)
        match, fields = InputMatch(opts.output, resumed, opts.force_resume), FieldCheck(opts.strict)

        def check(rec: InputRecord) -> None:
            fields(rec)
            preparer.check(rec)

        index = index_input(source, resumed.answered, check, seen=match.seen.add)
        name = source_name(opts.input)
        if refuse_duplicates(console, index.duplicates, name, opts.max_errors_shown):
            return EXIT_USAGE
        match.check(console, opts.quiet)
        if not opts.quiet:
            fields.warn(console, name)
        run = RunPlan(resumed, match.seen.result(), len(index), index.total - len(index), name,
                   choose_parser(opts.reasoning_parser, chat_template or template_of(tokenizer)), stdout, lock)
        code = _report_input(opts, console, config, index, run)
        if code is not None:
            return code
        # Chunks big enough for batch encoding, and a few of them ahead of what the engine holds waiting.
        window = 2 * config.max_num_seqs * opts.data_parallel_size
        stream = PreparedStream(source, index, preparer, chunk=min(1024, max(64, window)), ahead=4)
        ahead = stream.take(env_number("LLMCLI_CHECK_AHEAD", CHECK_AHEAD))
        found = [item for position, item in ahead if isinstance(item, InputRecord) and position not in index.bad]
        if found:  # prompts too long once tokenized, chat templates that fail
            report_errors(console, name, found, opts.max_errors_shown)
            if opts.on_error == "fail":
                say(console, f"{len(found)} input records are invalid; nothing was generated "
                             "(fix them, or pass --on-error skip to write error records instead)")
                return EXIT_USAGE
        input_s = time.perf_counter() - started
        engine = starter.result()
        if opts.verbose:
            _report_startup(console, engine, tokenizer_s, input_s, time.perf_counter() - started)
        too_big = check_pool(ahead, engine)
        if too_big:
            report_errors(console, name, too_big, opts.max_errors_shown)
            if opts.on_error == "fail":
                say(console, f"{len(too_big)} records can never fit the KV cache; nothing was generated")
                return EXIT_USAGE
        guess = _guess_budget(ahead, len(index), config.max_model_len)
        late: list[InputRecord] = []  # records the stream finds invalid after the first token: reported at the end
        items = chain(_consume(ahead), _late_errors(stream, index, late))
        code = _run(opts, console, engine, config, items, late, guess, run, started)
        # A resume finishes the run that wrote error records: it fails as that run did.
        return EXIT_FAILED if code == EXIT_OK and resumed.errors else code
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


def _guess_budget(ahead: list[Item], total: int, max_model_len: int) -> BudgetGuess:
    """The token budget of the records prepared ahead, and their mean for each record not prepared yet."""
    budgets = [token_budget(item, max_model_len) for _, item in ahead if isinstance(item, PreparedRequest)]
    known, rest = sum(map(sum, budgets)), total - len(ahead)
    mean = round(known / len(ahead)) if ahead else 0
    return BudgetGuess(first=len(ahead), tokens=mean, pending_seqs=sum(map(len, budgets)) + rest,
                       total=known + mean * rest)


def _report_input(opts: GenerateOptions, console: Console, config: Any, index: InputIndex, run: RunPlan) -> int | None:
    """What the checking pass found; an exit code when the run ends here."""
    bad = index.errors
    if bad and opts.on_error == "fail":
        # Nothing is generated from a malformed input: every problem is listed (the engine stops starting).
        report_errors(console, run.source, bad, opts.max_errors_shown)
        say(console, f"{len(bad)} of {len(index)} input records are invalid; nothing was generated "
                     "(fix them, or pass --on-error skip to write error records instead)")
        return EXIT_USAGE
    if bad and not opts.quiet:
        report_errors(console, run.source, bad, opts.max_errors_shown)
        say(console, f"{len(bad)} invalid records get error records in OUT")
    if not opts.quiet:
        if run.reasoning is not None and opts.reasoning_parser == "auto":
            say(console, f"reasoning parser {run.reasoning}: the chat template uses <think>, so thinking goes to "
                         f"{opts.reasoning_field} (--reasoning-parser none keeps it in the text)")
        earlier = f", {run.resumed.errors} of them by error records" if run.resumed.errors else ""
        # stdout is never resumed: nothing in it can be answered already
        answered = f" ({run.skipped} already answered in OUT{earlier})" if opts.output != "-" else ""
        say(console, f"{len(index)} records to run{answered}")
        if opts.output == "-" and opts.ordered and _is_pipe(run.stdout):
            say(console, "stdout is a pipe: records come in input order, each once every earlier one is done "
                         "(--unordered writes each the moment it finishes)")
        applied = {k: v for k, v in config.sampling_defaults.items() if k not in opts.sampling}
        if applied:
            say(console, "the model's generation_config.json sets " + ", ".join(f"{k}={v}" for k, v in applied.items())
                + " for records that leave them unset (--generation-config ignore: llmcli's neutral defaults)")
    if not len(index):
        _start_output(opts, run)
        return EXIT_FAILED if run.resumed.errors else EXIT_OK
    return None


def _is_pipe(stream: Any) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(stream.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):
        return False


def _report_startup(console: Console, engine: Any, tokenizer_s: float, input_s: float, ready_s: float) -> None:
    phases = {**getattr(engine, "startup_s", {}), "tokenizer": round(tokenizer_s, 3)}  # loaded here, not there
    listed = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
    say(console, f"start-up: {listed}; input checked and first records prepared after {input_s:.2f} s; "
                 f"engine ready after {ready_s:.2f} s")


def _close_writer(writer: BackgroundWriter, failure: OutputWriteError | None) -> OutputWriteError | None:
    """Write what is held and close OUT; the first write failure (disk full) is the one to report."""
    for op in (writer.drain, writer.close):
        try:
            op()
        except BrokenPipeError:
            pass
        except OutputWriteError as exc:
            failure = failure or exc
    return failure


def _run(opts: GenerateOptions, console: Console, engine: Any, config: Any, items: Any, late: list[InputRecord],
         guess: BudgetGuess, run: RunPlan, started: float) -> int:
    gen_started = time.perf_counter()
    show = not opts.quiet and (opts.progress if opts.progress is not None else console.is_terminal)
    _start_output(opts, run)
    # The step loop shares the GIL with the writer and the preparing thread: let it have it back sooner
    # when it returns from the device or a torch op (Python's default is 5 ms).
    sys.setswitchinterval(0.001)
    finish = engine.fill_texts if not getattr(engine, "detokenize", True) else None
    writer = BackgroundWriter(RecordWriter(open_sink(opts.output, run.stdout), ordered=opts.ordered), finish)
    failure: OutputWriteError | None = None
    window = 2 * config.max_num_seqs * opts.data_parallel_size  # enough waiting work for every replica
    try:
        with StopFlag() as stop, GenerateProgress(run.total, console, enabled=show, tokens_total=guess.total,
                                                  started=gen_started) as progress:
            runner = Runner(engine, writer, progress, model=opts.engine["model"], max_model_len=config.max_model_len,
                            include_token_ids=opts.include_token_ids, window=window, stop=stop,
                            include_metrics=opts.include_metrics, reasoning=run.reasoning, guess=guess,
                            token_bytes=TokenBytes(getattr(engine, "tokenizer", None)),
                            reasoning_field=opts.reasoning_field)
            counts = runner.run(items)
    except BrokenPipeError:
        # The reader has what it wanted (| head): stop at once and quietly, as Unix tools do (128 + SIGPIPE).
        return EXIT_PIPE_CLOSED
    except OutputWriteError as exc:
        failure = exc
    finally:
        failure = _close_writer(writer, failure)
    if failure is not None:
        say(console, f"error: {describe_write_failure(opts.output, writer.written, failure)}")
        return EXIT_FAILED
    stats = engine.stats
    # Records found invalid when their turn came (the ones found before the first token were listed then).
    report_errors(console, run.source, late + runner.rejected, opts.max_errors_shown)
    if not opts.quiet:
        console.print(summary_table(GenerateSummary(
            total=run.total, answered=counts.answered, failed=counts.failed, skipped=run.skipped,
            prompt_tokens=stats.prompt_tokens, generated_tokens=stats.generated_tokens,
            # The progress display's clock stopped with the last record: its final rates are these.
            wall_s=time.perf_counter() - started, generate_s=progress.state.elapsed_s,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            preemptions=stats.num_preemptions, interrupted=counts.interrupted,
            default_limited=counts.default_limited)))
        if counts.default_limited:
            limit = (f"--max-tokens {opts.sampling['max_tokens']}" if "max_tokens" in opts.sampling else
                     f"the default max_tokens: {PLAIN_MAX_TOKENS} for plain records, "
                     f"{OPENAI_COMPLETIONS_MAX_TOKENS} for OpenAI completions, the context for OpenAI chat")
            say(console, f"{counts.default_limited} records stopped at a length limit they do not set ({limit}); "
                         "give max_tokens in a record, or --max-tokens, to let them run longer")
    if counts.interrupted:
        say(console, f"interrupted ({counts.signal_name}): {writer.written} records written; "
                     "run the same command with --resume to finish")
        return EXIT_INTERRUPTED if counts.signal_name == "SIGINT" else EXIT_TERMINATED
    return EXIT_FAILED if counts.failed else EXIT_OK
