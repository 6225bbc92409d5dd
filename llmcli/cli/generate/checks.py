"""What `generate` checks before the first token, and how it says so: OUT, resumed input, ids, fields, KV pool."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rich.console import Console

from llmcli.cli.io.fields import UnknownFieldReport
from llmcli.cli.io.fingerprint import Fingerprint, FingerprintBuilder, InputMismatch, check_same_input, read_sidecar
from llmcli.cli.io.output_checks import OutputError, check_output
from llmcli.cli.io.prepare import PreparedRequest
from llmcli.cli.io.records import InputRecord, did_you_mean
from llmcli.cli.io.resume import ResumeError, ResumeState, scan_output
from llmcli.cli.progress import say
from llmcli.cli.rejection import first_rejection, rejection
from llmcli.cli.usage_error import UsageError
from llmcli.engine.engine_api import EngineAPI


def check_out(output: str, input: str, resume: bool, overwrite: bool) -> ResumeState:
    """What OUT already answers; refuses to clobber a non-empty OUT by accident."""
    if output == "-" and resume:
        raise UsageError("--resume needs OUT to be a file (stdout cannot be read back)")
    try:
        check_output(output, input, resume, overwrite)
    except OutputError as exc:
        raise UsageError(str(exc)) from None
    if output == "-":
        return ResumeState()
    out = Path(output)
    if out.is_dir():
        raise UsageError(f"OUT {out} is a folder")
    if not Path(os.path.realpath(out)).parent.is_dir():
        raise UsageError(f"the folder of OUT {out} does not exist")
    if resume:
        try:
            return scan_output(out)
        except ResumeError as exc:
            raise UsageError(str(exc)) from None
    if out.exists() and out.stat().st_size > 0 and not overwrite:
        raise UsageError(f"OUT {out} exists and is not empty; pass --resume to continue it "
                         "or --overwrite to replace it")
    return ResumeState()


def check_out_not_model(output: str, model_path: Path, tokenizer: str | None) -> None:
    """OUT must not be (or link to) a file the run reads: the checkpoint, its config or its tokenizer."""
    if output == "-":
        return
    folders = [model_path] + ([Path(tokenizer)] if tokenizer and Path(tokenizer).is_dir() else [])
    try:
        out = os.stat(output)
    except OSError:
        return  # a new file: it replaces nothing
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if os.path.samestat(out, entry.stat()):
                    raise UsageError(f"OUT {output} is {entry.path}, a file of the model being run; write the "
                                     "answers elsewhere")
            except OSError:
                continue


class InputMatch:
    """--resume must continue the input that produced OUT (the sidecar fingerprint), unless forced.

    The sidecar is read before IN, so the checking pass can take the fingerprint of IN's first records
    as it goes (``seen``) and the whole input's for the new sidecar."""

    def __init__(self, output: str, resumed: ResumeState, force: bool) -> None:
        self.output = output
        self.wanted = bool(resumed.answered) and not force
        self.stored: Fingerprint | None = read_sidecar(output) if self.wanted else None
        self.seen = FingerprintBuilder(prefix=self.stored.records if self.stored is not None else None)

    def check(self, console: Console, quiet: bool) -> None:
        if not self.wanted:
            return
        try:
            note = check_same_input(self.output, self.stored, self.seen)
        except InputMismatch as exc:
            raise UsageError(str(exc)) from None
        if note and not quiet:
            say(console, note)


def refuse_duplicates(console: Console, dups: list[InputRecord], source: str, cap: int) -> bool:
    """Two inputs named alike (explicit ids, or an implicit line index equal to an explicit id) cannot be
    told apart in OUT, so no mode can answer both once and resume them: always an input error."""
    if dups:
        report_errors(console, source, dups, cap)
        say(console, f"{len(dups)} input records repeat an id; nothing was generated (every record needs its "
                     "own id: a record without one is named by its 0-based line index)")
    return bool(dups)


class FieldCheck:
    """Unknown fields: one warning per field name (with its lines), or with --strict an error per record."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.report = UnknownFieldReport()

    def __call__(self, rec: InputRecord) -> None:
        if rec.error is not None or not rec.unknown:
            return
        if self.strict:
            name = rec.unknown[0]
            hint = did_you_mean(name)
            rec.prompt = None
            rec.fail(name, "unknown field (--strict)" + (f'; did you mean "{hint}"?' if hint else ""))
            return
        for name in rec.unknown:
            self.report.add(name, rec.line, did_you_mean(name))

    def warn(self, console: Console, source: str) -> None:
        for message in self.report.messages(source):
            say(console, message)


def report_errors(console: Console, source: str, bad: list[InputRecord], cap: int) -> None:
    for rec in bad[:cap]:
        say(console, rec.error.describe(source))
    if len(bad) > cap:
        say(console, f"... and {len(bad) - cap} more")


def check_pool(ahead: list[tuple[int, Any]], engine: EngineAPI) -> list[InputRecord]:
    """Requests that can never fit the KV pool are known once start-up has sized it (the engine's own rule);
    the records prepared ahead are checked now, the rest when admitted."""
    too_big = []
    for i, (position, item) in enumerate(ahead):
        if not isinstance(item, PreparedRequest):
            continue
        found = first_rejection(engine, item)
        if found is not None:
            item.record.fail(*rejection(item, *found))
            ahead[i] = (position, item.record)
            too_big.append(item.record)
    return too_big


def template_of(tokenizer: Any) -> str | None:
    """The chat template chat records use (the default one of named templates)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None
