"""The models' facts (shapes, parameter count, EOS ids) and the workload: ``llmcli bench``'s requests."""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any, Iterable

from benchmarks.harness.output import log
from llmcli.cli.bench import Workload, make_requests

REPO = Path(__file__).resolve().parent.parent.parent
DEFAULT_MODELS = ["configs/Qwen3-0.6B", "configs/Qwen3-8B"]
# every filter explicit and EOS ignored: a generation_config.json (Qwen3's: top_k 20, top_p 0.95) must not change
# the workload
NEUTRAL = dict(top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, ignore_eos=True)
TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 512, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    "attention_bias": False, "hidden_act": "silu", "use_cache": True}


def resolve_model(path: str) -> Path:
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (REPO / p).exists():
        p = REPO / p
    return p.resolve()


def write_tiny_config(parent: Path | None = None) -> Path:
    folder = Path(parent or tempfile.mkdtemp(prefix="llmcli-bench-")) / "Qwen3-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    return folder


def model_facts(model_dir: Path) -> dict[str, Any]:
    """Shapes from config.json, analytic parameter count (the family's layout: llmcli's DecoderSpec), EOS ids."""
    import torch

    from llmcli.models import model_class
    from llmcli.models.hub import load_hf_config

    cfg = load_hf_config(Path(model_dir))  # as llmcli reads it (Gemma 4's per-layer shapes included)
    eos: list[int] = []
    try:
        from llmcli.models.hub import load_generation_eos

        eos = load_generation_eos(model_dir, cfg)
    except Exception as exc:  # the workload only uses this to mirror llmcli bench
        log(f"EOS ids not read ({exc}); none avoided")
    spec = model_class(cfg).spec(cfg)
    H, L, V = spec.hidden_size, spec.num_layers, spec.vocab_size
    nh, nkv, hd, inter = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    def per_layer(kind: str) -> int:  # an attention layer of its kind's shape (Gemma 4's global ones: K = V)
        d, kv, k_eq_v = spec.attention_shape(kind)
        return (H * nh * d * (2 if spec.attn_output_gate else 1) + (1 if k_eq_v else 2) * H * kv * d + nh * d * H
                + (4 if spec.sandwich_norms else 2) * H + (2 * d if spec.qk_norm else 0)  # norms
                + ((nh + 2 * kv) * d if spec.qkv_bias else 0) + (H if spec.o_bias else 0))
    kinds, lin = [spec.layer_kind(i) for i in range(L)], spec.linear
    layer_params, linear = sum(per_layer(k) for k in kinds if k != "linear_attention"), kinds.count("linear_attention")
    if lin:  # a Gated DeltaNet layer: in_proj (q, k, v, z, b, a), conv, A_log and dt_bias, norm, out_proj
        key, value = lin.num_k_heads * lin.head_k_dim, lin.num_v_heads * lin.head_v_dim
        layer_params += linear * ((2 * key + 2 * value + 2 * lin.num_v_heads) * H + (2 * key + value) * lin.conv_kernel
                                  + 2 * lin.num_v_heads + lin.head_v_dim + value * H + 2 * H)
    mlp = 3 * H * inter + (2 * inter + H if spec.mlp_bias else 0)  # gate, up, down
    moe = moe_facts(cfg)
    sparse = moe.get("sparse_layers", 0)
    embed, head = V * H, 0 if spec.tie_word_embeddings else V * H
    # every weight but the experts and routers (Gemma 4's experts lie beside each layer's dense MLP)
    dense = embed + head + layer_params + (L if getattr(cfg, "enable_moe_block", False) else L - sparse) * mlp + H
    routed = sparse * (moe.get("router_params", 0) + moe.get("shared_params", 0))
    total = dense + routed + sparse * moe.get("experts", 0) * moe.get("expert_params", 0)
    active = dense + routed + sparse * moe.get("experts_per_tok", 0) * moe.get("expert_params", 0) if moe else total
    # what a decode step reads per sequence beyond the weights: KV of the attention layers (a sliding layer's
    # window at most), each linear layer's states (conv state in the model dtype, the recurrent one in float32)
    state = (2 * key + value) * (lin.conv_kernel - 1) * 2 + lin.num_v_heads * lin.head_k_dim * lin.head_v_dim \
        * (lin.state_dtype or torch.float32).itemsize if lin else 0
    return {"name": model_dir.name, "path": str(model_dir), "hidden": H, "layers": L, "heads": nh, "kv_heads": nkv,
            "head_dim": hd, "intermediate": inter, "vocab": V, "tied_embeddings": spec.tie_word_embeddings,
            "params": total, "params_non_embedding": total - embed - head,
            "params_active_non_embedding": active - embed - head, "eos_token_ids": eos, **moe,
            "attention_layers": L - linear, "sliding_layers": kinds.count("sliding_attention"),
            "sliding_window": spec.sliding_window, "linear_layers": linear, "linear_state_bytes": state,
            **dict(zip(("global_head_dim", "global_kv_heads"), spec.attention_shape("full_attention")[:2]))}


def moe_facts(cfg: Any) -> dict[str, Any]:
    """A mixture of experts' shape (empty for a dense model): the sparse layers, experts per layer and per token,
    parameters of one expert (gate, up, down), of one layer's router and of its shared expert with its gate
    (Qwen3.5-MoE; read every step)."""
    experts = getattr(cfg, "num_experts", 0) or 0
    if not experts:
        return {}
    from llmcli.layers.quantization.mxfp4 import BITS_PER_WEIGHT, is_mxfp4
    from llmcli.models.qwen3_moe import is_sparse_layer

    H, inter = cfg.hidden_size, getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size  # or gpt-oss's
    sparse = sum(is_sparse_layer(cfg, i) for i in range(cfg.num_hidden_layers))
    shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0  # Qwen3.5-MoE: read every step, with its gate
    bits = {"expert_bits": BITS_PER_WEIGHT} if is_mxfp4(cfg) else {}  # MXFP4 experts: read as stored on CUDA
    return {"experts": experts, "experts_per_tok": getattr(cfg, "num_experts_per_tok", None) or cfg.top_k_experts, "sparse_layers": sparse,
            "expert_params": 3 * H * inter, "router_params": experts * H,
            "shared_params": 3 * H * shared + H if shared else 0, **bits}


def add_workload_args(group: Any) -> None:
    """The workload's options (``llmcli bench``'s defaults) on an argparse parser or argument group."""
    group.add_argument("--num-prompts", type=int, default=256)
    group.add_argument("--min-input", type=int, default=100)
    group.add_argument("--max-input", type=int, default=1024)
    group.add_argument("--min-output", type=int, default=100)
    group.add_argument("--max-output", type=int, default=1024)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")


def make_workload(args: argparse.Namespace, facts: dict[str, Any]) -> tuple[list[list[int]], list[int], str]:
    """The requests of ``llmcli bench``, from its own generator."""
    w = Workload(num_prompts=args.num_prompts, input_len=(args.min_input, args.max_input),
                 output_len=(args.min_output, args.max_output), temperature=args.temperature, seed=args.seed)
    reqs = make_requests(w, facts["vocab"], set(facts["eos_token_ids"]))
    return [r[0] for r in reqs], [r[1] for r in reqs], "llmcli.cli.bench.make_requests"


def check_lengths(got: list[int], want: list[int]) -> list[str]:
    """What is wrong with the output lengths (every request must produce exactly its own)."""
    bad = [f"#{i}: {g} != {w}" for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if len(got) != len(want):
        bad.insert(0, f"{len(got)} outputs for {len(want)} requests")
    return bad


def write_requests_jsonl(path: Path, requests: Iterable[tuple[list[int], int]], **fields: Any) -> Path:
    """(prompt ids, output length) pairs as ``llmcli generate`` input: ``prompt_token_ids``, ``max_tokens``,
    and ``fields`` on every record."""
    with path.open("wb") as f:
        for ids, n_out in requests:
            f.write(json.dumps({"prompt_token_ids": ids, "max_tokens": n_out, **fields}).encode() + b"\n")
    return path
