"""The engine boundary the command line drives (``engine/engine_api.py``): ``LLMEngine`` and the data-parallel
``DataParallelEngine`` each satisfy ``EngineAPI`` with members of the protocol's names, signatures and meaning."""
from __future__ import annotations

import inspect

import pytest

from llmcli.config import Config
from llmcli.engine.engine_api import EngineAPI
from llmcli.engine.llm_engine import LLMEngine
from llmcli.engine.outputs import EngineStats
from llmcli.engine.sequence import RequestRejected
from llmcli.sampling_params import SamplingParams
from llmcli.scaleout.data_parallel import DataParallelEngine, ScaleOut

from test_data_parallel import ScriptedPool, answer

METHODS = ("fill_texts", "check_fits", "add_request", "has_unfinished", "step", "shutdown")
PROPERTIES = ("tokenizer", "stats", "startup_s", "detokenize")


def test_the_protocol_names_what_the_cli_reads():
    members = {name for name in vars(EngineAPI) if not name.startswith("_")}
    assert members == set(METHODS) | set(PROPERTIES)


@pytest.mark.parametrize("cls", [LLMEngine, DataParallelEngine])
def test_each_engine_class_has_the_protocols_methods_with_its_parameters(cls):
    for name in METHODS:
        want = list(inspect.signature(getattr(EngineAPI, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got[:len(want)] == want, f"{cls.__name__}.{name}{got} is not EngineAPI's {want}"
    for name in PROPERTIES:  # on the class (a property), or set by __init__: checked on instances below
        assert not callable(getattr(cls, name, None)), f"{cls.__name__}.{name} is a method, not a value"


def test_llm_engine_is_an_engine_api(tiny_model):
    engine = LLMEngine(Config(str(tiny_model), device="cpu", num_kvcache_blocks=32, kvcache_block_size=16,
                              max_model_len=128))
    try:
        assert isinstance(engine, EngineAPI)
        assert engine.tokenizer.decode(engine.tokenizer.encode("hello world")).strip() == "hello world"
        assert "weights" in engine.startup_s and all(isinstance(v, float) for v in engine.startup_s.values())
        assert engine.detokenize is True  # the CLI turns it off and decodes in its writer thread
        with pytest.raises(RequestRejected):
            engine.check_fits(list(range(3, 200)), SamplingParams(max_tokens=4))  # past max_model_len
        engine.detokenize = False
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        engine.check_fits([5, 6, 7], params)
        engine.add_request([5, 6, 7], params, request_id="r")
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert [o.request_id for o in outs] == ["r"] and outs[0].outputs[0].text is None
        engine.fill_texts(outs)
        done = outs[0].outputs[0]
        assert done.text == engine.tokenizer.decode(done.token_ids, skip_special_tokens=True)
        assert isinstance(engine.stats, EngineStats) and engine.stats.num_finished == 1
        assert engine.stats.generated_tokens == 5
    finally:
        engine.shutdown()


def test_data_parallel_engine_is_an_engine_api(tiny_model):
    pool = ScriptedPool(2)
    tokenizer = object()
    engine = DataParallelEngine(Config(str(tiny_model), device="cpu", max_model_len=128), ScaleOut(2),
                                tokenizer=tokenizer, pool=pool)
    assert isinstance(engine, EngineAPI)
    assert engine.tokenizer is tokenizer  # the driver's, for the writer's token bytes
    assert engine.startup_s == {}  # each replica times its own start-up in its own process
    assert engine.detokenize is True  # replicas decode before their outputs cross
    assert engine.stats.kv_blocks_total == 64 + 65  # ScriptedPool's replicas' pools, summed
    with pytest.raises(RequestRejected):
        engine.check_fits(list(range(3, 200)), SamplingParams(max_tokens=4))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), request_id="r")
    assert engine.has_unfinished() and engine.step() == []
    (replica,) = [r for r, batch in pool.sent.items() if batch]
    pool.events = [("out", replica, [answer("r")], EngineStats(num_finished=1))]
    outs = engine.step()
    engine.fill_texts(outs)
    assert [o.outputs[0].text for o in outs] == ["x"]  # as the replica sent it
    assert not engine.has_unfinished() and engine.stats.num_finished == 1
    engine.shutdown()
    assert pool.closed
