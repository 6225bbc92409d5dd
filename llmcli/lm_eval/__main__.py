"""``python -m llmcli.lm_eval --model llmcli --model_args pretrained=DIR --tasks ...``: lm-eval's CLI."""
from __future__ import annotations

import llmcli.lm_eval  # noqa: F401  (registers "llmcli")
from lm_eval.__main__ import cli_evaluate

if __name__ == "__main__":
    cli_evaluate()
