"""Defaults that pay (issue 45): 64-token KV blocks wherever the default is stated, and flash-attn's own 256."""
from __future__ import annotations

import logging
import re
import sys
import types
from pathlib import Path

import orjson
import pytest
import torch
from typer.testing import CliRunner

from llmcli.cli.app import app

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def test_the_block_size_default_is_64_everywhere_it_is_stated(tiny_model):
    from llmcli.config import Config

    assert Config(str(tiny_model), device="cpu").kvcache_block_size == 64
    help_text = " ".join(runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"}).stdout.split())
    assert re.search(r"--kvcache-block-size.*?\[default: 64; 256 with --attention-backend flash-attn\]", help_text)
    # the bench run itself, with no size given
    result = runner.invoke(app, ["bench", "--model", str(tiny_model), "--device", "cpu", "--num-prompts", "2",
                                 "--input-len", "8", "--output-len", "2", "--warmup", "0", "--json",
                                 "--num-kvcache-blocks", "16"])
    assert result.exit_code == 0, result.output
    assert orjson.loads(result.stdout)["kv_cache"]["block_size"] == 64
    # presets leave it to the default (the CPU smoke preset sizes a tiny pool of 16-token blocks on purpose)
    for preset in (REPO / "configs").glob("bench-*.toml"):
        sizes = re.findall(r"^(?:kvcache[-_]block[-_]size|block[-_]size)\s*=\s*(\d+)", preset.read_text(), re.M)
        assert sizes == (["16"] if preset.name == "bench-cpu-smoke.toml" else []), preset.name
    cli = (REPO / "docs" / "cli.md").read_text()
    assert "| `--kvcache-block-size`, `--block-size` |" in cli
    assert re.search(r"`--kvcache-block-size`.*\[default: 64; 256 with --attention-backend flash-attn\] \|", cli)
    assert re.search(r"^\| `kvcache_block_size` \| 64 \(256 with", (REPO / "docs" / "python-api.md").read_text(),
                     re.M)


@pytest.fixture
def fake_cuda_with_flash(monkeypatch):
    """This CPU machine as one sm_90 GPU with flash_attn importable (its functions are never called here)."""
    import llmcli.config as config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(config, "flash_attn_available", lambda: True)
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = fake.flash_attn_with_kvcache = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(config, "_said", set())
    return config


def test_flash_attn_with_an_unset_block_size_runs_at_256_and_says_so_once(tiny_model, fake_cuda_with_flash, caplog):
    pytest.importorskip("triton")  # the flash backend stores K/V with llmcli's Triton kernel
    from llmcli.kernels import make_backend

    config = fake_cuda_with_flash
    with caplog.at_level(logging.WARNING, logger="llmcli"):
        first = config.Config(str(tiny_model), device="cuda", attention_backend="flash-attn", load_format="dummy")
        again = config.Config(str(tiny_model), device="cuda", attention_backend="flash-attn", load_format="dummy")
    assert first.kvcache_block_size == again.kvcache_block_size == 256
    said = [r.getMessage() for r in caplog.records if "flash-attn" in r.getMessage()]
    assert len(said) == 1 and "256" in said[0], said
    # the model runner builds the backend from the config's size
    hf = first.hf_config
    backend = make_backend(first.attention_backend, hf.num_attention_heads, hf.num_key_value_heads,
                           hf.head_dim, hf.head_dim ** -0.5, first.kvcache_block_size)
    assert backend.name == "flash-attn" and backend.block_size == 256
    # a size the user set is theirs: one flash-attn cannot take is an error, not silently replaced
    with pytest.raises(config.ConfigError, match=r"kvcache_block_size=64: the flash-attn backend needs a multiple"):
        config.Config(str(tiny_model), device="cuda", attention_backend="flash-attn", kvcache_block_size=64)
    assert config.Config(str(tiny_model), device="cuda", attention_backend="flash-attn",
                         kvcache_block_size=512).kvcache_block_size == 512
    # the other backends take the default
    assert config.Config(str(tiny_model), device="cuda", attention_backend="triton").kvcache_block_size == 64


def test_auto_picking_flash_attn_takes_its_256_only_when_the_size_is_unset(tiny_model, fake_cuda_with_flash,
                                                                            monkeypatch):
    config = fake_cuda_with_flash
    hf_head_dim = config.Config(str(tiny_model), device="cpu").hf_config.head_dim
    monkeypatch.setitem(config.MEASURED_BACKENDS, (9, hf_head_dim), "flash-attn")  # a hypothetical measurement
    auto = config.Config(str(tiny_model), device="cuda", load_format="dummy")
    assert (auto.attention_backend, auto.kvcache_block_size) == ("flash-attn", 256)
    mine = config.Config(str(tiny_model), device="cuda", load_format="dummy", kvcache_block_size=64)
    assert (mine.attention_backend, mine.kvcache_block_size) == ("triton", 64)
