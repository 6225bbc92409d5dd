"""Bad settings fail early, with messages that name the field (and what to do)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from llmcli.config import ConfigError
from llmcli.sampling_params import SamplingParams, SamplingParamsError


# --------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.1), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-5), "max_tokens"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(min_p=-0.5), "min_p"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_error_is_a_value_error():
    assert issubclass(SamplingParamsError, ValueError)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0), dict(top_p=1.0), dict(top_k=-1), dict(top_k=0), dict(top_k=1),
                                    dict(min_p=0.0), dict(min_p=1.0), dict(max_tokens=1)])
def test_good_sampling_params_at_the_edges(kwargs):
    SamplingParams(**kwargs)


# --------------------------------------------------------------------------
# engine configuration
# --------------------------------------------------------------------------
def _llm(model, **kwargs):
    from llmcli import LLM

    base = dict(device="cpu", dtype="float32", num_kvcache_blocks=64, kvcache_block_size=16)
    base.update(kwargs)
    return LLM(str(model), **base)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_model_len=10**9), "max_model_len"),
        (dict(kvcache_block_size=0), "kvcache_block_size"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(attention_backend="nope"), "attention_backend"),
        (dict(tensor_parallel_size=10**6), "tensor_parallel_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(load_format="pickle"), "load_format"),
        (dict(dtype="float13"), "dtype"),
    ],
)
def test_bad_engine_config(tiny_model, kwargs, field):
    with pytest.raises(ConfigError, match=field):
        _llm(tiny_model, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_on_a_cpu_machine(tiny_model):
    with pytest.raises(ConfigError, match="device"):
        _llm(tiny_model, device="cuda")


def test_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises((ConfigError, FileNotFoundError, OSError, ValueError), match="config.json"):
        _llm(tmp_path)


def test_hub_id_without_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:  # huggingface_hub reads the variable at import time; make sure it sees it
        import huggingface_hub.constants as hub_constants

        monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    except (ImportError, AttributeError):
        pass
    with pytest.raises((ConfigError, FileNotFoundError, OSError, ValueError)) as info:
        _llm("no-such-org/no-such-model")
    message = str(info.value).lower()
    assert "hub" in message or "network" in message or "download" in message, message
    assert "folder" in message or "local" in message or "directory" in message, message


def test_checkpoint_with_a_missing_tensor(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    missing = "model.layers.1.self_attn.k_proj.weight"
    assert missing in tensors
    del tensors[missing]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match=missing.replace(".", r"\.")):
        _llm(broken, load_format="safetensors")


def test_checkpoint_with_a_wrong_shape(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken_shape"
    shutil.copytree(tiny_model, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match="up_proj"):
        _llm(broken, load_format="safetensors")


def test_config_json_that_is_not_json(tiny_model, tmp_path):
    broken = tmp_path / "bad_json"
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").write_text("{ not json")
    with pytest.raises((ConfigError, FileNotFoundError, OSError, ValueError), match="config.json"):
        _llm(broken)


def test_prompt_longer_than_max_model_len(tiny_model):
    llm = _llm(tiny_model, max_model_len=64)
    try:
        with pytest.raises(ValueError, match="prompt 1: .*max_model_len"):
            llm.generate([[5, 6], list(range(3, 103))], SamplingParams(temperature=0.0, max_tokens=4))
        assert not llm.engine.has_unfinished()  # the valid prompt before it was not queued either
        # The engine is still usable afterwards, with nothing left queued or held.
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(out[0]["token_ids"]) == 4
        bm = llm.engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.shutdown()


def test_unknown_engine_keyword(tiny_model):
    with pytest.raises((ConfigError, TypeError), match="no_such_knob"):
        _llm(tiny_model, no_such_knob=3)


def test_unsupported_architecture(tiny_model, tmp_path):
    odd = tmp_path / "odd_arch"
    shutil.copytree(tiny_model, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"] = ["NoSuchModelForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="NoSuchModelForCausalLM"):
        _llm(odd)


def test_flash_backend_without_the_package_says_how_to_install():
    pytest.importorskip("triton")
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here")
    from llmcli.kernels import make_backend

    with pytest.raises(ImportError, match=r"llmcli\[flash\]"):
        make_backend("flash-attn", 8, 2, 64, 0.125, 256)


@pytest.mark.parametrize("capability, flash, want", [
    ((9, 0), True, "triton"),  # flash-attn installed: the old rule took it
    ((9, 0), False, "triton"),
    ((8, 0), True, "triton"),  # (the tiny model's head size is unmeasured anywhere: llmcli's own kernels)
])
def test_auto_attention_backend_follows_the_measured_rule(tiny_model, monkeypatch, capability, flash, want):
    """``auto`` on CUDA is the rule's pick for the GPU and head size, not whatever is installed (Config resolves
    it; the CUDA queries are stood in for on this CPU machine)."""
    import llmcli.config as config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(config, "flash_attn_available", lambda: flash)
    cfg = config.Config(model=str(tiny_model), device="cuda", load_format="dummy")
    assert cfg.attention_backend == want


def test_auto_picks_flash_attn_only_where_measured_faster_and_usable(monkeypatch):
    from llmcli import config

    monkeypatch.setitem(config.MEASURED_BACKENDS, (10, 64), "flash-attn")  # a hypothetical measurement
    assert config.fastest_backend((10, 0), 64, True, 256) == "flash-attn"
    assert config.fastest_backend((10, 0), 64, False, 256) == "triton"  # not installed
    assert config.fastest_backend((10, 0), 64, True, 64) == "triton"  # flash-attn needs 256-token blocks
    assert config.fastest_backend((9, 0), 128, True, 256) == "triton"  # the H200 measurement
