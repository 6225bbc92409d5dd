"""The CPU memory check (issue 45): a model that cannot fit is refused in one line, before anything large is
allocated, with what it needs and what is available."""
from __future__ import annotations

import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes import REPO, env  # noqa: E402

LIMIT = 6 << 30  # a small machine: torch's own mappings take ~1 GiB of it


def _small_machine() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def test_a_32b_dummy_model_is_refused_in_one_line_before_allocating():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "llmcli", "probe-memory", "--model", "configs/Qwen3-32B",
                           "--load-format", "dummy"], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=120, preexec_fn=_small_machine)
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no traceback: refused before the weights were allocated
    found = re.search(r"Qwen3-32B does not fit in memory on CPU: it needs at least ([\d.]+) GiB \(weights "
                      r"([\d.]+) GiB, .*\) but ([\d.]+) GiB is available \(the address-space limit", lines[0])
    assert found, lines[0]
    need, weights, have = map(float, found.groups())
    assert 120 < weights < 125  # 32.8 B float32 parameters: 122.1 GiB
    assert need >= weights and have < LIMIT / (1 << 30) < need
    assert took < 60, took
    assert proc.stdout == ""


def test_the_cgroup_limit_counts(tmp_path, monkeypatch):
    from llmcli.engine import memory_check

    monkeypatch.setattr(memory_check, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(memory_check, "_meminfo", lambda: {"MemAvailable": 64 << 30})
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text(str(1 << 30))
    assert memory_check.available_host_memory() == (64 << 30, "available memory")  # no limit set
    (tmp_path / "memory.max").write_text(str(8 << 30))
    assert memory_check.available_host_memory() == (7 << 30, "the cgroup's memory limit")
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()  # cgroup v1
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(str(4 << 30))
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text(str(1 << 30))
    assert memory_check.available_host_memory() == (3 << 30, "the cgroup's memory limit")


def test_a_model_that_fits_starts_and_the_check_can_be_skipped(tiny_model, monkeypatch):
    from llmcli.config import Config
    from llmcli.engine import memory_check

    config = Config(str(tiny_model), device="cpu", num_kvcache_blocks=8)
    need = memory_check.host_need(config)
    assert 0 < need.weights < need.total < 64 << 20 and need.kv_tokens == 8 * config.kvcache_block_size
    memory_check.check_host_memory(config)  # fits: no error
    monkeypatch.setattr(memory_check, "available_host_memory", lambda: (need.total - 1, "available memory"))
    with pytest.raises(memory_check.HostMemoryTooSmall, match=r"but .* is available \(available memory\)"):
        memory_check.check_host_memory(config)
    monkeypatch.setenv("LLMCLI_MEMORY_CHECK", "0")
    memory_check.check_host_memory(config)
