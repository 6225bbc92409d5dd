"""lm-evaluation-harness on llmcli's engine: importing this package registers the model name ``llmcli``
(``lm_eval.simple_evaluate(model="llmcli", model_args="pretrained=...")``); ``python -m llmcli.lm_eval`` is
lm-eval's command line with it registered. Needs ``pip install llmcli[eval]``."""
from __future__ import annotations

try:
    import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry loads them only when empty)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("llmcli.lm_eval needs lm-evaluation-harness: pip install 'llmcli[eval]'") from exc

from llmcli.lm_eval.model import LLMCLIModel

__all__ = ["LLMCLIModel"]
