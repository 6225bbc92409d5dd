"""The folder plan stays true: imports inside llmcli only run downwards (ARCHITECTURE.md).

Every import in every module counts, the ones inside functions too: a lazy import
is still a dependency.
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
    "scaleout": {"api", "engine", "parallel", "models", "layers", "kernels", "base"},
    "api": {"engine", "parallel", "models", "layers", "kernels", "base"},
    "engine": {"parallel", "models", "layers", "kernels", "base"},
    "parallel": {"engine", "base"},  # beside the engine: a worker process hosts a model runner
    "models": {"layers", "kernels", "parallel_ranks", "base"},
    "layers": {"kernels", "parallel_ranks", "base"},
    "kernels": set(),
    "base": {"models_hub"},  # config.py resolves the model folder and reads its config.json
}


def layer_of(module: str) -> str:
    """Which layer a dotted llmcli module belongs to."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__",):
        return "cli"
    top = parts[1]
    if top in ("llm",):
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
    """(line, imported llmcli module) for every import statement in the file."""
    found = []
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "llmcli"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "llmcli":
                found.append((node.lineno, target))
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


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
