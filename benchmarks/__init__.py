"""Scripts that measure llmcli on the GPU machine; a package so that bench_vs_hf.py finds its harness first."""
