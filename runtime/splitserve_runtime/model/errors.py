"""The one exception type for every way a model directory can be unusable.

Loading fails for user-fixable reasons (wrong path, unsupported architecture, a truncated
download); a single type with a message that names the file, field or tensor lets the server
print one clear line instead of a traceback. Torch-free.
"""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model directory, URI, config, tokenizer or weight file cannot be used."""
