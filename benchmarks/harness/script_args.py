"""The options every benchmark script shares: where it runs (--device), its small modes (--tiny, --smoke)."""
from __future__ import annotations

import argparse
from typing import Any

SMOKE_HELP = "the CI smoke test: --device cpu --tiny"


def add_device_args(ap: Any, *, device: str = "auto", tiny: str | None = None, smoke: str = SMOKE_HELP) -> None:
    """``--device`` (auto: CUDA when one is visible), ``--smoke`` and, given its help, ``--tiny``."""
    ap.add_argument("--device", default=device, choices=["auto", "cuda", "cpu"])
    if tiny is not None:
        ap.add_argument("--tiny", action="store_true", help=tiny)
    ap.add_argument("--smoke", action="store_true", help=smoke)


def settle_device(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--smoke`` as ``--device cpu`` (and ``--tiny`` where the script has it); ``auto`` as the device there is."""
    import torch

    if args.smoke:
        args.device = "cpu"
        if hasattr(args, "tiny"):
            args.tiny = True
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is visible: use --smoke (CPU, a tiny model)")


def keep_defaults(ap: argparse.ArgumentParser, args: argparse.Namespace, values: dict[str, Any]) -> None:
    """Set ``values`` (a small mode's sizes) only on the options the user left at their defaults."""
    for name, value in values.items():
        if getattr(args, name) == ap.get_default(name):
            setattr(args, name, value)
