"""On CUDA: fla-core's chunked gated delta rule (varlen, initial/final states) and llmcli's Triton kernels
(kernels/triton_gated_delta.py: the in-place decode conv and delta rule, the varlen prefill conv) against the
torch reference in bf16 and float32 at Qwen3.5's sizes, the decode kernels captured in a CUDA graph, their
speed at batch 256, and the engine on a tiny Qwen3.5 against transformers with these kernels in the loop.

Run on the GPU machine: ``python -m pytest -q tests/test_gpu_gated_delta.py``.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _inputs(length: int, n: int, hk: int = 4, hv: int = 8, dk: int = 128, dv: int = 128):
    g = torch.Generator(device="cuda").manual_seed(0)
    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda")
    return (rnd(length, hk, dk), rnd(length, hk, dk), rnd(length, hv, dv), -torch.rand(length, hv, generator=g,
            device="cuda") * 0.5, torch.rand(length, hv, generator=g, device="cuda"), rnd(n, hv, dk, dv) * 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_varlen_chunked_matches_the_torch_reference(dtype):
    from llmcli.kernels.gated_delta_fla import chunked_varlen
    from llmcli.kernels.gated_delta_torch import gated_delta_rule_chunked

    cuts = [0, 1, 70, 200, 333]
    q, k, v, decay, beta, states = _inputs(cuts[-1], len(cuts) - 1)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    states[1] = 0  # a fresh sequence among continued ones
    out, final = chunked_varlen(q, k, v, decay, beta, states, torch.tensor(cuts, device="cuda"))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=2e-3)
    for i in range(len(cuts) - 1):
        lo, hi = cuts[i], cuts[i + 1]
        want, want_state = gated_delta_rule_chunked(q[lo:hi], k[lo:hi], v[lo:hi], decay[lo:hi], beta[lo:hi], states[i])
        torch.testing.assert_close(out[lo:hi].float(), want.float(), **tol)
        torch.testing.assert_close(final[i], want_state, **tol)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,pads", [(1, 0), (37, 5), (256, 0)])
def test_triton_decode_kernels_match_the_torch_reference(dtype, batch, pads):
    """Qwen3.5-9B's linear layer: 8192 conv channels, 16 key heads, 32 value heads of 128; the pool's rows
    adjacent, and apart in a larger buffer as the engine's state rows are (engine/state_pages.py)."""
    from test_triton_gated_delta import check_conv_step, check_delta_step

    for apart in (False, True):
        check_conv_step(batch, pads, channels=8192, dtype=dtype, device="cuda", apart=apart)
        check_delta_step(batch, pads, hk=16, hv=32, dk=128, dv=128, dtype=dtype, device="cuda", apart=apart)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_varlen_conv_matches_the_torch_reference(dtype):
    from test_triton_gated_delta import check_conv_varlen

    for with_pool, apart in ((True, False), (False, False), (True, True)):
        check_conv_varlen(with_pool, lens=(1, 2, 3, 700, 64, 5), channels=8192, dtype=dtype, device="cuda",
                          apart=apart)


def _decode_case(batch: int, slots: int, tap_major: bool = True):
    """Qwen3.5-9B's linear layer at ``batch`` rows of a pool of ``slots``; the conv states as the engine keeps
    them (``tap_major``) or channel-major."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    hk, hv, d, channels = 16, 32, 128, 8192
    proj = torch.randn(batch, channels + 2 * hv, generator=gen, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(channels, 4, generator=gen, device="cuda", dtype=torch.bfloat16)
    shape = (slots + 1, 3, channels) if tap_major else (slots + 1, channels, 3)
    conv = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    conv = conv.transpose(1, 2) if tap_major else conv
    ssm = torch.randn(slots + 1, hv, d, d, generator=gen, device="cuda") * 0.3
    heads = torch.randn(2, hv, generator=gen, device="cuda")
    rows = torch.randperm(slots, generator=gen, device="cuda")[:batch]
    return proj, weight, conv, ssm, heads, rows, (hk, hv, d, channels)


def _decode_step(proj, weight, conv, ssm, heads, rows, dims):
    from llmcli.kernels.triton_gated_delta import conv_step_, gated_delta_step_

    hk, hv, d, channels = dims
    x = conv_step_(proj[:, :channels], weight, conv, rows)
    q, k, v = x.split([hk * d, hk * d, hv * d], dim=-1)
    a, b = proj[:, channels:].split(hv, dim=-1)
    return gated_delta_step_(q.view(-1, hk, d), k.view(-1, hk, d), v.view(-1, hv, d), a, b, heads[0], heads[1],
                             ssm, rows)


def test_triton_decode_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs and rows (padding -1 among them): what eager kernels compute."""
    proj, weight, conv, ssm, heads, rows, dims = _decode_case(8, 12)
    args = [proj.clone(), weight, conv.clone(), ssm.clone(), heads, rows.clone()]
    _decode_step(*args, dims)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_step(*args, dims)
    for step in range(3):
        new_proj, new_rows = torch.randn_like(proj), torch.randperm(12, device="cuda")[:8]
        new_rows[-2:] = -1
        want_conv, want_ssm = args[2].clone(), args[3].clone()
        want = _decode_step(new_proj, weight, want_conv, want_ssm, heads, new_rows, dims)
        args[0].copy_(new_proj)
        args[5].copy_(new_rows)
        graph.replay()
        torch.testing.assert_close(out[:6], want[:6], rtol=0, atol=0)
        assert torch.equal(args[2], want_conv) and torch.equal(args[3], want_ssm), f"step {step}"


def test_triton_decode_step_streams_the_states_at_batch_256():
    """The delta rule at batch 256 reads and writes each row's 2 MiB state once: at least 1.5 TB/s of state
    traffic (an H200 copies ~4 TB/s; the torch path's gather, step and scatter managed ~0.5)."""
    seconds, rate = _state_traffic(*_decode_case(256, 256))
    print(f"decode step of one linear layer at batch 256: {seconds * 1e6:.0f} us, {rate / 1e12:.2f} TB/s")
    assert rate > 1.5e12


def test_conv_step_layouts_timed():
    """The conv step alone at batch 256 on both conv-state layouts (the engine keeps them tap-major: each tap's
    channels contiguous); tap-major must not be the slower (2026-12-04 R1b: channel-major took 30.9 us a call at
    Qwen3.6-27B's 10,240 channels and batch 209, ~8 us of bytes)."""
    from llmcli.kernels.triton_gated_delta import conv_step_

    times = {}
    for tap_major in (False, True):
        proj, weight, conv, _, _, rows, (_, _, _, channels) = _decode_case(256, 256, tap_major)
        x = proj[:, :channels]
        for _ in range(3):
            conv_step_(x, weight, conv, rows)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            conv_step_(x, weight, conv, rows)
        end.record()
        torch.cuda.synchronize()
        times[tap_major] = start.elapsed_time(end) / 50 * 1e3
    moved = 256 * channels * 2 * (2 * 3 + 2)  # the states read and written, x read, out written (bf16)
    for tap_major, us in times.items():
        print(f"conv step at batch 256, {'tap' if tap_major else 'channel'}-major states: {us:.1f} us, "
              f"{moved / us / 1e6:.2f} TB/s")
    assert times[True] <= times[False] * 1.1


def _state_traffic(proj, weight, conv, ssm, heads, rows, dims) -> tuple[float, float]:
    """Seconds per decode step (after 3 warm-up steps) and bytes of state read + written per second."""
    for _ in range(3):
        _decode_step(proj, weight, conv, ssm, heads, rows, dims)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        _decode_step(proj, weight, conv, ssm, heads, rows, dims)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 20
    return seconds, 2 * rows.numel() * (ssm[0].numel() * 4 + conv[0].numel() * 2) / seconds


@pytest.mark.parametrize("tile", [(16, 1), (32, 1), (32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4),
                                  (128, 8)], ids=lambda t: f"v{t[0]}w{t[1]}")
def test_delta_step_tiles(tile, monkeypatch):
    """Each (value columns, warps) tile of the delta rule gives the default tile's outputs and states (up to the
    reduction order), and its state traffic at batch 256 is printed (-s): how far from the copy ceiling the
    default is, and which tile to make the default."""
    from llmcli.kernels import triton_gated_delta as tg

    proj, weight, conv, ssm, heads, rows, dims = _decode_case(256, 256)
    want_ssm = ssm.clone()
    want = _decode_step(proj, weight, conv.clone(), want_ssm, heads, rows, dims)
    monkeypatch.setattr(tg, "DELTA_TILE", tile)
    got = _decode_step(proj, weight, conv.clone(), ssm, heads, rows, dims)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ssm, want_ssm, rtol=1e-5, atol=1e-5)
    seconds, rate = _state_traffic(proj, weight, conv, ssm, heads, rows, dims)
    print(f"delta step tile {tile}: {seconds * 1e6:.0f} us, {rate / 1e12:.2f} TB/s")


def test_engine_on_cuda_with_fla_matches_transformers(tmp_path):
    """fp32 on the GPU, eager and with decode graphs (the state rows in the graph's inputs): the tiny Qwen3.5's
    greedy tokens equal transformers' (on the CPU), prompts past a 64-token chunk, chunked prefill."""
    from tiny_qwen3 import write_tiny_model
    from transformers import AutoModelForCausalLM

    from llmcli import LLM, SamplingParams

    model = write_tiny_model(tmp_path / "q35", "qwen3.5", seed=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 600, (n,), generator=g).tolist() for n in (1, 30, 100, 150)]
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                        max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts]
    for eager in (True, False):
        llm = LLM(str(model), device="cuda", dtype="float32", max_model_len=256, max_num_batched_tokens=64,
                  enforce_eager=eager, gpu_memory_utilization=0.3)
        try:
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        finally:
            llm.shutdown()
        assert [o["token_ids"] for o in outs] == want, f"enforce_eager={eager}"
