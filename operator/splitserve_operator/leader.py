"""Lease-based leader election (``coordination.k8s.io/v1``), with client-go's semantics.

kopf's peering is a freeze protocol, not leader election (see the research notes), so the
operator runs kopf with ``standalone=True`` and gates it behind this module instead:

* :meth:`LeaderElector.acquire` polls every ``retry_period`` until it holds the Lease. The
  Lease is free when it does not exist, has no holder, or its holder has not renewed it for
  ``lease_duration`` -- measured, as in client-go, on *our* monotonic clock from the moment
  we last saw the record change, so clock skew between nodes does not matter.
* :meth:`LeaderElector.hold` renews every ``retry_period`` and returns (raises
  :class:`LeadershipLost`) once it has failed to renew for ``renew_deadline``: a leader that
  cannot prove it still leads must stop writing *before* a standby may take over
  (renew_deadline < lease_duration). The caller then exits the process non-zero.
* :meth:`LeaderElector.release` (on a clean shutdown) clears the holder so a standby takes
  over at once instead of waiting for the lease to expire.

All writes are PUTs with the last-read ``resourceVersion``: two candidates racing for an
expired Lease cannot both win (the loser gets 409 and goes back to waiting).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Final

from . import kube

logger = logging.getLogger(__name__)

MICROTIME_FORMAT: Final = "%Y-%m-%dT%H:%M:%S.%fZ"


class LeadershipLost(Exception):
    """The Lease could not be renewed within the renew deadline, or someone else holds it."""


@dataclasses.dataclass(frozen=True)
class LeaderConfig:
    name: str
    namespace: str
    identity: str
    lease_duration_seconds: float = 15.0
    renew_deadline_seconds: float = 10.0
    retry_period_seconds: float = 2.0

    def __post_init__(self) -> None:
        if not (self.retry_period_seconds < self.renew_deadline_seconds < self.lease_duration_seconds):
            raise ValueError("leader election needs retry period < renew deadline < lease duration")


def make_identity(*, pod_name: str | None) -> str:
    """Pod name (for humans reading the Lease) plus a UUID (unique per process)."""
    return f"{pod_name or 'splitserve-operator'}_{uuid.uuid4()}"


def _microtime(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime(MICROTIME_FORMAT)


def utc_now() -> datetime.datetime:
    """The wall clock of the Lease's timestamps (``acquireTime``, ``renewTime``)."""
    return datetime.datetime.now(datetime.UTC)


class LeaderElector:
    """One candidate. ``clock`` (monotonic seconds) measures expiry and the renew deadline;
    ``wall_clock`` stamps the Lease for humans. Both are injected so tests can drive them."""

    def __init__(
        self,
        *,
        api: kube.Kube,
        config: LeaderConfig,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime.datetime] = utc_now,
    ) -> None:
        self._api = api
        self.config = config
        self._clock = clock
        self._wall_clock = wall_clock
        self._observed_spec: dict[str, Any] | None = None
        self._observed_at = 0.0
        self._last_renew = 0.0

    @property
    def identity(self) -> str:
        return self.config.identity

    # ------------------------------------------------------------------ one attempt
    def try_acquire_or_renew(self) -> bool:
        """One round: True if we hold the Lease afterwards. Synchronous (runs in a thread)."""
        cfg = self.config
        now = self._wall_clock()
        duration = max(1, int(round(cfg.lease_duration_seconds)))
        lease = self._api.get(kind=kube.LEASE, namespace=cfg.namespace, name=cfg.name)
        if lease is None:
            lease_spec: dict[str, Any] = {
                "holderIdentity": cfg.identity,
                "leaseDurationSeconds": duration,
                "acquireTime": _microtime(now),
                "renewTime": _microtime(now),
                "leaseTransitions": 0,
            }
            body = {
                "apiVersion": kube.LEASE.api_version,
                "kind": "Lease",
                "metadata": {"name": cfg.name, "namespace": cfg.namespace},
                "spec": lease_spec,
            }
            try:
                self._api.create(kind=kube.LEASE, namespace=cfg.namespace, obj=body)
            except kube.ApiException as exc:
                if exc.status == 409:
                    return False
                raise
            self._observe(lease_spec)
            return True
        spec = dict(lease.get("spec") or {})
        if spec != self._observed_spec:
            self._observe(spec)
        holder = spec.get("holderIdentity") or ""
        observed_duration = float(spec.get("leaseDurationSeconds") or cfg.lease_duration_seconds)
        if holder and holder != cfg.identity and self._clock() < self._observed_at + observed_duration:
            return False  # somebody else's, and not expired
        new_spec = dict(spec)
        if holder != cfg.identity:
            new_spec["acquireTime"] = _microtime(now)
            new_spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        new_spec.update(
            {"holderIdentity": cfg.identity, "leaseDurationSeconds": duration, "renewTime": _microtime(now)}
        )
        body = {**lease, "spec": new_spec}
        try:
            self._api.replace(kind=kube.LEASE, namespace=cfg.namespace, name=cfg.name, obj=body)
        except kube.ApiException as exc:
            if exc.status == 409:
                return False
            raise
        self._observe(new_spec)
        return True

    def _observe(self, spec: dict[str, Any]) -> None:
        self._observed_spec = dict(spec)
        self._observed_at = self._clock()

    def release_sync(self) -> None:
        cfg = self.config
        lease = self._api.get(kind=kube.LEASE, namespace=cfg.namespace, name=cfg.name)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != cfg.identity:
            return
        now = _microtime(self._wall_clock())
        spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": now}
        self._api.replace(kind=kube.LEASE, namespace=cfg.namespace, name=cfg.name, obj={**lease, "spec": spec})

    # ------------------------------------------------------------------ loops
    async def _attempt(self) -> bool:
        try:
            return await asyncio.to_thread(self.try_acquire_or_renew)
        except Exception as exc:  # noqa: BLE001 - any failure is just "not acquired this round"
            logger.warning("Leader election round failed: %s", kube.error_message(exc))
            return False

    async def acquire(self, *, stop: asyncio.Event) -> bool:
        """Block until we lead (True) or ``stop`` is set (False)."""
        logger.info("Waiting for Lease %s/%s as %s", self.config.namespace, self.config.name, self.identity)
        while not stop.is_set():
            if await self._attempt():
                self._last_renew = self._clock()
                logger.info("Acquired Lease %s/%s", self.config.namespace, self.config.name)
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.config.retry_period_seconds)
        return False

    async def hold(self) -> None:
        """Renew until renewing fails for ``renew_deadline``; then raise LeadershipLost."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.retry_period_seconds)
            if await self._attempt():
                self._last_renew = self._clock()
                continue
            if self._clock() - self._last_renew >= cfg.renew_deadline_seconds:
                raise LeadershipLost(
                    f"Lease {cfg.namespace}/{cfg.name} not renewed for {cfg.renew_deadline_seconds:g}s"
                )

    async def release(self) -> None:
        try:
            await asyncio.to_thread(self.release_sync)
        except Exception as exc:  # noqa: BLE001 - best effort on shutdown
            logger.warning("Releasing the Lease failed: %s", kube.error_message(exc))
