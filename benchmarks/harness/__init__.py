"""The parts of benchmarks/bench_vs_hf.py, one job a module: output, report and sections, ceilings, workload,
the llmcli run, its decode-step profile, the transformers run, and the physical bound."""
