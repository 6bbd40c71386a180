"""The serving engines' pods: one module per engine behind one small interface.

:func:`renderer` returns the :class:`~.pod.EngineRenderer` of an InferenceService's
``spec.runtime.engine``; :mod:`..render` builds every pool's pod around what it returns. A new
engine is one more module here and one more row in ``splitserve_contract.engines`` and
``splitserve_contract.engine_metrics``.
"""

from __future__ import annotations

from typing import Final

from splitserve_contract.engines import Engine

from . import splitserve, vllm
from .pod import EngineRenderer, PoolContainer

RENDERERS: Final[dict[Engine, EngineRenderer]] = {
    Engine.SPLITSERVE: splitserve.RENDERER,
    Engine.VLLM: vllm.RENDERER,
}


def renderer(engine: Engine) -> EngineRenderer:
    return RENDERERS[engine]


__all__ = ["RENDERERS", "EngineRenderer", "PoolContainer", "renderer"]
