"""The runtime's model errors: :class:`ModelLoadError` is defined once in the contract
(``splitserve_contract.model_config``, which parses config.json for the runtime and the
planner alike) and re-exported here for the loader, tokenizer and URI modules.

:func:`parser_message` is how a parser's own error text (``tokenizers``, ``safetensors``: both
Rust/serde) enters a :class:`ModelLoadError`: serde quotes the offending value
(``unknown variant `...```, ``invalid type: string "..."``), and a model load error must never carry the content of
a file (the message becomes the pod's termination message and the InferenceService's
condition, readable by whoever can read those)."""

from __future__ import annotations

import re

from splitserve_contract.model_config import ModelLoadError

_QUOTED = re.compile(r"`[^`]*`(?:, `[^`]*`)*|\"[^\"]*\"")
_MAX_CHARACTERS = 200


def parser_message(error: BaseException) -> str:
    """The first line of ``error``'s text with every quoted value (backticks, double quotes)
    replaced by ``<...>`` (and cut to 200 characters): what went wrong and where, not what the file holds."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    text = _QUOTED.sub("<...>", lines[0]) if lines else type(error).__name__
    cut = min((text.index(q) for q in '`"' if q in text), default=None)
    if cut is not None:  # an unpaired quote: the rest may be content
        text = text[:cut] + "<...>"
    return text if len(text) <= _MAX_CHARACTERS else text[:_MAX_CHARACTERS] + "..."


__all__ = ["ModelLoadError", "parser_message"]
