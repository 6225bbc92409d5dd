"""The `generate` command's act: check OUT, read and validate every input, then build the engine and run."""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from llmcli.cli.io.fingerprint import Fingerprint, InputMismatch, check_same_input, fingerprint, write_sidecar
from llmcli.cli.io.lock import OutputLock, OutputLocked
from llmcli.cli.io.output_checks import OutputError, check_output, describe_write_failure
from llmcli.cli.io.prepare import Preparer, PreparedRequest
from llmcli.models.hub import load_tokenizer
from llmcli.cli.io.fields import UnknownFieldReport
from llmcli.cli.io.reasoning import choose_parser
from llmcli.cli.io.records import InputRecord, did_you_mean, mark_duplicates, parse_line
from llmcli.cli.io.resume import ResumeError, ResumeState, scan_output
from llmcli.cli.io.source import read_lines, source_name
from llmcli.cli.io.writer import OutputWriteError, RecordWriter, open_sink, reserve_stdout
from llmcli.cli.progress import GenerateProgress, GenerateSummary, say, summary_table
from llmcli.cli.runner import Runner, StopFlag, token_budget

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143


class UsageError(Exception):
    """The command cannot start as asked (exit code 2); the message says what to change."""


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
    data_parallel_size: int = 1  # engine replicas fed from this one input
    distributed_backend: str | None = None  # "local" (processes on this machine) | "ray"; None: ray with an address
    ray_address: str | None = None  # an existing Ray cluster (implies "ray")
    strict: bool = False  # unknown record fields are input errors instead of warnings
    chat_template_kwargs: dict[str, Any] | None = None  # --chat-template-kwargs (records' own win per key)
    reasoning_parser: str = "auto"  # "auto" | "qwen3" | "none"
    include_metrics: bool = False


def _template_of(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one is what chat records use
        template = template.get("default")
    return template if isinstance(template, str) else None


def _check_output(opts: GenerateOptions) -> ResumeState:
    """What OUT already answers; refuses to clobber a non-empty OUT by accident."""
    if opts.output == "-" and opts.resume:
        raise UsageError("--resume needs OUT to be a file (stdout cannot be read back)")
    try:
        check_output(opts.output, opts.input, opts.resume, opts.overwrite)
    except OutputError as exc:
        raise UsageError(str(exc)) from None
    if opts.output == "-":
        return ResumeState()
    out = Path(opts.output)
    if out.is_dir():
        raise UsageError(f"OUT {out} is a folder")
    if not out.parent.is_dir():
        raise UsageError(f"the folder of OUT {out} does not exist")
    if opts.resume:
        try:
            return scan_output(out)
        except ResumeError as exc:
            raise UsageError(str(exc)) from None
    if out.exists() and out.stat().st_size > 0 and not opts.overwrite:
        raise UsageError(f"OUT {out} exists and is not empty; pass --resume to continue it "
                         "or --overwrite to replace it")
    return ResumeState()


def _check_input_matches(opts: GenerateOptions, console: Console, records: list[InputRecord],
                         resumed: ResumeState) -> None:
    """--resume must continue the input that produced OUT (the sidecar fingerprint), unless forced."""
    if not resumed.answered or opts.force_resume:
        return
    try:
        note = check_same_input(opts.output, records)
    except InputMismatch as exc:
        raise UsageError(str(exc)) from None
    if note and not opts.quiet:
        say(console, note)


def _refuse_duplicates(console: Console, records: list[InputRecord], source: str, cap: int) -> bool:
    """Two inputs named alike (explicit ids, or an implicit line index equal to an explicit id) cannot be
    told apart in OUT, so no mode can answer both once and resume them: always an input error."""
    dups = mark_duplicates(records)
    if dups:
        _report_errors(console, source, dups, cap)
        say(console, f"{len(dups)} input records repeat an id; nothing was generated (every record needs its "
                     "own id: a record without one is named by its 0-based line index)")
    return bool(dups)


def _start_output(opts: GenerateOptions, fp: Fingerprint) -> None:
    """OUT is about to be (re)started or continued: empty it for --overwrite and record which input it answers."""
    if opts.output == "-":
        return
    if opts.overwrite:
        Path(opts.output).write_bytes(b"")  # only now: a run refused for bad input leaves the old OUT alone
    else:
        Path(opts.output).touch()  # an empty input still leaves the OUT a script expects
    if os.path.isfile(opts.output):  # not for /dev/null or a pipe
        write_sidecar(opts.output, fp)


def _read_records(opts: GenerateOptions) -> list[InputRecord]:
    try:
        lines = read_lines(opts.input)
    except OSError as exc:
        raise UsageError(f"cannot read IN {opts.input}: {exc.strerror or exc}") from None
    return [parse_line(line) for line in lines]


def _check_fields(records: list[InputRecord], strict: bool, console: Console, source: str, quiet: bool) -> None:
    """Unknown fields: one warning per field name (with its lines), or with --strict an error per record."""
    report = UnknownFieldReport()
    for rec in records:
        if rec.error is not None or not rec.unknown:
            continue
        if strict:
            name = rec.unknown[0]
            hint = did_you_mean(name)
            rec.prompt = None
            rec.fail(name, "unknown field (--strict)" + (f'; did you mean "{hint}"?' if hint else ""))
            continue
        for name in rec.unknown:
            report.add(name, rec.line, did_you_mean(name))
    if not quiet:
        for message in report.messages(source):
            say(console, message)


def _report_errors(console: Console, source: str, bad: list[InputRecord], cap: int) -> None:
    for rec in bad[:cap]:
        say(console, rec.error.describe(source))
    if len(bad) > cap:
        say(console, f"... and {len(bad) - cap} more")


def _check_pool(items: list[PreparedRequest | InputRecord], engine: Any) -> None:
    """Requests that can never fit the KV pool are known once start-up has sized it (the engine's own rule)."""
    from llmcli.engine.sequence import RequestRejected

    for i, item in enumerate(items):
        if not isinstance(item, PreparedRequest):
            continue
        try:
            engine.check_fits(item.prompt_token_ids, item.params[0])
        except RequestRejected as exc:
            rec = item.record
            rec.fail(_too_big_field(engine, item), f"{exc} (--num-kvcache-blocks / --gpu-memory-utilization)")
            items[i] = rec


def _too_big_field(engine: Any, item: PreparedRequest) -> str:
    """The field to blame for a request the pool cannot hold: the prompt if it alone cannot fit, else max_tokens."""
    from llmcli.engine.sequence import RequestRejected

    try:
        engine.check_fits(item.prompt_token_ids, dataclasses.replace(item.params[0], max_tokens=1))
    except RequestRejected:
        return item.record.prompt_field()
    return item.record.field_name("max_tokens")


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
        return _generate(opts, console)
    finally:
        lock.release()


def _generate(opts: GenerateOptions, console: Console) -> int:
    from llmcli.config import Config

    started = time.perf_counter()
    scale = _scale_out(opts)
    resumed = _check_output(opts)
    answered = resumed.answered
    stdout = reserve_stdout() if opts.output == "-" else None
    if scale.enabled:
        from llmcli.scaleout.data_parallel import driver_config

        config = driver_config(opts.engine, scale)
    else:
        config = Config(**opts.engine)
    records = _read_records(opts)
    if _refuse_duplicates(console, records, source_name(opts.input), opts.max_errors_shown):
        return EXIT_USAGE
    _check_input_matches(opts, console, records, resumed)
    fp = fingerprint(records)
    todo = [r for r in records if r.key not in answered]
    chat_template = opts.chat_template.read_text() if opts.chat_template else None
    try:
        tokenizer = load_tokenizer(config.model_path, config.tokenizer)
    except Exception as exc:  # only an explicit --tokenizer raises
        raise UsageError(f"--tokenizer {config.tokenizer} could not be loaded: {exc}") from None
    preparer = Preparer(tokenizer, config.max_model_len, config.hf_config.vocab_size, opts.sampling, chat_template,
                        opts.chat_template_kwargs)
    reasoning = choose_parser(opts.reasoning_parser, chat_template or _template_of(tokenizer))
    source = source_name(opts.input)
    _check_fields(todo, opts.strict, console, source, opts.quiet)
    items: list[PreparedRequest | InputRecord] = preparer.prepare_all(todo)
    bad = [r for r in todo if r.error is not None]
    if bad and opts.on_error == "fail":
        # Nothing is generated from a malformed input: every problem is listed before the engine starts.
        _report_errors(console, source, bad, opts.max_errors_shown)
        say(console, f"{len(bad)} of {len(todo)} input records are invalid; nothing was generated "
                 "(fix them, or pass --on-error skip to write error records instead)")
        return EXIT_USAGE
    if bad and not opts.quiet:
        _report_errors(console, source, bad, opts.max_errors_shown)
        say(console, f"{len(bad)} invalid records get error records in OUT")
    if not opts.quiet and reasoning is not None and opts.reasoning_parser == "auto":
        say(console, f"reasoning parser {reasoning}: the chat template uses <think>, so thinking goes to "
                     "reasoning_content (--reasoning-parser none keeps it in the text)")
    if not opts.quiet:
        earlier = f", {resumed.errors} of them by error records" if resumed.errors else ""
        say(console, f"{len(todo)} records to run ({len(records) - len(todo)} already answered in OUT{earlier})")
        applied = {k: v for k, v in config.sampling_defaults.items() if k not in opts.sampling}
        if applied:
            say(console, "the model's generation_config.json sets " + ", ".join(f"{k}={v}" for k, v in applied.items())
                + " for records that leave them unset (--generation-config ignore: llmcli's neutral defaults)")
    if not todo:
        _start_output(opts, fp)
        return EXIT_FAILED if resumed.errors else EXIT_OK

    if scale.enabled:
        from llmcli.scaleout.data_parallel import DataParallelEngine

        engine: Any = DataParallelEngine(config, scale, engine_kwargs=opts.engine, tokenizer=tokenizer)
    else:
        from llmcli.engine.llm_engine import LLMEngine

        engine = LLMEngine(config, tokenizer=tokenizer)
    try:
        _check_pool(items, engine)
        known = {id(r) for r in bad}
        too_big = [i for i in items if isinstance(i, InputRecord) and id(i) not in known]
        if too_big:
            _report_errors(console, source, too_big, opts.max_errors_shown)
            if opts.on_error == "fail":
                say(console, f"{len(too_big)} records can never fit the KV cache; nothing was generated")
                return EXIT_USAGE
        code = _run(opts, console, engine, config, items, fp, len(records) - len(todo), started, source, stdout,
                    reasoning)
        # A resume finishes the run that wrote error records: it fails as that run did.
        return EXIT_FAILED if code == EXIT_OK and resumed.errors else code
    finally:
        engine.shutdown()


def _close_writer(writer: RecordWriter, failure: OutputWriteError | None) -> OutputWriteError | None:
    """Write what is held and close OUT; the first write failure (disk full) is the one to report."""
    try:
        writer.drain()
    except BrokenPipeError:
        pass
    except OutputWriteError as exc:
        failure = failure or exc
    try:
        writer.close()
    except BrokenPipeError:
        pass
    except OutputWriteError as exc:
        failure = failure or exc
    return failure


def _run(opts: GenerateOptions, console: Console, engine: Any, config: Any, items: list,
         fp: Fingerprint, skipped: int, started: float, source: str, stdout: Any, reasoning: str | None) -> int:
    gen_started = time.perf_counter()
    show = not opts.quiet and (opts.progress if opts.progress is not None else console.is_terminal)
    _start_output(opts, fp)
    writer = RecordWriter(open_sink(opts.output, stdout), ordered=opts.ordered)
    failure: OutputWriteError | None = None
    window = 2 * config.max_num_seqs * opts.data_parallel_size  # enough waiting work for every replica
    budget = sum(sum(token_budget(i, config.max_model_len)) for i in items if isinstance(i, PreparedRequest))
    try:
        with StopFlag() as stop, GenerateProgress(len(items), console, enabled=show, tokens_total=budget,
                                                  started=gen_started) as progress:
            runner = Runner(engine, writer, progress, model=opts.engine["model"], max_model_len=config.max_model_len,
                            include_token_ids=opts.include_token_ids, window=window, stop=stop,
                            include_metrics=opts.include_metrics, reasoning=reasoning)
            counts = runner.run(items)
    except BrokenPipeError:
        say(console, "output closed before every record was written")
        return EXIT_FAILED
    except OutputWriteError as exc:
        failure = exc
    finally:
        failure = _close_writer(writer, failure)
    if failure is not None:
        say(console, f"error: {describe_write_failure(opts.output, writer.written, failure)}")
        return EXIT_FAILED
    stats = engine.stats
    if not opts.quiet:
        # Records the engine rejected while running (the ones found before it started were listed then).
        rejected = [i.record for i in items if isinstance(i, PreparedRequest) and i.record.error is not None]
        _report_errors(console, source, rejected, opts.max_errors_shown)
        console.print(summary_table(GenerateSummary(
            total=len(items), answered=counts.answered, failed=counts.failed, skipped=skipped,
            prompt_tokens=stats.prompt_tokens, generated_tokens=stats.generated_tokens,
            # The progress display's clock stopped with the last record: its final rates are these.
            wall_s=time.perf_counter() - started, generate_s=progress.state.elapsed_s,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            preemptions=stats.num_preemptions, interrupted=counts.interrupted)))
    if counts.interrupted:
        say(console, f"interrupted ({counts.signal_name}): {writer.written} records written; "
                     "run the same command with --resume to finish")
        return EXIT_INTERRUPTED if counts.signal_name == "SIGINT" else EXIT_TERMINATED
    return EXIT_FAILED if counts.failed else EXIT_OK
