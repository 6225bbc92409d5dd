"""Step 4 of `generate`: OUT started, the step loop fed from the prepared stream, each finished record written."""
from __future__ import annotations

import os
import sys
import time

from llmcli.cli.generate.handoff import EXIT_FAILED, EXIT_PIPE_CLOSED, EndRun, Outcome, Prepared
from llmcli.cli.generate.write import close_writer, open_writer, start_output
from llmcli.cli.io.logprobs_format import TokenBytes
from llmcli.cli.io.output_checks import describe_write_failure
from llmcli.cli.io.reasoning import make_splitter
from llmcli.cli.io.writer import OutputWriteError
from llmcli.cli.progress import GenerateProgress, say
from llmcli.cli.runner import Runner, StopFlag


def run_engine(prepared: Prepared) -> Outcome:
    """Every record answered (or interrupted by a signal); raises EndRun when OUT's reader left or a write failed."""
    job, plan, engine = prepared.job, prepared.plan, prepared.engine
    opts, console, config = job.opts, job.console, job.config
    gen_started = time.perf_counter()
    show = not opts.quiet and (opts.progress if opts.progress is not None else console.is_terminal)
    # redrawn in place only where nothing else writes: records on the same terminal would be overwritten
    live = console.is_terminal and not (opts.output == "-" and _is_terminal(plan.stdout))
    start_output(job, plan)
    # The step loop shares the GIL with the writer and the preparing thread: let it have it back sooner
    # when it returns from the device or a torch op (Python's default is 5 ms).
    sys.setswitchinterval(0.001)
    writer = open_writer(job, plan, engine)
    failure: OutputWriteError | None = None
    window = 2 * config.max_num_seqs * opts.data_parallel_size  # enough waiting work for every replica
    try:
        with StopFlag() as stop, GenerateProgress(plan.total, console, enabled=show, tokens_total=prepared.guess.total,
                                                  started=gen_started, live=live,
                                                  written=lambda: writer.written) as progress:
            runner = Runner(engine, writer, progress, model=opts.engine["model"], max_model_len=config.max_model_len,
                            include_token_ids=opts.include_token_ids or job.tokenizer is None, window=window, stop=stop,
                            include_metrics=opts.include_metrics, reasoning=make_splitter(plan.reasoning, job.tokenizer),
                            guess=prepared.guess,
                            token_bytes=TokenBytes(engine.tokenizer),
                            reasoning_field=opts.reasoning_field,
                            block_size=config.kvcache_block_size if config.enable_prefix_caching else 0)
            counts = runner.run(prepared.items)
    except BrokenPipeError:
        # The reader has what it wanted (| head): stop at once and quietly, as Unix tools do (128 + SIGPIPE).
        raise EndRun(EXIT_PIPE_CLOSED) from None
    except OutputWriteError as exc:
        failure = exc
    finally:
        failure = close_writer(writer, failure)
    if failure is not None:
        say(console, f"error: {describe_write_failure(opts.output, writer.written, failure)}")
        raise EndRun(EXIT_FAILED)
    # Records found invalid when their turn came (the ones found before the first token were listed then).
    return Outcome(job, plan, counts, engine.stats, writer.written, progress.state.elapsed_s,
                   prepared.late + runner.rejected)


def _is_terminal(stream: object) -> bool:
    try:
        return os.isatty(stream.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False
