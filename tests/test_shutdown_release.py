"""``LLM.shutdown()`` gives the device memory back while the engine is still referenced.

A script that builds its next engine before dropping the last (``engine = LLM(...)`` over a live ``engine``)
needs the first one's KV pool and weights gone at ``shutdown``, not at garbage collection. After ``shutdown``,
with the ``LLM`` still held, no live tensor may sit on the KV pool's memory or on a parameter's, for each way the
pool is laid out: one tensor for every layer (Qwen3), KV groups of full and sliding-window layers with sinks
(gpt-oss; with MXFP4 experts in ``frag``'s layout too), slabs of mixed head sizes (Gemma 4), pages shared with
linear-attention state rows (Qwen3.5). On CUDA the allocator's count must also fall back to within 256 MiB of
where it was before the engine (``benchmarks/release_gpu.py`` prints what holds the memory where it does not).
"""
from __future__ import annotations

import gc
import types

import pytest
import torch

from attention_reference import interpret_triton_without_cuda
from tiny_qwen3 import write_tiny_model

interpret_triton_without_cuda()  # the MXFP4 case's kernel on CPU: before llmcli's Triton modules are imported

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                reason="needs CUDA")])]


def storages(tensors) -> dict[int, int]:
    """data pointer -> bytes of each non-empty storage under ``tensors``."""
    out = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            out[s.data_ptr()] = s.nbytes()
    return out


def holders(obj, found: list) -> list[str]:
    """Who refers to ``obj``: ``Owner.attribute`` where an object's attribute dict holds it, else the type."""
    out = []
    for ref in gc.get_referrers(obj):
        if ref is found or isinstance(ref, (types.CellType, types.FrameType)):  # this test's own
            continue
        if isinstance(ref, dict):
            keys = [k for k, v in ref.items() if v is obj][:1]
            owners = [type(o).__name__ for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref]
            out.append(f"{(owners or ['dict'])[0]}.{keys[0] if keys else '?'}")
        else:
            out.append(type(ref).__name__)
    return out[:4]


def survivors(watched: dict[int, int]) -> list[str]:
    """Live tensors (after a collection) on one of the ``watched`` storages, described with their holders."""
    gc.collect()
    found: list[torch.Tensor] = []
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            s = obj.untyped_storage()
            if watched.get(s.data_ptr()) == s.nbytes() and s.nbytes():
                found.append(obj)
    return [f"{tuple(t.shape)} {t.dtype} on {t.untyped_storage().nbytes()} bytes, held by {holders(t, found)}"
            for t in found]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["qwen3", "gpt-oss", "gpt-oss-mxfp4", "gemma4", "qwen3.5"])
def test_shutdown_frees_the_kv_pool_and_weights_while_referenced(tmp_path_factory, family, device, monkeypatch):
    from llmcli import LLM, SamplingParams

    if family == "qwen3.5" and device == "cuda":
        pytest.importorskip("fla", reason="Qwen3.5 on CUDA runs fla's kernels")
    where = tmp_path_factory.mktemp(f"release_{family}")
    path = write_tiny_model(where / "tiny", family.removesuffix("-mxfp4"), seed=3)
    extra = {"gpu_memory_utilization": 0.3} if device == "cuda" else {}
    if family == "gpt-oss-mxfp4":  # the experts converted to frag's layout after loading (bfloat16 on a GPU)
        from test_new_families import write_mxfp4_twins

        path, _ = write_mxfp4_twins(path, where)
        monkeypatch.setenv("LLMCLI_MOE", "triton")  # on CPU too: the kernel under Triton's interpreter
        monkeypatch.setenv("LLMCLI_MXFP4_KERNEL", "frag")
        extra["dtype"] = "bfloat16" if device == "cuda" else "float32"
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
    llm = LLM(str(path), device=device, kvcache_block_size=16, max_model_len=256, **extra)
    llm.generate([[5, 6, 7] * 20, [9] * 70], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    runner = llm.engine.model_runner
    if family == "gpt-oss-mxfp4":
        from llmcli.layers.moe_mxfp4 import Mxfp4Experts

        assert all(m.fragments is not None for m in runner.model.modules() if isinstance(m, Mxfp4Experts))
    pool = storages([runner.kv_cache])
    weights = storages(runner.model.parameters())
    assert pool and weights
    llm.shutdown()
    assert not (left := survivors(pool)), f"the KV pool outlives shutdown: {left}"
    assert not (left := survivors(weights)), f"weights outlive shutdown: {left}"
    if device == "cuda":
        # the pool is tens of GiB here; a few dozen MiB may stay in library workspaces (cuBLAS's, per stream)
        left = torch.cuda.memory_allocated() - before
        assert left < 256 * 2**20, f"{left / 2**20:.0f} MiB stay allocated after shutdown"
    assert llm.engine is not None  # held to here on purpose
