"""Engine start-up: phases timed, start-up abandoned between phases, compile caches, graph sizes."""
from __future__ import annotations

import pytest

from llmcli.config import Config
from llmcli.engine.cuda_graphs import graph_batch_sizes
from llmcli.engine.llm_engine import LLMEngine
from llmcli.engine.startup import StartupCancelled, use_persistent_compile_cache


def test_startup_phases_are_timed(tiny_model):
    engine = LLMEngine(Config(str(tiny_model), device="cpu", num_kvcache_blocks=32, kvcache_block_size=16))
    try:
        phases = engine.startup_s
    finally:
        engine.shutdown()
    assert list(phases) == ["tokenizer", "weights", "probe", "kv_cache"]  # no compile pass or graphs on CPU
    assert all(v >= 0 for v in phases.values()) and phases["weights"] > 0


def test_startup_stops_at_the_next_phase_when_cancelled(tiny_model):
    asked = []

    def cancelled() -> bool:
        asked.append(True)
        return len(asked) > 2  # tokenizer and weights run, then the answer changes

    with pytest.raises(StartupCancelled):
        LLMEngine(Config(str(tiny_model), device="cpu", num_kvcache_blocks=32, kvcache_block_size=16),
                  cancelled=cancelled)
    assert len(asked) == 3


def test_compile_caches_go_under_the_user_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    monkeypatch.delenv("LLMCLI_COMPILE_CACHE", raising=False)
    use_persistent_compile_cache()
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "llmcli" / "inductor")
    assert (tmp_path / "llmcli" / "inductor").is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"  # the user's choice stays


def test_graph_sizes():
    every = graph_batch_sizes(512, "every16")
    assert every[:5] == [1, 2, 4, 8, 16] and every[-1] == 512 and len(every) == 36
    assert graph_batch_sizes(512, "pow2") == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert graph_batch_sizes(100, "pow2")[-1] == 100 and graph_batch_sizes(3, "pow2") == [1, 2, 3]


def test_graph_sizes_default_is_spaced(monkeypatch):
    monkeypatch.delenv("LLMCLI_GRAPH_SIZES", raising=False)
    sizes = graph_batch_sizes(512)
    assert sizes == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    # a step of n rows pads to at most 1.5x n (2x for the tiny ones), and every size is one a step of
    # real rows compiles kernels for anyway: 1, 2, 4, 8 or a multiple of 16
    for n in range(1, 513):
        padded = next(b for b in sizes if b >= n)
        assert padded <= max(2 * n - 1, n * 3 // 2), n
    assert all(b in (1, 2, 4, 8) or b % 16 == 0 for b in sizes)
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 100]  # the largest batch always
    assert graph_batch_sizes(1) == [1]
    monkeypatch.setenv("LLMCLI_GRAPH_SIZES", "pow2")
    assert graph_batch_sizes(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    monkeypatch.setenv("LLMCLI_GRAPH_SIZES", "8, 64,1000")
    assert graph_batch_sizes(256) == [8, 64, 256]
    monkeypatch.setenv("LLMCLI_GRAPH_SIZES", "fewer")
    with pytest.raises(ValueError, match="LLMCLI_GRAPH_SIZES='fewer'.*spaced, pow2, every16"):
        graph_batch_sizes(512)


HEAVY_MODULES = (
    "torch._dynamo", "torch._inductor", "sympy",  # torch.compile
    "torch.distributed.fsdp", "torch.distributed.tensor", "torch.onnx",  # what Dynamo pulls in
    "transformers.generation.utils", "transformers.generation.candidate_generator", "transformers.modeling_utils",
    "transformers.distributed", "sklearn", "scipy", "ray",
)


def test_start_up_imports_nothing_heavy(tiny_model):
    """Importing llmcli, its CLI, and building an engine and generating (CPU, tiny model) pulls in none of
    torch.compile's machinery, transformers' generation or modelling code, sklearn or ray: on the H200 those
    cost seconds of start-up (transformers 5.17 imports them just to read a Qwen3 config.json)."""
    import subprocess
    import sys

    from tests.processes import env

    code = (
        "import sys, llmcli, llmcli.cli.app\n"
        "from llmcli import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_model)!r}, device='cpu', load_format='dummy', num_kvcache_blocks=16)\n"
        "llm.generate(['hello'], SamplingParams(max_tokens=2, temperature=0.8, top_k=5, seed=1))\n"
        f"print(','.join(m for m in {HEAVY_MODULES!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1:] in ([], [""]), f"heavy modules imported: {out.stdout.strip()}"
