"""Step 3 of `generate`: IN's records prepared as a stream, the first ones checked before the first token."""
from __future__ import annotations

import time
from collections import deque
from contextlib import ExitStack
from itertools import chain
from typing import Iterator

from llmcli.cli.generate.checks import check_pool, report_errors
from llmcli.cli.generate.handoff import EXIT_USAGE, Checked, EndRun, Job, Prepared
from llmcli.cli.io.index import InputIndex
from llmcli.cli.io.prepare import PreparedRequest
from llmcli.cli.io.records import InputRecord
from llmcli.cli.io.stream import Item, PreparedStream
from llmcli.cli.progress import say
from llmcli.cli.runner import BudgetGuess, token_budget
from llmcli.config import env_number
from llmcli.engine.engine_api import EngineAPI

# Records prepared (tokenized, length-checked) before the first token: with --on-error fail a problem among
# them still means exit 2 and nothing generated. Later records are checked when the stream reaches them.
CHECK_AHEAD = 16384  # LLMCLI_CHECK_AHEAD overrides


def prepare_input(checked: Checked, resources: ExitStack) -> Prepared:
    """The stream of prepared records and the engine they go to; raises EndRun for records that cannot run."""
    job, index, name = checked.job, checked.index, checked.plan.source
    opts, console, config = job.opts, job.console, job.config
    # Chunks big enough for batch encoding, and a few of them ahead of what the engine holds waiting.
    window = 2 * config.max_num_seqs * opts.data_parallel_size
    stream = PreparedStream(checked.source, index, checked.preparer, chunk=min(1024, max(64, window)), ahead=4)
    resources.callback(stream.close)
    ahead = stream.take(env_number("LLMCLI_CHECK_AHEAD", CHECK_AHEAD))
    found = [item for position, item in ahead if isinstance(item, InputRecord) and position not in index.bad]
    if found:  # prompts too long once tokenized, chat templates that fail
        report_errors(console, name, found, opts.max_errors_shown)
        if opts.on_error == "fail":
            say(console, f"{len(found)} input records are invalid; nothing was generated "
                         "(fix them, or pass --on-error skip to write error records instead)")
            raise EndRun(EXIT_USAGE)
    input_s = time.perf_counter() - job.started
    engine = checked.starter.result()
    if opts.verbose:
        _report_startup(job, engine, input_s, time.perf_counter() - job.started)
    too_big = check_pool(ahead, engine)
    if too_big:
        report_errors(console, name, too_big, opts.max_errors_shown)
        if opts.on_error == "fail":
            say(console, f"{len(too_big)} records can never fit the KV cache; nothing was generated")
            raise EndRun(EXIT_USAGE)
    guess = _guess_budget(ahead, len(index), config.max_model_len)
    late: list[InputRecord] = []
    items = chain(_consume(ahead), _late_errors(stream, index, late))
    return Prepared(job, checked.plan, engine, items, late, guess)


def _consume(items: list[Item]) -> Iterator[Item]:
    """The items of a list, each let go of once the run has taken it."""
    queue = deque(items)
    items.clear()
    while queue:
        yield queue.popleft()


def _late_errors(stream: PreparedStream, index: InputIndex, late: list[InputRecord]) -> Iterator[Item]:
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


def _report_startup(job: Job, engine: EngineAPI, input_s: float, ready_s: float) -> None:
    phases = {**engine.startup_s, "tokenizer": round(job.tokenizer_s, 3)}  # loaded here, not there
    listed = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
    say(job.console, f"start-up: {listed}; input checked and first records prepared after {input_s:.2f} s; "
                     f"engine ready after {ready_s:.2f} s")
