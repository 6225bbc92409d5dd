"""Step 5 of `generate`: what the run did, on stderr (late errors, summary, interruption), and its exit code."""
from __future__ import annotations

import time

from rich.console import Console

from llmcli.cli.generate.checks import report_errors
from llmcli.cli.generate.handoff import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED, Outcome
from llmcli.cli.io.prepare import OPENAI_COMPLETIONS_MAX_TOKENS, PLAIN_MAX_TOKENS
from llmcli.cli.progress import GenerateSummary, say, summary_table


def _note(console: Console, text: str) -> None:
    """A note after the summary: wrapped between words on a terminal, one line in a log."""
    console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=not console.is_terminal)


def report(outcome: Outcome) -> int:
    """The exit code: 0 all answered, 1 some failed (in this run or the one it resumes), 130/143 interrupted."""
    job, plan, counts, stats = outcome.job, outcome.plan, outcome.counts, outcome.stats
    opts, console = job.opts, job.console
    report_errors(console, plan.source, outcome.rejected, opts.max_errors_shown)
    if not opts.quiet:  # -q hides the progress and the summary, not what changed the results (the note below)
        console.print(summary_table(GenerateSummary(
            total=plan.total, answered=counts.answered, failed=counts.failed, skipped=plan.skipped,
            prompt_tokens=stats.prompt_tokens, generated_tokens=stats.generated_tokens,
            # The progress display's clock stopped with the last record: its final rates are these.
            wall_s=time.perf_counter() - job.started, generate_s=outcome.generate_s,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            preemptions=stats.num_preemptions, interrupted=counts.interrupted,
            default_limited=counts.default_limited, state_snapshots=(
                stats.state_snapshot_slots, stats.state_snapshot_bytes, stats.state_snapshots_taken,
                stats.state_snapshot_hits))))
        if counts.block_size_hint:
            _note(console, counts.block_size_hint)
    if counts.default_limited:  # records cut at a limit nobody set (--max-tokens sets one for every record)
        _note(console, f"{counts.default_limited} records stopped at a length limit they do not set (the default "
                       f"max_tokens: {PLAIN_MAX_TOKENS} for plain records, {OPENAI_COMPLETIONS_MAX_TOKENS} for "
                       "OpenAI completions, the context for OpenAI chat); give max_tokens in a record, or "
                       "--max-tokens, to let them run longer")
    if counts.interrupted:
        say(console, f"interrupted ({counts.signal_name}): {outcome.written} records written; "
                     "run the same command with --resume to finish")
        return EXIT_INTERRUPTED if counts.signal_name == "SIGINT" else EXIT_TERMINATED
    if counts.failed:
        return EXIT_FAILED
    # A resume finishes the run that wrote error records: it fails as that run did.
    return EXIT_FAILED if plan.resumed.errors else EXIT_OK
