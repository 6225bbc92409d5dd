"""A logits row that is not finite fails its own request alone (issue 44, F1 and F11).

The checkpoint is examples/tiny-qwen3 (fp32) with the embedding row of one token set to NaN: a prompt holding
that token gets NaN logits, every other prompt is untouched. Its request must end with the error "the model
produced non-finite logits at token N" on every sampling path, and the others must get exactly the answers
they get from the undamaged checkpoint (their tokens never meet the poisoned row). A model whose warm-up
logits are not finite is refused at start-up in one line.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
from safetensors.torch import load_file, save_file

from processes import REPO, env

MODEL = REPO / "examples" / "tiny-qwen3"
POISON = 5  # the token whose embedding row is NaN
PROMPTS = [[300, 301, 302], [301, 301, 302], [300, POISON, 301], [303, 301, 302]]
BAD = 2  # the index of the prompt holding POISON
SAMPLING = {
    "greedy": {"temperature": 0},
    "plain": {"temperature": 0.8, "seed": 7},
    "top_k_top_p": {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7},
    "min_p": {"temperature": 0.8, "min_p": 0.1, "seed": 7},
    "logprobs": {"temperature": 0, "logprobs": 3},
}


def damaged_copy(path: Path, rows: slice | int = POISON, inf_norm: bool = False) -> Path:
    """examples/tiny-qwen3 with the embedding ``rows`` NaN (or, ``inf_norm``, the final norm's weight +inf)."""
    shutil.copytree(MODEL, path)
    state = load_file(str(MODEL / "model.safetensors"))
    if inf_norm:
        state["model.norm.weight"] = torch.full_like(state["model.norm.weight"], float("inf"))
    else:
        embed = state["model.embed_tokens.weight"].clone()
        embed[rows] = float("nan")
        state["model.embed_tokens.weight"] = embed
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory) -> Path:
    return damaged_copy(tmp_path_factory.mktemp("nan") / "model")


def command(model: Path, inp: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "llmcli", "generate", str(inp), "-o", str(out), "--model", str(model),
            "--device", "cpu", "--num-kvcache-blocks", "64", "--kvcache-block-size", "16", "--max-num-seqs", "4",
            "--max-model-len", "128", "--include-token-ids", *extra]


def write_input(path: Path, sampling: dict) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "prompt_token_ids": p, "max_tokens": 6,
                                            "ignore_eos": True, **sampling}) + b"\n"
                              for i, p in enumerate(PROMPTS)))
    return path


def lines_of(out: Path) -> list[dict]:
    return [orjson.loads(line) for line in out.read_bytes().splitlines()]


def engine_outputs(model: Path, sampling: dict, prompts: list[list[int]] = PROMPTS, blocks: int = 64) -> dict:
    """The engine's outputs by request id, all prompts in one batch (so the poisoned row shares its steps)."""
    from llmcli.config import Config
    from llmcli.engine.llm_engine import LLMEngine
    from llmcli.sampling_params import SamplingParams

    engine = LLMEngine(Config(model=str(model), device="cpu", max_num_seqs=4, max_model_len=128,
                              num_kvcache_blocks=blocks, kvcache_block_size=16))
    try:
        params = SamplingParams(max_tokens=6, ignore_eos=True, **sampling)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=i)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.request_id not in done
                done[out.request_id] = out
        return done
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def clean_outputs() -> dict:
    return {name: engine_outputs(MODEL, sampling) for name, sampling in SAMPLING.items()}


@pytest.mark.parametrize("name", list(SAMPLING))
def test_the_poisoned_request_fails_alone_on_every_sampling_path(name, nan_model, clean_outputs):
    got = engine_outputs(nan_model, SAMPLING[name])
    assert sorted(got) == list(range(len(PROMPTS)))
    assert got[BAD].error == "the model produced non-finite logits at token 0"
    assert got[BAD].outputs[0].finish_reason == "error"
    for i, out in got.items():
        if i != BAD:
            clean = clean_outputs[name][i]
            assert out.error is None and len(out.token_ids) == 6
            assert out.token_ids == clean.token_ids
            if name == "logprobs":
                assert [e.logprob for e in out.outputs[0].logprobs[0].values()] == \
                    [e.logprob for e in clean.outputs[0].logprobs[0].values()]


def test_the_poisoned_requests_kv_blocks_serve_the_next_requests_cleanly(nan_model):
    """Its blocks (NaN keys and values in them) go back to the pool and are taken by the waiting requests,
    whose shorter contexts leave NaN slots past their ends in the block (attention must not read them)."""
    prompts = PROMPTS[:BAD] + [[300, POISON] + [301] * 12] + PROMPTS[BAD + 1:] + [[310 + i, 301, 302] for i in range(4)]
    got = engine_outputs(nan_model, SAMPLING["greedy"], prompts, blocks=5)  # 5 blocks of 16: all reused
    clean = engine_outputs(MODEL, SAMPLING["greedy"], prompts, blocks=5)
    assert got[BAD].error is not None
    assert {i: out.token_ids for i, out in got.items() if i != BAD} == \
        {i: out.token_ids for i, out in clean.items() if i != BAD}


def test_llm_generate_raises_the_error_naming_the_prompt(nan_model):
    from llmcli import LLM, SamplingParams

    llm = LLM(str(nan_model), device="cpu", max_num_seqs=4, max_model_len=128, num_kvcache_blocks=64,
              kvcache_block_size=16)
    try:
        with pytest.raises(RuntimeError, match=r"^prompt 1: the model produced non-finite logits at token 0$"):
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:3]], SamplingParams(max_tokens=3))
    finally:
        llm.engine.shutdown()


def test_a_row_going_non_finite_mid_answer_names_its_token_index(tmp_path):
    """The prompt is clean; the model's first greedy token's embedding is NaN, so token 1's logits are."""
    first = engine_outputs(MODEL, {"temperature": 0})[0].token_ids[0]
    model = damaged_copy(tmp_path / "model", rows=first)
    got = engine_outputs(model, {"temperature": 0})[0]
    assert got.error == "the model produced non-finite logits at token 1"
    assert got.token_ids == [first]


def test_the_cli_writes_the_error_record_and_resume_does_not_rerun_it(nan_model, tmp_path):
    inp, out = write_input(tmp_path / "in.jsonl", SAMPLING["top_k_top_p"]), tmp_path / "out.jsonl"
    result = subprocess.run(command(nan_model, inp, out, "-q"), env=env(), capture_output=True, timeout=300)
    err = result.stderr.decode()
    assert result.returncode == 1, err  # a run with error records exits 1 (docs/cli.md)
    assert "Traceback" not in err and "non-finite logits at token 0" in err, err
    got = lines_of(out)
    assert [line["id"] for line in got] == [f"r{i}" for i in range(len(PROMPTS))]
    assert "non-finite logits at token 0" in got[BAD]["error"]["message"]
    assert got[BAD]["error"]["field"] == "prompt_token_ids"
    assert all("error" not in line and len(line["token_ids"]) == 6 for i, line in enumerate(got) if i != BAD)
    again = subprocess.run(command(nan_model, inp, out, "-q", "--resume"), env=env(), capture_output=True,
                           timeout=300)
    assert again.returncode == 1 and "Traceback" not in again.stderr.decode(), again.stderr.decode()
    assert lines_of(out) == got


def test_a_constrained_record_gets_the_error_on_its_prompt_not_its_constraint(nan_model, tmp_path):
    """Structured outputs sample outside the graphs, behind a token mask (-inf where disallowed)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"".join(orjson.dumps({"id": i, "prompt_token_ids": p, "max_tokens": 4,
                                           "guided_choice": ["yes", "no"]}) + b"\n"
                             for i, p in enumerate(PROMPTS)))
    result = subprocess.run(command(nan_model, inp, out, "-q"), env=env(), capture_output=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr.decode(), result.stderr.decode()
    got = lines_of(out)
    assert got[BAD]["error"] == {"message": "the model produced non-finite logits at token 0", "line": BAD + 1,
                                 "field": "prompt_token_ids"}
    assert all(line["text"] in ("yes", "no") for i, line in enumerate(got) if i != BAD)


def test_with_data_parallel_the_error_record_is_written_once_and_not_resent(nan_model, tmp_path):
    inp, out = write_input(tmp_path / "in.jsonl", SAMPLING["greedy"]), tmp_path / "out.jsonl"
    result = subprocess.run(command(nan_model, inp, out, "-q", "-dp", "2"), env=env(), capture_output=True,
                            timeout=300)
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert "Traceback" not in err and "lost" not in err and "sending" not in err, err
    got = lines_of(out)
    assert [line["id"] for line in got] == [f"r{i}" for i in range(len(PROMPTS))]
    assert "non-finite logits at token 0" in got[BAD]["error"]["message"]
    assert sum("error" in line for line in got) == 1


@pytest.mark.parametrize("damage", ["nan_embedding", "inf_norm"])
def test_a_model_whose_warmup_logits_are_not_finite_is_refused_in_one_line(damage, tmp_path):
    model = damaged_copy(tmp_path / "model", rows=slice(None), inf_norm=damage == "inf_norm")
    inp, out = write_input(tmp_path / "in.jsonl", SAMPLING["greedy"]), tmp_path / "out.jsonl"
    result = subprocess.run(command(model, inp, out, "-q"), env=env(), capture_output=True, timeout=300)
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "non-finite logits" in err and "warm-up" in err, err
    assert not out.exists() or not out.read_bytes()


def test_the_filtered_sampler_takes_a_nan_row_without_an_index_error():
    from llmcli.layers.sampler import filter_logits, mark_nonfinite

    logits = torch.randn(3, 64)
    logits[1] = float("nan")
    logits[2, 7] = float("inf")
    kept = filter_logits(logits, torch.tensor([20, 20, 20]), torch.tensor([0.9, 0.9, 0.9]))
    assert torch.isfinite(kept[0]).sum() >= 1
    tokens = mark_nonfinite(logits, torch.tensor([4, 5, 6]))
    assert tokens.tolist() == [4, -1, -1]


TRITON_CHECK = """
import sys
import torch
from llmcli.layers.sampler import sample_one_pass
device = sys.argv[1]
logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(0))
logits[1] = float("nan")
logits[2, 2500] = float("inf")
logits[3, 10] = float("nan")
logits[4, 100] = float("-inf")  # -inf alone (a mask writes it) is no fault
expected = [-1, -1, -1, int(logits[4].argmax())]
temps = torch.tensor([0.8, 0.0, 0.8, 0.0, 0.0])
args = [temps, torch.full((5,), 20), torch.full((5,), 0.9), torch.zeros(5), torch.arange(5),
        torch.zeros(5, dtype=torch.int64)]
logits, args = logits.to(device), [a.to(device) for a in args]
for filtered in (False, True):
    tokens = sample_one_pass(logits, *args, filtered).cpu()
    assert tokens[1:].tolist() == expected, tokens
    assert 0 <= int(tokens[0]) < 3000
print("ok")
"""


def test_the_one_pass_triton_sampler_flags_non_finite_rows_in_its_kernel():
    """The kernel the CUDA paths (and the in-graph sampler) run, in a process of its own: compiled on CUDA
    tensors where a GPU is present, else under Triton's interpreter (TRITON_INTERPRET must be set before triton
    is imported, and the interpreter is for CPU tensors only, so it is never set on a GPU machine)."""
    child = env()
    if torch.cuda.is_available():
        device = "cuda"
        child.pop("TRITON_INTERPRET", None)
    else:
        device = "cpu"
        child["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, "-c", TRITON_CHECK, device], env=child, capture_output=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == b"ok", result.stderr.decode()[-3000:]


@pytest.mark.gpu
def test_on_the_gpu_a_poisoned_request_fails_alone_in_bf16_with_the_in_graph_sampler(tmp_path):
    """bf16, CUDA graphs with the one-pass sampler inside them (the plain graph and the filtered one): rows go
    NaN mid-answer in decode steps; exactly the requests that meet a poisoned token fail, at the predicted
    token, and the others are answered in full."""
    from llmcli.config import Config
    from llmcli.engine.llm_engine import LLMEngine
    from llmcli.sampling_params import SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    greedy = [([300 + i, 301, 302], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0))
              for i in range(6)]
    filtered = [([310 + i, 301, 302], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, top_k=20,
                                                      top_p=0.9, seed=i)) for i in range(6)]
    requests = greedy + filtered  # the filtered ones end first: later steps take the plain sampler graph

    def run(model: Path) -> dict:
        engine = LLMEngine(Config(model=str(model), device="cuda", dtype="bfloat16", max_num_seqs=16,
                                  max_model_len=256, attention_backend="triton"))
        try:
            graphs = engine.model_runner.graphs
            assert graphs is not None and graphs.sample_in_graph
            for i, (prompt, params) in enumerate(requests):
                engine.add_request(prompt, params, request_id=i)
            done = {}
            while engine.has_unfinished():
                for out in engine.step():
                    done[out.request_id] = out
            return done
        finally:
            engine.shutdown()

    clean = run(MODEL)
    assert all(out.error is None for out in clean.values())
    banned = {0} | {t for prompt, _ in requests for t in prompt}  # 0: the warm-up's token
    # a greedy row's token from its 7th on: the next token's logits go NaN when the plain graph samples;
    # a filtered row's from its first three: while the filtered graph samples
    late = next(t for t in clean[0].token_ids[6:] if t not in banned)
    early = next(t for t in clean[6].token_ids[:3] if t not in banned | {late})
    poisoned = {late, early}
    got = run(damaged_copy(tmp_path / "model", rows=sorted(poisoned)))
    hits = {i: next((k + 1 for k, t in enumerate(clean[i].token_ids) if t in poisoned), params.max_tokens)
            for i, (_, params) in enumerate(requests)}  # the token whose logits are NaN, if it is computed
    failed = {i for i, (_, params) in enumerate(requests) if hits[i] < params.max_tokens}
    assert 0 in failed and 6 in failed
    first = min(hits[i] for i in failed)  # until then the two runs' batches are the same
    for i, (_, params) in enumerate(requests):
        if i in failed:
            assert got[i].error == f"the model produced non-finite logits at token {hits[i]}", i
            assert got[i].token_ids == clean[i].token_ids[:hits[i]]
        else:
            assert got[i].error is None and len(got[i].token_ids) == params.max_tokens, i
            assert got[i].token_ids[:first] == clean[i].token_ids[:first]
