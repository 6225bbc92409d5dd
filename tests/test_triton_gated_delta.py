"""The Gated DeltaNet's Triton kernels (kernels/triton_gated_delta.py) against the torch reference
(kernels/gated_delta_torch.py): the in-place decode conv and delta rule step, the varlen prefill conv, and the
layer's decode through them against its torch decode.

Without CUDA they run under Triton's interpreter in float32; on a GPU, tests/test_gpu_gated_delta.py runs them
in bf16 and float32. Cases: several batch sizes, grouped value heads, padding rows (-1), pool rows in any order,
a value dim the tile does not divide, chunks shorter than the conv's carried state, rows apart in a larger
buffer (the engine's state rows lie in the KV pool's pages: engine/state_pages.py), which nothing may write
between.
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    if "llmcli.kernels.triton_gated_delta" in sys.modules:  # decorated before the switch: redo it
        importlib.reload(sys.modules["llmcli.kernels.triton_gated_delta"])

from llmcli.kernels import triton_gated_delta as tg  # noqa: E402
from llmcli.kernels.gated_delta_torch import causal_conv1d, causal_conv1d_step, gated_delta_rule_step  # noqa: E402

SLOTS = 9  # pool rows (+1 scratch)
# the GPU runs the checks below in bf16 and float32 at Qwen3.5's sizes (tests/test_gpu_gated_delta.py)
cpu_only = pytest.mark.skipif(ON_GPU, reason="on a GPU: tests/test_gpu_gated_delta.py")


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def rows_for(batch: int, pads: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` distinct pool rows of ``slots_for(batch)`` in random order, the last ``pads`` of them -1 (a
    graph's padding)."""
    rows = torch.randperm(slots_for(batch), generator=gen)[:batch]
    rows[batch - pads:] = -1
    return rows


def slots_for(batch: int) -> int:
    return max(SLOTS, batch + 3)


def check_untouched(after: torch.Tensor, before: torch.Tensor, rows: torch.Tensor) -> None:
    others = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    others[rows[rows >= 0]] = False
    assert torch.equal(after[others], before[others]), "a pool row outside the batch (or the scratch) was written"


class Spaced:
    """A pool of ``shape`` whose rows lie ``gap`` elements apart in a larger buffer, as the engine's state rows
    lie in the KV pool's pages; ``check`` asserts nothing between or around the rows changed."""

    def __init__(self, shape: tuple[int, ...], gen: torch.Generator, device, dtype, scale: float = 1.0,
                 gap: int = 37) -> None:
        inner = 1
        for d in shape[1:]:
            inner *= d
        self.buffer = (torch.randn(shape[0] * (inner + gap) + gap, generator=gen) * scale).to(device, dtype)
        strides, step = [], 1
        for d in reversed(shape[1:]):
            strides.insert(0, step)
            step *= d
        self.layout = (shape, (inner + gap, *strides), gap)
        self.view = torch.as_strided(self.buffer, *self.layout)
        self.before = self.buffer.clone()

    def check(self) -> None:
        cover = torch.zeros(self.buffer.numel(), dtype=torch.bool, device=self.buffer.device)
        torch.as_strided(cover, *self.layout).fill_(True)
        assert torch.equal(self.buffer[~cover], self.before[~cover]), "written between the pool's rows"


def conv_pool(slots: int, channels: int, width: int, gen: torch.Generator, tap_major: bool) -> torch.Tensor:
    """A conv-state pool [slots, C, K-1]: as the engine keeps it (``tap_major``: over [slots, K-1, C] storage,
    engine/state_pool.py) or channel-major."""
    if tap_major:
        return torch.randn(slots, width - 1, channels, generator=gen).transpose(1, 2)
    return torch.randn(slots, channels, width - 1, generator=gen)


def check_conv_step(batch: int, pads: int, channels: int = 40, dtype=torch.float32, device="cpu",
                    tap_major: bool = True, apart: bool = False) -> None:
    gen = torch.Generator().manual_seed(batch)
    width = 4
    # the projection's rows are wider than the conv's channels: x is a strided view, as in the layer
    x = torch.randn(batch, channels + 24, generator=gen).to(device, dtype)[:, :channels]
    weight = torch.randn(channels, width, generator=gen).to(device, dtype)
    spaced = Spaced((slots_for(batch) + 1, width - 1, channels), gen, device, dtype) if apart else None
    pool = spaced.view.transpose(1, 2) if apart else \
        conv_pool(slots_for(batch) + 1, channels, width, gen, tap_major).to(device, dtype)
    rows = rows_for(batch, pads, gen).to(device)
    before = pool.clone()
    out = tg.conv_step_(x, weight, pool, rows)
    state = torch.where((rows >= 0)[:, None, None], before[rows.clamp(min=0)], 0)  # padding: a zero state
    want, want_state = causal_conv1d_step(x.float(), weight.float(), state.float())
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    real = rows >= 0
    torch.testing.assert_close(pool[rows[real]], want_state[real].to(dtype), rtol=0, atol=0)
    check_untouched(pool, before, rows)
    if spaced is not None:
        spaced.check()


def check_delta_step(batch: int, pads: int, hk: int, hv: int, dk: int, dv: int, dtype=torch.float32,
                     device="cpu", apart: bool = False) -> None:
    gen = torch.Generator().manual_seed(10 * batch + hv)
    proj = torch.randn(batch, 2 * hk * dk + hv * dv + 2 * hv + 5, generator=gen)  # strided views of one projection
    proj[0, 2 * hk * dk + hv * dv] = 30.0  # a: softplus past its linear threshold
    q, k, v, a, b = proj.to(device, dtype)[:, :-5].split([hk * dk, hk * dk, hv * dv, hv, hv], dim=-1)
    q, k, v = q.reshape(batch, hk, dk), k.reshape(batch, hk, dk), v.reshape(batch, hv, dv)
    a_log, dt_bias = (torch.randn(hv, generator=gen) * 0.5).to(device), torch.randn(hv, generator=gen).to(device)
    spaced = Spaced((slots_for(batch) + 1, hv, dk, dv), gen, device, torch.float32, scale=0.3) if apart else None
    pool = spaced.view if apart else (torch.randn(slots_for(batch) + 1, hv, dk, dv, generator=gen) * 0.3).to(device)
    rows = rows_for(batch, pads, gen).to(device)
    before = pool.clone()
    out = tg.gated_delta_step_(q, k, v, a, b, a_log, dt_bias, pool, rows)
    g = -a_log.exp() * F.softplus(a.float() + dt_bias)
    state = torch.where((rows >= 0)[:, None, None, None], before[rows.clamp(min=0)], 0.0)
    want, want_state = gated_delta_rule_step(q, k, v, g, torch.sigmoid(b), state)
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    real = rows >= 0
    torch.testing.assert_close(pool[rows[real]], want_state[real], **TOL[dtype])
    check_untouched(pool, before, rows)
    if spaced is not None:
        spaced.check()


def check_conv_varlen(with_pool: bool, lens=(1, 2, 37, 5), channels: int = 300, dtype=torch.float32,
                      device="cpu", tap_major: bool = True, apart: bool = False) -> None:
    """Chunks shorter and longer than the K-1 carried inputs, continued or fresh, in pool rows out of order;
    without a pool (the start-up warm-up) every chunk starts from zeros and nothing is kept."""
    gen = torch.Generator().manual_seed(5)
    width, n = 4, len(lens)
    carried = torch.arange(n) % 3 != 2
    rows = torch.randperm(SLOTS, generator=gen)[:n].to(device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    x = torch.randn(int(cu[-1]), channels + 10, generator=gen).to(device, dtype)[:, :channels]
    weight = torch.randn(channels, width, generator=gen).to(device, dtype)
    spaced = Spaced((SLOTS + 1, width - 1, channels), gen, device, dtype) if apart else None
    pool = spaced.view.transpose(1, 2) if apart else conv_pool(SLOTS + 1, channels, width, gen, tap_major).to(device, dtype)
    before = pool.clone()
    out = tg.conv_varlen_(x, weight, pool if with_pool else None, rows, carried.to(device), cu)
    for i, row in enumerate(rows.tolist()):
        lo, hi = int(cu[i]), int(cu[i + 1])
        start = before[row].float() if carried[i] and with_pool else None
        want, want_state = causal_conv1d(x[lo:hi].float(), weight.float(), start)
        torch.testing.assert_close(out[lo:hi].float(), want, **TOL[dtype])
        torch.testing.assert_close(pool[row], want_state.to(dtype) if with_pool else before[row], rtol=0, atol=0)
    check_untouched(pool, before, rows if with_pool else torch.tensor([-1], device=device))
    if spaced is not None:
        spaced.check()


@pytest.mark.parametrize("batch,pads,tap_major,apart", [(1, 0, True, False), (4, 1, True, False),
                                                       (7, 3, True, True), (4, 1, False, False)])
@cpu_only
def test_conv_step_updates_the_pool_in_place(batch, pads, tap_major, apart):
    check_conv_step(batch, pads, tap_major=tap_major, apart=apart)


@pytest.mark.parametrize("batch,pads,hk,hv,dv,apart", [(1, 0, 2, 2, 32, False), (3, 1, 2, 4, 48, True),
                                                       (6, 2, 1, 4, 64, False)])
@cpu_only
def test_delta_step_updates_the_pool_in_place(batch, pads, hk, hv, dv, apart):
    check_delta_step(batch, pads, hk, hv, 32, dv, apart=apart)


@pytest.mark.parametrize("with_pool,tap_major,apart", [(True, True, False), (False, True, False),
                                                       (True, False, False), (True, True, True)])
@cpu_only
def test_conv_varlen_matches_the_per_chunk_conv(with_pool, tap_major, apart):
    check_conv_varlen(with_pool, tap_major=tap_major, apart=apart)


@cpu_only
def test_layer_decode_in_place_matches_its_torch_decode(monkeypatch):
    """The layer's decode through the kernels (the projection's strided views, the pool's rows) against its torch
    decode on the same weights and states: outputs and every pool row after three steps."""
    from llmcli.kernels.backend import AttentionMetadata
    from llmcli.layers import gated_delta_net as gdn

    torch.manual_seed(0)
    spec = gdn.GatedDeltaNetSpec(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32, conv_kernel=4)

    class Backend:
        metadata = None

    layers = []
    for _ in range(2):
        layer = gdn.GatedDeltaNet(64, spec, 1e-6, Backend())
        layers.append(layer)
    for p_a, p_b in zip(layers[0].parameters(), layers[1].parameters()):
        p_a.data.copy_(torch.randn_like(p_a) * 0.2)
        p_b.data.copy_(p_a.data)
    conv, ssm = layers[0].state_shapes()
    states = [torch.randn(SLOTS + 1, *conv) * 0.3, torch.randn(SLOTS + 1, *ssm) * 0.3]
    for layer in layers:
        layer.conv_state, layer.ssm_state = states[0].clone(), states[1].clone()
    rows = torch.tensor([4, 1, 7, -1])
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.full((4,), -1), context_lens=torch.tensor([5, 3, 9, 0]),
                             block_tables=None, rows=rows)
    Backend.metadata = meta
    for _ in range(3):
        hidden = torch.randn(4, 64)
        want = layers[0](hidden)
        monkeypatch.setattr(gdn, "use_cuda_kernels", lambda x: True)
        got = layers[1](hidden)
        monkeypatch.undo()
        torch.testing.assert_close(got[:3], want[:3], rtol=1e-4, atol=1e-5)
    real = rows[rows >= 0]
    for a, b in ((layers[0].conv_state, layers[1].conv_state), (layers[0].ssm_state, layers[1].ssm_state)):
        torch.testing.assert_close(b[real], a[real], rtol=1e-4, atol=1e-5)


# The interpreter accepts code the compiler rejects: build each kernel for an H100/H200 in a fresh process
# (Triton's bundled ptxas, no GPU) at Qwen3.5-9B's shapes, with the constexprs and warps its wrapper launches.
_COMPILE_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmcli.kernels import triton_gated_delta as tg

def build(kernel, constexprs, ptrs):
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "i32") for n in kernel.arg_names}
    triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": tg.NUM_WARPS})
    print("compiled", kernel.__name__)

bf16 = {n: "*bf16" for n in ("x_ptr", "w_ptr", "out_ptr", "q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "a_log_ptr",
                             "dt_bias_ptr")}
ints = {"rows_ptr": "*i64", "init_ptr": "*i8", "cu_ptr": "*i32", "seq_ptr": "*i64", "scale": "fp32"}
build(tg._conv_step_kernel, dict(K=4, KPAD=4, BC=tg.BLOCK_C), {**bf16, **ints, "state_ptr": "*bf16"})
build(tg._delta_step_kernel, dict(HV=32, GROUP=2, DK=128, DV=128, BK=128, BV=tg.DELTA_TILE[0]),
      {**bf16, **ints, "state_ptr": "*fp32"})
build(tg._conv_varlen_kernel, dict(K=4, HAS_STATE=True, BT=tg.BLOCK_T, BC=tg.BLOCK_C), {**bf16, **ints, "state_ptr": "*bf16"})
build(tg._conv_state_varlen_kernel, dict(K=4, KPAD=4, BC=tg.BLOCK_C), {**bf16, **ints, "state_ptr": "*bf16"})
"""


@cpu_only
def test_kernels_compile_for_sm90():
    from processes import compiled_without_interpreter

    assert compiled_without_interpreter(_COMPILE_SM90).count("compiled") == 4
