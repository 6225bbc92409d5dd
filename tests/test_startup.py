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
    every = graph_batch_sizes(512, "")
    assert every[:5] == [1, 2, 4, 8, 16] and every[-1] == 512 and len(every) == 36
    assert graph_batch_sizes(512, "pow2") == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert graph_batch_sizes(100, "pow2")[-1] == 100 and graph_batch_sizes(3, "pow2") == [1, 2, 3]
