#!/usr/bin/env bash
# One device-machine call: install carried wheels, then the stages named on the command line.
#   smoke   start-up + a small batch (fails fast if the GPU path is broken)
#   e2e     tests/test_gpu_e2e.py on Qwen3-0.6B and Llama-3.2-1B (bf16 greedy agreement with transformers)
#   kernels tests/test_triton_kernels.py, test_triton_elementwise.py, test_sampler_filter.py on the GPU (bf16, CUDA
#           graphs; ~2 min)
#   bench   benchmarks/bench_vs_hf.py: llmcli vs transformers, ceilings, the physical bound; args in BENCH_ARGS
#   speed   benchmarks/host_step_cpu.py (host ms per decode step), then speed_gpu.py: the default workload on 0.6B
#           and 8B, the prefill-heavy preset on 0.6B, share of the bound (~5 min); args in SPEED_ARGS (e.g.
#           "--preset sampling|families|attention": speed_gpu.py's PRESETS)
#   job     benchmarks/job_gpu.py: `llmcli generate` wall vs the engine alone, args in JOB_ARGS
#           (default: both jobs, each twice; JOB_ARGS="--repeat 1" halves it, "--jobs bench" is ~1 minute)
#   startup benchmarks/startup_gpu.py: process launch to a ready engine; run it FIRST on a fresh machine;
#           args in STARTUP_ARGS
#   logprobs  benchmarks/speed_gpu.py --preset logprobs: the default workload on 0.6B with and without logprobs=5 (cost <= 10%), args in LOGPROBS_ARGS
#   lmeval  benchmarks/lm_eval_gpu.py: lm-eval's llmcli model vs LLM.generate, Qwen3-8B dummy (wheels in .whl/lmeval/)
#   structured  benchmarks/structured_bench.py: unconstrained / one JSON schema / 64 schemas, args in STRUCTURED_ARGS
#   tp      benchmarks/tp_gpu.py (needs 2 GPUs: kind nvidia-h200-x2), args in TP_ARGS
#   dp      benchmarks/dp_gpu.py (one GPU: -dp 1 through the pool; two or more: issue #17's matrix), args in DP_ARGS
#   fp8     tests/test_fp8_kv.py on the GPU, then speed_gpu.py --preset fp8: the FP8 KV cache on 0.6B and FP8
#           weights on 8B against bf16, each against its bound (~5 min)
#   moe     tests/test_triton_moe.py on the GPU, test_gpu_e2e.py on a 4-layer random Qwen3-30B-A3B, then
#           speed_gpu.py --preset moe: Qwen3-30B-A3B against the MoE bound (~6 min)
#   blocks  speed_gpu.py --preset blocks (0.6B, 8B at 64 vs 256), the shared-system-prompt preset (~5 min)
#   hybrid-prefix  the shared-system-prompt preset (5,000 records) on Qwen3.5-9B dummy, prefix cache (state
#           snapshots) on, then off: prompt tokens computed vs unique, wall time (JSON in $OUT) (~6 min)
#   state-rows  a hybrid's states in rows of the KV pool's pages (engine/state_pages.py) on the real path: the
#           Gated DeltaNet kernel and snapshot tests on the GPU, the cut-down Qwen3.5-9B against transformers,
#           probe-memory on Qwen3.6-27B (its rows and max_num_seqs) (~4 min, estimated); then `speed` with
#           SPEED_ARGS for the shares
#   e2e-all tests/test_gpu_e2e.py's first three: Qwen3-0.6B, Llama-3.2-1B, the 4-layer Qwen3-30B-A3B (#31: xfail until it passes) (~6 min)
#   mxfp4-frag the frag MXFP4 kernel on the GPU: its tests, whether an engine gives its memory back
#           (tests/test_shutdown_release.py on CUDA: tiny engines of each KV layout; benchmarks/release_gpu.py)
#           (at most 600 s by its timeouts: a fresh machine's first compilations take minutes)
#   mxfp4-model gpt-oss-20b's default workload and the cut-down gpt-oss e2e through frag (LLMCLI_MXFP4_KERNEL=frag;
#           at most 380 s)
#   mxfp4-tiles the MXFP4 kernels' sm_90 builds with this machine's Triton (3.6) read for register writes under MMAs
#           still in flight (tests/sass_loops.py), then tests/test_gpu_moe_mxfp4_speed.py: the A/B table (scaled,
#           dequant, frag, bf16) and the tile candidates of scaled and frag up to 4,096 tokens, frag's pick also
#           unsettled and its once-refused tiles unchecked (at most 290 s)
#   mxfp4-check one frag MoE layer (benchmarks/moe_layer.py) under compute-sanitizer (initcheck with torch's caching
#           allocator off, so a read of memory no kernel wrote shows; memcheck; racecheck) at the refused 64 x 128 x 64
#           tile, then ncu's speed-of-light, occupancy, memory, warp-stall and instruction sections on the picks at 128
#           and 256 tokens and, unsettled, at 128 (Firecracker machines read the counters; ~5 min, estimated)
#   cache-out  last in a call: Triton's compiled kernels (cubins, PTX, launchers; the intermediate IRs left out)
#           into $OUT/triton-cache.tar.xz, and every *.log of $OUT into $OUT/logs.tar.gz (a call brings back at
#           most 8 files). Put the tarball in .triton-cache/ here and carry that folder with the next calls: a fresh
#           machine then loads those kernels instead of compiling them for minutes (keys unchanged: same source,
#           Triton, ptxas and options). Its size is printed; the tree a call carries is at most 64 MiB.
#   e2e-new its cut-down Qwen3.5-9B, gemma-3-12b-it, gpt-oss-20b, gemma-4-31B (~7 min, estimated); E2E_NEW=mxfp4: gpt-oss's MXFP4 experts (~2 min)
# Retired stages and scripts: benchmarks/RESULTS.md ("Scripts retired ..." sections) says what each answered.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
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
# llmcli's own dependencies that the image may lack (it has no orjson: the fifth session lost a call's first stage
# to that): stop here, naming them, rather than fail inside every stage
MISSING=$(python3 -c "import importlib.util as u; print(' '.join(m for m in ('orjson', 'xxhash', 'typer', 'rich', \
'safetensors', 'transformers') if u.find_spec(m) is None))")
if [ -n "$MISSING" ]; then echo "gpu_session: missing on this machine: $MISSING; carry their wheels in .whl/"; return 1 2>/dev/null || exit 1; fi
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
# One cache path on every machine: a kernel's cache entry names its files by absolute path.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
if [ ! -e "$TRITON_CACHE_DIR/.restored" ] && ls .triton-cache/triton-cache.tar.xz >/dev/null 2>&1; then
  mkdir -p "$TRITON_CACHE_DIR" && tar -xJf .triton-cache/triton-cache.tar.xz -C "$TRITON_CACHE_DIR" \
    && touch "$TRITON_CACHE_DIR/.restored" \
    && echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries restored from .triton-cache/" \
    || echo "triton cache: the carried tarball did not unpack; kernels compile as usual"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    smoke) timeout 240 python3 benchmarks/gpu_smoke.py 2>&1 | tee "$OUT/smoke.log" || exit 1 ;;
    e2e) timeout 420 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_e2e.py -k "0.6B or Llama" 2>&1 | tee "$OUT/e2e.log" ;;
    kernels) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
      tests/test_triton_elementwise.py tests/test_sampler_filter.py 2>&1 | tee "$OUT/kernels.log" | tail -5 ;;
    bench) timeout 430 python3 benchmarks/bench_vs_hf.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" ;;
    speed) timeout 30 python3 benchmarks/host_step_cpu.py --steps 200 2>&1 | tee "$OUT/host_step.log"
      timeout 330 python3 benchmarks/speed_gpu.py ${SPEED_ARGS:-} 2>&1 | tee "$OUT/speed.log" ;;
    # the tokenizer's batch encoding uses its own threads here, as for a user (the session turns them off above)
    job) env -u TOKENIZERS_PARALLELISM timeout 580 python3 benchmarks/job_gpu.py ${JOB_ARGS:-} 2>&1 | tee "$OUT/job.log" ;;
    startup) timeout 420 python3 benchmarks/startup_gpu.py ${STARTUP_ARGS:-} 2>&1 | tee "$OUT/startup.log" ;;
    logprobs) timeout 330 python3 benchmarks/speed_gpu.py --preset logprobs ${LOGPROBS_ARGS:-} 2>&1 | tee "$OUT/logprobs.log" ;;
    lmeval) python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/lmeval/*.whl; timeout 240 python3 benchmarks/lm_eval_gpu.py ${LMEVAL_ARGS:-} 2>&1 | tee "$OUT/lm_eval.log" ;;
    structured) timeout 300 python3 benchmarks/structured_bench.py ${STRUCTURED_ARGS:-} 2>&1 | tee "$OUT/structured.log" ;;
    tp) timeout 560 python3 benchmarks/tp_gpu.py ${TP_ARGS:---stack-dump-after 150} 2>&1 | tee "$OUT/tp.log" ;;
    dp) timeout 590 python3 benchmarks/dp_gpu.py ${DP_ARGS:-} 2>&1 | tee "$OUT/dp.log" ;;
    fp8) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kv.py 2>&1 | tee "$OUT/fp8_kernels.log" | tail -5
      timeout 330 python3 benchmarks/speed_gpu.py --preset fp8 2>&1 | tee "$OUT/fp8.log" ;;
    moe) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_moe.py 2>&1 | tee "$OUT/moe_kernels.log" | tail -5
      timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_e2e.py -k A3B 2>&1 | tee "$OUT/moe_e2e.log"
      timeout 330 python3 benchmarks/speed_gpu.py --preset moe 2>&1 | tee "$OUT/moe.log" ;;
    blocks) timeout 330 python3 benchmarks/speed_gpu.py --preset blocks 2>&1 | tee "$OUT/blocks.log"
      timeout 200 python3 -m llmcli bench --config configs/bench-shared-system-prompt.toml --model configs/Qwen3-0.6B \
        --output "$OUT/shared_system_prompt.json" 2>&1 | tee "$OUT/shared_system_prompt.log" ;;
    hybrid-prefix) for c in enable no-enable; do timeout 280 python3 -m llmcli bench --config configs/bench-shared-system-prompt.toml \
      --model configs/Qwen3.5-9B --num-prompts 5000 --$c-prefix-caching --output "$OUT/hybrid_prefix_$c.json" 2>&1 | tee -a "$OUT/hybrid_prefix.log"; done ;;
    state-rows) timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_gated_delta.py \
      tests/test_hybrid_prefix_cache.py -k "not tile and not timed" 2>&1 | tee "$OUT/state_rows_tests.log" | tail -8
      timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_e2e.py -k "Qwen3.5" 2>&1 \
        | tee "$OUT/state_rows_e2e.log" | tail -8
      timeout 120 python3 -m llmcli probe-memory --model configs/Qwen3.6-27B --load-format dummy 2>&1 \
        | tee "$OUT/state_rows_probe.log" ;;
    e2e-all) timeout 540 python3 -m pytest -q -s -rxX -p no:cacheprovider tests/test_gpu_e2e.py -k "0.6B or Llama or A3B" 2>&1 | tee "$OUT/e2e_all.log" ;;
    mxfp4-frag) timeout 250 python3 -m pytest -q -m gpu -p no:cacheprovider \
            "tests/test_triton_moe_mxfp4.py::test_bf16_at_gpt_oss_20b_shapes" \
            "tests/test_triton_moe_mxfp4.py::test_frag_equals_scaled_at_gpt_oss_20b_shapes" \
            "tests/test_triton_moe_mxfp4.py::test_mxfp4_captured_in_a_cuda_graph" 2>&1 | tee "$OUT/frag_tests.log" | tail -5
        timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_shutdown_release.py 2>&1 \
            | tee "$OUT/frag_release_tests.log" | tail -8
        timeout 200 python3 benchmarks/release_gpu.py --model configs/gpt-oss-20b 2>&1 | tee "$OUT/frag_release.log" ;;
    mxfp4-model) LLMCLI_MXFP4_KERNEL=frag timeout 180 python3 benchmarks/speed_gpu.py --models configs/gpt-oss-20b \
            --variants base --later-variants base --no-prefill-heavy --time-budget 120 2>&1 | tee "$OUT/frag_gpt_oss.log"
        LLMCLI_MXFP4_KERNEL=frag timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_e2e.py \
            -k mxfp4 2>&1 | tee "$OUT/frag_e2e.log" | tail -5 ;;
    mxfp4-check) for tool in initcheck memcheck racecheck; do PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 \
            compute-sanitizer --tool $tool --kernel-name kns=_frag python3 benchmarks/moe_layer.py --tokens 256 \
            --tile 64x128x64x8x3 --unchecked --reps 1 2>&1 | tail -25 | tee "$OUT/frag_$tool.log"; done
        for run in 128 256 128-unsettled; do timeout 150 ncu --clock-control none -k regex:_frag --section SpeedOfLight \
            --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats --section InstructionStats \
            python3 benchmarks/moe_layer.py --tokens ${run%%-*} $([ "${run#*-}" = unsettled ] && echo --unsettled) \
            --reps 1 2>&1 | tee "$OUT/frag_ncu_$run.log" | grep -v "^==PROF==" | tail -120; done ;;
    mxfp4-tiles) timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_mxfp4_fragments.py \
            tests/test_triton_moe_mxfp4.py -k "k_loop or compile_for_sm90" 2>&1 | tee "$OUT/frag_sass.log" | tail -5
        timeout 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu_moe_mxfp4_speed.py 2>&1 \
            | tee "$OUT/frag_speed.log" ;;
    cache-out) (cd "$TRITON_CACHE_DIR" && XZ_OPT="-T0 -6" tar --exclude='*.llir' --exclude='*.ttir' --exclude='*.ttgir' \
            --exclude='*.source' --exclude=.restored -cJf "$OUT/triton-cache.tar.xz" .) \
        && echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries, $(du -h "$OUT/triton-cache.tar.xz" | cut -f1) \
packed into \$OUT/triton-cache.tar.xz"
        (cd "$OUT" && ls *.log >/dev/null 2>&1 && tar -czf logs.tar.gz *.log && rm -f *.log) ;;
    e2e-new) timeout 500 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_e2e.py -k "${E2E_NEW:-(Qwen3.5 or gemma or gpt-oss) and not mxfp4}" 2>&1 | tee "$OUT/e2e_new.log" ;;
    *) echo "unknown stage $stage (see the list at the top of benchmarks/gpu_session.sh)"; exit 2 ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S)"
