"""The physical bound of a workload on this machine: the least time its bytes and FLOPs take at the ceilings.

The floor is a sum of terms. A term (``Term``) is one amount of work of the workload, bytes moved or
FLOPs done, over one ceiling (the copy bandwidth or the matmul rate). To add one (a decode FLOPs term for
prefill-heavy workloads, say), write its amount as a function of ``Shape`` and put a ``Term`` in ``TERMS``:
the floor, the JSON, the printed derivation and the bound table all follow ``TERMS``.

FP8: with FP8 weights (``weight_elem_bytes=1``) the linear layers' weights are read at one byte each (the
embedding and lm_head stay 16-bit) and the prefill linear FLOPs run at the measured FP8 matmul rate
(``fp8_matmul_flops_per_s``); an FP8 KV cache (``kv_elem_bytes=1``) reads one byte per cached element.

Weights a decode step reads: all of them but an untied input embedding table, of which it gathers its tokens'
rows only (a tied table is read whole as the LM head). Shares recorded before 2026-12-04's thirteenth session
counted that table as read every step (benchmarks/RESULTS.md says by how much).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from benchmarks.harness.output import fmt_f, md_table, say


@dataclass(frozen=True)
class Shape:
    """What the terms know of a model and a workload."""

    facts: dict[str, Any]  # workload.model_facts
    prompt_lens: list[int]
    output_lens: list[int]
    elem_bytes: int
    max_concurrent: int | None = None  # the engine's max_num_seqs; None: every request runs at once
    weight_elem_bytes: int | None = None  # bytes per linear-layer weight (1: FP8); None: elem_bytes
    kv_elem_bytes: int | None = None  # bytes per KV-cache element (1: FP8 cache); None: elem_bytes
    kv_pool_bytes: int | None = None  # the engine's KV pool; None: as large as the workload needs

    @property
    def fp8_weights(self) -> bool:
        return self.weight_elem_bytes == 1

    @property
    def decode_steps(self) -> int:
        """The fewest decode steps possible: the longest output, or every output token at max_concurrent a step,
        or, as no step can hold more KV than the pool, the KV every decode step reads over the pool's bytes (where
        the pool is known: a model whose context of a few hundred sequences outgrows the memory, Gemma 4-31B).
        Dense models only: a mixture of experts' steps are ``decode_batches``'."""
        steps = max(self.output_lens)
        if self.max_concurrent:
            steps = max(steps, -(-sum(self.output_lens) // self.max_concurrent))
        if self.kv_pool_bytes:
            steps = max(steps, -(-int(self.kv_read) // self.kv_pool_bytes))
        return steps

    @property
    def input_table(self) -> int:
        """Parameters of an untied input embedding table, which a decode step does not read: it gathers its
        tokens' rows (``rows_gathered``). A tied table is read whole, as the LM head."""
        f = self.facts
        return 0 if f.get("tied_embeddings", True) else f["vocab"] * f["hidden"]

    @property
    def rows_gathered(self) -> int:
        """Bytes of an untied input table's rows the decode steps gather: one per output token."""
        return sum(self.output_lens) * self.facts["hidden"] * self.elem_bytes if self.input_table else 0

    @property
    def weight_bytes(self) -> int:
        """What a decode step reads of the weights: all but an untied input table."""
        linear = self.facts["params_non_embedding"]
        return linear * (self.weight_elem_bytes or self.elem_bytes) \
            + (self.facts["params"] - linear - self.input_table) * self.elem_bytes

    @property
    def decode_batches(self) -> list[int]:
        """Requests decoding at each decode step, for a mixture of experts (whose bytes per step depend on the
        batch): every request at once, each until its own output is done; with max_concurrent, requests in
        input order, each admitted when a slot frees (then there may be more steps than ``decode_steps``)."""
        cap = self.max_concurrent or len(self.output_lens)
        waiting, running, batches = list(self.output_lens), [], []
        while waiting or running:
            while waiting and len(running) < cap:
                running.append(waiting.pop(0))
            batches.append(len(running))
            running = [left - 1 for left in running if left > 1]
        return batches

    @property
    def expert_bytes(self) -> float:  # MXFP4 experts (gpt-oss) at their 4.25 bits, read as stored
        return self.facts.get("expert_params", 0) * self.facts.get("expert_bits", 8 * self.elem_bytes) / 8

    @property
    def dense_weight_bytes(self) -> int:
        """What every decode step reads whatever the routing: all weights but the experts."""
        f = self.facts
        return (f["params"] - self.input_table - f.get("sparse_layers", 0) * f.get("experts", 0)
                * f.get("expert_params", 0)) * self.elem_bytes

    @property
    def experts_touched(self) -> float:
        """Distinct experts read over the decode steps, summed over steps and sparse layers (expected value)."""
        f = self.facts
        return f.get("sparse_layers", 0) * sum(expected_experts_touched(f["experts"], f["experts_per_tok"], b)
                                               for b in self.decode_batches) if f.get("experts") else 0.0

    @property
    def weights_read(self) -> float:
        """Dense models: every weight each decode step. Mixtures of experts: the dense part each step plus the
        experts the step's batch touches (expected under uniform routing, ``expected_experts_touched``), over
        the steps of ``decode_batches``."""
        if not self.facts.get("experts"):
            return self.decode_steps * self.weight_bytes + self.rows_gathered
        return len(self.decode_batches) * self.dense_weight_bytes + self.experts_touched * self.expert_bytes \
            + self.rows_gathered

    @property
    def kv_layer_bytes(self) -> tuple[int, int]:  # K and V of a token in a (full, sliding) layer (Gemma 4: two shapes)
        f, size = self.facts, 2 * (self.kv_elem_bytes or self.elem_bytes)
        return size * f.get("global_kv_heads", f["kv_heads"]) * f.get("global_head_dim", f["head_dim"]), \
            size * f["kv_heads"] * f["head_dim"]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over the attention layers (a hybrid's linear layers keep none)."""
        f, (full, local) = self.facts, self.kv_layer_bytes
        return (attention_layers(f) - f.get("sliding_layers", 0)) * full + f.get("sliding_layers", 0) * local

    @property
    def head_dims(self) -> int:  # the attention layers' head sizes summed (Gemma 4's full layers: global_head_dim)
        f, sliding = self.facts, self.facts.get("sliding_layers", 0)
        return (attention_layers(f) - sliding) * f.get("global_head_dim", f["head_dim"]) + sliding * f["head_dim"]

    @property
    def kv_tokens_read(self) -> int:
        return sum(o * i + o * (o - 1) // 2 for i, o in zip(self.prompt_lens, self.output_lens))  # sum_{t<O} (I + t)

    @property
    def kv_read(self) -> float:
        """Every attention layer reads each step's whole context, a sliding layer at most its window."""
        f, window = self.facts, self.facts.get("sliding_window") or 0
        if not f.get("sliding_layers"):
            return self.kv_tokens_read * self.kv_bytes_per_token
        windowed = sum(min(i + t, window) for i, o in zip(self.prompt_lens, self.output_lens) for t in range(o))
        full, local = self.kv_layer_bytes
        return (attention_layers(f) - f["sliding_layers"]) * self.kv_tokens_read * full \
            + f["sliding_layers"] * windowed * local

    @property
    def state_bytes(self) -> int:
        """A hybrid's linear layers: each decode step reads and writes every running sequence's states."""
        return 2 * self.facts.get("linear_layers", 0) * self.facts.get("linear_state_bytes", 0) * sum(self.output_lens)


def expected_experts_touched(experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch of ``batch`` tokens reads in one layer when each token picks ``top_k`` of
    ``experts`` uniformly at random: an expert is missed by one token with probability 1 - k/E, by all of them
    with (1 - k/E)^B, so E * (1 - (1 - k/E)^B) are read. (Real routers are skewed: fewer distinct experts, so
    this is a bound for a balanced router, not a measured count.)"""
    return experts * (1.0 - (1.0 - top_k / experts) ** batch)


@dataclass(frozen=True)
class Ceiling:
    """A rate of the machine (a key of the report's ``ceilings``), as the formula names it and its unit."""

    key: str
    symbol: str
    unit: str  # of the amount, in the bound table

    def show(self, amount: float) -> str:
        return f"{amount / 1e12:.3f} TB" if self.unit == "TB" else f"{amount / 1e12:.1f} TFLOP"


COPY = Ceiling("copy_bytes_per_s", "copy_bw", "TB")
MATMUL = Ceiling("matmul_flops_per_s", "matmul_rate", "TFLOP")
MATMUL_FP8 = Ceiling("fp8_matmul_flops_per_s", "fp8_matmul_rate", "TFLOP")


@dataclass(frozen=True)
class Term:
    """One part of the floor: ``amount(shape) / ceiling``.

    In the JSON the amount is ``amount_key`` and its time ``t_<name>_s``; ``column`` is the bound table's
    column it is summed into (terms of one column share one printed line); ``detail`` says the amount in
    the printed derivation, from the bound's dict.
    """

    name: str
    amount_key: str
    ceiling: Ceiling
    formula: str
    column: str
    amount: Callable[[Shape], float]
    detail: Callable[[dict[str, Any]], str]

    @property
    def time_key(self) -> str:
        return f"t_{self.name}_s"


def _weights_detail(b: dict[str, Any]) -> str:
    rows = f" + {b['rows_gathered_bytes'] / 1e9:.3f} GB of input-table rows" if b["rows_gathered_bytes"] else ""
    if not b.get("experts_touched"):
        return (f"weights: {b['decode_steps']} x {b['weight_bytes'] / 1e9:.3f} GB{rows} = "
                f"{b['weights_read_bytes'] / 1e12:.3f} TB")
    return (f"weights: {b['decode_steps']} x {b['dense_weight_bytes'] / 1e9:.3f} GB dense + "
            f"{b['experts_touched']:,.0f} experts touched (uniform routing, E(1-(1-k/E)^B) per layer and step) x "
            f"{b['expert_bytes'] / 1e6:.2f} MB{rows} = {b['weights_read_bytes'] / 1e12:.3f} TB")


TERMS: tuple[Term, ...] = (
    Term("weights", "weights_read_bytes", COPY,
         "decode_steps x weight_bytes (MoE: steps x dense_weight_bytes + experts touched x expert_bytes) + rows "
         "gathered of an untied input table", "weights read",
         lambda s: s.weights_read, _weights_detail),
    Term("kv", "kv_read_bytes", COPY, "KV tokens read (sliding layers: the window) x kv_bytes_per_token",
         "KV + state read", lambda s: s.kv_read,
         lambda b: f"KV: {b['kv_tokens_read']:,} tokens x {b['kv_bytes_per_token']:,} B (sliding layers: the window) "
                   f"= {b['kv_read_bytes'] / 1e12:.3f} TB"),
    Term("states", "state_rw_bytes", COPY, "2 x linear layers x state bytes x output tokens", "KV + state read",
         lambda s: s.state_bytes, lambda b: f"linear-layer states read + written: {b['state_rw_bytes'] / 1e12:.3f} TB"),
    Term("prefill_linear", "prefill_linear_flops", MATMUL, "2 x active params_non_embedding x prompt tokens",
         "prefill FLOPs", lambda s: 0 if s.fp8_weights else 2 * active_params(s.facts) * sum(s.prompt_lens),
         lambda b: f"prefill linear: {b['prefill_linear_flops'] / 1e12:.2f} TFLOP"),
    Term("prefill_linear_fp8", "prefill_linear_fp8_flops", MATMUL_FP8,
         "2 x params_non_embedding x prompt tokens (FP8 weights)", "prefill FLOPs",
         lambda s: 2 * active_params(s.facts) * sum(s.prompt_lens) if s.fp8_weights else 0,
         lambda b: f"prefill linear FP8: {b['prefill_linear_fp8_flops'] / 1e12:.2f} TFLOP"),
    Term("prefill_attention", "prefill_attention_flops", MATMUL, "4 x attention layers x heads x head_dim x sum(I^2)/2",
         "prefill FLOPs",
         lambda s: 4 * s.facts["heads"] * s.head_dims * sum(i * i for i in s.prompt_lens) / 2,
         lambda b: f"prefill attention: {b['prefill_attention_flops'] / 1e12:.2f} TFLOP"),
)


def active_params(facts: dict[str, Any]) -> int:
    """Parameters outside the embeddings that one token's forward multiplies by (MoE: its k experts only)."""
    return facts.get("params_active_non_embedding", facts["params_non_embedding"])


def attention_layers(facts: dict[str, Any]) -> int:
    return facts.get("attention_layers", facts["layers"])


def _grouped(by: Callable[[Term], Any]) -> dict[Any, list[Term]]:
    groups: dict[Any, list[Term]] = {}
    for term in TERMS:
        groups.setdefault(by(term), []).append(term)
    return groups


def physical_bound(facts: dict[str, Any], prompts: list[list[int]], outs: list[int], ceilings: dict[str, Any],
                   elem_bytes: int, max_concurrent: int | None = None, weight_elem_bytes: int | None = None,
                   kv_elem_bytes: int | None = None, kv_pool_bytes: int | None = None) -> dict[str, Any]:
    """Every term's amount, and with the ceilings its terms need known, their times, the floor and its tok/s.

    ``max_concurrent`` (the engine's max_num_seqs) bounds how many requests decode in one step; without it
    every request is taken to run at once (right for the default workload's 256 requests).
    ``weight_elem_bytes`` / ``kv_elem_bytes``: 1 for FP8 weights / an FP8 KV cache (module docstring).
    ``kv_pool_bytes``: the engine's KV pool, which bounds the KV a step holds (``Shape.decode_steps``).
    """
    s = Shape(facts, [len(p) for p in prompts], outs, elem_bytes, max_concurrent, weight_elem_bytes, kv_elem_bytes,
              kv_pool_bytes)
    out: dict[str, Any] = {
        "elem_bytes": elem_bytes, "decode_steps": s.decode_steps, "max_concurrent": max_concurrent,
        "kv_pool_bytes": kv_pool_bytes, "weight_bytes": s.weight_bytes, "rows_gathered_bytes": s.rows_gathered,
        "kv_bytes_per_token": s.kv_bytes_per_token, "kv_tokens_read": s.kv_tokens_read,
        **({"dense_weight_bytes": s.dense_weight_bytes, "expert_bytes": s.expert_bytes,
            "experts_touched": s.experts_touched} if facts.get("experts") else {}),
        **{t.amount_key: t.amount(s) for t in TERMS},
        # decode compute: memory-bound, so reported beside the floor rather than in it
        "output_tokens": sum(outs), "decode_flops_info": 2 * active_params(facts) * sum(outs)
        + 4 * facts["heads"] * s.head_dims * s.kv_tokens_read,
    }
    rates = {t.ceiling.key: ceilings.get(t.ceiling.key) for t in TERMS if out[t.amount_key]}
    if all(rates.values()):
        out.update({t.time_key: out[t.amount_key] / rates[t.ceiling.key] if out[t.amount_key] else 0.0
                    for t in TERMS})
        out["floor_s"] = sum(out[t.time_key] for t in TERMS)
        out["floor_tok_s"] = sum(outs) / out["floor_s"]
        out["t_decode_compute_info_s"] = out["decode_flops_info"] / rates[MATMUL.key]
    return out


def print_bound(name: str, b: dict[str, Any]) -> None:
    say(f"\nphysical bound, {name}:")
    for i, (ceiling, terms) in enumerate(_grouped(lambda t: t.ceiling).items()):
        say(f"  {'floor =' if i == 0 else '      +'} ({' + '.join(t.formula for t in terms)}) / {ceiling.symbol}")
    if b.get("kv_pool_bytes"):
        say(f"  decode steps = max(max(O), ceil(sum(O) / max_num_seqs = {b['max_concurrent']}), ceil(KV read / KV pool "
            f"= {b['kv_pool_bytes'] / 1e9:.1f} GB)) = {b['decode_steps']}")
    elif b.get("max_concurrent"):
        say(f"  decode steps = max(max(O), ceil(sum(O) / max_num_seqs = {b['max_concurrent']})) = {b['decode_steps']}")
    else:
        say(f"  decode steps = max(O) = {b['decode_steps']} (assumption: all requests run concurrently)")
    for terms in _grouped(lambda t: t.column).values():
        say("  " + "; ".join(f"{t.detail(b)} -> {fmt_f(b.get(t.time_key), 3)} s" for t in terms))
    say(f"  floor = {fmt_f(b.get('floor_s'), 3)} s = {fmt_f(b.get('floor_tok_s'), 0)} output tok/s "
        f"(decode compute, not in the floor as decode is memory-bound: {b['decode_flops_info'] / 1e12:.1f} TFLOP = "
        f"{fmt_f(b.get('t_decode_compute_info_s'), 3)} s at the matmul rate)")


def bound_table(bounds: dict[str, dict[str, Any]]) -> str | None:
    """One row per workload: each column's amount and time, then the floor; None without bounds."""
    if not bounds:
        return None
    columns = _grouped(lambda t: t.column)
    header = ["workload", "decode steps"]
    for column in columns:
        header += [column, "s"]
    rows = []
    for name, b in bounds.items():
        row: list[Any] = [name, b["decode_steps"]]
        for terms in columns.values():
            row.append(terms[0].ceiling.show(sum(b[t.amount_key] for t in terms)))
            row.append(fmt_f(sum(b[t.time_key] for t in terms) if b.get("floor_s") else None, 3))
        rows.append(row + [fmt_f(b.get("floor_s"), 3), fmt_f(b.get("floor_tok_s"), 0)])
    return md_table(header + ["floor s", "floor tok/s"], rows)
