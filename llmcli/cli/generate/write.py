"""OUT in `generate`: started once the input passed its checks, written by a thread, closed with its first failure."""
from __future__ import annotations

import os
from pathlib import Path

from llmcli.cli.generate.handoff import Job, RunPlan
from llmcli.cli.io.background_writer import BackgroundWriter
from llmcli.cli.io.fingerprint import write_sidecar
from llmcli.cli.io.lock import OutputLocked
from llmcli.cli.io.writer import OutputWriteError, RecordWriter, open_sink
from llmcli.cli.usage_error import UsageError
from llmcli.engine.engine_api import EngineAPI


def start_output(job: Job, plan: RunPlan) -> None:
    """OUT is about to be (re)started or continued: empty it for --overwrite and record which input it answers."""
    output = job.opts.output
    if output == "-":
        return
    try:
        if job.opts.overwrite:
            Path(output).write_bytes(b"")  # only now: a run refused for bad input leaves the old OUT alone
        else:
            Path(output).touch()  # an empty input still leaves the OUT a script expects
        if plan.lock is not None:
            plan.lock.lock_output()
        if os.path.isfile(output):  # not for /dev/null or a pipe
            write_sidecar(output, plan.fp)
    except OutputLocked as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot start OUT {output}: {exc.strerror or exc}"
                         + (f" ({exc.filename})" if exc.filename else "")) from None


def open_writer(job: Job, plan: RunPlan, engine: EngineAPI) -> BackgroundWriter:
    """The writer thread for OUT; it decodes texts the engine left undecoded, in batches."""
    finish = None if engine.detokenize else engine.fill_texts
    return BackgroundWriter(RecordWriter(open_sink(job.opts.output, plan.stdout), ordered=job.opts.ordered), finish)


def close_writer(writer: BackgroundWriter, failure: OutputWriteError | None) -> OutputWriteError | None:
    """Write what is held and close OUT; the first write failure (disk full) is the one to report."""
    for op in (writer.drain, writer.close):
        try:
            op()
        except BrokenPipeError:
            pass
        except OutputWriteError as exc:
            failure = failure or exc
    return failure
