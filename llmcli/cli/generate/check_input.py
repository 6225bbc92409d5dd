"""Step 2 of `generate`: every line of IN checked and indexed, what was found reported, and the run planned."""
from __future__ import annotations

import os
import stat
from typing import Any

from llmcli.cli.generate.checks import FieldCheck, InputMatch, refuse_duplicates, report_errors, template_of
from llmcli.cli.generate.handoff import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Checked, EndRun, Job, Opened, RunPlan
from llmcli.cli.generate.write import start_output
from llmcli.cli.io.index import InputIndex, index_input
from llmcli.cli.io.prepare import Preparer
from llmcli.cli.io.reasoning import choose_parser, make_splitter
from llmcli.cli.usage_error import UsageError
from llmcli.engine.harmony import BUDGET_NEEDS_HARMONY, HarmonyTokens
from llmcli.cli.io.records import InputRecord
from llmcli.cli.io.source import source_name
from llmcli.cli.progress import say


def check_input(opened: Opened) -> Checked:
    """One pass over IN: each record parsed and checked, only its place kept; raises EndRun when nothing runs."""
    job = opened.job
    opts, console, config = job.opts, job.console, job.config
    preparer = Preparer(job.tokenizer, config.max_model_len, config.hf_config.vocab_size, opts.sampling,
                        job.chat_template, opts.chat_template_kwargs)
    match, fields = InputMatch(opts.output, opened.resumed, opts.force_resume), FieldCheck(opts.strict)

    def check(rec: InputRecord) -> None:
        fields(rec)
        preparer.check(rec)

    index = index_input(opened.source, opened.resumed.answered, check, seen=match.seen.add)
    name = source_name(opts.input)
    if refuse_duplicates(console, index.duplicates, name, opts.max_errors_shown):
        raise EndRun(EXIT_USAGE)
    match.check(console, opts.quiet)
    fields.warn(console, name)  # even with -q: an ignored field changes the results
    _check_budget(job)
    plan = RunPlan(opened.resumed, match.seen.result(), len(index), index.total - len(index), name,
                   _parser(opts.reasoning_parser, job), opened.stdout, opened.lock)
    _report(job, index, plan)
    return Checked(job, opened.source, opened.starter, index, preparer, plan)


def _check_budget(job: Job) -> None:
    """--thinking-token-budget on a model whose format marks no reasoning: one usage error, not one per record."""
    if job.opts.sampling.get("thinking_token_budget") is not None and HarmonyTokens.of(job.tokenizer) is None:
        raise UsageError(f"--thinking-token-budget {BUDGET_NEEDS_HARMONY}")


def _parser(option: str, job: Job) -> str | None:
    """The run's reasoning parser; UsageError when it cannot read this model's output."""
    try:
        parser = choose_parser(option, job.chat_template or template_of(job.tokenizer))
        make_splitter(parser, job.tokenizer)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return parser


def _report(job: Job, index: InputIndex, plan: RunPlan) -> None:
    """What the checking pass found; raises EndRun when the run ends here."""
    opts, console = job.opts, job.console
    bad = index.errors
    if bad and opts.on_error == "fail":
        # Nothing is generated from a malformed input: every problem is listed (the engine stops starting).
        report_errors(console, plan.source, bad, opts.max_errors_shown)
        say(console, f"{len(bad)} of {len(index)} input records are invalid; nothing was generated "
                     "(fix them, or pass --on-error skip to write error records instead)")
        raise EndRun(EXIT_USAGE)
    if bad:  # even with -q: these records get error records instead of answers
        report_errors(console, plan.source, bad, opts.max_errors_shown)
        say(console, f"{len(bad)} invalid records get error records in OUT")
    if not opts.quiet:
        if plan.reasoning is not None and opts.reasoning_parser == "auto":
            why = "is Harmony's (gpt-oss): the analysis channel" if plan.reasoning == "harmony" \
                else "uses <think>, so thinking"
            say(console, f"reasoning parser {plan.reasoning}: the chat template {why} goes to "
                         f"{opts.reasoning_field} (--reasoning-parser none keeps it in the text)")
        template = job.chat_template or template_of(job.tokenizer)
        if "reasoning_effort" in (opts.chat_template_kwargs or {}) and template and "reasoning_effort" not in template:
            say(console, "note: the chat template never reads reasoning_effort, so the reasoning effort asked for "
                         "changes nothing with this model")
        earlier = f", {plan.resumed.errors} of them by error records" if plan.resumed.errors else ""
        # stdout is never resumed: nothing in it can be answered already
        answered = f" ({plan.skipped} already answered in OUT{earlier})" if opts.output != "-" else ""
        say(console, f"{len(index)} records to run{answered}")
        if opts.output == "-" and opts.ordered and _is_pipe(plan.stdout):
            say(console, "stdout is a pipe: records come in input order, each once every earlier one is done "
                         "(--unordered writes each the moment it finishes)")
        applied = {k: v for k, v in job.config.sampling_defaults.items() if k not in opts.sampling}
        if applied:
            say(console, "the model's generation_config.json sets " + ", ".join(f"{k}={v}" for k, v in applied.items())
                + " for records that leave them unset (--generation-config ignore: llmcli's neutral defaults)")
    if not len(index):
        start_output(job, plan)
        raise EndRun(EXIT_FAILED if plan.resumed.errors else EXIT_OK)


def _is_pipe(stream: Any) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(stream.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):
        return False
