"""End to end on a GPU in bfloat16: llmcli (triton, torch and, when installed, flash-attn backends) against transformers.

A random-weight Qwen3-0.6B checkpoint (the published config, weights drawn
here) is written as safetensors; 16 prompts x 64 greedy tokens are compared. The same
for Llama-3.2-1B (llama3 rope scaling, no q/k norm: the fused kernel's rotary-only
form, tied embeddings): ``-k Llama`` runs that one alone; and for Qwen3-30B-A3B cut to
4 layers (layer 1 dense), the fused MoE kernel's bf16 agreement: ``-k A3B``.

The newer families, each cut to a few layers of its published config at the real head sizes (``OVERRIDES``
says what each keeps): Qwen3.5-9B (Gated DeltaNet and gated attention, ``-k Qwen3.5``), gemma-3-12b-it
(``-k gemma-3``), gpt-oss-20b with 16-bit experts and with MXFP4 ones (``-k gpt-oss``; ``-k mxfp4`` the latter),
gemma-4-31B (``-k gemma-4``). The multimodal configs are written as their text models. Gemma's prompts run to
1,400 tokens, past its 1,024-key window. transformers has no sdpa path for gpt-oss: its reference there is
SDPA with the sink as an extra key (``_sdpa_with_sinks``), its control eager as for the rest.
Time on an H200 (estimated, not yet measured): the checkpoint ~5-10 s, four transformers loads ~15 s, its greedy
decoding ~1 ms a layer plus ~5 ms a step, three llmcli engines ~10 s each plus their first Triton compiles
(fla's autotuning for Qwen3.5); about 100 s a case at 8 prompts, 20 s more at 16. So these take 8 prompts: the
four fit one 8-minute call (``gpu_session.sh e2e-new``), the MXFP4 case ~1.5 min more.

Random weights make bf16 near-ties common (about a fifth of transformers' own
greedy steps have two logits within 2% of the largest), and free-running
greedy decoding turns one flipped tie into a different continuation, so every
token after it counts as a mismatch. The test therefore measures two ways:

* teacher-forced: at each of the prompts x 64 positions, llmcli's greedy token
  given transformers' own prefix; this must match on >= 95% of positions and
  every mismatch must be a near-tie in transformers' logits;
* free-running: position-by-position agreement of the two greedy outputs,
  reported next to transformers against itself (eager vs sdpa attention) as
  the control; each first divergence must be a near-tie.

Models with routed experts (Qwen3-30B-A3B, gpt-oss) replace the near-tie check by a float32 one: a router's
top-k flips where two experts nearly tie, and a flip moves the logits by whole units (gpt-oss-20b cut to two
layers: transformers' eager and sdpa agree on 85% of teacher-forced positions, 2026-12-04 call P1 in
benchmarks/RESULTS.md), so llmcli's bf16 must agree with transformers' float32 on its own prefixes at least as
often as transformers' bf16 does, less ``ROUTED_MARGIN``.

Skipped without CUDA.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from greedy_compare import (NOISE_SIGMAS, TIE_TOL, agreement, count_near_ties, gap_noise, non_tie_mismatches, regroup,
                            teacher_forced_prompts)
from tiny_qwen3 import write_random_published

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
NUM_PROMPTS, NEW_TOKENS, LONGEST = 16, 64, 700
# routed experts (the test's float32 criterion): llmcli's bf16 may agree with transformers' float32 this much less
# than transformers' own bf16 does (two standard deviations of a difference of two rates at ~90% over 512 positions)
ROUTED_MARGIN = 0.03
# a published config cut down to fit beside its engines (the 30B mixture of experts: 4 of its 48 layers); a
# multimodal wrapper is written as its text model alone, its layer_types cut to the first num_hidden_layers
OVERRIDES = {"Qwen3-30B-A3B": {"num_hidden_layers": 4, "mlp_only_layers": [1]},
             # 3 Gated DeltaNet layers (16 key / 32 value heads of 128) and the first gated full-attention one
             # (head dim 256, a quarter of it rotated)
             "Qwen3.5-9B": {"num_hidden_layers": 4},
             # five 1,024-key sliding layers (head dim 256) and the first global one (linear rope x8); untied: tied
             # random Gemma weights (embeddings x sqrt(hidden) on the way in) greedily repeat the last token
             "gemma-3-12b-it": {"num_hidden_layers": 6, "tie_word_embeddings": False},
             # a 128-key sliding layer and a full one (head dim 64, sinks), 32 experts top-4 with the clamped SwiGLU
             "gpt-oss-20b": {"num_hidden_layers": 2},
             # five 1,024-key sliding layers (16 KV heads of 256) and the first global one (4 KV heads of 512, K
             # = V, a quarter rotated): the real head dims, window and pattern. Hidden 5,376 -> 2,048 and the MLP
             # 21,504 -> 8,192 (8.7 GB -> 3.4 GB of weights; the kernels' head shapes are unchanged); untied as
             # Gemma 3 above
             "gemma-4-31B": {"num_hidden_layers": 6, "hidden_size": 2048, "intermediate_size": 8192,
                             "tie_word_embeddings": False}}
# other write_random_published arguments: gpt-oss's published MXFP4 experts (random codes and scales; llmcli's
# MXFP4 kernel against transformers on the same values dequantized to bf16); Gemma 4's final norm at gain 2, so
# that its logits (std ~1.8) stay in the near-linear part of the 30 * tanh(x / 30) soft cap (at 8 they would
# reach it, and the cap would squeeze the top logits' gaps into near-ties)
WRITE = {"gpt-oss-20b-mxfp4": {"mxfp4": True}, "gemma-4-31B": {"norm_gain": 2.0}}
# (prompts, longest prompt) where not (NUM_PROMPTS, LONGEST): 8 prompts for time (the module docstring);
# Gemma's to 1,400 tokens, so that some (2 of the 8: 1,320 and 1,375) run past its 1,024-key window
PROMPTS = {"Qwen3.5-9B": (8, LONGEST), "gpt-oss-20b": (8, LONGEST), "gpt-oss-20b-mxfp4": (8, LONGEST),
           "gemma-3-12b-it": (8, 1400), "gemma-4-31B": (8, 1400)}


# Issue #31 (blocked on device time): the MoE case has mismatches outside the noise band on the GPU (2026-12-03,
# call V in benchmarks/RESULTS.md: triton teacher-forced gap 1.125, flash-attn free-running gap 0.750); it stays
# here as a known failure, reported as XPASS once the fused MoE's bf16 agreement is fixed.
MOE_KNOWN_FAILURE = pytest.mark.xfail(reason="issue #31: fused MoE bf16 mismatches outside the noise band "
                                      "(benchmarks/RESULTS.md, 2026-12-03 call V)", strict=False)


@pytest.fixture(scope="module", params=["Qwen3-0.6B", "Llama-3.2-1B",
                                        pytest.param("Qwen3-30B-A3B", marks=MOE_KNOWN_FAILURE),
                                        "Qwen3.5-9B", "gemma-3-12b-it", "gpt-oss-20b", "gpt-oss-20b-mxfp4",
                                        "gemma-4-31B"])
def random_published(request, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """(checkpoint, prompts) of a random-weight published config."""
    name = request.param
    config = CONFIGS / name.removesuffix("-mxfp4") / "config.json"
    out = write_random_published(config, tmp_path_factory.mktemp(f"{name}_random"),
                                 overrides=OVERRIDES.get(name.removesuffix("-mxfp4")), **WRITE.get(name, {}))
    torch.cuda.empty_cache()
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    return out, _prompts(vocab, *PROMPTS.get(name, (NUM_PROMPTS, LONGEST)))


def _prompts(vocab: int, count: int = NUM_PROMPTS, longest: int = LONGEST) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(8, longest))] for _ in range(count)]


def _sdpa_with_sinks(module, query, key, value, attention_mask, scaling, dropout=0.0, s_aux=None, **kwargs):
    """gpt-oss's attention through torch's SDPA (transformers runs gpt-oss with eager, flex or Hub kernels only):
    the sink is one more key and value of zeros whose score is the sink logit, put there by the additive mask."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    b, h, q, d = query.shape
    zeros = key.new_zeros(b, h, 1, d)
    mask = attention_mask[..., :key.shape[2]].to(query.dtype).expand(b, h, q, -1)  # eager_mask's: never None
    mask = torch.cat([mask, s_aux.to(query.dtype).view(1, h, 1, 1).expand(b, h, q, 1)], dim=-1)
    out = torch.nn.functional.scaled_dot_product_attention(query, torch.cat([key, zeros], 2),
                                                           torch.cat([value, zeros], 2), attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _hf_model(path: Path, attn: str = "sdpa", dtype: torch.dtype = torch.bfloat16):
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM, Mxfp4Config
    from transformers.masking_utils import eager_mask

    config = json.loads((path / "config.json").read_text())
    if attn == "sdpa" and config["model_type"] == "gpt_oss":
        AttentionInterface.register("sink_column", _sdpa_with_sinks)
        AttentionMaskInterface.register("sink_column", eager_mask)
        attn = "sink_column"  # a name without "sdpa" in it: transformers refuses sdpa for gpt-oss
    kw = {}
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        # the MXFP4 experts dequantized to bf16 (exactly: an e2m1 value times a power of two), on the GPU, rather
        # than run by transformers' MXFP4 kernels (fetched from the Hub, which the GPU machine cannot reach)
        kw = {"quantization_config": Mxfp4Config(dequantize=True), "device_map": "cuda"}
    # use_kernels=False: transformers would otherwise fetch Hub kernels (MXFP4's) when `kernels` is installed, and
    # the GPU machine has no network
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attn, use_kernels=False,
                                                **kw).cuda().eval()


def _hf_greedy(path: Path, prompts: list[list[int]], attn: str = "sdpa") -> list[list[int]]:
    model = _hf_model(path, attn)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


def _hf_step_logits(path: Path, prompts, continuations, attn: str = "sdpa",
                    dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """For each prompt, transformers' logits at every continuation position ([64, vocab], teacher-forced)."""
    model = _hf_model(path, attn, dtype)
    rows = []
    with torch.no_grad():
        for p, c in zip(prompts, continuations):
            logits = model(torch.tensor([p + c[:-1]], device="cuda")).logits[0, len(p) - 1:].float()
            rows.append(logits.cpu())
    del model
    torch.cuda.empty_cache()
    return rows


class Llmcli:
    """One engine for several greedy runs."""

    def __init__(self, path: Path, backend: str, **kw) -> None:
        from llmcli import LLM

        self.llm = LLM(str(path), dtype="bfloat16", attention_backend=backend, gpu_memory_utilization=0.5,
                       max_model_len=2048, **kw)
        # unset, the block size is the default every user gets (issue 45): 64, flash-attn's own 256
        want = kw.get("kvcache_block_size", 256 if backend == "flash-attn" else 64)
        assert self.llm.engine.config.kvcache_block_size == want

    def greedy(self, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[list[int]]:
        from llmcli import SamplingParams

        outs = self.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        bm = self.llm.engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        return [o.token_ids for o in outs]

    def teacher_forced(self, prompts, continuations) -> list[list[int]]:
        """llmcli's greedy next token after every prefix ``prompt + continuation[:j]``."""
        flat = self.greedy(teacher_forced_prompts(prompts, continuations), max_tokens=1)
        return regroup([t[0] for t in flat], len(continuations[0]))

    def close(self) -> None:
        # dropped as well as shut down: this test measures agreement, and the next engine starts while this
        # wrapper is still bound (test_shutdown_release.py holds shutdown to freeing memory on its own)
        self.llm.shutdown()
        self.llm = None
        gc.collect()
        torch.cuda.empty_cache()


def test_bf16_greedy_matches_transformers(random_published):
    path, prompts = random_published
    hf = _hf_greedy(path, prompts)
    hf_eager = _hf_greedy(path, prompts, attn="eager")
    step_logits = _hf_step_logits(path, prompts, hf)
    eager_logits = _hf_step_logits(path, prompts, hf, attn="eager")
    noise = gap_noise(step_logits, eager_logits)
    eager_tf = [logits.argmax(-1).tolist() for logits in eager_logits]
    near_ties = count_near_ties(step_logits)

    engine = Llmcli(path, "triton")
    try:
        triton, triton_tf = engine.greedy(prompts), engine.teacher_forced(prompts, hf)
    finally:
        engine.close()
    engine = Llmcli(path, "torch", enforce_eager=True)
    try:
        torch_ref, torch_tf = engine.greedy(prompts), engine.teacher_forced(prompts, hf)
    finally:
        engine.close()
    # chunked prefill (512-token budget) + prefix sharing (16-token blocks) through the triton kernels
    engine = Llmcli(path, "triton", max_num_batched_tokens=512, kvcache_block_size=16)
    try:
        chunked_tf = engine.teacher_forced(prompts, hf)
    finally:
        engine.close()

    flash = flash_tf = None
    # the lab's flash-attn wheel (shared/wheels) is built for head dim 128 only and runs a wrong kernel on others
    config = json.loads((path / "config.json").read_text())
    routed = bool(config.get("num_local_experts") or config.get("num_experts"))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if importlib.util.find_spec("flash_attn") is not None and head_dim == 128:
        engine = Llmcli(path, "flash-attn")
        try:
            flash, flash_tf = engine.greedy(prompts), engine.teacher_forced(prompts, hf)
        finally:
            engine.close()

    teacher = {"triton vs transformers": agreement(triton_tf, hf), "torch vs transformers": agreement(torch_tf, hf),
               "triton (chunked, 16-token blocks) vs transformers": agreement(chunked_tf, hf),
               "triton vs torch": agreement(triton_tf, torch_tf)}
    free = {"triton vs transformers": agreement(triton, hf), "torch vs transformers": agreement(torch_ref, hf),
            "triton vs torch": agreement(triton, torch_ref),
            "control: transformers eager vs sdpa": agreement(hf_eager, hf)}
    control_tf = agreement(eager_tf, hf)
    if flash is not None:
        teacher["flash-attn vs transformers"] = agreement(flash_tf, hf)
        free["flash-attn vs transformers"] = agreement(flash, hf)
    else:
        print("\nflash_attn is not installed: the flash-attn backend was not compared")
    total = len(prompts) * NEW_TOKENS
    print(f"\ntransformers' greedy steps with a top-2 near-tie (within {TIE_TOL:.0%}): {near_ties}/{total} "
          f"({near_ties / total:.1%})")
    print(f"GREEDY TOKEN AGREEMENT, teacher-forced (bf16, {len(prompts)} prompts x {NEW_TOKENS} positions):")
    for name, rate in teacher.items():
        print(f"  {name:52s} {rate:.2%}")
    print(f"  {'control: transformers eager vs sdpa':52s} {control_tf:.2%}")
    print("GREEDY TOKEN AGREEMENT, free-running (position by position):")
    for name, rate in free.items():
        print(f"  {name:52s} {rate:.2%}")

    bad = []
    forced = [("triton", triton_tf), ("torch", torch_tf), ("triton chunked", chunked_tf)]
    running = [("triton", triton), ("torch", torch_ref)]
    if flash is not None:
        forced.append(("flash-attn", flash_tf))
        running.append(("flash-attn", flash))
    if routed:
        # A router's top-k is a step function of its logits: where two experts' scores nearly tie, bf16 rounding
        # anywhere upstream picks the other expert and moves the logits by far more than any band (transformers'
        # own eager and sdpa then disagree on gaps of several units, so no near-tie band can separate noise
        # from a fault). Against transformers in float32 instead: llmcli's bf16 must pick its token at least
        # as often as transformers' own bf16 does, less ROUTED_MARGIN (a fault in attention, the experts or
        # the router misses at every position, not at the few where a flip lands).
        fp32_tf = [logits.argmax(-1).tolist() for logits in _hf_step_logits(path, prompts, hf, dtype=torch.float32)]
        ref = {"transformers bf16 sdpa": agreement([x.argmax(-1).tolist() for x in step_logits], fp32_tf),
               "transformers bf16 eager": agreement(eager_tf, fp32_tf)}
        floor = min(ref.values()) - ROUTED_MARGIN
        print("GREEDY TOKEN AGREEMENT with transformers in float32, teacher-forced (routed experts):")
        for name, rate in ref.items():
            print(f"  {name:52s} {rate:.2%}")
        for name, ours in forced:
            rate = agreement(ours, fp32_tf)
            print(f"  {'llmcli ' + name:52s} {rate:.2%}")
            if rate < floor:
                bad.append(f"{name} teacher-forced agrees with float32 on {rate:.2%} < {floor:.2%}")
    else:
        for name, ours in forced:
            bad += [f"{name} teacher-forced: {m}" for m in non_tie_mismatches(step_logits, ours, hf, False, noise)]
        for name, ours in running:
            bad += [f"{name} free-running: {m}" for m in non_tie_mismatches(step_logits, ours, hf, True, noise)]
    median_noise = torch.cat(noise).median().item()
    print(f"bf16 noise on a logit gap (sdpa vs eager, median over positions): {median_noise:.3f}; a mismatch is a "
          f"near-tie within {TIE_TOL:.0%} of the largest |logit| or {NOISE_SIGMAS:g} x that position's noise")
    print("control (eager teacher-forced) mismatches that are not near-ties:",
          non_tie_mismatches(step_logits, eager_tf, hf, first_only=False, noise=noise) or "none")
    print("failures:", bad or "none")
    assert not bad
    # 95%, or where transformers' two attention implementations agree less with each other than that (a random
    # model with many near-ties: Llama-3.2-1B, 35% of positions in round call 1), two points under their agreement
    bar = min(0.95, control_tf - 0.02)
    for name, rate in teacher.items():
        assert rate >= bar, f"teacher-forced {name}: {rate:.2%} < {bar:.2%}"
