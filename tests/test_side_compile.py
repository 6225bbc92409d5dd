"""Start-up's side compile: the kernel launches it makes on worker threads, on the tiny model's real shapes.

Without CUDA the kernels run under Triton's interpreter, so every launch here is a real one: a launch that
would fail on the GPU for a silly reason (a wrong argument, a shape) fails here first.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from llmcli.engine.cuda_graphs import graph_batch_sizes  # noqa: E402
from llmcli.engine.side_compile import SideCompile, kernel_tasks  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_side_compile_runs_every_kernel_task_on_the_models_shapes(tiny_model):
    from llmcli.config import Config

    cfg = Config(str(tiny_model), device="cpu", dtype="float32")
    vocab = cfg.hf_config.vocab_size
    launched = []
    tasks = kernel_tasks(vocab, torch.float32, DEVICE)
    wrapped = [lambda t=t: launched.append(t()) for t in tasks]
    # one worker: Triton's interpreter patches triton.language while it runs a kernel, so two kernels
    # interpreted at once on two threads trip over each other (compiled kernels on a GPU do not)
    side = SideCompile(wrapped, DEVICE, workers=1 if DEVICE.type == "cpu" else 4)
    assert side.join() == 0 and side.join() == 0
    # 2 samplers (the model's dtype and float32) and 2 logprobs widths (1 and 5)
    assert len(tasks) == 4
    assert len(launched) == len(tasks)


def test_a_failing_side_task_is_counted_not_raised():
    def broken() -> None:
        raise RuntimeError("no such kernel")

    side = SideCompile([broken, lambda: None], DEVICE, workers=2)
    assert side.join() == 1


def test_attention_tasks_cover_the_prefill_variants_and_each_decode_split_count():
    from llmcli.kernels.triton_backend import TritonAttentionBackend
    from llmcli.kernels.triton_decode import choose_num_splits
    from llmcli.engine.side_compile import attention_tasks

    backend = TritonAttentionBackend(4, 2, 16, 0.25, 16)
    sizes = graph_batch_sizes(512, "spaced")
    tasks = attention_tasks(backend, torch.float32, DEVICE, 4096, 64, sizes)
    # varlen and paged at chunk lengths 16 and 64 (the long variant, clipped to the largest chunk)
    splits = {choose_num_splits(b, 2, 4096, backend._sms(DEVICE)) for b in sizes}
    assert 1 in splits and len(splits) > 1  # small graphs split their contexts, large ones do not
    assert len(tasks) == 4 + len({(n > 1, n % 16 == 0) for n in splits})
    outputs = [task() for task in tasks]
    for out in outputs:  # zero queries, keys and values: every row attends to zeros (or to nothing)
        assert out.shape[1:] == (4, 16) and torch.count_nonzero(out) == 0
    assert {out.shape[0] for out in outputs} == {16, 64, 1}
    assert attention_tasks(object(), torch.float32, DEVICE, 4096, 64, sizes) == []  # other backends: nothing


def test_cancelling_drops_the_tasks_not_started():
    import threading

    started, release, ran = threading.Event(), threading.Event(), []

    def slow() -> None:
        started.set()
        release.wait(10)
        ran.append("slow")

    side = SideCompile([slow, lambda: ran.append("later")], DEVICE, workers=1)
    assert started.wait(10)
    threading.Timer(0.2, release.set).start()
    assert side.join(cancel=True) == 0
    assert ran == ["slow"]  # the running task finished; the queued one never ran
