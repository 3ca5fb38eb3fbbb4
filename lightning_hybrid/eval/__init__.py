"""Downstream evaluation through lm-evaluation-harness, on the model as the strategy sharded it (tp x pp x dp x cp).

- :class:`DownstreamEval`: a callback that scores harness tasks every N steps of training and at its end;
- :class:`ShardedLM` (:mod:`~lightning_hybrid.eval.harness`): the harness's ``LM`` backed by the sharded model;
- ``lightning-hybrid eval --config RECIPE.yaml [--checkpoint CKPT] --tasks ...`` (:mod:`~lightning_hybrid.eval.cli`).

The harness is the optional extra ``pip install 'lightning-hybrid[eval]'``: importing this package does not import it
(``ShardedLM`` is loaded on first use; ``DownstreamEval`` names the extra when it is missing).
"""

from typing import Any

from lightning_hybrid.eval.callback import DownstreamEval
from lightning_hybrid.eval.tasks import EVAL_EXTRA, require_harness

__all__ = ["DownstreamEval", "ShardedLM", "EVAL_EXTRA", "require_harness"]


def __getattr__(name: str) -> Any:
    if name == "ShardedLM":  # imports lm-evaluation-harness
        from lightning_hybrid.eval.harness import ShardedLM

        return ShardedLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
