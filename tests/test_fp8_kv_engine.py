"""The FP8 KV cache in the engine: the pool holds twice the blocks of bf16, and a trained model's numbers move
only by e4m3's rounding of the cached keys and values (torch backend on CPU, the reference)."""
from __future__ import annotations

import orjson
import torch
from typer.testing import CliRunner

from tiny_qwen3 import training_corpus

from llmcli import LLM, SamplingParams
from llmcli.cli.app import app

runner = CliRunner()

# Teacher-forced log-likelihood of in-distribution text, per token, against the float32 cache: e4m3 keeps 3
# mantissa bits (relative rounding <= 2^-4 per cached element). Measured on the trained model below (mean
# logprob -0.51): largest change 0.16 nats (a probability ratio of 1.17), mean 0.009, the 149 tokens' total
# 0.04 of 76 nats; greedy tokens identical. The bounds allow about twice that: a per-token probability ratio
# within e^0.3 = 1.35, a mean within 0.02 nats.
MAX_LOGPROB_DIFF = 0.3
MEAN_LOGPROB_DIFF = 0.02


def probe(model, *extra: str) -> dict:
    result = runner.invoke(app, ["probe-memory", "--model", str(model), "--device", "cpu", "--dtype", "bfloat16",
                                 "--kv-cache-memory-gib", "0.01", "--kvcache-block-size", "16", "--json", *extra])
    assert result.exit_code == 0, result.output
    return orjson.loads(result.stdout)


def test_probe_memory_shows_twice_the_blocks_with_fp8(tiny_model):
    bf16, fp8 = probe(tiny_model), probe(tiny_model, "--kv-cache-dtype", "fp8")
    assert fp8["kv_bytes_per_token"] * 2 == bf16["kv_bytes_per_token"]
    assert fp8["num_blocks"] == 2 * bf16["num_blocks"] > 0
    assert fp8["kv_cache_dtype"] == "float8_e4m3fn" and bf16["kv_cache_dtype"] == "bfloat16"


def logprobs_and_tokens(model, kv_cache_dtype: str):
    text = " ".join(training_corpus()[:6])
    kwargs = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64,
                  max_num_batched_tokens=16, max_num_seqs=4, max_model_len=512, enforce_eager=True,
                  kv_cache_dtype=kv_cache_dtype)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"][:150]
    with LLM(str(model), **kwargs) as llm:
        # 16-token chunks: every chunk after the first reads the ones before it from the (FP8) cache
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0))[0]
    lp = torch.tensor([out.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))])
    return lp, out.outputs[0].token_ids


def test_fp8_kv_cache_stays_close_on_a_trained_model(trained_tiny_model):
    ref_lp, ref_tokens = logprobs_and_tokens(trained_tiny_model, "auto")
    lp, tokens = logprobs_and_tokens(trained_tiny_model, "fp8")
    assert ref_lp.mean() > -2.5, f"the model did not learn the corpus (mean logprob {ref_lp.mean():.2f})"
    diff = (lp - ref_lp).abs()
    assert diff.max() <= MAX_LOGPROB_DIFF and diff.mean() <= MEAN_LOGPROB_DIFF, (diff.max(), diff.mean())
    assert diff.max() > 0, "no difference at all: the cache is not FP8"
    print(f"FP8 KV cache vs float32: teacher-forced logprob diff max {diff.max():.4f} mean {diff.mean():.5f}")
    assert tokens == ref_tokens


def test_flash_attn_refuses_an_fp8_cache_by_name(tiny_model):
    import pytest

    from llmcli.config import Config, ConfigError

    with pytest.raises(ConfigError, match=r"attention_backend='flash-attn'.*16-bit KV caches only.*'triton'"):
        Config(str(tiny_model), device="cpu", attention_backend="flash-attn", kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp16': must be one of auto, fp8"):
        Config(str(tiny_model), device="cpu", kv_cache_dtype="fp16")
