"""splitserve runtime: the bundled inference engine, OpenAI server, router and KV transfer.

Importing this package must not import torch: the operator shares `contract` with it.
"""

__version__ = "0.1.0"
