"""The `llmcli` command line: generate, bench and probe-memory (parses options, hands off to the engine)."""
import enum
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, List, Optional

import typer
from rich.console import Console

from llmcli.cli.options import (DataParallelSizeOption, DistributedBackendOption, RayAddressOption,
                                with_engine_options)
from llmcli.cli.progress import say

app = typer.Typer(
    name="llmcli",
    help="Offline batch generation with LLMs: JSONL in, JSONL out, on llmcli's own paged-attention engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

SAMPLING = "Sampling defaults (per-record fields override them)"
OUTPUT = "Output"


class OnError(str, enum.Enum):
    fail = "fail"
    skip = "skip"


def _console() -> Console:
    return Console(stderr=True)


def _guarded(run: Callable[[], int]) -> None:
    """Maps the ways a command can fail onto exit codes: 2 for usage/config, 130 for Ctrl-C."""
    from llmcli.config import ConfigError
    from llmcli.scaleout.errors import DataParallelError
    from llmcli.parallel.tp_runner import TensorParallelError
    from llmcli.cli.generate import UsageError
    from llmcli.models.hub import ModelNotFoundError
    from llmcli.sampling_params import SamplingParamsError

    console = _console()
    try:
        code = run()
    except (UsageError, ConfigError, ModelNotFoundError, SamplingParamsError) as exc:
        say(console, f"error: {exc}")
        raise typer.Exit(2) from None
    except (TensorParallelError, DataParallelError) as exc:
        say(console, f"error: {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        say(console, "interrupted")
        raise typer.Exit(130) from None
    raise typer.Exit(code)


@app.command(no_args_is_help=True)
@with_engine_options
def generate(
    input: Annotated[str, typer.Argument(help="Input JSONL file, or - for stdin.", show_default=False)],
    output: Annotated[str, typer.Option("--output", "-o", help="Output JSONL file, or - for stdout.",
                                        rich_help_panel=OUTPUT)] = "-",
    resume: Annotated[bool, typer.Option("--resume", help="Append to OUT, skipping every input it already answers.",
                                         rich_help_panel=OUTPUT)] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty OUT instead of refusing to start.",
                                            rich_help_panel=OUTPUT)] = False,
    unordered: Annotated[bool, typer.Option("--unordered", help="Write each record as soon as it finishes, "
                                            "not in input order.", rich_help_panel=OUTPUT)] = False,
    include_token_ids: Annotated[bool, typer.Option("--include-token-ids", help="Add the generated token ids "
                                                    "to each record.", rich_help_panel=OUTPUT)] = False,
    on_error: Annotated[OnError, typer.Option(help="fail: stop before generating if any input is invalid; "
                                                   "skip: write an error record for it and carry on.",
                                              rich_help_panel=OUTPUT)] = OnError.fail,
    max_errors: Annotated[int, typer.Option(help="Most input errors listed on stderr.", rich_help_panel=OUTPUT)] = 20,
    chat_template: Annotated[Optional[Path], typer.Option(help="Jinja chat template file for `messages` records, "
                                                          "instead of the tokenizer's.", exists=True, dir_okay=False,
                                                          rich_help_panel=OUTPUT)] = None,
    progress: Annotated[Optional[bool], typer.Option("--progress/--no-progress", help="Show the progress bar "
                                                     "\\[default: only when stderr is a terminal].",
                                                     show_default=False, rich_help_panel=OUTPUT)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress, summary or notes on stderr "
                                        "(errors are still reported).", rich_help_panel=OUTPUT)] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also say how long each start-up phase took.",
                                          rich_help_panel=OUTPUT)] = False,
    temperature: Annotated[Optional[float], typer.Option(help="0 is greedy. \\[default: 1.0]", show_default=False,
                                                         rich_help_panel=SAMPLING)] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Nucleus sampling mass. \\[default: 1.0, off]",
                                                   show_default=False, rich_help_panel=SAMPLING)] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Keep the k likeliest tokens. \\[default: -1, off]",
                                                 show_default=False, rich_help_panel=SAMPLING)] = None,
    min_p: Annotated[Optional[float], typer.Option(help="Drop tokens below min_p times the top probability. "
                                                   "\\[default: 0, off]", show_default=False,
                                                   rich_help_panel=SAMPLING)] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens generated per completion.",
                                            rich_help_panel=SAMPLING)] = 256,
    stop: Annotated[Optional[List[str]], typer.Option(help="Stop string (repeatable); not included in the text.",
                                                      show_default=False, rich_help_panel=SAMPLING)] = None,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed; the i-th of n completions uses seed+i.",
                                                show_default=False, rich_help_panel=SAMPLING)] = None,
    ignore_eos: Annotated[Optional[bool], typer.Option("--ignore-eos", help="Keep generating past EOS.",
                                                       show_default=False, rich_help_panel=SAMPLING)] = None,
    n: Annotated[Optional[int], typer.Option("--n", help="Completions per input. \\[default: 1]",
                                             show_default=False, rich_help_panel=SAMPLING)] = None,
    data_parallel_size: DataParallelSizeOption = 1,
    distributed_backend: DistributedBackendOption = None,
    ray_address: RayAddressOption = None,
    engine: Any = None,
) -> None:
    """Generate a completion for every JSONL record of IN, appending one JSONL record per input to OUT.

    Records: {"prompt": ...}, {"messages": [...]}, {"prompt_token_ids": [...]}, or OpenAI batch lines
    ({"custom_id", "method", "url", "body"}). Exit codes: 0 all answered, 1 some failed, 2 usage or
    input errors, 130 interrupted (run again with --resume).
    """
    from llmcli.cli.generate import GenerateOptions, run_generate
    from llmcli.sampling_params import SamplingParams

    sampling = {k: v for k, v in dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                      max_tokens=max_tokens, stop=stop or None, seed=seed,
                                      ignore_eos=ignore_eos, n=n).items() if v is not None}
    opts = GenerateOptions(
        input=input, output=output, engine=engine, sampling=sampling, resume=resume, overwrite=overwrite,
        ordered=not unordered, on_error=on_error.value, include_token_ids=include_token_ids,
        chat_template=chat_template, max_errors_shown=max_errors, progress=progress, quiet=quiet, verbose=verbose,
        data_parallel_size=data_parallel_size, ray_address=ray_address,
        distributed_backend=distributed_backend.value if distributed_backend is not None else None)

    def run() -> int:
        SamplingParams(**sampling)  # a bad flag is a usage error, not one error per record
        return run_generate(opts, _console())

    _guarded(run)


@app.command()
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
                            temperature=temperature, seed=seed, warmup=warmup)
        return run_bench_command(engine, workload, _console(), as_json=json_, output=output)

    _guarded(run)


@app.command("probe-memory")
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
    app(prog_name="llmcli")


if __name__ == "__main__":
    sys.exit(main())
