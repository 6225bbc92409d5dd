"""The elementwise Triton kernels (kernels/triton_elementwise.py) against the eager torch functions they replace.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before the kernel module is
imported) in float32 and float16; with CUDA on the GPU, in bfloat16 too, plus a CUDA-graph capture. The
reference is the eager code in llmcli.layers / llmcli.models (``fn.__wrapped__``), on fresh random inputs.
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    if "llmcli.kernels.triton_elementwise" in sys.modules:  # decorated before the switch: redo it
        importlib.reload(sys.modules["llmcli.kernels.triton_elementwise"])

from llmcli.kernels import triton_elementwise as te  # noqa: E402
from llmcli.layers.activation import silu_and_mul  # noqa: E402
from llmcli.layers.compile import elementwise_mode  # noqa: E402
from llmcli.layers.norm import add_rms_norm, rms_norm  # noqa: E402
from llmcli.layers.rotary import RotaryEmbedding  # noqa: E402
from llmcli.models.qwen3 import qk_norm_rotary  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
gpu_only = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need CUDA")
EPS = 1e-6


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to float32 summation order, or one rounding step of a half-precision dtype."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    if dtype != torch.float32:  # a rounding step apart now and then, not everywhere
        assert (out != ref).float().mean().item() <= 0.02


def randn(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("hidden", [64, 96, 1024])
def test_rms_norm_matches_eager(dtype, m, hidden):
    x, w = randn(m, hidden, dtype=dtype), 1 + 0.1 * randn(hidden, dtype=dtype)
    before = x.clone()
    close(te.rms_norm(x, w, EPS), rms_norm.__wrapped__(x, w, EPS), dtype)
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("hidden", [64, 96, 1024])
def test_add_rms_norm_matches_eager(dtype, m, hidden):
    x, res = randn(m, hidden, dtype=dtype), randn(m, hidden, dtype=dtype)
    w = 1 + 0.1 * randn(hidden, dtype=dtype)
    out, new_res = te.add_rms_norm(x, res, w, EPS)
    ref_out, ref_res = add_rms_norm.__wrapped__(x, res, w, EPS)
    assert torch.equal(new_res, ref_res)  # one add in the dtype: nothing to differ on
    close(out, ref_out, dtype)


def test_rms_norm_of_a_strided_3d_view():
    """Rows that are not contiguous with each other (a slice of a wider tensor), over a leading batch shape."""
    wide = randn(3, 5, 160, dtype=torch.float32)
    x, w = wide[..., :96], randn(96, dtype=torch.float32)
    close(te.rms_norm(x, w, EPS), rms_norm.__wrapped__(x, w, EPS), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 31])
@pytest.mark.parametrize("inter", [80, 1100])  # 1100: two column blocks, the second part masked
def test_silu_and_mul_matches_eager(dtype, m, inter):
    x = 3 * randn(m, 2 * inter, dtype=dtype)
    close(te.silu_and_mul(x), silu_and_mul.__wrapped__(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 9])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (6, 2, 64), (5, 3, 128), (4, 1, 64)])
def test_qk_norm_rotary_matches_eager(dtype, m, heads, kv_heads, head_dim):
    rotary = RotaryEmbedding(head_dim, 4096, 1_000_000.0).to(DEVICE)
    # q and k as strided views of a fused qkv projection, as the model passes them
    qkv = randn(m, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(m, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(m, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (m,), device=DEVICE)
    positions[0] = 4095  # the table's last row
    qw, kw = 1 + 0.1 * randn(head_dim, dtype=dtype), 1 + 0.1 * randn(head_dim, dtype=dtype)
    before = qkv.clone()
    q_out, k_out = te.qk_norm_rotary(q, k, positions, qw, kw, EPS, rotary.cos, rotary.sin)
    q_ref, k_ref = qk_norm_rotary.__wrapped__(q, k, positions, qw, kw, EPS, rotary.cos, rotary.sin)
    close(q_out, q_ref, dtype)
    close(k_out, k_ref, dtype)
    assert torch.equal(qkv, before)


@pytest.mark.skipif(ON_GPU, reason="CPU-only: the interpreter in the CPU model; GPU e2e covers the real path")
def test_tiny_model_with_the_kernels_matches_transformers(tiny_model, hf_oracle, monkeypatch):
    """The kernels at the model's own call sites (shapes, strided q/k views, argument order): greedy float32
    generation through the engine, every elementwise function swapped for its kernel, against transformers."""
    from llmcli import LLM, SamplingParams
    from tests.test_engine_vs_hf import assert_same_tokens, random_prompts

    monkeypatch.setattr("llmcli.layers.norm.rms_norm", te.rms_norm)
    monkeypatch.setattr("llmcli.layers.norm.add_rms_norm", te.add_rms_norm)
    monkeypatch.setattr("llmcli.layers.activation.silu_and_mul", te.silu_and_mul)
    monkeypatch.setattr("llmcli.models.qwen3.qk_norm_rotary", te.qk_norm_rotary)
    prompts = random_prompts([1, 6, 19], seed=7)
    llm = LLM(str(tiny_model), device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=16,
              max_num_batched_tokens=32, max_num_seqs=4, max_model_len=48, enable_prefix_caching=False)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    finally:
        llm.shutdown()
    expected = hf_oracle.greedy(tiny_model, prompts, 6)
    assert_same_tokens(hf_oracle, tiny_model, prompts, outs, expected, "triton elementwise kernels")


# Run in a fresh interpreter-free process: Triton decides interpreted vs compiled at import and decoration time.
PTX_SCRIPT = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmcli.kernels import triton_elementwise as te

bf, i32, c = "*bf16", "i32", "constexpr"
rms = dict(x_ptr=bf, res_ptr=bf, w_ptr=bf, out_ptr=bf, res_out_ptr=bf, M=i32, x_stride=i32, res_stride=i32,
           out_stride=i32, res_out_stride=i32, eps="fp32", N=c, BLOCK_N=c, ROWS=c, HAS_RESIDUAL=c)
silu = dict(x_ptr=bf, out_ptr=bf, M=i32, x_stride=i32, out_stride=i32, N=c, BLOCK=c)
qk = dict(q_ptr=bf, k_ptr=bf, pos_ptr="*i64", qw_ptr=bf, kw_ptr=bf, cos_ptr="*fp32", sin_ptr="*fp32",
          q_out_ptr=bf, k_out_ptr=bf, M=i32, q_stride=i32, q_head_stride=i32, k_stride=i32, k_head_stride=i32,
          cos_stride=i32, sin_stride=i32, eps="fp32", HQ=c, BLOCK_HQ=c, HK=c, BLOCK_HK=c, HEAD_DIM=c, BLOCK_HALF=c)
cases = {
    "rms_norm": (te._rms_norm_kernel, rms, dict(N=1024, BLOCK_N=1024, ROWS=2, HAS_RESIDUAL=True)),
    "silu_and_mul": (te._silu_and_mul_kernel, silu, dict(N=3072, BLOCK=1024)),
    "qk_norm_rotary": (te._qk_norm_rotary_kernel, qk,
                       dict(HQ=16, BLOCK_HQ=16, HK=8, BLOCK_HK=8, HEAD_DIM=128, BLOCK_HALF=64)),
}
out = {}
for name, (fn, signature, constexprs) in cases.items():
    # pointers and row strides 16-aligned, as torch allocates them (Triton specialises on that at launch)
    aligned = {(i,): [["tt.divisibility", 16]] for i, (arg, kind) in enumerate(signature.items())
               if kind.startswith("*") or arg.endswith("stride")}
    k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    out[name] = {"ptx": k.asm["ptx"], "has_cubin": "cubin" in k.asm}
print(json.dumps(out))
"""


@pytest.mark.skipif(ON_GPU or "nvidia" not in __import__("triton.backends").backends.backends,
                    reason="CPU-only (Triton's compile API differs across versions; a GPU runs the kernels for real)")
def test_kernels_compile_for_h200_with_vector_loads():
    """The kernels build for sm_90 (no GPU needed: Triton's compiler and its ptxas) at Qwen3-0.6B's sizes, and
    their bf16 loads and stores are 16-byte vectors: the looped, unvectorised code that dynamic torch.compile
    produced is what they replace."""
    import json
    import re
    import subprocess

    from tests.processes import env

    e = env()
    e.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", PTX_SCRIPT], env=e, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, got in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        ptx = got["ptx"]
        assert got["has_cubin"], name
        assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx) and re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx), name
        assert not re.search(r"(ld|st)\.global(\.\w+)*\.b16\b", ptx), f"{name}: scalar bf16 loads or stores"


def test_elementwise_mode_from_environment(monkeypatch):
    monkeypatch.delenv("LLMCLI_EAGER", raising=False)
    monkeypatch.delenv("LLMCLI_ELEMENTWISE", raising=False)
    assert elementwise_mode() == "triton"
    monkeypatch.setenv("LLMCLI_ELEMENTWISE", "compile")
    assert elementwise_mode() == "compile"
    monkeypatch.setenv("LLMCLI_EAGER", "1")
    assert elementwise_mode() == "eager"  # LLMCLI_EAGER=1 wins: everything eager
    monkeypatch.delenv("LLMCLI_EAGER")
    monkeypatch.setenv("LLMCLI_ELEMENTWISE", "inductor")
    with pytest.raises(ValueError, match="LLMCLI_ELEMENTWISE"):
        elementwise_mode()


@gpu_only
def test_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs written into the same buffers: outputs follow the inputs."""
    dtype, m, hidden, inter, heads, kv_heads, head_dim = torch.bfloat16, 12, 1024, 3072, 16, 8, 128
    rotary = RotaryEmbedding(head_dim, 4096, 1_000_000.0).to(DEVICE)
    w, qw, kw = randn(hidden, dtype=dtype), randn(head_dim, dtype=dtype), randn(head_dim, dtype=dtype)
    x, res, gate_up = randn(m, hidden, dtype=dtype), randn(m, hidden, dtype=dtype), randn(m, 2 * inter, dtype=dtype)
    qkv = randn(m, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.randint(0, 4096, (m,), device=DEVICE)

    def body():
        q = qkv[:, : heads * head_dim].view(m, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(m, kv_heads, head_dim)
        return (te.rms_norm(x, w, EPS), *te.add_rms_norm(x, res, w, EPS), te.silu_and_mul(gate_up),
                *te.qk_norm_rotary(q, k, positions, qw, kw, EPS, rotary.cos, rotary.sin))

    body()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = body()
    for t in (x, res, gate_up, qkv):
        t.copy_(torch.randn_like(t))
    positions.copy_(torch.randint(0, 4096, (m,), device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    for out, ref in zip(outs, body()):
        assert torch.equal(out, ref)
