"""On CPU, before anything large is allocated: do the weights, the activations and a minimal KV pool fit in the
memory this process may use? Refused in one line with both numbers, instead of an OOM kill minutes later.

The weights are counted from config.json's sizes (within a fraction of a percent); the
activations are estimated from a prefill step of ``max_num_batched_tokens`` tokens; the minimal KV pool is one
sequence of ``max_model_len`` tokens, or the planned pool when that is smaller. What is available is the least
of the machine's available memory (``MemAvailable``), the cgroup's limit less its usage (containers, systemd
slices) and the address-space limit (``ulimit -v``) less what the process maps already.
``LLMCLI_MEMORY_CHECK=0`` skips the check.
"""
from __future__ import annotations

import math
import os
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

from llmcli.config import Config
from llmcli.engine.kv_cache import CPU_DEFAULT_KV_GIB, kv_bytes_per_token

GIB = 1 << 30
CGROUP_ROOT = Path("/sys/fs/cgroup")


class HostMemoryTooSmall(RuntimeError):
    """The model cannot run in the memory this process may use; the message has both numbers and what to do."""


@dataclass
class HostNeed:
    """Bytes a CPU engine needs at the least."""

    weights: int
    activations: int
    kv_pool: int
    kv_tokens: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.kv_pool


def check_host_memory(config: Config) -> None:
    """Raise HostMemoryTooSmall when ``config``'s model cannot fit; a no-op off CPU or with LLMCLI_MEMORY_CHECK=0."""
    if config.device != "cpu" or os.environ.get("LLMCLI_MEMORY_CHECK", "1") == "0":
        return
    available = available_host_memory()
    if available is None:
        return
    have, where = available
    need = host_need(config)
    if need.total <= have:
        return
    fixes = ["a smaller model"]
    if config.torch_dtype == torch.float32:
        fixes.append("--dtype bfloat16 (half the weights)")
    if need.activations > need.weights // 4:
        fixes.append("a lower --max-num-batched-tokens")
    if need.kv_pool > need.weights // 4:
        fixes.append("a lower --max-model-len")
    name = Path(str(config.model)).name or str(config.model)  # a hub id: its name, not the cache folder
    raise HostMemoryTooSmall(
        f"{name} does not fit in memory on CPU: it needs at least {_gib(need.total)} (weights {_gib(need.weights)}, "
        f"activations {_gib(need.activations)}, KV cache for {need.kv_tokens:,} tokens {_gib(need.kv_pool)}) but "
        f"{_gib(have)} is available ({where}); try {', or '.join(fixes)}, or a GPU "
        "(LLMCLI_MEMORY_CHECK=0 skips this check)")


def host_need(config: Config) -> HostNeed:
    """What ``config``'s engine allocates on CPU at the least (see the module docstring)."""
    hf = config.hf_config
    weights = _weight_bytes(config)
    size = config.torch_dtype.itemsize
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    experts = getattr(hf, "num_experts_per_tok", 0) or 0
    mlp = (getattr(hf, "moe_intermediate_size", 0) or 0) * experts or getattr(hf, "intermediate_size", 0) or 0
    # per token of a prefill step: the residual stream and a normed copy, q/k/v, the attention output, gate/up
    # and their product (a floor: temporaries come and go)
    per_token = size * (3 * hf.hidden_size + (2 * heads + 2 * kv_heads) * head_dim + 3 * mlp)
    tokens = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
    rows = min(config.max_num_seqs, tokens)
    activations = tokens * per_token + rows * hf.vocab_size * 4 * 2  # float32 logits and the sampler's copy
    kv_per_token = kv_bytes_per_token(hf, kv_heads, head_dim, config.kv_torch_dtype)
    bs = config.kvcache_block_size
    one_seq = math.ceil(config.max_model_len / bs) * bs
    if config.num_kvcache_blocks is not None:
        planned = config.num_kvcache_blocks * bs
    else:
        gib = config.kv_cache_memory_gib or CPU_DEFAULT_KV_GIB
        planned = min(int(gib * GIB) // (kv_per_token * bs) * bs, config.max_num_seqs * one_seq)
    kv_tokens = max(bs, min(one_seq, planned))
    return HostNeed(weights, activations, kv_tokens * kv_per_token, kv_tokens)


def _weight_bytes(config: Config) -> int:
    """The model's parameters from config.json's sizes (biases and norms left out: a fraction of a percent).

    Not by building the model on PyTorch's meta device: its ops import torch.compile's machinery, seconds of
    start-up that llmcli otherwise never pays (tests/test_startup.py)."""
    hf = config.hf_config
    hidden, vocab, layers = hf.hidden_size, hf.vocab_size, hf.num_hidden_layers
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hidden // heads
    attention = hidden * (2 * heads + 2 * kv_heads) * head_dim
    dense = 3 * hidden * (getattr(hf, "intermediate_size", 0) or 0)  # none in an all-MoE config (Qwen3.5-MoE)
    experts = getattr(hf, "num_experts", 0) or 0
    expert_size = getattr(hf, "moe_intermediate_size", 0) or 0
    if experts and not expert_size:  # gpt-oss: every layer's MLP is experts of intermediate_size
        expert_size = getattr(hf, "intermediate_size", 0) or 0
    sparse = experts * 3 * hidden * expert_size + hidden * experts
    dense_only = set(getattr(hf, "mlp_only_layers", None) or ())
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    mlps = sum(sparse if experts and i not in dense_only and (i + 1) % step == 0 else dense for i in range(layers))
    embeddings = vocab * hidden * (1 if getattr(hf, "tie_word_embeddings", False) else 2)
    return (embeddings + layers * attention + mlps) * config.torch_dtype.itemsize


def available_host_memory() -> tuple[int, str] | None:
    """(bytes this process may still allocate, what limits it), or None when nothing could be read."""
    found: list[tuple[int, str]] = []
    meminfo = _meminfo()
    if "MemAvailable" in meminfo:
        found.append((meminfo["MemAvailable"], "available memory"))
    cgroup = _cgroup_room()
    if cgroup is not None:
        found.append((cgroup, "the cgroup's memory limit"))
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        mapped = _status_bytes("VmSize")
        found.append((max(0, limit - mapped), "the address-space limit, ulimit -v"))
    return min(found) if found else None


def _meminfo() -> dict[str, int]:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _status_bytes(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cgroup_room() -> int | None:
    """The cgroup's memory limit less its usage (v2, else v1), or None without a limit."""
    try:  # v2: "0::/path" (in a container whose cgroup namespace is its own, "0::/")
        own = next((line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.startswith("0::")), "/")
    except OSError:
        own = "/"
    for limit_file, usage_file in ((f"{own.strip('/')}/memory.max", f"{own.strip('/')}/memory.current"),
                                   ("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (CGROUP_ROOT / limit_file.lstrip("/")).read_text().strip()
            usage = int((CGROUP_ROOT / usage_file.lstrip("/")).read_text().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:  # "max", or v1's "no limit" (a huge number)
            return None
        return max(0, int(limit) - usage)
    return None


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB // 10 else f"{n / (1 << 20):.0f} MiB"
