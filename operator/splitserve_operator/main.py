"""`splitserve operator`: flags -> login -> leader election -> kopf.

Start-up order, and why:

1. Parse the flags of :mod:`operator_flags` (the chart passes exactly those).
2. Load credentials the way kopf's default login does (``KUBECONFIG`` if set, else the
   in-cluster ServiceAccount, else ``~/.kube/config``), for our own API calls.
3. Serve /metrics and /healthz + /readyz at once, so probes answer while we wait.
4. With leader election, wait for the Lease. Only then build the kopf registry and start
   kopf (``standalone=True``: kopf's peering is off; the Lease is the only gate). A standby
   replica runs no handler at all.
5. Register the reconciler's handlers (:mod:`handlers`) and the autoscaler's
   (:func:`splitserve_operator.autoscaler.loop.register`) in one fresh kopf registry.
6. Run kopf and the Lease renewal side by side. If the renewal fails for the renew deadline,
   stop kopf and exit with status 1: the Deployment restarts us as a fresh candidate, which is
   simpler and safer than trying to un-become a leader inside a running kopf. On SIGTERM, kopf
   stops, we release the Lease (a standby takes over immediately) and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from typing import Any, Final

import kopf
import prometheus_client

import splitserve_contract as contract

from . import (
    api,
    diffbase,
    events,
    handlers,
    health,
    kube,
    leader,
    metrics,
    operator_flags,
    reconcile,
)
from .autoscaler import loop as autoscaler_loop

logger = logging.getLogger("splitserve_operator")

EXIT_LEADERSHIP_LOST: Final = 1
KOPF_STOP_TIMEOUT_SECONDS: Final = 10.0
ANNOTATION_PREFIX: Final = contract.API_GROUP
CONNECTION_POOL_SIZE: Final = 32


def load_credentials() -> kube.ApiClient:
    """An ApiClient for our own calls (:func:`.kube.load_credentials`). Reconciles apply
    children concurrently, several objects at a time: more than the default 2 x CPU
    connections, or urllib3 keeps discarding and reopening them."""
    return kube.load_credentials(connection_pool_size=CONNECTION_POOL_SIZE)


def kopf_settings(*, identity: str, namespaced: bool) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.peering.standalone = True
    # A namespace-scoped install has no right to list CRDs or namespaces cluster-wide; kopf
    # then serves the given namespace and the resources present at start (what we want).
    settings.scanning.disabled = namespaced
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    # The last handled state as a digest, not the whole spec: all annotations share 256 KiB,
    # and a spec of that size must not make kopf's bookkeeping patch fail forever (:mod:`diffbase`).
    settings.persistence.diffbase_storage = diffbase.DigestDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration", progress=settings.persistence.progress_storage
    )
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/kopf-finalizer"  # none is required today
    settings.posting.level = logging.WARNING  # kopf's own messages; ours go through events.EventPoster
    settings.posting.reporting_component = contract.MANAGED_BY_VALUE
    settings.posting.reporting_instance = identity[:128]
    settings.posting.event_name_prefix = "splitserve-"
    # Stalled watches: the server closes each watch after server_timeout, the client gives up
    # after client_timeout; either way kopf re-lists, so a silently dead stream heals.
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    settings.execution.default_backoff = 10
    return settings


def count_requests(registry: prometheus_client.CollectorRegistry) -> kube.RequestObserver:
    """``splitserve_operator_api_requests_total{verb,resource}`` in ``registry``, and the
    observer that counts each request :class:`kube.Kube` sends into it."""
    counter = prometheus_client.Counter(
        contract.OperatorMetric.API_REQUESTS_TOTAL,
        "API requests the operator sent (kopf's own not counted)",
        ["verb", "resource"],
        registry=registry,
    )

    def observe(verb: str, resource: str) -> None:
        counter.labels(verb=verb, resource=resource).inc()

    return observe


def _bind_host() -> str:
    # The pod IP (the chart sets POD_IP): /metrics and the probes answer on the pod network only.
    return os.environ.get(contract.ENV_POD_IP) or "0.0.0.0"


async def run(*, args: operator_flags.OperatorArgs) -> int:
    api_client = load_credentials()
    identity = leader.make_identity(pod_name=os.environ.get(contract.ENV_POD_NAME))
    host = _bind_host()
    operator_metrics = metrics.OperatorMetrics.create()
    on_request = count_requests(operator_metrics.registry)
    api = kube.Kube(api_client=api_client, on_request=on_request)
    metrics_server, _ = metrics.serve(metrics=operator_metrics, host=host, port=args.metrics_port)
    state = health.HealthState()
    health_runner = await health.serve(state=state, host=host, port=args.health_port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    elector: leader.LeaderElector | None = None
    try:
        if args.leader_election:
            lease_namespace = args.lease_namespace or os.environ.get(contract.ENV_POD_NAMESPACE) or "default"
            short = max(1.0, leader.LeaderConfig.renew_deadline_seconds / 3)
            elector = leader.LeaderElector(
                api=kube.Kube(api_client=api_client, timeout_seconds=short, on_request=on_request),
                config=leader.LeaderConfig(name=args.lease_name, namespace=lease_namespace, identity=identity),
            )
            state.phase = health.Phase.STANDBY
            if not await elector.acquire(stop=stop):
                return 0
            operator_metrics.leader.set(1)
        state.phase = health.Phase.LEADING
        return await _lead(
            args=args,
            api=api,
            identity=identity,
            elector=elector,
            state=state,
            operator_metrics=operator_metrics,
            stop=stop,
        )
    finally:
        state.phase = health.Phase.STOPPING
        operator_metrics.leader.set(0)
        await health_runner.cleanup()
        metrics_server.shutdown()


async def _lead(
    *,
    args: operator_flags.OperatorArgs,
    api: kube.Kube,
    identity: str,
    elector: leader.LeaderElector | None,
    state: health.HealthState,
    operator_metrics: metrics.OperatorMetrics,
    stop: asyncio.Event,
) -> int:
    ctx = handlers.OperatorContext(
        api=api,
        settings=reconcile.ReconcileSettings(
            runtime_image=args.runtime_image,
            vllm_image=args.vllm_image,
            router_service_account=args.router_service_account,
            inference_pool=args.inference_pool,
        ),
        metrics=operator_metrics,
        namespaces=operator_flags.watched_namespaces(args),
    )
    poster = events.EventPoster(api=api, component=contract.MANAGED_BY_VALUE, instance=identity)
    poster.start()
    events.install(poster)
    registry, coalescer = handlers.build_registry(ctx=ctx)
    # The autoscaler's own handlers (an event tracker and a startup/cleanup pair that runs one
    # operator-wide loop; no finalizer) join the same registry, so they too run only on the
    # leader. Its series go to the operator's /metrics.
    autoscaler_loop.register(
        registry=registry,
        api=api,
        prometheus_url=args.prometheus_url,
        metrics_registry=operator_metrics.registry,
        scrape_interval_seconds=args.prometheus_scrape_interval_seconds,
        window_seconds=args.metrics_window_seconds,
    )
    stop_flag: asyncio.Event = asyncio.Event()
    ready_flag: asyncio.Event = asyncio.Event()
    namespaces = list(operator_flags.watched_namespaces(args))  # exactly these, or [] for all
    kopf_task = asyncio.create_task(
        kopf.operator(
            registry=registry,
            settings=kopf_settings(identity=identity, namespaced=bool(namespaces)),
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        ),
        name="kopf",
    )
    waiters: set[asyncio.Task[Any]] = {kopf_task}
    hold_task = asyncio.create_task(elector.hold(), name="lease") if elector else None
    if hold_task is not None:
        waiters.add(hold_task)
    stop_task = asyncio.create_task(stop.wait(), name="stop")
    waiters.add(stop_task)

    async def mark_ready() -> None:
        await ready_flag.wait()
        state.kopf_ready = True
        logger.info("Operator is ready (leader %s)", identity)

    ready_task = asyncio.create_task(mark_ready())
    exit_code = 0
    try:
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if hold_task is not None and hold_task in done:
            exc = hold_task.exception()
            logger.error("Leadership lost (%s): stopping and exiting", exc)
            exit_code = EXIT_LEADERSHIP_LOST
        elif kopf_task in done:
            exc = kopf_task.exception()
            if exc is not None:
                logger.error("kopf stopped with an error: %s", exc)
                state.kopf_failed = True
                exit_code = 1
    finally:
        stop_flag.set()
        await coalescer.close()
        ctx.spec_lane.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(kopf_task, timeout=KOPF_STOP_TIMEOUT_SECONDS)
        for task in (hold_task, stop_task, ready_task):
            if task is not None:
                task.cancel()
        await asyncio.to_thread(poster.stop)  # what is queued is posted before the Lease goes
        events.install(None)
        if elector is not None and exit_code != EXIT_LEADERSHIP_LOST:
            await elector.release()
    return exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve operator", description="Reconcile InferenceServices into prefill/decode/router workloads."
    )
    operator_flags.add_operator_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    """Entry point of `splitserve operator` (argv without the subcommand)."""
    parser = build_parser()
    args = operator_flags.operator_args_from_namespace(parser.parse_args(argv))
    try:
        operator_flags.watched_namespaces(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:  # the hubs this operator serves: every spec it parses is checked against them
        api.hub_policy.enforce(api.hub_policy.HubAllowList.parse(args.allowed_hub_endpoints))
    except ValueError as exc:
        parser.error(f"--allowed-hub-endpoints: {exc}")
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return asyncio.run(run(args=args))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
