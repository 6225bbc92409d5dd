#!/usr/bin/env bash
# One device-machine call: install carried wheels, then the stages named on the command line.
#   smoke   start-up + a small batch (fails fast if the GPU path is broken)
#   e2e     tests/test_gpu_e2e.py (bf16 greedy agreement with transformers) and the triton kernel tests
#   kernels tests/test_triton_kernels.py + test_triton_elementwise.py on the GPU, then benchmarks/fused_store_gpu.py
#           (q/k norm+rotary with the KV store fused in vs the two kernels: µs per forward, same bits; < 1 min)
#   bench   benchmarks/bench_vs_hf.py, extra args in BENCH_ARGS
#   tp      benchmarks/tp_gpu.py (needs 2 GPUs: kind nvidia-h200-x2), extra args in TP_ARGS
#   dp      benchmarks/dp_gpu.py (one GPU: -dp 1 through the pool; two or more: issue #17's matrix), args in DP_ARGS
#   stopped-rank  benchmarks/stopped_rank_gpu.py: SIGSTOP of a TP=2 rank, heartbeat limit 5 s (needs 2 GPUs)
#   logprobs  benchmarks/logprobs_cost.py: bench workload with and without logprobs=5 (issue 15: cost <= 10%)
#   structured  benchmarks/structured_step_cpu.py (the mask fill on this host, one template vs independent ones),
#           then benchmarks/structured_bench.py: bench workload unconstrained / one JSON schema / 64 schemas
#           (needs .whl/llguidance-*.whl), extra args in STRUCTURED_ARGS
#   speed   issue #13 (one H200, <= 6 min): benchmarks/host_step_cpu.py (host ms per decode step on this CPU), then
#           benchmarks/speed_gpu.py (mixed_steps, sample_in_graph, decode_gemm on/off; share of bound; Triton compiles mid-run), args in SPEED_ARGS
#   elementwise  issues #13/#12 (~4 min): start-up + 32x570 prefill profile with the Triton elementwise kernels
#           (startup_profile_gpu.py), tests/test_triton_elementwise.py on the GPU (bf16, CUDA graph), then
#           benchmarks/elementwise_gpu.py (torch.compile vs the kernels: µs, GB/s, max diff), args in ELEMENTWISE_ARGS
#   decode-attn  issue #13 (<= 2 min): benchmarks/decode_attention_gpu.py: split-KV paged decode attention as the
#           engine runs it, split-count and launch candidates at batch <= 64, Qwen3-0.6B/8B heads,
#           batch 1-256 x context 256-4096, in CUDA graphs; args in DECODE_ATTN_ARGS
#   job     benchmarks/job_gpu.py: `llmcli generate` wall vs the engine alone (issue 12), extra args in JOB_ARGS
#           (default: both jobs, each twice; JOB_ARGS="--repeat 1" halves it, "--jobs bench" is ~1 minute)
#   host-diag  benchmarks/host_diag_gpu.py (issue #13, ~2 min): host phases' wall vs CPU time, busy threads, settings;
#           decode step graph time vs kernel time at batches 256/64/16; args in HOST_DIAG_ARGS
#   launch  benchmarks/launch_overhead_gpu.py (issue #13, ~20 s): host cost of one eager kernel launch, by wrapper
#   startup benchmarks/startup_gpu.py: process launch to a ready engine, 0.6B x3 (first = cold on a fresh machine),
#           0.6B with every16 and pow2 graph sizes, 8B x2; run it FIRST on a fresh machine; args in STARTUP_ARGS.
#           Then benchmarks/sampler_check_gpu.py: the Triton sampler (now also behind top-k/top-p) on every path
#   prefill-graphs  benchmarks/prefill_graphs_gpu.py: prefill_graphs on vs off in one engine (greedy agreement, a
#           prefill-heavy-shaped job of --prompts N, default 6000, twice each way; ~1.5 min), args in PREFILL_GRAPHS_ARGS
#   prefill-attn  benchmarks/prefill_attention_gpu.py: the prefill attention kernel, old vs new and a tile sweep
#           (issue #13, ~3 min), extra args in PREFILL_ATTN_ARGS ("--no-sweep": defaults only)
#   decode-gemm  benchmarks/decode_gemm_gpu.py: the split-K Triton thin GEMM vs cuBLAS, PDL on/off (correctness,
#           then ms per decode GEMM chain in a CUDA graph; ~2 min), then the GPU thin-GEMM/PDL kernel tests;
#           args in DECODE_GEMM_ARGS
#   gemm-templates  benchmarks/gemm_templates_gpu.py: cuBLAS vs Inductor's max-autotune per decode GEMM shape (8B,
#           batch 128/256 by default; ~2-4 min of tuning), args in GEMM_TEMPLATES_ARGS
#   decode-chain  benchmarks/decode_chain_compile_gpu.py: the decode forward without attention, llmcli's kernels vs
#           Inductor's fusion (default and max-autotune; 0.6B, batch 64/128/256 by default), args in DECODE_CHAIN_ARGS
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Print every torch.compile recompilation and its reason (run 3 saw 491 ms prefill launches; suspect).
export TORCH_LOGS=${TORCH_LOGS:-recompiles}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  # installed once per machine, so that two sessions can run side by side (one per GPU)
  [ -e /tmp/site/.done ] || { python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && touch /tmp/site/.done; }
  export PYTHONPATH=/tmp/site:$PWD
  # a carried transformers wheel (with its tokenizers/hub) that does not import here is dropped, not fatal
  python3 -c "import transformers, tokenizers, huggingface_hub" 2>/dev/null || { echo "carried transformers does not \
import: using the image's"; rm -rf /tmp/site/transformers* /tmp/site/tokenizers* /tmp/site/huggingface_hub* \
    /tmp/site/safetensors* /tmp/site/hf_xet*; }
else
  export PYTHONPATH=$PWD
fi
# The image's torch has no usable .pyc files (run 18: 1,483 modules compiled from source at every start, ~5 s).
# A pip install writes them once; so does this, into a cache folder, once per machine and outside the timings.
PYC_STATE=$(python3 -c "import sys, os, glob, importlib.util as u; d = os.path.dirname(u.find_spec('torch').origin); \
print('dont_write_bytecode', sys.flags.dont_write_bytecode, 'torch pycs', len(glob.glob(d + '/__pycache__/*.cpython-312.pyc')), \
'writable', os.access(d + '/__pycache__', os.W_OK))")
echo "pyc: $PYC_STATE"
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
[ -e /tmp/pycache/.done ] || { T=$(date +%s); python3 -m compileall -q -j 16 \
  "$(python3 -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('torch').origin))")" \
  "$(python3 -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('triton').origin))")" \
  /tmp/site "$PWD/llmcli" >/dev/null 2>&1; mkdir -p /tmp/pycache; touch /tmp/pycache/.done; \
  echo "pyc: compiled in $(( $(date +%s) - T )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    smoke) timeout 240 python3 benchmarks/gpu_smoke.py 2>&1 | tee "$OUT/smoke.log" || exit 1 ;;
    e2e) timeout 420 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_e2e.py 2>&1 | tee "$OUT/e2e.log" ;;
    kernels) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_elementwise.py \
      2>&1 | tee "$OUT/kernels.log" | tail -5
      timeout 120 python3 benchmarks/fused_store_gpu.py 2>&1 | tee "$OUT/fused_store.log" | tail -13 ;;
    # start-up first, so that the elementwise kernels' Triton cache is as cold as the machine's (run 18 to compare)
    elementwise) timeout 150 python3 benchmarks/startup_profile_gpu.py --prefill 32x570 > "$OUT/elementwise_startup.log" 2>&1
      grep -E "^imports|^LLM\(\)|^prefill|^GEMMs" "$OUT/elementwise_startup.log"
      grep -A14 -E "^ +ms +calls +kernel" "$OUT/elementwise_startup.log"
      timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_triton_elementwise.py 2>&1 | tail -5
      timeout 300 python3 benchmarks/elementwise_gpu.py ${ELEMENTWISE_ARGS:-} 2>&1 | tee "$OUT/elementwise.log" ;;
    decode-attn) timeout 170 python3 benchmarks/decode_attention_gpu.py ${DECODE_ATTN_ARGS:-} 2>&1 \
      | tee "$OUT/decode_attn.log" ;;
    tp) timeout 560 python3 benchmarks/tp_gpu.py ${TP_ARGS:---stack-dump-after 150} 2>&1 | tee "$OUT/tp.log" ;;
    stopped-rank) timeout 330 python3 benchmarks/stopped_rank_gpu.py 2>&1 | tee "$OUT/stopped_rank.log" ;;
    logprobs) timeout 300 python3 benchmarks/logprobs_cost.py ${LOGPROBS_ARGS:-} 2>&1 | tee "$OUT/logprobs.log" ;;
    # the tokenizer's batch encoding uses its own threads here, as for a user (the session turns them off above)
    job) env -u TOKENIZERS_PARALLELISM timeout 580 python3 benchmarks/job_gpu.py ${JOB_ARGS:-} 2>&1 | tee "$OUT/job.log" ;;
    startup) timeout 420 python3 benchmarks/startup_gpu.py ${STARTUP_ARGS:-} 2>&1 | tee "$OUT/startup.log"
      [ -n "${SKIP_SAMPLER_CHECK:-}" ] || timeout 120 python3 benchmarks/sampler_check_gpu.py 2>&1 | tail -8 \
        | tee "$OUT/sampler_check.log" ;;
    launch) timeout 120 python3 benchmarks/launch_overhead_gpu.py ${LAUNCH_ARGS:-} 2>&1 | tee "$OUT/launch.log" ;;
    host-diag) timeout 300 python3 benchmarks/host_diag_gpu.py ${HOST_DIAG_ARGS:-} 2>&1 | tee "$OUT/host_diag.log" ;;
    bench) timeout 430 python3 benchmarks/bench_vs_hf.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" ;;
    dp) timeout 590 python3 benchmarks/dp_gpu.py ${DP_ARGS:-} 2>&1 | tee "$OUT/dp.log" ;;
    speed) timeout 30 python3 benchmarks/host_step_cpu.py --steps 200 2>&1 | tee "$OUT/host_step.log"
      timeout 330 python3 benchmarks/speed_gpu.py ${SPEED_ARGS:-} 2>&1 | tee "$OUT/speed.log" ;;
    # the host's mask fill alone first: every matcher a copy of one template (--shards 1, the old way), then
    # the compiler's independent templates (copies of one template share a lexer lock)
    structured) timeout 60 python3 benchmarks/structured_step_cpu.py --steps 40 --shards 1 2>&1 | tail -3 \
        | tee "$OUT/structured_step.log"
      timeout 60 python3 benchmarks/structured_step_cpu.py --steps 40 2>&1 | tail -1 | tee -a "$OUT/structured_step.log"
      timeout 300 python3 benchmarks/structured_bench.py ${STRUCTURED_ARGS:-} 2>&1 | tee "$OUT/structured.log" ;;
    prefill-graphs) timeout 300 python3 benchmarks/prefill_graphs_gpu.py ${PREFILL_GRAPHS_ARGS:-} 2>&1 \
      | tee "$OUT/prefill_graphs.log" ;;
    decode-gemm) timeout 300 python3 benchmarks/decode_gemm_gpu.py ${DECODE_GEMM_ARGS:-} 2>&1 | tee "$OUT/decode_gemm.log"
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "gemm or pdl" 2>&1 | tail -4 ;;
    gemm-templates) timeout 400 python3 benchmarks/gemm_templates_gpu.py ${GEMM_TEMPLATES_ARGS:-} 2>&1 \
      > "$OUT/gemm_templates.log"; grep -v -i "autotune\|triton_mm\|^ *mm " "$OUT/gemm_templates.log" | tail -40 ;;
    decode-chain) timeout 500 python3 benchmarks/decode_chain_compile_gpu.py ${DECODE_CHAIN_ARGS:-} 2>&1 \
      > "$OUT/decode_chain.log"; grep -v -i "autotune\|triton_mm\|^ *mm \|recompil" "$OUT/decode_chain.log" | tail -40 ;;
    prefill-attn) timeout 330 python3 benchmarks/prefill_attention_gpu.py ${PREFILL_ATTN_ARGS:-} 2>&1 \
      | tee "$OUT/prefill_attn.log" ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S)"
