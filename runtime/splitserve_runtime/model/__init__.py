"""The model: config parsing, weight loading, the Llama-family forward, tokenizer, URIs.

Only the torch-free parts are re-exported here (``ModelConfig``, ``ModelLoadError``), so
``import splitserve_runtime.model`` stays cheap; import ``.llama`` / ``.loader`` explicitly.
"""

from splitserve_contract.model_config import ModelConfig, RopeScaling, load_model_config

from .errors import ModelLoadError

__all__ = ["ModelConfig", "ModelLoadError", "RopeScaling", "load_model_config"]
