"""Structured outputs on the tiny random model (the hardest case: the model prefers nothing, so only the
constraint shapes the text): JSON schemas, choices, regexes and Lark grammars, through the engine and the CLI."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest
import torch

from processes import env
from structured_cases import SCHEMAS

from llmcli import LLM, SamplingParams, StructuredOutputsParams
from llmcli.engine.structured import GrammarError, check_constraint
from llmcli.layers.token_mask import apply_token_bitmask
from llmcli.sampling_params import SamplingParamsError

PROMPTS = ["Give me JSON:", "The answer is", "Hello", "Once upon a time", "Data:"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(str(tiny_model), device="cpu", enforce_eager=True, max_num_seqs=48) as engine:
        yield engine


def constrained(temperature: float = 1.0, seed: int | None = None, max_tokens: int = 300, **kind) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kind))


def test_every_finished_json_output_validates_against_its_schema(llm):
    assert len(SCHEMAS) >= 30
    params = [constrained(seed=i, json=schema) for i, schema in enumerate(SCHEMAS)]
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))], params)
    stopped = 0
    for schema, out in zip(SCHEMAS, outs):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
            stopped += 1
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 300
    assert stopped >= 0.8 * len(SCHEMAS), [o.text for o in outs if o.finish_reason != "stop"]


def test_json_object_is_an_object(llm):
    outs = llm.generate(PROMPTS[:3], [constrained(seed=s, json_object=True) for s in range(3)])
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished
    for out in finished:
        assert isinstance(json.loads(out.text), dict)


def test_choice_is_always_one_of_the_choices(llm):
    choices = ["positive", "negative", "neutral", "it depends"]
    outs = llm.generate(PROMPTS * 3, [constrained(seed=i, choice=choices) for i in range(15)])
    assert all(o.finish_reason == "stop" and o.text in choices for o in outs)
    assert len({o.text for o in outs}) > 1  # sampled, not stuck on one


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[0-9]{4}", r"(yes|no), because [a-z]{2,8}\.", r"[A-F]{1,3}"])
def test_regex_outputs_match_fully(llm, pattern):
    outs = llm.generate(PROMPTS, [constrained(seed=i, regex=pattern, max_tokens=60) for i in range(5)])
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text


def test_lark_grammar(llm):
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'
    outs = llm.generate(PROMPTS, [constrained(seed=i, grammar=grammar, max_tokens=100) for i in range(5)])
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 3
    for out in finished:
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", out.text), out.text


def test_greedy_under_a_constraint_is_deterministic_whatever_the_batch(llm):
    schema = SCHEMAS[0]
    alone = llm.generate(PROMPTS[0], constrained(temperature=0, json=schema))[0]
    again = llm.generate(PROMPTS[:3], [constrained(temperature=0, json=schema),
                                        constrained(seed=1, choice=["a", "b"]),
                                        SamplingParams(temperature=0, max_tokens=20)])[0]
    assert alone.token_ids == again.token_ids and alone.finish_reason == "stop"
    jsonschema.validate(json.loads(alone.text), schema)


def test_unconstrained_requests_get_the_same_tokens_in_a_mixed_batch(llm):
    plain = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)]
    alone = llm.generate(PROMPTS[:2], plain)
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[2:5], plain + [constrained(seed=i, json=SCHEMAS[i]) for i in range(3)])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]


def test_overlapped_loop_matches_the_synchronous_one(llm):
    params = [constrained(temperature=0, json=SCHEMAS[i]) for i in range(4)] + \
             [constrained(seed=3, regex=r"[a-z]{2,5}"), SamplingParams(temperature=0, max_tokens=12)]
    overlapped = llm.generate(PROMPTS + PROMPTS[:1], params)
    llm.engine.overlap = False
    try:
        synchronous = llm.generate(PROMPTS + PROMPTS[:1], params)
    finally:
        llm.engine.overlap = True
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in synchronous]


def test_max_tokens_before_the_grammar_completes_gives_length_and_partial_text(llm):
    out = llm.generate(PROMPTS[0], constrained(temperature=0, json=SCHEMAS[10], max_tokens=5))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_invalid_constraints_are_rejected_before_queuing(llm):
    with pytest.raises(GrammarError, match="prompt 1"):
        llm.generate(PROMPTS[:2], [constrained(json=SCHEMAS[0]), constrained(regex="(ab")])
    assert not llm.engine.has_unfinished()
    for bad in ({"json": {"type": "foo"}}, {"grammar": "start: missing_rule"},
                {"json": {"type": "integer", "minimum": 5, "maximum": 3}}):
        with pytest.raises(GrammarError):
            check_constraint(StructuredOutputsParams(**bad))


def test_structured_outputs_params_shape():
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(SamplingParamsError, match="choice"):
        StructuredOutputsParams(choice="abc")
    # the cache key is canonical: key order and JSON text vs dict do not matter
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert a.key == b.key and a.key != StructuredOutputsParams(json_object=True).key
    assert SamplingParams(structured_outputs={"choice": ["x"]}).structured_outputs.choice == ("x",)


def test_compiler_compiles_each_distinct_constraint_once(llm):
    compiler = llm.engine.structured.compiler
    a = StructuredOutputsParams(json={"type": "object", "properties": {"zz": {"type": "integer"}}})
    b = StructuredOutputsParams(json={"properties": {"zz": {"type": "integer"}}, "type": "object"})
    assert compiler.submit(a) is compiler.submit(b)
    assert compiler.submit(a) is not compiler.submit(StructuredOutputsParams(regex="zz"))


def test_a_constraint_of_many_requests_gets_independent_templates(llm, monkeypatch):
    """llguidance's copies of one matcher share its lexer, behind one lock held for a whole mask: the masks
    of 256 requests under one schema were filled one at a time on any number of threads. Requests of one
    constraint are spread over a few templates compiled on their own, whose lexers are independent (seen
    here through a lexer failure: it reaches every copy of its template, and no other template)."""
    from llmcli.engine.structured import GrammarCompiler, grammar
    from llmcli.engine.structured.compiler import ROWS_PER_SHARD

    monkeypatch.setitem(grammar.PARSER_LIMITS, "step_lexer_fuel", 50)  # the first string is too much
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.eos_token_ids, llm.engine.config.hf_config.vocab_size,
                               shards=3)
    try:
        spec = StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string"}},
                                             "required": ["name"], "title": "independent templates"})
        futures = [compiler.submit(spec) for _ in range(4 * ROWS_PER_SHARD)]
        distinct = list(dict.fromkeys(futures))
        assert len(distinct) == 3 == compiler.templates(spec)
        assert futures[:ROWS_PER_SHARD] == [distinct[0]] * ROWS_PER_SHARD  # consecutive requests share one
        assert futures[3 * ROWS_PER_SHARD] is distinct[0]  # then they come round again
        few = StructuredOutputsParams(regex="[a-z]{1,4}")
        assert len({compiler.submit(few) for _ in range(ROWS_PER_SHARD)}) == 1  # a few requests: one compile
        first, sibling = distinct[0].result().deep_copy(), distinct[0].result().deep_copy()
        other = distinct[1].result().deep_copy()
        prefix = llm.tokenizer.encode('{"name": "')
        assert first.consume_tokens(prefix)
        first.compute_bitmask()
        assert first.is_error() and "lexer" in first.get_error()
        for matcher in (sibling, other):
            matcher.compute_bitmask()  # at the start: no string yet, well within the fuel
        assert sibling.is_error()  # the same lexer as ``first``
        assert not other.is_error(), other.get_error()
    finally:
        compiler.shutdown()


def test_a_masked_token_is_never_sampled_at_the_noise_hash_edge(llm):
    """Each (seed, step) below gives one token the top 24-bit noise hash (the uniform rounded to 1.0: infinite
    Gumbel noise, NaN on a masked logit) at the step where the regex forbids it: 'm', an id past the
    tokenizer's 600 tokens, 'Fr'. The sampler drew that token and the matcher refused it ("abort"); as the
    structured bench's request 213 did with token 86015 at its step 534."""
    edges = [(7719, 2), (4955, 3), (3000, 8)]
    outs = llm.generate(["Digits:"] * len(edges), [constrained(temperature=1.0, seed=seed, regex="[0-9]{12}",
                                                               max_tokens=40) for seed, _ in edges])
    for out, (seed, step) in zip(outs, edges):
        assert out.finish_reason == "stop", (seed, out.finish_reason, out.text)
        assert re.fullmatch("[0-9]{12}", out.text) and len(out.token_ids) > step


def test_token_bitmask_on_logits():
    vocab = 70  # three 32-bit words, the last one partly used
    allowed = {0, 5, 31, 32, 63, 64, 69}
    words = [0, 0, 0]
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    mask = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in words], [-1, -1, -1]], dtype=torch.int32)
    logits = torch.randn(2, vocab)
    out = apply_token_bitmask(logits, mask)
    assert {i for i in range(vocab) if out[0, i] != float("-inf")} == allowed
    assert torch.equal(out[1], logits[1])  # an all-ones row changes nothing


# -- the command line -------------------------------------------------------------
def _generate(tmp_path, model, lines, *args):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "llmcli", "generate", str(src), "-o", str(out), "--model", str(model),
                           "--device", "cpu", "-q", "--overwrite", *args], capture_output=True, text=True, env=env(),
                          timeout=300)
    records = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return proc, records


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_cli_records_and_default_schema(tmp_path, tiny_checkpoint, family):
    """Every constraint kind through the CLI; on Llama too (its tokenizer's special tokens, its chat template)."""
    tiny_model = tiny_checkpoint(family)
    schema = SCHEMAS[0]
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMAS[3]))
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 300, "temperature": 0,
                  "response_format": {"type": "json_schema",
                                      "json_schema": {"name": "person", "schema": schema, "strict": True}}}},
        {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Who?", "max_tokens": 300, "temperature": 0,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "l", "schema": SCHEMAS[1]}}}},
        {"id": "choice", "prompt": "Mood:", "guided_choice": ["happy", "sad"], "seed": 1},
        {"id": "regex", "prompt": "Phone:", "guided_regex": "[0-9]{3}-[0-9]{4}", "seed": 2},
        {"id": "default", "prompt": "Flag:", "temperature": 0},  # the --json-schema file
        {"id": "text", "prompt": "Free:", "response_format": {"type": "text"}, "max_tokens": 5, "ignore_eos": True},
    ]
    proc, records = _generate(tmp_path, tiny_model, lines, "--json-schema", str(tmp_path / "schema.json"))
    assert proc.returncode == 0, proc.stderr
    by = {r.get("custom_id", r.get("id")): r for r in records}
    jsonschema.validate(json.loads(by["chat"]["response"]["body"]["choices"][0]["message"]["content"]), schema)
    jsonschema.validate(json.loads(by["completion"]["response"]["body"]["choices"][0]["text"]), SCHEMAS[1])
    assert by["choice"]["text"] in ("happy", "sad")
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", by["regex"]["text"])
    jsonschema.validate(json.loads(by["default"]["text"]), SCHEMAS[3])
    assert by["text"]["finish_reason"] == "length"


def test_cli_invalid_constraints_name_file_line_field(tmp_path, tiny_model):
    lines = [
        {"id": "ok", "prompt": "x", "guided_choice": ["a", "b"]},
        {"id": "regex", "prompt": "x", "guided_regex": "(ab"},
        {"custom_id": "schema", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "x"}],
                  "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "foo"}}}}},
        {"id": "two", "prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
    ]
    proc, records = _generate(tmp_path, tiny_model, lines)
    assert proc.returncode == 2 and records == []
    assert "in.jsonl:2: guided_regex: invalid regex" in proc.stderr
    assert "in.jsonl:3: body.response_format.json_schema.schema: invalid json: Invalid type: foo" in proc.stderr
    assert "in.jsonl:4: guided_choice: conflicts with guided_regex" in proc.stderr
    proc, records = _generate(tmp_path, tiny_model, lines, "--on-error", "skip")
    assert proc.returncode == 1, proc.stderr
    assert records[0]["text"] in ("a", "b")
    assert records[1]["error"]["field"] == "guided_regex" and records[1]["error"]["line"] == 2
    assert records[2]["response"]["status_code"] == 400
    (tmp_path / "bad.json").write_text('{"type": "json_schema", "json_schema": {"schema": {"type": 3}}}')
    proc, _ = _generate(tmp_path, tiny_model, lines[:1], "--response-format", str(tmp_path / "bad.json"))
    assert proc.returncode == 2 and "--response-format" in proc.stderr and "bad.json" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 on CPU needs 2 cores")
def test_tensor_parallel_masks_on_rank_zero(tmp_path):
    from tiny_qwen3 import write_tiny_qwen3

    model = write_tiny_qwen3(tmp_path / "tp", seed=11, num_attention_heads=4, num_key_value_heads=2)
    params = [constrained(seed=i, json=SCHEMAS[i]) for i in range(4)] + [constrained(seed=9, choice=["on", "off"])]
    with LLM(str(model), device="cpu", tensor_parallel_size=2, enforce_eager=True, num_kvcache_blocks=128) as llm:
        outs = llm.generate(PROMPTS, params)
    assert outs[4].text in ("on", "off")
    finished = [(o, s) for o, s in zip(outs[:4], SCHEMAS) if o.finish_reason == "stop"]
    assert len(finished) >= 3
    for out, schema in finished:
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.slow
def test_data_parallel_replicas_compile_their_own_grammars(tmp_path, tiny_model):
    lines = [{"id": i, "prompt": PROMPTS[i % 5], "seed": i, "max_tokens": 300, "response_format": {
        "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]}}} for i in range(6)]
    lines.append({"id": "choice", "prompt": "Pick:", "guided_choice": ["left", "right"], "seed": 3})
    proc, one = _generate(tmp_path, tiny_model, lines)
    assert proc.returncode == 0, proc.stderr
    proc, two = _generate(tmp_path, tiny_model, lines, "--data-parallel-size", "2")
    assert proc.returncode == 0, proc.stderr
    assert [r["text"] for r in two] == [r["text"] for r in one]  # seeded: the replica does not matter
    assert two[-1]["text"] in ("left", "right")


def test_a_grammar_completed_by_the_last_allowed_token_is_a_stop(llm):
    params = constrained(temperature=0, choice=["positive", "negative"], max_tokens=50)
    free = llm.generate(PROMPTS[0], params)[0]
    exact = llm.generate(PROMPTS[0], constrained(temperature=0, choice=["positive", "negative"],
                                                 max_tokens=len(free.token_ids)))[0]
    assert exact.finish_reason == "stop" and exact.text == free.text
    short = llm.generate(PROMPTS[0], constrained(temperature=0, choice=["positive", "negative"], max_tokens=1))[0]
    assert len(free.token_ids) == 1 or short.finish_reason == "length"


def test_eos_is_allowed_only_where_the_grammar_accepts(llm):
    from llmcli.engine.sequence import Sequence
    from llmcli.engine.structured import ConstrainedBatch, GrammarCompiler

    tok, eos = llm.tokenizer, llm.engine.eos_token_ids
    vocab = llm.engine.config.hf_config.vocab_size
    compiler = GrammarCompiler(tok, eos, vocab)
    try:
        seq = Sequence([1, 2], SamplingParams(), 16)
        seq.matcher = compiler.submit(StructuredOutputsParams(regex="[0-9]{1,3}")).result().deep_copy()
        masks = ConstrainedBatch(vocab)

        def allowed() -> set[int]:
            row = masks.fill([seq])[0].tolist()
            return {t for t in range(vocab) if (row[t // 32] >> (t % 32)) & 1}

        digit = tok.convert_tokens_to_ids("7")
        start = allowed()
        assert digit in start and not start & set(eos)
        assert seq.matcher.consume_token(digit)
        after_one = allowed()
        assert digit in after_one and set(eos) <= after_one  # complete, and may go on
        assert all(re.fullmatch("[0-9]+", tok.decode([t])) for t in after_one - set(eos))
    finally:
        compiler.shutdown()


@pytest.mark.parametrize("limit", [{"step_lexer_fuel": 50},  # the mask fails: its row allows only EOS
                                   {"step_max_items": 10}])  # the matcher fails later, in a number
def test_a_matcher_over_its_parser_limits_aborts_with_the_text_it_accepted(llm, monkeypatch, limit):
    import llguidance
    import llguidance.hf

    from llmcli.engine.structured import grammar

    # a schema of its own, so that it compiles afresh under the tight limit
    schema = {"type": "object", "properties": {"records": {"type": "array", "minItems": 50, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "qty": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["name", "qty"], "additionalProperties": False}}},
        "required": ["records"], "additionalProperties": False, "title": f"limits {sorted(limit)}"}
    for key, value in limit.items():
        monkeypatch.setitem(grammar.PARSER_LIMITS, key, value)
    outs = llm.generate(PROMPTS[:3], [constrained(temperature=t, seed=1, json=schema, max_tokens=200)
                                      for t in (0, 0.8, 1.0)])
    tokenizer = llguidance.hf.from_tokenizer(llm.tokenizer, n_vocab=llm.engine.config.hf_config.vocab_size,
                                             eos_token=llm.engine.eos_token_ids)
    for out in outs:
        assert out.finish_reason == "abort", (out.finish_reason, out.text)
        assert not set(out.token_ids) & set(llm.engine.eos_token_ids)
        # every token of the output is one the grammar allowed and took, under the tight limit too
        for limits in (grammar.parser_limits(), None):
            matcher = llguidance.LLMatcher(tokenizer, grammar.grammar_text(StructuredOutputsParams(json=schema)),
                                           log_level=0, limits=limits)
            for token in out.token_ids:
                allowed = matcher.compute_bitmask()
                assert not matcher.is_error() and allowed[token // 8] >> (token % 8) & 1, matcher.get_error()
                assert matcher.consume_token(token), matcher.get_error()
        assert out.text.startswith('{"records": [{"name": "')
    if "step_lexer_fuel" in limit:  # the lexer gives up at the first string
        assert all(out.text == '{"records": [{"name": "' for out in outs)


def test_reused_mask_buffers_leave_no_stale_rows(llm):
    from llmcli.engine.sequence import Sequence
    from llmcli.engine.structured import ConstrainedBatch, GrammarCompiler

    vocab = llm.engine.config.hf_config.vocab_size
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.eos_token_ids, vocab)
    try:
        template = compiler.submit(StructuredOutputsParams(choice=["yes", "no"])).result()
        seqs = [Sequence([1, 2], SamplingParams(), 16) for _ in range(3)]
        for seq in seqs[:2]:
            seq.matcher = template.deep_copy()
        masks = ConstrainedBatch(vocab)
        alone = masks.fill([seqs[0]])[0].clone()
        assert (alone != -1).any()  # the constraint does forbid tokens
        for _ in range(2):  # both buffers now hold constrained rows 0 and 1
            masks.fill(seqs[:2])
        mixed = masks.fill([seqs[2], seqs[0]])  # row 0 unconstrained now
        assert (mixed[0] == -1).all() and torch.equal(mixed[1], alone)
        assert masks.fill([seqs[2]]) is None
    finally:
        compiler.shutdown()


class _FlippingFuture:
    """A compile that completes between two looks at it (a slow machine's timing, made certain)."""

    def __init__(self) -> None:
        self.looks = 0

    def done(self) -> bool:
        self.looks += 1
        return self.looks > 1

    def exception(self) -> None:
        return None

    def result(self) -> object:
        return type("Template", (), {"deep_copy": lambda self: "matcher"})()


def test_a_grammar_finishing_while_ready_looks_is_never_lost():
    from types import SimpleNamespace

    from llmcli.engine.structured.requests import StructuredRequests

    requests = StructuredRequests(None, [], 16)
    seq = SimpleNamespace(matcher=None)
    requests.compiling = [(seq, _FlippingFuture())]
    seen = []
    for _ in range(3):
        ready, failed = requests.ready(block=False)
        seen += ready
        assert not failed and len(seen) + requests.num_compiling == 1
    assert seen == [seq] and seq.matcher == "matcher"
    requests.shutdown()
