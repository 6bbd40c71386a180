"""/healthz and /readyz on the health port (kubebuilder's convention, port 8081).

* ``/healthz`` (liveness): the asyncio loop answers, and -- once this replica leads -- kopf's
  watch tasks are alive. A standby replica waiting for the Lease is healthy.
* ``/readyz`` (readiness): the replica is either a healthy standby or a leader whose kopf
  has finished its initial listing (``ready_flag``). A leader that is still starting is
  not ready.

A tiny aiohttp app (aiohttp is already a kopf dependency) running on the operator's own
event loop: if the loop is blocked, the probe times out, which is exactly the failure
liveness must catch.
"""

from __future__ import annotations

import dataclasses
import enum

from aiohttp import web


class Phase(enum.StrEnum):
    STARTING = "starting"
    STANDBY = "standby"  # waiting for the leader Lease
    LEADING = "leading"  # kopf is running (or starting)
    STOPPING = "stopping"


@dataclasses.dataclass
class HealthState:
    phase: Phase = Phase.STARTING
    kopf_ready: bool = False
    kopf_failed: bool = False

    def live(self) -> bool:
        return not self.kopf_failed

    def ready(self) -> bool:
        if self.phase is Phase.STANDBY:
            return True
        return self.phase is Phase.LEADING and self.kopf_ready and not self.kopf_failed


async def serve(*, state: HealthState, host: str, port: int) -> web.AppRunner:
    """Start the health endpoints; ``await runner.cleanup()`` stops them."""

    async def healthz(_request: web.Request) -> web.Response:
        ok = state.live()
        return web.Response(status=200 if ok else 503, text=f"{state.phase.value}\n")

    async def readyz(_request: web.Request) -> web.Response:
        ok = state.ready()
        return web.Response(status=200 if ok else 503, text=f"{state.phase.value}\n")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host=host, port=port)
    await site.start()
    return runner
