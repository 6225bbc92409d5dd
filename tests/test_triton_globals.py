"""Every global a Triton kernel reads is one the GPU compiler accepts.

The interpreter (``TRITON_INTERPRET=1``, what CPU tests run) reads any Python global, but the real compiler
refuses a global that is not a ``tl.constexpr`` instance (GPU run of 2026-12-02: the sort-free sampler's
``_ITERS: tl.constexpr = 33`` compiled on CPU and failed on the H200, turning the one-pass sampler off).
"""
from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

triton = pytest.importorskip("triton")
from triton.runtime.jit import KernelInterface  # noqa: E402  (a JITFunction, or an InterpretedFunction under TRITON_INTERPRET)

import llmcli.kernels  # noqa: E402


def jit_kernels() -> list[tuple[str, KernelInterface]]:
    found = []
    for info in pkgutil.iter_modules(llmcli.kernels.__path__):
        module = importlib.import_module(f"llmcli.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, KernelInterface) and getattr(value, "fn", None) is not None \
                    and value.fn.__module__ == module.__name__:
                found.append((f"{info.name}.{name}", value))
    return found


def names_read(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= names_read(const)
    return names


def test_there_are_kernels_to_check():
    assert len(jit_kernels()) >= 10


@pytest.mark.parametrize("name,kernel", jit_kernels(), ids=[n for n, _ in jit_kernels()])
def test_kernel_globals_are_constexpr(name, kernel):
    fn = kernel.fn
    bad = []
    for ref in sorted(names_read(fn.__code__)):
        if ref not in fn.__globals__:
            continue  # an attribute name (tl.arange's "arange") or a builtin
        value = fn.__globals__[ref]
        ok = (isinstance(value, (KernelInterface, types.ModuleType, triton.language.constexpr))
              or getattr(value, "__module__", "").startswith("triton")  # tl.dtype objects, decorators
              or callable(value) and getattr(value, "__triton_builtin__", False))
        if not ok:
            bad.append(f"{ref} = {value!r}")
    assert not bad, f"{name} reads globals the GPU compiler refuses (make them tl.constexpr(...)): {bad}"
