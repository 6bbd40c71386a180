"""splitserve runtime: the bundled inference engine, OpenAI server, router and KV transfer.

Importing this package must not import torch (the router's and the CLI's light paths import
it); the names it shares with the operator live in ``splitserve_contract``.
"""

from splitserve_contract import __version__

__all__ = ["__version__"]
