"""The device-idle analysis of ``benchmarks/step_gaps_gpu.py``: busy time, gaps and their neighbours, from a trace."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.device_idle import Span, idle_report, short, trace_spans  # noqa: E402


def test_gaps_busy_time_and_neighbours_over_two_steps():
    # step 1: gemm 0-10, norm 12-14 (gap 2), sample 14-20; step 2 after a 30 us gap: gemm 50-60, norm 60.5-62,
    # sample 67-70 (gap 5); a copy on another stream overlapping the first gemm counts once
    spans = [Span("gemm<128>", 0, 10), Span("copy", 5, 3), Span("norm", 12, 2), Span("sample", 14, 6),
             Span("gemm<128>", 50, 10), Span("norm", 60.5, 1.5), Span("sample", 67, 3)]
    r = idle_report(spans, steps=2, waits=[Span("cudaEventSynchronize", 30, 15), Span("cudaEventSynchronize", 90, 5)])
    assert r["window_us_per_step"] == pytest.approx(35.0)
    assert r["busy_us_per_step"] == pytest.approx((10 + 8 + 10 + 1.5 + 3) / 2)
    assert r["idle_us_per_step"] == pytest.approx((2 + 30 + 0.5 + 5) / 2)
    assert r["gaps_per_step"] == pytest.approx(2.0)
    by_bucket = {(b["from_us"], b["to_us"]): b["idle_us_per_step"] for b in r["gap_buckets"]}
    assert by_bucket[(0.0, 1.0)] == pytest.approx(0.25)
    assert by_bucket[(1.0, 3.0)] == pytest.approx(1.0)
    assert by_bucket[(3.0, 10.0)] == pytest.approx(2.5)
    assert by_bucket[(10.0, 50.0)] == pytest.approx(15.0)
    worst = r["worst_pairs"][0]
    assert (worst["before"], worst["after"], worst["mean_gap_us"]) == ("sample", "gemm", pytest.approx(30.0))
    assert r["host_wait_us_per_step"] == pytest.approx(7.5)  # the wait outside the window is not counted


def test_trace_spans_keeps_device_records_and_host_waits_only(tmp_path):
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 20, "dur": 1},
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 10, "dur": 2},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 5, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1, "dur": 3},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 2, "dur": 9},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 4},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3},
    ]}
    (tmp_path / "t.json").write_text(json.dumps(trace))
    device, waits = trace_spans(json.loads((tmp_path / "t.json").read_text()))
    assert [s.name for s in device] == ["Memcpy HtoD", "k1", "k2"]
    assert [s.name for s in waits] == ["cudaEventSynchronize"]


def test_short_names_and_an_empty_window():
    assert short("void cutlass::Kernel2<cutlass_80_tensorop>(Params)") == "void cutlass::Kernel2"
    assert short("x" * 60, 10) == "x" * 9 + "…"
    assert idle_report([], steps=3) == {"device_records": 0}


def test_kernel_groups_of_a_window():
    from benchmarks.harness.device_idle import group_times

    spans = [Span("nvjet_sm90_tst_128x64", 0, 10), Span("_decode_partition_kernel", 10, 6),
             Span("_rms_norm_kernel", 16, 2), Span("Memcpy HtoD (Pinned -> Device)", 18, 1),
             Span("nvjet_sm90_tst_128x64", 20, 10), Span("void at::native::index_elementwise_kernel", 30, 2)]
    g = group_times(spans, steps=2)
    assert list(g)[0] == "GEMM" and g["GEMM"] == {"records": 1.0, "us": 10.0}
    assert g["attention"]["us"] == 3.0 and g["elementwise (Triton kernels)"]["us"] == 1.0
    assert g["copies and fills"]["us"] == 0.5 and g["other"]["us"] == 1.0


def test_step_floors_count_every_weight_and_the_batch_kv_once():
    from benchmarks.harness.workload import TINY_CONFIG, model_facts, write_tiny_config
    from benchmarks.step_gaps_gpu import step_floors_ms

    facts = model_facts(write_tiny_config())
    c = TINY_CONFIG
    H, L, V, I = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    layer = H * nh * hd + 2 * H * nkv * hd + nh * hd * H + 3 * H * I + 2 * H + 2 * hd  # tied embeddings
    params = V * H + L * layer + H
    kv_per_token = 2 * L * nkv * hd * 4  # float32
    memory, compute = step_floors_ms(facts, [10, 30], 4, {"copy_bytes_per_s": 1e9, "matmul_flops_per_s": 1e12})
    assert memory == pytest.approx(1e3 * (params * 4 + 40 * kv_per_token) / 1e9)
    assert compute == pytest.approx(1e3 * (2 * (params - V * H) * 2 + 4 * L * nh * hd * 40) / 1e12)
