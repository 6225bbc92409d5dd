"""The `llmcli` command line: generate, bench and probe-memory (parses options, hands off to the engine)."""
import enum
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, List, Optional

import typer
import typer.core
from rich.console import Console

from llmcli.cli.options import (ChoiceOption, DataParallelSizeOption, DistributedBackendOption, IdColumnOption,
                                InputFormat, InputFormatOption, KeepColumnsOption, MessagesColumnOption,
                                PromptColumnOption, RayAddressOption, RegexOption, SystemPromptFileOption,
                                SystemPromptOption, split_list, system_prompt_of,
                                with_engine_options)
from llmcli.cli.progress import say


def _plain_metavars(params: list[Any]) -> list[Any]:
    """Flags take no value, so they show no type placeholder (Typer would print <bool>)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class Command(typer.core.TyperCommand):
    """A command whose --help is plain text in titled sections (Input, Output, Engine, ...).

    Rich's option tables cut long flag names (``--max-num-batc…``) at any width below ~140 columns;
    plain definition lists wrap the help text instead and keep every flag whole at 80.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rich_markup_mode = None

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """vLLM also takes flags spelled with underscores (``--max_model_len``): read them as the dashed flag."""
        known = {opt for param in self.get_params(ctx) for opt in (*param.opts, *getattr(param, "secondary_opts", ()))}
        out = []
        for i, arg in enumerate(args):
            if arg == "--":  # what follows is arguments, not flags
                out += args[i:]
                break
            name, eq, value = arg.partition("=")
            dashed = name.replace("_", "-")
            out.append(dashed + eq + value if name.startswith("--") and "_" in name and dashed in known else arg)
        return super().parse_args(ctx, out)

    def get_params(self, ctx: Any) -> list[Any]:
        params = _plain_metavars(super().get_params(ctx))
        for param in params:
            if getattr(param, "help", None) and "\\[" in param.help:
                param.help = param.help.replace("\\[", "[")  # rich escapes, shown as text here
        return params

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            panel = getattr(param, "rich_help_panel", None)
            name = panel or ("Arguments" if param.param_type_name == "argument" else "Options")
            sections.setdefault(name, []).append(record)
        for name, rows in sections.items():
            with formatter.section(name):
                formatter.write_dl(rows)


class Group(typer.core.TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_metavars(super().get_params(ctx))


app = typer.Typer(
    name="llmcli",
    cls=Group,
    help="Offline batch generation with LLMs: JSONL in, JSONL out, on llmcli's own paged-attention engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

INPUT = "Input"
SAMPLING = "Sampling defaults (per-record fields override them)"
OUTPUT = "Output"


class OnError(str, enum.Enum):
    fail = "fail"
    skip = "skip"


class ReasoningField(str, enum.Enum):
    reasoning = "reasoning"
    reasoning_content = "reasoning_content"


class ReasoningParser(str, enum.Enum):
    auto = "auto"
    qwen3 = "qwen3"
    harmony = "harmony"
    none = "none"


class ReasoningEffort(str, enum.Enum):
    low = "low"
    medium = "medium"
    high = "high"


def _version(value: bool) -> None:
    if value:
        from llmcli import __version__

        typer.echo(f"llmcli {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[Optional[bool], typer.Option("--version", help="Print the version and exit.",
                                                          callback=_version, is_eager=True)] = None) -> None:
    """Offline batch generation with LLMs: JSONL in, JSONL out, on llmcli's own paged-attention engine."""


def _json_object(value: Optional[str]) -> Optional[dict]:
    if value is None:
        return None
    import orjson

    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise typer.BadParameter(f"not valid JSON ({exc}); give an object, e.g. '{{\"enable_thinking\": false}}'")
    if not isinstance(parsed, dict):
        raise typer.BadParameter("must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return parsed


def _console() -> Console:
    # User text (file names, field values) goes through it: ":100:" or "[red]" must print as written.
    return Console(stderr=True, emoji=False, markup=False, highlight=False)


def _guarded(run: Callable[[], int]) -> None:
    """Maps the ways a command can fail onto exit codes: 2 for usage/config, 130 for Ctrl-C."""
    from llmcli.config import ConfigError, EnvError, check_environment
    from llmcli.engine.kv_cache import KVCacheAllocationError, KVCacheTooSmall
    from llmcli.engine.memory_check import HostMemoryTooSmall
    from llmcli.scaleout.errors import DataParallelError
    from llmcli.parallel.tp_runner import TensorParallelError
    from llmcli.cli.flag_errors import flag_message
    from llmcli.cli.generate import UsageError
    from llmcli.models.config_checks import ModelConfigError
    from llmcli.models.hub import ModelNotFoundError
    from llmcli.models.loader import CheckpointError
    from llmcli.sampling_params import SamplingParamsError

    console = _console()
    try:
        check_environment()
        code = run()
    except EnvError as exc:
        say(console, f"error: {exc}")
        raise typer.Exit(2) from None
    except (ConfigError, SamplingParamsError) as exc:
        # Raised only by command-line (or --config) values here: name the flag, not the Python field.
        say(console, f"error: {flag_message(str(exc))}")
        raise typer.Exit(2) from None
    except (UsageError, ModelNotFoundError, ModelConfigError, CheckpointError, HostMemoryTooSmall) as exc:
        say(console, f"error: {exc}")
        raise typer.Exit(2) from None
    except (KVCacheTooSmall, KVCacheAllocationError) as exc:  # the engine's sizes do not fit this machine
        say(console, f"error: the KV cache does not fit: {exc}")
        raise typer.Exit(2) from None
    except (TensorParallelError, DataParallelError) as exc:
        say(console, f"error: {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        say(console, "interrupted")
        from llmcli.cli.generate.startup import leave_if_start_up_abandoned

        leave_if_start_up_abandoned()
        raise typer.Exit(130) from None
    raise typer.Exit(code)


@app.command(no_args_is_help=True, cls=Command)
@with_engine_options
def generate(
    input: Annotated[Optional[str], typer.Argument(help="Input JSONL file or table (Parquet, CSV, TSV, "
                                                   "Arrow, a saved dataset), or - for stdin (or give it as -i).",
                                                   metavar="IN", show_default=False)] = None,
    input_option: Annotated[Optional[str], typer.Option("--input", "-i", "--input-file", help="Input JSONL file "
                                                        "(-i and --input-file as vLLM's run-batch takes it), "
                                                        "instead of IN.", metavar="IN",
                                                        show_default=False, rich_help_panel=INPUT)] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Unknown record fields are input errors "
                                         "(default: one warning per field name, and ignored).",
                                         rich_help_panel=INPUT)] = False,
    chat_template: Annotated[Optional[Path], typer.Option(help="Jinja chat template file for `messages` records, "
                                                          "instead of the tokenizer's.", exists=True, dir_okay=False,
                                                          rich_help_panel=INPUT)] = None,
    chat_template_kwargs: Annotated[Optional[str], typer.Option(
        help="JSON object of extra chat-template variables for every chat record, e.g. "
             "'{\"enable_thinking\": false}'; a record's own chat_template_kwargs win key by key.",
        metavar="JSON", show_default=False, callback=_json_object, rich_help_panel=INPUT)] = None,
    reasoning_effort: Annotated[Optional[ReasoningEffort], typer.Option(
        help="The chat template's reasoning_effort for every chat record (gpt-oss: how long it reasons); a "
             "record's own reasoning_effort wins.", show_default=False, rich_help_panel=INPUT)] = None,
    output: Annotated[str, typer.Option("--output", "-o", "--output-file", help="Output JSONL file, or - for "
                                        "stdout; a name ending .parquet, .csv, .tsv or .arrow writes a table.", metavar="OUT", rich_help_panel=OUTPUT)] = "-",
    resume: Annotated[bool, typer.Option("--resume", help="Append to OUT, skipping every input it already answers.",
                                         rich_help_panel=OUTPUT)] = False,
    force_resume: Annotated[bool, typer.Option("--force-resume", help="--resume even when IN is not the input "
                                               "that produced OUT (its fingerprint in OUT.llmcli-input differs).",
                                               rich_help_panel=OUTPUT)] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty OUT instead of refusing to start.",
                                            rich_help_panel=OUTPUT)] = False,
    unordered: Annotated[bool, typer.Option("--unordered", help="Write each record as soon as it finishes, "
                                            "not in input order.", rich_help_panel=OUTPUT)] = False,
    include_token_ids: Annotated[bool, typer.Option("--include-token-ids", help="Add prompt_token_ids and each "
                                                    "completion's token_ids to plain records.",
                                                    rich_help_panel=OUTPUT)] = False,
    include_metrics: Annotated[bool, typer.Option("--include-metrics", help="Add per-completion timings to plain "
                                                  "records: time to first token, total time, cached prompt tokens.",
                                                  rich_help_panel=OUTPUT)] = False,
    reasoning_parser: Annotated[ReasoningParser, typer.Option(
        help="qwen3: move the text between <think> and </think> into reasoning (see --reasoning-field); "
             "harmony (gpt-oss): the analysis channel into reasoning, the final channel into text, tool calls "
             "into tool_calls; auto: harmony when the chat template is Harmony's, qwen3 when it mentions <think>; "
             "none: leave the text alone.",
        rich_help_panel=OUTPUT)
    ] = ReasoningParser.auto,
    reasoning_field: Annotated[ReasoningField, typer.Option(
        help="The field the reasoning parser writes: reasoning (vLLM's name now) or reasoning_content (its "
             "name before).", rich_help_panel=OUTPUT)] = ReasoningField.reasoning,
    on_error: Annotated[OnError, typer.Option(help="fail: stop before generating if any input is invalid; "
                                                   "skip: write an error record for it and carry on.",
                                              rich_help_panel=OUTPUT)] = OnError.fail,
    max_errors: Annotated[int, typer.Option(help="Most input errors listed on stderr.", rich_help_panel=OUTPUT)] = 20,
    progress: Annotated[Optional[bool], typer.Option("--progress/--no-progress", help="Show progress: a live "
                                                     "bar on a terminal, a plain line every 30 s (records, tok/s, "
                                                     "ETA) in a log \\[default: only when stderr is a terminal].",
                                                     show_default=False, rich_help_panel=OUTPUT)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress, summary or notes on stderr; "
                                        "errors and warnings that change the results (unknown fields, invalid "
                                        "records, records cut at a default length limit) are still reported.",
                                        rich_help_panel=OUTPUT)] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also say how long each start-up phase took.",
                                          rich_help_panel=OUTPUT)] = False,
    temperature: Annotated[Optional[float], typer.Option(
        help="0 is greedy. \\[default: the model's generation_config.json, else 1.0]", show_default=False,
        rich_help_panel=SAMPLING)] = None,
    top_p: Annotated[Optional[float], typer.Option(
        help="Nucleus sampling mass. \\[default: generation_config.json, else 1.0, off]", show_default=False,
        rich_help_panel=SAMPLING)] = None,
    top_k: Annotated[Optional[int], typer.Option(
        help="Keep the k likeliest tokens. \\[default: generation_config.json, else -1, off]", show_default=False,
        rich_help_panel=SAMPLING)] = None,
    min_p: Annotated[Optional[float], typer.Option(help="Drop tokens below min_p times the top probability. "
                                                   "\\[default: generation_config.json, else 0, off]",
                                                   show_default=False, rich_help_panel=SAMPLING)] = None,
    repetition_penalty: Annotated[Optional[float], typer.Option(
        help="Divide positive (multiply negative) logits of tokens already in the prompt or output; >1 "
             "discourages repeats. \\[default: generation_config.json, else 1.0, off]", show_default=False,
        rich_help_panel=SAMPLING)] = None,
    presence_penalty: Annotated[Optional[float], typer.Option(
        help="Subtract from the logit of every token generated so far, -2 to 2. \\[default: 0, off]",
        show_default=False, rich_help_panel=SAMPLING)] = None,
    frequency_penalty: Annotated[Optional[float], typer.Option(
        help="Subtract this times its count from each generated token's logit, -2 to 2. \\[default: 0, off]",
        show_default=False, rich_help_panel=SAMPLING)] = None,
    max_tokens: Annotated[Optional[int], typer.Option(
        help="Most tokens generated per completion. \\[default: OpenAI chat lines run until they stop or the "
             "context is full, OpenAI completions lines 16 (OpenAI's defaults), other records 256]",
        show_default=False, rich_help_panel=SAMPLING)] = None,
    stop: Annotated[Optional[List[str]], typer.Option(help="Stop string (repeatable); not included in the text.",
                                                      metavar="TEXT",
                                                      show_default=False, rich_help_panel=SAMPLING)] = None,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed of every record without its own seed (the "
                                                "i-th of n completions uses seed+i). Not --engine-seed, which only "
                                                "seeds requests that have no seed at all.",
                                                show_default=False, rich_help_panel=SAMPLING)] = None,
    ignore_eos: Annotated[Optional[bool], typer.Option("--ignore-eos", help="Keep generating past EOS.",
                                                       show_default=False, rich_help_panel=SAMPLING)] = None,
    n: Annotated[Optional[int], typer.Option("--n", help="Completions per input. \\[default: 1]",
                                             show_default=False, rich_help_panel=SAMPLING)] = None,
    thinking_token_budget: Annotated[Optional[int], typer.Option(
        help="gpt-oss (Harmony): end the analysis after at most this many tokens and go on to the final answer "
             "(0: no analysis); with a JSON schema, every answer is then complete within max_tokens. "
             "\\[default: unbounded]", show_default=False, rich_help_panel=SAMPLING)] = None,
    response_format: Annotated[Optional[Path], typer.Option(
        help="JSON file holding an OpenAI response_format ({\"type\": \"json_schema\", ...} or json_object): the "
             "default constraint of every record.", exists=True, dir_okay=False, show_default=False,
        rich_help_panel=SAMPLING)] = None,
    json_schema: Annotated[Optional[Path], typer.Option(
        help="JSON schema file every completion must follow (records may override it).", exists=True,
        dir_okay=False, show_default=False, rich_help_panel=SAMPLING)] = None,
    choice: ChoiceOption = None,
    regex: RegexOption = None,
    input_format: InputFormatOption = InputFormat.auto,
    prompt_column: PromptColumnOption = None,
    messages_column: MessagesColumnOption = None,
    id_column: IdColumnOption = None,
    system_prompt: SystemPromptOption = None,
    system_prompt_file: SystemPromptFileOption = None,
    keep_columns: KeepColumnsOption = None,
    data_parallel_size: DataParallelSizeOption = 1,
    distributed_backend: DistributedBackendOption = None,
    ray_address: RayAddressOption = None,
    engine: Any = None,
) -> None:
    """Generate a completion for every JSONL record (or table row) of IN, appending one JSONL record per input to OUT
    (or writing a Parquet, CSV or Arrow table when OUT's name ends so).

    Records: {"prompt": ...}, {"messages": [...]}, {"prompt_token_ids": [...]}, or OpenAI batch lines
    ({"custom_id", "method", "url", "body"}). Exit codes: 0 all answered, 1 some failed, 2 usage or
    input errors, 130 interrupted (run again with --resume).
    """
    from llmcli.cli.generate import GenerateOptions, UsageError, run_generate
    from llmcli.sampling_params import SamplingParams

    template_kwargs: Optional[dict] = chat_template_kwargs  # type: ignore[assignment]  # parsed by its callback

    sampling = {k: v for k, v in dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                      max_tokens=max_tokens, stop=stop or None, seed=seed,
                                      ignore_eos=ignore_eos, n=n, repetition_penalty=repetition_penalty,
                                      presence_penalty=presence_penalty,
                                      frequency_penalty=frequency_penalty,
                                      thinking_token_budget=thinking_token_budget).items() if v is not None}
    given_effort = (template_kwargs or {}).get("reasoning_effort")
    if reasoning_effort is not None:
        template_kwargs = {**(template_kwargs or {}), "reasoning_effort": reasoning_effort.value}
    opts = GenerateOptions(
        input=input if input is not None else (input_option or ""), output=output, strict=strict,
        chat_template_kwargs=template_kwargs, reasoning_parser=reasoning_parser.value,
        reasoning_field=reasoning_field.value,
        include_metrics=include_metrics, engine=engine, sampling=sampling, resume=resume or force_resume,
        force_resume=force_resume, overwrite=overwrite,
        ordered=not unordered, on_error=on_error.value, include_token_ids=include_token_ids,
        chat_template=chat_template, max_errors_shown=max_errors, progress=progress, quiet=quiet, verbose=verbose,
        data_parallel_size=data_parallel_size, ray_address=ray_address,
        distributed_backend=distributed_backend.value if distributed_backend is not None else None)

    def run() -> int:
        if input is None and input_option is None:
            raise UsageError("no input file: give IN (- for stdin) or -i/--input-file")
        if input is not None and input_option is not None:
            raise UsageError("the input file is given twice (IN and -i/--input-file); give one")
        if max_errors < 0:
            raise UsageError(f"--max-errors must be at least 0 (0 lists none), got {max_errors}")
        from llmcli.cli.io.reasoning_effort import check_flag_effort
        from llmcli.cli.io.structured_fields import default_constraint, flag_constraint

        check_flag_effort(given_effort, reasoning_effort.value if reasoning_effort is not None else None)
        from llmcli.cli.io.tables import ColumnFlags

        constraint = default_constraint(response_format, json_schema)
        given = flag_constraint(split_list(choice, "--choice"), regex)
        if given is not None and constraint is not None:
            raise UsageError(f"{'--choice' if choice is not None else '--regex'} and "
                             f"{'--json-schema' if json_schema is not None else '--response-format'}: give only one")
        constraint = constraint or given
        if constraint is not None:
            sampling["structured_outputs"] = constraint
        opts.input_format = input_format.value
        opts.columns = ColumnFlags(prompt_column, messages_column, id_column, system_prompt_of(system_prompt,
                                   system_prompt_file), split_list(keep_columns, "--keep-columns"))
        SamplingParams(**sampling)  # a bad flag is a usage error, not one error per record
        return run_generate(opts, _console())

    _guarded(run)


@app.command(cls=Command)
@with_engine_options
def bench(
    num_prompts: Annotated[int, typer.Option(help="Requests in the timed run.", rich_help_panel="Workload")] = 256,
    input_len: Annotated[str, typer.Option(help="Prompt length: N, or LO:HI drawn uniformly.",
                                           rich_help_panel="Workload")] = "100:1024",
    output_len: Annotated[str, typer.Option(help="Output length (max_tokens, EOS ignored): N, or LO:HI.",
                                            rich_help_panel="Workload")] = "100:1024",
    prefix_len: Annotated[int, typer.Option(help="Tokens of one shared prefix put in front of every prompt.",
                                            rich_help_panel="Workload")] = 0,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0 is greedy).",
                                               rich_help_panel="Workload")] = 0.6,
    sampling: Annotated[str, typer.Option(
        help="Sampling filters: 'plain' (temperature only), 'qwen3-defaults' (top_k 20, top_p 0.95 on every "
             "request: what a real Qwen3 checkpoint's generation_config.json gives), 'mixed' (every other "
             "request filtered).", rich_help_panel="Workload")] = "plain",
    seed: Annotated[int, typer.Option(help="Seed of the random workload.", rich_help_panel="Workload")] = 0,
    warmup: Annotated[int, typer.Option(help="Short requests run before timing starts.",
                                        rich_help_panel="Workload")] = 4,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of a table.",
                                        rich_help_panel=OUTPUT)] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Also write the JSON result to this file.",
                                                   dir_okay=False, rich_help_panel=OUTPUT)] = None,
    engine: Any = None,
) -> None:
    """Offline throughput benchmark on random token ids (default: 256 requests, lengths uniform in [100, 1024])."""
    from llmcli.cli.bench import Workload, parse_length, run_bench_command

    def run() -> int:
        workload = Workload(num_prompts=num_prompts, input_len=parse_length(input_len, "--input-len"),
                            output_len=parse_length(output_len, "--output-len"), prefix_len=prefix_len,
                            temperature=temperature, seed=seed, warmup=warmup, sampling=sampling)
        return run_bench_command(engine, workload, _console(), as_json=json_, output=output)

    _guarded(run)


@app.command("probe-memory", cls=Command)
@with_engine_options
def probe_memory(
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of a table.",
                                        rich_help_panel=OUTPUT)] = False,
    engine: Any = None,
) -> None:
    """Run only start-up and show where memory goes: weights, activations, CUDA graphs, KV blocks."""
    from llmcli.cli.probe import run_probe_command

    _guarded(lambda: run_probe_command(engine, _console(), as_json=json_))


def main() -> None:
    """Console-script entry point."""
    try:
        app(prog_name="llmcli")
    except SystemExit as done:
        _exit(done)
        raise


def _exit(done: SystemExit) -> None:
    """Leave at once once the command is over, when nothing outside this process still needs tearing down.

    Every output file is closed and synced by now; what interpreter shutdown would still do is free the GPU
    memory and the CUDA context piece by piece and run library exit hooks, seconds that a user waits for
    and that the process exit does anyway. Not with worker processes or Ray alive (their exit hooks stop
    them), nor with ``LLMCLI_FAST_EXIT=0``.
    """
    import logging
    import multiprocessing

    if os.environ.get("LLMCLI_FAST_EXIT", "1") == "0" or "ray" in sys.modules or multiprocessing.active_children():
        return
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return
    code = done.code
    code = 0 if code is None else code if isinstance(code, int) else 1
    if isinstance(done.code, str):
        print(done.code, file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass  # closed (None when the process started without it): nothing left to say on it
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
