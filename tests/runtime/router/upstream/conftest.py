"""The router's upstream clients (the pod client of the proxied requests, the aiohttp transport
of its health polls) are tested on both event loops: asyncio's, and uvloop's, which the router
runs on (its transports are not subclasses of asyncio's)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
import uvloop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Any]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
