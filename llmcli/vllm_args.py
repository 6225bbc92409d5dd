"""vLLM's ``LLM(...)`` keyword arguments: mapped onto Config fields, accepted with a note, or refused with why."""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

from llmcli.config import Config, ConfigError

log = logging.getLogger("llmcli")

# vLLM name -> Config field, for arguments that mean the same thing under another name.
RENAMED = {"block_size": "kvcache_block_size", "num_gpu_blocks_override": "num_kvcache_blocks"}


@dataclass(frozen=True)
class Unused:
    """An argument with no effect here: ``fine`` are the values that change nothing (no note for those)."""

    why: str
    fine: tuple = (None, False)


@dataclass(frozen=True)
class Refused:
    """An argument llmcli cannot honour unless it has one of the ``fine`` values."""

    why: str
    fine: tuple = (None, False)


NO_EFFECT: dict[str, Unused] = {
    "trust_remote_code": Unused("llmcli runs no code from the model folder, so it is not needed"),
    "enable_chunked_prefill": Unused("llmcli always splits long prompts into chunks of max_num_batched_tokens",
                                     (None, True)),
    "swap_space": Unused("a preempted request is recomputed, never swapped to CPU memory", (None, 0, 4)),
    "disable_log_stats": Unused("llmcli's LLM logs no statistics", (None, False, True)),
    "max_seq_len_to_capture": Unused("CUDA graphs cover decode batches of every length"),
    "disable_custom_all_reduce": Unused("tensor parallelism uses torch.distributed's all-reduce"),
    "tokenizer_mode": Unused("llmcli loads the fast (tokenizers) tokenizer", (None, "auto", "hf", "slow")),
    "max_lora_rank": Unused("only with enable_lora, which is refused", (None, 16)),
    "compilation_config": Unused("llmcli compiles its own kernels", (None, 0, 3, {})),
    "distributed_executor_backend": Unused("tensor parallelism runs llmcli's own worker processes",
                                           (None, "mp")),
    "max_logprobs": Unused("llmcli returns up to 20 logprobs per position", (None, 20)),
    "download_dir": Unused("hub models go to the Hugging Face cache"),
    "served_model_name": Unused("no server runs"),
    "enable_sleep_mode": Unused("no sleep mode", (None, False)),
    "disable_async_output_proc": Unused("outputs are always processed while the next step runs"),
    "limit_mm_per_prompt": Unused("llmcli runs text-only models", (None, {})),
    "hf_token": Unused("hub downloads read the token from the environment (HF_TOKEN)"),
    "model_impl": Unused("llmcli runs its own implementation of every model", (None, "auto")),
}

REFUSED: dict[str, Refused] = {
    "revision": Refused("pinned revisions are not supported; download that revision and pass its folder",
                        (None, "main")),
    "tokenizer_revision": Refused("pinned tokenizer revisions are not supported; pass the tokenizer's folder "
                                  "as tokenizer=", (None, "main")),
    "code_revision": Refused("llmcli runs no code from the model folder"),
    "enable_lora": Refused("LoRA adapters are not supported; merge the adapter into the weights first"),
    "pipeline_parallel_size": Refused("pipeline parallelism is not supported; use tensor_parallel_size",
                                      (None, 1)),
    "data_parallel_size": Refused("LLM holds one engine; run data-parallel replicas with `llmcli generate "
                                  "--data-parallel-size N`", (None, 1)),
    "enable_expert_parallel": Refused("experts are split by tensor parallelism; expert parallelism is not "
                                      "supported"),
    "cpu_offload_gb": Refused("weights cannot be offloaded to CPU memory", (None, 0)),
    "skip_tokenizer_init": Refused("llmcli needs the tokenizer (stop strings, EOS, texts)"),
    "hf_overrides": Refused("config.json is read as it is; edit a copy of the model folder", (None, {})),
    "runner": Refused("llmcli runs generative models only", (None, "auto", "generate")),
    "task": Refused("llmcli runs generative models only", (None, "auto", "generate")),
    "logprobs_mode": Refused("logprobs are the raw model's (vLLM's raw_logprobs)", (None, "raw_logprobs")),
    "speculative_config": Refused("speculative decoding is not supported"),
    "tokenizer_pool_size": Refused("the tokenizer runs in the engine's process", (None, 0)),
}


def _same(value: Any, fine: tuple) -> bool:
    return any(value is f or (type(value) is type(f) and value == f) for f in fine)


def config_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The Config fields for ``LLM(**kwargs)`` written with vLLM's names; logs one note per argument that
    changes nothing here and raises ConfigError, naming the argument and why, for one llmcli cannot honour."""
    knobs = set(Config.knob_names())
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in REFUSED:
            rule = REFUSED[name]
            if not _same(value, rule.fine):
                raise ConfigError(f"LLM({name}={value!r}): {rule.why}")
        elif name in NO_EFFECT:
            rule = NO_EFFECT[name]
            if not _same(value, rule.fine):
                log.warning("LLM(%s=%r) is accepted and has no effect: %s", name, value, rule.why)
        elif name in RENAMED:
            if value is not None:
                out[RENAMED[name]] = value
        elif name == "kv_cache_memory_bytes":
            if value is not None:
                out["kv_cache_memory_gib"] = value / (1 << 30)
        elif name == "seed" and value is None:
            # vLLM: no fixed seed, so unseeded requests differ from run to run
            out["seed"] = random.SystemRandom().randrange(1 << 31)
            log.warning("LLM(seed=None): requests without a seed of their own use seed %d this run", out["seed"])
        elif name in knobs:
            if value is not None:  # vLLM's callers pass None for "the default" (every None field defaults to it)
                out[name] = value
        else:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}; the engine arguments are "
                            f"{', '.join(sorted(knobs))}, and vLLM's names listed in docs/python-api.md")
    return out
