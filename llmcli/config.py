"""Config: every engine knob in one validated dataclass."""
from __future__ import annotations

import importlib.util
import logging
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

DEVICES = ("auto", "cuda", "cpu")
DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
          "float": torch.float32}
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
GENERATION_CONFIGS = ("auto", "ignore", "vllm")  # "vllm": vLLM's name for "ignore" (its own neutral defaults)
# Upper ends of the size knobs (README, reliability): past them host arrays, block ids (int32) or the
# pool's size in bytes overflow, or the warm-up allocates more than any machine has.
MAX_STATE_SNAPSHOTS = 1 << 16
MAX_SIZES = {"max_num_batched_tokens": 1 << 24, "max_num_seqs": 1 << 16, "tensor_parallel_size": 1 << 10,
             "kvcache_block_size": 1 << 16, "max_model_len": 1 << 24, "num_kvcache_blocks": (1 << 31) - 1}
MAX_KV_CACHE_GIB = float(1 << 20)
# Tokens per KV block when kvcache_block_size is left unset. The prefix cache shares whole blocks, so a shared
# instruction shorter than a block is never shared: 64 shares 192 of a 200-token one (256 shares none), and
# costs nothing measurable on decode (H200, 2026-12-03, issue 45: Qwen3-8B 9,584 vs 9,591 output tok/s at 256).
# A backend may need another (its ``default_block_size``; flash-attn: 256) and rules of its own
# (``block_size_problem``): the backend classes own both, read here through ``kernels.backend_class``.
DEFAULT_KVCACHE_BLOCK_SIZE = 64

log = logging.getLogger("llmcli")

# Every numeric LLMCLI_* environment variable, parsed here (``env_number``) and checked at once by the CLI's
# start-up (``check_environment``): a bad value is one line naming it, not a traceback mid-run.
# name -> (type, least value, what it is)
ENV_NUMBERS: dict[str, tuple[type, float, str]] = {
    "LLMCLI_CHECK_AHEAD": (int, 1, "records prepared before the first token"),
    "LLMCLI_MASK_THREADS": (int, 1, "threads filling structured-output masks"),
    "LLMCLI_TP_SHM_MIB": (int, 1, "MiB of the tensor-parallel shared-memory payload"),
    "LLMCLI_TP_HEARTBEAT_S": (float, 0, "seconds a silent tensor-parallel rank is waited for"),
    "LLMCLI_TP_TIMEOUT_S": (float, 0, "seconds a tensor-parallel collective may take"),
    "LLMCLI_TP_EXIT_GRACE_S": (float, 0, "seconds tensor-parallel workers get to exit"),
    "LLMCLI_DP_START_TIMEOUT_S": (float, 0, "seconds a data-parallel replica may take to start"),
    "LLMCLI_DP_HEARTBEAT_S": (float, 0, "seconds a silent data-parallel replica is waited for"),
    "LLMCLI_TEMPLATE_TIMEOUT_S": (float, 0, "seconds a chat template may take to render"),
    "LLMCLI_PROGRESS_INTERVAL_S": (float, 0, "seconds between progress lines when stderr is not a terminal"),
}


class EnvError(ValueError):
    """An LLMCLI_* environment variable has a value llmcli cannot use; the message names it."""


def env_number(name: str, default: float) -> Any:
    """The value of the numeric variable ``name`` (one of ENV_NUMBERS), or ``default`` when it is unset."""
    kind, least, what = ENV_NUMBERS[name]
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    strict = kind is float  # seconds must be above 0; counts at least their least value
    if value is None or (kind is float and not math.isfinite(value)) or value < least or (strict and value == least):
        wanted = "a whole number" if kind is int else "a number"
        bound = f"above {least:g}" if strict else f"at least {least:g}"
        raise EnvError(f"environment variable {name}={raw!r}: must be {wanted} {bound} ({what}); fix or unset it")
    return value


def check_environment() -> None:
    """Raise EnvError for the first LLMCLI_* variable set to a value llmcli cannot use."""
    for name in ENV_NUMBERS:
        env_number(name, 0)


# "auto": the model dtype; "fp8" (vLLM also spells it "fp8_e4m3"): e4m3 with a per-layer k and v scale
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


class ConfigError(ValueError):
    """An engine setting is invalid; the message names the field and what to do."""


# ``attention_backend="auto"`` on CUDA: the backend measured fastest, by a rule keyed by (compute capability
# major, head dim), each entry with the measurement behind it. A GPU generation or head size nobody measured
# gets llmcli's own Triton kernels, the backend every GPU session tests; flash-attn is chosen only where it was
# measured faster, is installed and suits the KV block size. It stays selectable by name wherever it runs.
MEASURED_BACKENDS: dict[tuple[int, int], str] = {
    # H200 (sm_90), Qwen3-0.6B and Qwen3-8B (head dim 128), the default bench (256 requests, in/out 100-1024,
    # bf16), 2026-12-02, issue 28: flash-attn 22,881 vs triton 26,028 output tok/s on 0.6B (-12%), 8,876 vs
    # 9,749 on 8B (-9%). benchmarks/real_path_gpu.py re-measures both with the flash-attn wheel installed.
    (9, 128): "triton",
}
UNMEASURED_BACKEND = "triton"


def fastest_backend(capability: tuple[int, int], head_dim: int, flash_available: bool,
                    block_size: int | None) -> str:
    """'triton' or 'flash-attn' for a GPU of ``capability`` and a model of ``head_dim`` (``block_size`` None:
    unset, so the backend may choose its own)."""
    from llmcli.kernels import backend_class

    choice = MEASURED_BACKENDS.get((capability[0], head_dim), UNMEASURED_BACKEND)
    if choice == "flash-attn" and (not flash_available or (
            block_size is not None and backend_class(choice).block_size_problem(block_size))):
        return "triton"
    return choice


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


_said: set[str] = set()


def _say_once(message: str) -> None:
    """A note about a choice made for the user, logged once per process (data-parallel replicas each start one)."""
    if message not in _said:
        _said.add(message)
        log.warning(message)


@dataclass
class Config:
    """Engine configuration. ``LLM(model, **kwargs)`` takes these fields as keyword arguments."""

    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 1024
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int | None = None  # None: DEFAULT_KVCACHE_BLOCK_SIZE, or 256 for flash-attn
    num_kvcache_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    enable_prefix_caching: bool = True
    # hybrid models: slots of linear-attention state snapshots that let prefix hits skip tokens (None: auto, 0: off)
    num_state_snapshots: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    tokenizer: str | None = None
    generation_config: str = "auto"  # "auto": generation_config.json's sampling values fill unset fields
    mixed_steps: bool = True  # decode rows ride along with prompt chunks in one step (False: prefill first)
    sample_in_graph: bool = True  # CUDA: the decode graph also holds the lm_head and the one-pass sampler
    kv_cache_dtype: str = "auto"  # "fp8": the KV pool in float8_e4m3fn (half the bytes of bf16)
    quantization: str | None = None  # "fp8": a 16-bit checkpoint's linear weights in FP8 (FP8 checkpoints: found)

    # Filled in by __post_init__ (not user knobs).
    hf_config: Any = field(default=None, repr=False)
    model_path: Path | None = field(default=None, repr=False)
    torch_dtype: torch.dtype | None = field(default=None, repr=False)
    kv_torch_dtype: torch.dtype | None = field(default=None, repr=False)  # the KV pool's element type
    quant_config: Any = field(default=None, repr=False)  # layers.quantization.QuantConfig, or None: 16-bit weights
    eos_token_ids: list[int] = field(default_factory=list, repr=False)
    sampling_defaults: dict[str, Any] = field(default_factory=dict, repr=False)  # empty with "ignore"

    def __post_init__(self) -> None:
        from llmcli.models.hub import (load_generation_defaults, load_generation_eos, load_hf_config,
                                       resolve_model_path)

        self._check_simple_fields()
        if self.generation_config == "vllm":
            self.generation_config = "ignore"
        self.device = self._resolve_device()
        self._check_host_memory()
        self.attention_backend = self._resolve_backend()
        if self.attention_backend != "auto":
            self._check_block_size()
        self._check_tensor_parallel()
        self.model_path = resolve_model_path(self.model, need_weights=self.load_format != "dummy")
        self.hf_config = load_hf_config(self.model_path)
        if self.attention_backend == "auto":  # the rule needs the model's head size
            self.attention_backend = self._fastest_backend()
            self._check_block_size()
        self.eos_token_ids = load_generation_eos(self.model_path, self.hf_config)
        if self.generation_config == "auto":
            self.sampling_defaults = load_generation_defaults(self.model_path)
        self.torch_dtype = self._resolve_dtype()
        self.kv_torch_dtype = KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype
        self.quant_config = self._resolve_quantization()
        self._check_model_len()

    # -- validation ---------------------------------------------------------
    def _fail(self, name: str, why: str) -> ConfigError:
        return ConfigError(f"Config.{name}={getattr(self, name)!r}: {why}")

    def _check_simple_fields(self) -> None:
        positive = ("max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise self._fail(name, "must be a positive integer")
        for name in ("max_model_len", "num_kvcache_blocks", "kvcache_block_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise self._fail(name, "must be a positive integer or None (derived automatically)")
        snapshots = self.num_state_snapshots
        if snapshots is not None and (not isinstance(snapshots, int) or isinstance(snapshots, bool)
                                      or not 0 <= snapshots <= MAX_STATE_SNAPSHOTS):
            raise self._fail("num_state_snapshots", f"must be an integer from 0 (no snapshots: a hybrid model "
                                                    f"computes every prompt token) to {MAX_STATE_SNAPSHOTS}, or None "
                                                    "(sized from max_num_seqs)")
        for name, most in MAX_SIZES.items():
            value = getattr(self, name)
            if value is not None and value > most:
                raise self._fail(name, f"must be an integer from 1 to {most}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise self._fail("gpu_memory_utilization", "must be in (0, 1], the share of device memory llmcli may use")
        if self.kv_cache_memory_gib is not None and not (math.isfinite(self.kv_cache_memory_gib)
                                                         and 0 < self.kv_cache_memory_gib <= MAX_KV_CACHE_GIB):
            raise self._fail("kv_cache_memory_gib", f"must be a positive number of GiB, at most {MAX_KV_CACHE_GIB:.0f}")
        if self.device not in DEVICES:
            raise self._fail("device", f"must be one of {', '.join(DEVICES)}")
        if self.dtype not in DTYPES:
            raise self._fail("dtype", f"must be one of {', '.join(DTYPES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise self._fail("attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)}")
        if self.quantization not in (None, "fp8"):
            raise self._fail("quantization", "must be 'fp8' or None (the checkpoint's own format)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise self._fail("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise self._fail("load_format", f"must be one of {', '.join(LOAD_FORMATS)}")
        if self.generation_config not in GENERATION_CONFIGS:
            raise self._fail("generation_config", "must be 'auto' (use generation_config.json's sampling values "
                                                  "for fields a request leaves unset) or 'ignore' (or vLLM's "
                                                  "name for it, 'vllm')")
        for name in ("mixed_steps", "sample_in_graph"):
            if not isinstance(getattr(self, name), bool):
                raise self._fail(name, "must be true or false")
        if not isinstance(self.seed, int):
            raise self._fail("seed", "must be an integer")

    def _check_host_memory(self) -> None:
        """On CPU the pool is host memory: more than the machine has is known before anything loads."""
        if self.device != "cpu" or self.kv_cache_memory_gib is None:
            return
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return
        if self.kv_cache_memory_gib * (1 << 30) > total:
            raise self._fail("kv_cache_memory_gib", f"this machine has {total / (1 << 30):.2f} GiB of memory; "
                                                    "ask for less")

    def _resolve_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise self._fail("device", "no CUDA device is visible to PyTorch; use device='cpu' or 'auto'")
        return self.device

    def _resolve_backend(self) -> str:
        backend = self.attention_backend
        fp8_kv = KV_CACHE_DTYPES[self.kv_cache_dtype] is not None
        if backend == "auto":
            return "torch" if self.device == "cpu" else "auto"
        if backend == "flash-attn" and KV_CACHE_DTYPES.get(self.kv_cache_dtype) is not None:
            raise self._fail("attention_backend", "flash-attn reads 16-bit KV caches only; with "
                                                  "kv_cache_dtype='fp8' use 'triton' (or 'auto')")
        if backend == "flash-attn":
            if self.device != "cuda":
                raise self._fail("attention_backend", "flash-attn runs on CUDA only; use 'torch' on CPU")
            if not flash_attn_available():
                raise self._fail("attention_backend", "flash_attn is not installed; pip install 'llmcli[flash]' or use 'triton'")
        if backend == "triton" and self.device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise self._fail("attention_backend", "triton kernels need a CUDA device (or TRITON_INTERPRET=1 for testing)")
        return backend

    def _fastest_backend(self) -> str:
        cfg = self.hf_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # the flash-attn build llmcli runs reads 16-bit caches only
        flash = flash_attn_available() and KV_CACHE_DTYPES[self.kv_cache_dtype] is None
        return fastest_backend(torch.cuda.get_device_capability(), head_dim, flash, self.kvcache_block_size)

    def _check_block_size(self) -> None:
        from llmcli.kernels import backend_class

        backend = backend_class(self.attention_backend)
        if self.kvcache_block_size is None:  # unset: the backend's own size, else the engine's
            self.kvcache_block_size = backend.default_block_size or DEFAULT_KVCACHE_BLOCK_SIZE
            if backend.default_block_size:
                _say_once(f"the {backend.name} backend uses KV blocks of {backend.default_block_size} tokens (its "
                          f"kernels need them); other backends default to {DEFAULT_KVCACHE_BLOCK_SIZE}, which "
                          "shares shorter prompt prefixes")
        problem = backend.block_size_problem(self.kvcache_block_size)
        if problem:
            raise self._fail("kvcache_block_size", problem)

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        available = torch.cuda.device_count() if self.device == "cuda" else (os.cpu_count() or 1)
        if tp > available:
            where = "CUDA devices" if self.device == "cuda" else "CPU cores"
            raise self._fail("tensor_parallel_size", f"only {available} {where} are present")

    def _resolve_dtype(self) -> torch.dtype:
        chosen = DTYPES[self.dtype]
        if chosen is not None:
            if self.device == "cpu" and chosen is torch.float16:
                raise self._fail("dtype", "float16 is not supported on CPU; use float32 or bfloat16")
            return chosen
        if self.device == "cpu":
            return torch.float32
        native = getattr(self.hf_config, "torch_dtype", None) or getattr(self.hf_config, "dtype", None)
        if isinstance(native, str):
            native = DTYPES.get(native)
        return native if native in (torch.float16, torch.bfloat16) else torch.bfloat16

    def _resolve_quantization(self) -> Any:
        from dataclasses import replace

        from llmcli.models.hub import QuantizationError, load_quant_config

        try:
            quant = load_quant_config(self.hf_config, self.quantization)
        except QuantizationError as exc:
            raise self._fail("quantization", f"{self.model_path}/{exc}") from None
        if quant is not None and quant.source == "mxfp4":  # gpt-oss's experts: 4-bit on CUDA, dequantized on CPU
            from llmcli.models.hub import mxfp4_split_problem

            problem = self.device == "cuda" and mxfp4_split_problem(self.hf_config, self.tensor_parallel_size)
            if problem:
                raise self._fail("tensor_parallel_size", f"{self.model_path}/config.json: {problem}")
            return None if self.load_format == "dummy" else quant  # random weights: the model builds them
        if quant is not None and self.load_format == "dummy":  # random weights: every linear layer made FP8
            quant = replace(quant, source="online")
        return quant

    def _check_model_len(self) -> None:
        from llmcli.models.hub import supported_positions

        try:  # architecture and rotary: refused here, before any worker starts or weight loads
            limit = supported_positions(self.hf_config, None)
        except ValueError as exc:
            raise self._fail("model", str(exc)) from None
        if self.max_model_len is None:
            self.max_model_len = min(limit or 4096, 40960)
        elif limit is not None and self.max_model_len > limit:
            stretched = limit != getattr(self.hf_config, "max_position_embeddings", limit)
            raise self._fail("max_model_len", f"the model allows at most {limit} positions (max_position_"
                                              f"embeddings{' times its rope scaling factor' if stretched else ''})")
        try:  # what depends on the length too (a sliding window)
            supported_positions(self.hf_config, self.max_model_len)
        except ValueError as exc:
            raise self._fail("model", str(exc)) from None

    @classmethod
    def knob_names(cls) -> list[str]:
        """The user-facing field names (what ``LLM(**kwargs)`` accepts)."""
        derived = {"hf_config", "model_path", "torch_dtype", "kv_torch_dtype", "quant_config", "eos_token_ids",
                   "sampling_defaults"}
        return [f.name for f in fields(cls) if f.name not in derived and f.name != "model"]
