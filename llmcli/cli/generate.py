"""The `generate` command's act: check OUT, read and validate every input, then build the engine and run."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from llmcli.cli.io.prepare import Preparer, PreparedRequest
from llmcli.models.hub import load_tokenizer
from llmcli.cli.io.records import InputRecord, mark_duplicates, parse_line
from llmcli.cli.io.resume import ResumeError, scan_output
from llmcli.cli.io.source import read_lines, source_name
from llmcli.cli.io.writer import RecordWriter, open_sink, reserve_stdout
from llmcli.cli.progress import GenerateProgress, GenerateSummary, say, summary_table
from llmcli.cli.runner import Runner, StopFlag

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


def _read_records(opts: GenerateOptions) -> list[InputRecord]:
    try:
        lines = read_lines(opts.input)
    except OSError as exc:
        raise UsageError(f"cannot read IN {opts.input}: {exc.strerror or exc}") from None
    records = [parse_line(line) for line in lines]
    mark_duplicates(records)
    return records


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
            rec.fail(rec.prompt_field(), f"{exc} (--num-kvcache-blocks / --gpu-memory-utilization)")
            items[i] = rec


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
    """Run the command; returns the exit code. Raises UsageError (and ConfigError) for exit code 2."""
    from llmcli.config import Config

    started = time.perf_counter()
    scale = _scale_out(opts)
    answered = _check_output(opts)
    stdout = reserve_stdout() if opts.output == "-" else None
    if scale.enabled:
        from llmcli.scaleout.data_parallel import driver_config

        config = driver_config(opts.engine, scale)
    else:
        config = Config(**opts.engine)
    records = _read_records(opts)
    todo = [r for r in records if r.key not in answered]
    chat_template = opts.chat_template.read_text() if opts.chat_template else None
    try:
        tokenizer = load_tokenizer(config.model_path, config.tokenizer)
    except Exception as exc:  # only an explicit --tokenizer raises
        raise UsageError(f"--tokenizer {config.tokenizer} could not be loaded: {exc}") from None
    preparer = Preparer(tokenizer, config.max_model_len, config.hf_config.vocab_size, opts.sampling, chat_template)
    items: list[PreparedRequest | InputRecord] = [preparer.prepare(r) or r for r in todo]
    source = source_name(opts.input)
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
    if not opts.quiet:
        say(console, f"{len(todo)} records to run ({len(records) - len(todo)} already answered in OUT)")
        applied = {k: v for k, v in config.sampling_defaults.items() if k not in opts.sampling}
        if applied:
            say(console, "the model's generation_config.json sets " + ", ".join(f"{k}={v}" for k, v in applied.items())
                + " for records that leave them unset (--generation-config ignore: llmcli's neutral defaults)")
    if not todo:
        if opts.output != "-":
            Path(opts.output).touch()  # an empty input still leaves the OUT a script expects
        return EXIT_OK

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
        return _run(opts, console, engine, config, items, len(records) - len(todo), started, source, stdout)
    finally:
        engine.shutdown()


def _run(opts: GenerateOptions, console: Console, engine: Any, config: Any, items: list, skipped: int,
         started: float, source: str, stdout: Any) -> int:
    gen_started = time.perf_counter()
    show = not opts.quiet and (opts.progress if opts.progress is not None else console.is_terminal)
    if opts.overwrite and not opts.resume and opts.output != "-":
        Path(opts.output).write_bytes(b"")  # only now: a run refused for bad input leaves the old OUT alone
    writer = RecordWriter(open_sink(opts.output, stdout), ordered=opts.ordered)
    window = 2 * config.max_num_seqs * opts.data_parallel_size  # enough waiting work for every replica
    try:
        with StopFlag() as stop, GenerateProgress(len(items), console, enabled=show) as progress:
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
    if not opts.quiet:
        # Records the engine rejected while running (the ones found before it started were listed then).
        rejected = [i.record for i in items if isinstance(i, PreparedRequest) and i.record.error is not None]
        _report_errors(console, source, rejected, opts.max_errors_shown)
        console.print(summary_table(GenerateSummary(
            total=len(items), answered=counts.answered, failed=counts.failed, skipped=skipped,
            prompt_tokens=stats.prompt_tokens, generated_tokens=stats.generated_tokens,
            wall_s=time.perf_counter() - started, generate_s=time.perf_counter() - gen_started,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            preemptions=stats.num_preemptions, interrupted=counts.interrupted)))
    if counts.interrupted:
        say(console, f"interrupted ({counts.signal_name}): {writer.written} records written; "
                     "run the same command with --resume to finish")
        return EXIT_INTERRUPTED if counts.signal_name == "SIGINT" else EXIT_TERMINATED
    return EXIT_FAILED if counts.failed else EXIT_OK
