"""KV groups on a GPU: sliding-window models through the triton kernels and real decode CUDA graphs, with window
blocks given back to the pool (and handed to other sequences) against the same engine laid out as full attention
(``LLMCLI_KV_WINDOW_RELEASE=0``: one group, nothing released). Same kernels, same numbers: the greedy tokens must
be identical, so a graph reading a wrong group's table or slot shows up as a different token. Skipped without
CUDA (on CPU, ``tests/test_triton_kernels.py::test_decode_graph_path_reads_each_kv_groups_tables`` runs the same
staging through eager stand-ins for the graphs)."""
from __future__ import annotations

import pytest
import torch

from test_engine_vs_hf import greedy, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


# blocks of 16 tokens: the full layout's pool holds every sequence at once (no preemption, no waiting), so both
# runs schedule the same steps; the windowed pools hold every sequence's window but fewer blocks than the run
# takes over time, so blocks given back are handed out again
POOLS = {("gemma3", "0"): 120, ("gemma3", "1"): 200, ("mistral-window", "0"): 120, ("mistral-window", "1"): 48,
         ("gemma4", "0"): 120, ("gemma4", "1"): 200}  # Gemma 4: Gemma 3's groups, its layers of two shapes in slabs


@pytest.mark.parametrize("family", ["gemma3", "mistral-window", "gemma4"])
def test_window_release_through_cuda_graphs_changes_no_token(family, tiny_checkpoint, monkeypatch):
    from llmcli import LLM

    model = tiny_checkpoint(family)
    prompts = random_prompts([300, 9, 130, 24, 25, 200, 70, 1], seed=460)  # up to 12 windows of 24 keys
    tokens, steps = {}, {}
    for release in ("0", "1"):
        monkeypatch.setenv("LLMCLI_KV_WINDOW_RELEASE", release)
        llm = LLM(str(model), device="cuda", dtype="bfloat16", attention_backend="triton", enforce_eager=False,
                  kvcache_block_size=16, num_kvcache_blocks=POOLS[family, release], max_num_seqs=8,
                  max_num_batched_tokens=64, max_model_len=512)
        try:
            assert llm.engine.model_runner.graphs is not None
            groups = len(llm.engine.model_runner.rows.group_tables)
            assert groups == (1 if release == "0" or family == "mistral-window" else 3)
            tokens[release] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(64))]
            stats = llm.engine.stats
            assert stats.num_preemptions == 0 and stats.peak_running == len(prompts)
            steps[release] = stats.num_steps
            manager = llm.engine.scheduler.block_manager
            assert manager.num_free_blocks == manager.num_blocks  # every block back, window ones included
        finally:
            llm.shutdown()
    assert steps["1"] == steps["0"]  # the same steps, so the same kernels on the same shapes
    assert tokens["1"] == tokens["0"]
