"""The folder plan stays true: imports inside llmcli only run downwards (ARCHITECTURE.md), and no modules import
each other in a circle.

Every import in every module counts, the ones inside functions and under ``if TYPE_CHECKING:`` too: a lazy
import is still a dependency, and a type-only one still ties the two modules together for a reader.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "llmcli"

# Each layer and the llmcli layers it may import (besides itself). Top to bottom: the CLI, scale-out above whole
# engines, the public API, the engine with tensor parallelism beside it, the model, its layers, the kernels.
LAYERS: dict[str, set[str]] = {
    "cli": {"scaleout", "api", "engine", "parallel", "models", "layers", "kernels", "base"},
    # lm-evaluation-harness's model over the public API, beside the CLI (neither imports the other)
    "lm_eval": {"scaleout", "api", "engine", "parallel", "models", "layers", "kernels", "base"},
    "scaleout": {"api", "engine", "parallel", "models", "layers", "kernels", "base"},
    "api": {"engine", "parallel", "models", "layers", "kernels", "base"},
    "engine": {"parallel", "models", "layers", "kernels", "base"},
    "parallel": {"engine", "base"},  # beside the engine: a worker process hosts a model runner
    "models": {"layers", "kernels", "parallel_ranks", "base"},
    "layers": {"kernels", "parallel_ranks", "base"},
    "kernels": set(),
    # config.py resolves the model folder and reads its config.json, and asks the attention backend's class for its
    # block-size rules (kernels import nothing else of llmcli, so this makes no circle)
    "base": {"models_hub", "kernels"},
}


def layer_of(module: str) -> str:
    """Which layer a dotted llmcli module belongs to."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__",):
        return "cli"
    top = parts[1]
    if top in ("llm", "vllm_args"):
        return "api"
    if top in ("config", "sampling_params"):
        return "base"
    if top == "parallel" and len(parts) == 2:
        return "parallel_ranks"  # the package itself: tp_rank / tp_size / all_reduce for the layers
    if top == "models" and parts[2:3] == ["hub"]:
        return "models_hub"
    return top


def allowed(src: str, dst: str) -> bool:
    if src == dst or (src, dst) in {("parallel", "parallel_ranks"), ("models", "models_hub")}:
        return True
    if dst in ("parallel_ranks",) and "parallel" in LAYERS[src]:
        return True
    if dst == "models_hub" and "models" in LAYERS[src]:
        return True
    return dst in LAYERS[src]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    return imports_of_text(path.read_text(), path)


def imports_of_text(text: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported llmcli module) for every import statement in ``text``, the source of ``path``;
    ``from llmcli.x import y`` names the module ``llmcli.x.y`` where y is one."""
    found = []
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "llmcli"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "llmcli":
                found += [(node.lineno, f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target)
                          for a in node.names]
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))
MODULES = {module_name(path) for path in SOURCES}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected group of modules: Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set(stack[stack.index(v):])
            del stack[stack.index(v):]
            if len(group) > 1 or v in graph.get(v, ()):
                cycles.append(_path_around(graph, v, group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _path_around(graph: dict[str, set[str]], start: str, group: set[str]) -> list[str]:
    """The shortest path from ``start`` back to itself inside ``group`` (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ()) & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a group without a cycle")


def test_every_module_has_a_layer():
    for path in SOURCES:
        assert layer_of(module_name(path)) in set(LAYERS) | {"parallel_ranks", "models_hub"}, path


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_downwards(path):
    src = layer_of(module_name(path))
    src = {"parallel_ranks": "layers", "models_hub": "models"}.get(src, src)  # checked as the layer they serve
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} ({src} -> {layer_of(target)})"
           for line, target in imports_of(path) if not allowed(src, layer_of(target))]
    assert not bad, "imports against the layer plan (see ARCHITECTURE.md):\n" + "\n".join(bad)


def test_the_rule_catches_a_violation(tmp_path):
    # the checker itself: an engine module importing the CLI must be reported
    assert not allowed("engine", layer_of("llmcli.cli.generate"))
    assert not allowed("layers", layer_of("llmcli.scaleout.data_parallel"))
    assert not allowed("kernels", layer_of("llmcli.layers.norm"))
    assert not allowed("layers", layer_of("llmcli.parallel.tp_runner"))
    assert allowed("layers", layer_of("llmcli.parallel"))
    assert not allowed("models", layer_of("llmcli.engine.sequence"))


def test_no_import_cycles():
    graph = {module_name(p): {t for _, t in imports_of(p) if t != module_name(p)} for p in SOURCES}
    cycles = find_cycles(graph)
    assert not cycles, "modules importing each other in a circle (move the shared piece into a lower module):\n" + \
        "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_names_every_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"g"}, "h": {"a"}}
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["e", "f", "e"], ["g", "g"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_type_only_and_submodule_imports_count():
    text = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llmcli.engine.model_runner import X\n"
            "from llmcli.kernels import backend\n")
    found = sorted(t for _, t in imports_of_text(text, PACKAGE / "engine" / "warmup.py"))  # a real path: its package
    assert found == ["llmcli.engine.model_runner", "llmcli.kernels.backend"]


def test_cli_io_sits_below_the_commands():
    # the JSONL io serves the commands: it may reach the CLI only for the shared error type (cli/usage_error.py)
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
           for path in SOURCES if module_name(path).startswith("llmcli.cli.io")
           for line, target in imports_of(path)
           if target.startswith("llmcli.cli") and not target.startswith("llmcli.cli.io")
           and target != "llmcli.cli.usage_error"]
    assert not bad, "cli/io importing the commands above it:\n" + "\n".join(bad)


GENERATE = "llmcli.cli.generate"  # the orchestrator: the package itself
GENERATE_STEPS = [f"{GENERATE}.{step}" for step in ("open_input", "check_input", "prepare_input", "run_engine",
                                                      "report")]


def step_imports_against_the_pipeline(text: str, path: Path) -> list[str]:
    """Imports of a step or of the orchestrator by a module of the `generate` package (the orchestrator aside)."""
    if not module_name(path).startswith(GENERATE + "."):
        return []
    return [f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            for line, target in imports_of_text(text, path)
            if target in (GENERATE, *GENERATE_STEPS) and target != module_name(path)]


def test_generate_steps_hand_off_forward_only():
    # `generate` reads as a pipeline (ARCHITECTURE.md): each step takes the previous step's hand-off from the
    # orchestrator, so no step (nor a piece they share) imports another step or the orchestrator
    assert set(GENERATE_STEPS) <= MODULES
    bad = [problem for path in SOURCES for problem in step_imports_against_the_pipeline(path.read_text(), path)]
    assert not bad, "generate's steps calling each other instead of handing off:\n" + "\n".join(bad)


def test_the_pipeline_rule_catches_a_step_calling_another():
    step = PACKAGE / "cli" / "generate" / "prepare_input.py"
    assert step_imports_against_the_pipeline("from llmcli.cli.generate.run_engine import run_engine\n", step)
    assert step_imports_against_the_pipeline("from llmcli.cli.generate import run_generate\n", step)
    assert not step_imports_against_the_pipeline("from llmcli.cli.generate.handoff import Prepared\n", step)
