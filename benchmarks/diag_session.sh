#!/usr/bin/env bash
# One-off diagnostics call (session 2026-12-01 #2): start-up profile cold/warm, prefill kernels, mask fill on 16 cores.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
S=benchmarks/startup_profile_gpu.py
echo "=== cold 0.6B $(date -u +%T)"; timeout 150 python3 $S --prefill 32x570 --pstats $OUT/cold.pstats > $OUT/cold.log 2>&1; grep -E "^imports|^LLM\(\)" $OUT/cold.log
echo "=== warm 0.6B $(date -u +%T)"; timeout 150 python3 $S --prefill 32x570 --pstats $OUT/warm.pstats > $OUT/warm.log 2>&1; grep -E "^imports|^LLM\(\)|^prefill|^GEMMs" $OUT/warm.log
echo "=== warm pow2 $(date -u +%T)"; LLMCLI_GRAPH_SIZES=pow2 timeout 150 python3 $S > $OUT/pow2.log 2>&1; grep -E "^LLM\(\)" $OUT/pow2.log
echo "=== 8B cold+warm $(date -u +%T)"; for i in 1 2; do timeout 200 python3 $S --model configs/Qwen3-8B --prefill 16x570 > $OUT/8b$i.log 2>&1; grep -E "^LLM\(\)|^prefill|^GEMMs" $OUT/8b$i.log; done
echo "=== importtime $(date -u +%T)"; python3 -X importtime -c "import llmcli.cli.app" 2> $OUT/importtime.log; sort -t'|' -k2 -n $OUT/importtime.log | tail -12
echo "=== mask fill 16 cores $(date -u +%T)"; timeout 120 python3 benchmarks/structured_step_cpu.py --steps 40 2>&1 | tail -15
timeout 120 python3 benchmarks/structured_step_cpu.py --steps 40 --threads 8 2>&1 | tail -6
echo "=== done $(date -u +%T)"
