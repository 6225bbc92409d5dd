"""Options every command shares: --model, the engine knobs, and --config TOML defaults (and generate's scale-out)."""
import enum
import functools
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENGINE_PANEL = "Engine"


@dataclass(frozen=True)
class Knob:
    """One Config field exposed as a flag."""

    name: str  # the Config field
    type: Any
    help: str
    default: str = ""  # shown in --help; Config holds the real default (a test keeps them equal)
    flag: str = ""  # defaults to --name-with-dashes
    aliases: tuple[str, ...] = ()  # other spellings, e.g. vLLM's name and a short form
    choices: tuple[str, ...] = ()  # shown and checked as choices

    @property
    def option(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def param(self) -> str:
        # Prefixed so a knob never collides with a command's own parameter (bench has its own --seed).
        return "knob_" + self.name


ENGINE_KNOBS = (
    Knob("max_num_batched_tokens", int, "Most tokens computed in one engine step (prefill chunks plus decodes).",
         "16384"),
    Knob("max_num_seqs", int, "Most sequences running at once.", "1024"),
    Knob("max_model_len", int, "Longest sequence, prompt plus output.",
         "the model's max_position_embeddings, at most 40960"),
    Knob("gpu_memory_utilization", float, "Share of GPU memory llmcli may use for weights, activations and KV cache.",
         "0.9"),
    Knob("tensor_parallel_size", int, "Ranks to shard the model over: GPUs on CUDA, processes on CPU.", "1",
         aliases=("-tp",)),
    Knob("enforce_eager", bool, "Run without CUDA graphs.", "off"),
    Knob("kvcache_block_size", int, "Tokens per KV-cache block; the prefix cache shares whole blocks, so a "
                                    "shared prompt prefix shorter than a block is never shared.",
         "64; 256 with --attention-backend flash-attn", aliases=("--block-size",)),
    Knob("num_kvcache_blocks", int, "Use exactly this many KV blocks instead of sizing the pool from free memory "
                                    "(a hybrid model's linear-attention states then get pages of their own beside "
                                    "them).",
         "sized from free memory", aliases=("--num-gpu-blocks-override",)),
    Knob("kv_cache_memory_gib", float, "Give the KV cache exactly this many GiB instead of sizing it from "
                                       "free memory (a hybrid model's linear-attention states share it).", "sized from free memory; on CPU 4 GiB or less"),
    Knob("enable_prefix_caching", bool, "Share KV blocks between requests that start with the same tokens.", "on"),
    Knob("num_state_snapshots", int, "Hybrid models (Qwen3.5, Qwen3-Next): slots of linear-attention state "
                                     "snapshots at shared prompt prefixes, which give those models prefix-cache "
                                     "hits; each slot takes one sequence's state memory (0: off).",
         "max_num_seqs / 16, from 4 to 32"),
    Knob("mixed_steps", bool, "Decode running requests in the same step as new prompts' prefill chunks "
                              "(off: a step is all prefill or all decode, prefill first).", "on"),
    Knob("sample_in_graph", bool, "CUDA: run the lm_head and the sampler inside the decode CUDA graph (once the "
                                  "one-pass sampler passed its start-up check).", "on"),
    Knob("device", str, "Where the engine runs.", "auto: cuda if visible, else cpu",
         choices=("auto", "cuda", "cpu")),
    Knob("dtype", str, "Weights and activations.", "auto: the checkpoint's on GPU, float32 on CPU",
         choices=("auto", "float32", "bfloat16", "float16", "float", "half")),  # vLLM's names too
    Knob("quantization", str, "fp8: quantize a 16-bit checkpoint's linear weights to FP8 at load (per output "
                              "channel; FP8 GEMMs on sm90+, elsewhere the weights are rounded through FP8). FP8 "
                              "checkpoints are recognised without it.", "the checkpoint's format",
         choices=("fp8",)),
    Knob("kv_cache_dtype", str, "KV-cache element type: fp8 stores e4m3 with a per-layer scale (the "
                                "checkpoint's k_scale/v_scale, else 1.0), half the bytes of bf16: twice the "
                                "blocks in the same memory.", "auto: the model dtype",
         choices=("auto", "fp8", "fp8_e4m3")),
    Knob("attention_backend", str, "Attention kernels.", "auto: the backend measured fastest for the GPU and head size (triton on sm_90); torch on CPU",
         choices=("auto", "torch", "triton", "flash-attn")),
    Knob("load_format", str, "dummy: random weights from config.json alone, for benchmarks.", "auto",
         choices=("auto", "safetensors", "dummy")),
    Knob("seed", int, "Engine seed: requests with no seed of their own (record field or generate's --seed) "
                      "draw their sampling noise from it.", "0", flag="--engine-seed"),
    Knob("tokenizer", str, "Tokenizer folder or hub id, when it is not the model's.", "the model's"),
    Knob("generation_config", str, "auto: sampling fields that neither a record nor a flag sets take the model's "
                                   "generation_config.json values (temperature, top_p, top_k, min_p, "
                                   "repetition_penalty), as vLLM's server does; ignore (or vLLM's name for it, "
                                   "vllm): llmcli's neutral defaults.", "auto",
         choices=("auto", "ignore", "vllm")),
)


def _choice_enum(knob: Knob) -> type[enum.Enum]:
    return enum.Enum(knob.name.title().replace("_", ""), {c: c for c in knob.choices}, type=str)  # type: ignore


def _knob_parameter(knob: Knob) -> inspect.Parameter:
    decls = [f"{knob.option}/--no-{knob.option[2:]}" if knob.type is bool else knob.option, *knob.aliases]
    kind = _choice_enum(knob) if knob.choices else knob.type
    help_text = knob.help + (f" \\[default: {knob.default}]" if knob.default else "")
    option = typer.Option(*decls, help=help_text, rich_help_panel=ENGINE_PANEL, show_default=False,
                          metavar="PATH" if knob.name == "tokenizer" else None)
    return inspect.Parameter(knob.param, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[Optional[kind], option])


# -- --config FILE.toml ----------------------------------------------------------
def _flag_to_param(command: Any) -> dict[str, str]:
    """TOML keys are flag names without dashes in front: 'max-num-seqs' or 'max_num_seqs'."""
    table = {}
    for param in command.params:
        for opt in list(param.opts) + list(getattr(param, "secondary_opts", [])):
            if opt.startswith("--") and not opt.startswith("--no-"):
                table[opt[2:].replace("-", "_")] = param.name
        if param.param_type_name == "argument":
            table[param.name] = param.name
    return table


def _typed(path: Path, key: str, value: Any, param: Any) -> Any:
    """``value`` if it has the type the flag takes: the option parser would turn ``true`` into 1 for an
    integer flag, or a number into a string."""
    import enum
    import typing

    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    many = typing.get_origin(annotation) in (list, tuple)
    if many:
        annotation = (typing.get_args(annotation) or (None,))[0]
    if annotation is bool:
        ok, wanted = (lambda v: isinstance(v, bool)), "true or false"
    elif annotation is int:
        ok, wanted = (lambda v: isinstance(v, int) and not isinstance(v, bool)), "an integer"
    elif annotation is float:
        ok, wanted = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)), "a number"
    elif annotation in (str, Path) or (isinstance(annotation, type) and issubclass(annotation, enum.Enum)):
        ok, wanted = (lambda v: isinstance(v, str)), "a string"
    else:
        return value  # a type of its own, which checks what it converts
    if not (all(map(ok, value)) if many and isinstance(value, list) else ok(value)):
        wanted = f"{wanted} (or a list of them)" if many else wanted
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        raise typer.BadParameter(f"{path}: {key} must be {wanted}, got {shown}")
    return value


def _toml_defaults(path: Path, data: dict[str, Any], command: str, own: Any, commands: dict[str, Any]) -> dict:
    """The defaults ``data`` gives ``command``; a key or table no command knows is an error for every command."""
    known = _flag_to_param(own)
    params = {param.name: param for param in own.params}
    defaults, unknown = {}, []
    for key, item in data.items():
        if isinstance(item, dict):
            if commands and key not in commands:
                raise typer.BadParameter(f"{path}: unknown table [{key}] (tables: "
                                         f"{', '.join('[' + c + ']' for c in sorted(commands))})")
            if key == command or not commands:
                continue
            # Another command's table: not applied here, but a typo in it is still a typo.
            theirs = _flag_to_param(commands[key])
            bad = [k for k in item if theirs.get(k.replace("-", "_")) in (None, "config")]
            if bad:
                raise typer.BadParameter(f"{path}: unknown key(s) in [{key}]: "
                                         + ", ".join(_with_hint(k, theirs) for k in sorted(bad)))
            continue
        name = known.get(key.replace("-", "_"))
        if name is None or name == "config":
            unknown.append(_with_hint(key, known))
        else:
            defaults[name] = _typed(path, key, item, params[name])
    section = data.get(command, {})
    for key, item in (section.items() if isinstance(section, dict) else ()):
        name = known.get(key.replace("-", "_"))
        if name is None or name == "config":
            unknown.append(f"[{command}] {_with_hint(key, known)}")
        else:
            defaults[name] = _typed(path, f"[{command}] {key}", item, params[name])
    if unknown:
        raise typer.BadParameter(f"{path}: unknown key(s) for `llmcli {command}`: {', '.join(sorted(unknown))}")
    return defaults


def _with_hint(key: str, known: dict[str, str]) -> str:
    """``key``, with the closest known key when one is close (a typo)."""
    import difflib

    names = sorted(k.replace("_", "-") for k, param in known.items() if param != "config")
    match = difflib.get_close_matches(key.replace("_", "-"), names, n=1, cutoff=0.75)
    return f'{key} (did you mean "{match[0]}"?)' if match else key


def load_toml_defaults(ctx: typer.Context, value: Optional[Path]) -> Optional[Path]:
    """Eager callback: top-level keys and the command's own [table] become defaults that flags override."""
    if value is None or ctx.resilient_parsing:
        return value
    from llmcli.cli.text_files import TextFileError, read_text

    try:
        data = tomllib.loads(read_text(value, str(value)))
    except TextFileError as exc:
        raise typer.BadParameter(str(exc)) from None
    except tomllib.TOMLDecodeError as exc:
        raise typer.BadParameter(f"cannot read {value}: {exc}") from None
    group = ctx.parent.command if ctx.parent is not None else None
    commands = dict(getattr(group, "commands", {}) or {})
    defaults = _toml_defaults(Path(value), data, ctx.info_name or "", ctx.command, commands)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


ConfigOption = Annotated[Optional[Path], typer.Option(
    "--config", help="TOML file of defaults (keys are flag names; a \\[generate], \\[bench] or \\[probe-memory] table "
                     "applies to that command only). Flags given on the command line win.",
    is_eager=True, callback=load_toml_defaults, exists=True, dir_okay=False, rich_help_panel=ENGINE_PANEL)]

TrustRemoteCodeOption = Annotated[bool, typer.Option(
    "--trust-remote-code", help="Accepted for vLLM's command lines; not needed: llmcli runs no code from the "
                                "model folder.", rich_help_panel=ENGINE_PANEL)]

ModelOption = Annotated[str, typer.Option(
    "--model", "-m", help="Model folder (config.json, *.safetensors, tokenizer) or Hugging Face hub id.",
    metavar="MODEL",
    rich_help_panel=ENGINE_PANEL, show_default=False)]


# -- scale-out (generate only; not Config fields: Config is one engine's knobs) --------
SCALE_OUT_PANEL = "Scale-out"


class DistributedBackend(str, enum.Enum):
    local = "local"
    ray = "ray"


DataParallelSizeOption = Annotated[int, typer.Option(
    "--data-parallel-size", "-dp", min=1, rich_help_panel=SCALE_OUT_PANEL,
    help="Engine replicas fed from this one input, each with its own --tensor-parallel-size ranks "
         "(on CUDA, replica r uses GPUs r*tp .. r*tp+tp-1).")]

DistributedBackendOption = Annotated[Optional[DistributedBackend], typer.Option(
    "--distributed-backend", rich_help_panel=SCALE_OUT_PANEL, show_default=False,
    help="Where the replicas run: local (processes on this machine) or ray (actors on a Ray cluster; "
         "pip install 'llmcli\\[ray]') \\[default: local, or ray with --ray-address].")]

RayAddressOption = Annotated[Optional[str], typer.Option(
    "--ray-address", rich_help_panel=SCALE_OUT_PANEL, show_default=False,
    help="Address of a running Ray cluster ('auto', or HOST:PORT of its head); implies --distributed-backend ray. "
         "Without it, the ray backend joins the cluster of RAY_ADDRESS or of `ray start` on this machine, "
         "else starts a Ray instance for this run alone.")]


def with_engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Adds --config, --model and every engine knob to a command; it receives them as ``engine``.

    ``engine`` is the keyword arguments for ``Config``: the model plus only the
    knobs that were set, so Config's own defaults stay the single source.
    """
    sig = inspect.signature(func, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "engine"]
    added = [
        inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=ConfigOption),
        inspect.Parameter("model", inspect.Parameter.KEYWORD_ONLY, default=..., annotation=ModelOption),
        inspect.Parameter("trust_remote_code", inspect.Parameter.KEYWORD_ONLY, default=False,
                          annotation=TrustRemoteCodeOption),
    ] + [_knob_parameter(k) for k in ENGINE_KNOBS]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("config", None)
        if kwargs.pop("trust_remote_code") and not kwargs.get("quiet"):
            print("note: --trust-remote-code is not needed: llmcli runs no code from the model folder",
                  file=sys.stderr)
        engine = {"model": kwargs.pop("model")}
        for knob in ENGINE_KNOBS:
            value = kwargs.pop(knob.param)
            if value is not None:
                engine[knob.name] = value.value if isinstance(value, enum.Enum) else value
        return func(*args, engine=engine, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + added)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + added}
    return wrapper


# -- generate's table input and whole-job constraints (cli/io/tables.py) ----------------------------------------
TABLE_PANEL = "Table input (Parquet, CSV, TSV, Arrow, saved datasets)"


class InputFormat(str, enum.Enum):
    auto = "auto"
    jsonl = "jsonl"
    parquet = "parquet"
    csv = "csv"
    tsv = "tsv"
    arrow = "arrow"
    hf = "hf"


def _column(help_text: str, flag: str) -> Any:
    return Annotated[Optional[str], typer.Option(flag, help=help_text, metavar="COLUMN", show_default=False,
                                                 rich_help_panel=TABLE_PANEL)]


InputFormatOption = Annotated[InputFormat, typer.Option(
    help="IN's format; auto: by its extension (.parquet, .csv, .tsv, .arrow; a folder by the parts it holds or a "
         "dataset saved with save_to_disk), else JSONL. hf: a saved dataset, or a folder of its data files.",
    rich_help_panel=TABLE_PANEL)]
PromptColumnOption = _column("The column holding each row's prompt text [default: prompt].", "--prompt-column")
MessagesColumnOption = _column("The column holding each row's conversation (a list of {role, content}, or its "
                               "JSON text) [default: messages].", "--messages-column")
IdColumnOption = _column("The column naming each row in OUT, kept as written (\"00123\" stays a string) "
                         "[default: id if the table has one, else the 0-based row index].", "--id-column")
SystemPromptOption = Annotated[Optional[str], typer.Option(
    help="A system message put before each row's prompt (which then runs as chat) or conversation.",
    show_default=False, rich_help_panel=TABLE_PANEL)]
SystemPromptFileOption = Annotated[Optional[Path], typer.Option(
    help="--system-prompt read from a UTF-8 text file.", exists=True, dir_okay=False, show_default=False,
    rich_help_panel=TABLE_PANEL)]
KeepColumnsOption = Annotated[Optional[str], typer.Option(
    help="Columns copied to each output row (a,b or all); one named like an output field (text, error, ...) "
         "is written as input_<name>.", metavar="COLUMNS", show_default=False, rich_help_panel=TABLE_PANEL)]
ChoiceOption = Annotated[Optional[str], typer.Option(
    help="Every completion is exactly one of these strings (a,b,c): the bare string, no quotes.",
    metavar="A,B,C", show_default=False, rich_help_panel="Sampling defaults (per-record fields override them)")]
RegexOption = Annotated[Optional[str], typer.Option(
    help="Every completion matches this regular expression, whole.", metavar="REGEX", show_default=False,
    rich_help_panel="Sampling defaults (per-record fields override them)")]


def split_list(value: str | None, flag: str) -> list[str] | None:
    """``a,b,c`` as its items (spaces around each dropped); a usage error when one is empty."""
    from llmcli.cli.usage_error import UsageError

    if value is None:
        return None
    items = [item.strip() for item in value.split(",")]
    if not all(items):
        raise UsageError(f"{flag} {value!r}: an empty item; give names separated by commas")
    return items


def system_prompt_of(text: Optional[str], path: Optional[Path]) -> Optional[str]:
    """The system prompt given as text or as a file (UsageError for both, or an unreadable file)."""
    from llmcli.cli.text_files import TextFileError, read_text
    from llmcli.cli.usage_error import UsageError

    if text is not None and path is not None:
        raise UsageError("--system-prompt and --system-prompt-file: give only one")
    if path is None:
        return text
    try:
        return read_text(path, f"--system-prompt-file {path}")
    except TextFileError as exc:
        raise UsageError(str(exc)) from None
