"""The runtime's model errors: :class:`ModelLoadError` is defined once in the contract
(``splitserve_contract.model_config``, which parses config.json for the runtime and the
planner alike) and re-exported here for the loader, tokenizer and URI modules."""

from __future__ import annotations

from splitserve_contract.model_config import ModelLoadError

__all__ = ["ModelLoadError"]
