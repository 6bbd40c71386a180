"""kopf handlers: thin decorators that route events to :func:`reconcile.reconcile`.

:func:`build_registry` returns a fresh :class:`kopf.OperatorRegistry` (not kopf's global one),
so the handlers exist only when the operator really starts, i.e. after this replica won the
leader election, and tests can build several independent operators.

Triggers, all level-based (every reconcile recomputes everything):

* InferenceService resume/create/update -> reconcile. Errors become ``kopf.TemporaryError``
  with a bounded exponential delay, so kopf retries them; nothing escapes as a crash.
* Any event on a child (Deployment, Service, ConfigMap, PDB, NetworkPolicy labelled
  ``managed-by=splitserve-operator``) -> reconcile its controlling InferenceService: a deleted
  child is re-created, a drifted field is re-applied, and Deployment status changes refresh
  the pool counts in status. ``spec.replicas`` drift needs no special case: the apply never
  contains it. These reconciles are coalesced per object by :class:`Coalescer` (a burst of
  child events costs one or two reconciles) and retried with bounded backoff. Every event also
  goes into :class:`.child_cache.ChildCache`, the reconciler's view of its children (no read
  before a write, no write of an unchanged child); the echo of the operator's own write
  triggers nothing (:func:`child_event_target`).
* Unschedulable pods of our pools, and pods that cannot run (:func:`failures.pod_failure`: a
  model that cannot be loaded, a crash loop, an OOM kill, an image that cannot be pulled) ->
  reconcile their InferenceService, so a capacity shortfall or a child failure is reported
  as soon as it shows. A Deployment that cannot create pods (ReplicaFailure) or is past its
  progress deadline changes its status, which the Deployment watch above already delivers.
* The KV handoff key Secrets (labelled ``managed-by=splitserve-operator``): a metadata-only
  watch of our own (:mod:`.secret_watch`; a kopf watch would receive the Secrets' data) feeds
  the child cache and reconciles the controlling InferenceService of a Secret deleted or changed
  by someone else (:func:`secret_event_target`), so a deleted key is created again at once.
* A spec that can never apply is reported as Stalled/InvalidSpec by the reconcile and then
  left alone (:func:`reconcile.spec_never_applies`): neither kopf nor the child path retries
  it until its generation changes.
* Pause: objects annotated ``splitserve.dev/paused: "true"`` are filtered out by ``when=``
  before kopf computes anything, so kopf stores no progress and writes nothing to them, and
  the child path skips them too: zero writes. Removing the annotation reconciles at once
  (:func:`unpause_target`): kopf leaves annotations under its own storage prefix
  (``splitserve.dev/``) out of what it compares, so it sees no change, and drift made during
  the pause would wait for some other event.
* Deletion: no handler and no finalizer. Owner references with ``blockOwnerDeletion`` let the
  garbage collector remove the children; a finalizer would only make ``kubectl delete`` hang
  whenever the operator is down.

kopf's own progress and diff-base annotations use the ``splitserve.dev`` prefix (settings in
:mod:`main`); the diff-base is a digest of the last handled state, not the spec itself
(:mod:`.diffbase`), so a spec of any size fits the annotations.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

import kopf

import splitserve_contract as contract

from . import child_cache, failures, kube, leader_worker_set, reconcile, secret_watch
from .metrics import OperatorMetrics

logger = logging.getLogger(__name__)

MAX_RETRY_DELAY_SECONDS: Final = 60.0
CHILD_RETRY_ATTEMPTS: Final = 8
SPEC_WORKERS: Final = 4
"""Threads for reconciles of a created, changed or resumed InferenceService. They are their
own, so such an object is not queued behind the status refreshes (child events) of many others,
which use asyncio's default executor."""

Key = tuple[str, str]  # (namespace, name)
T = TypeVar("T")

CHILD_RESOURCES: Final = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    # the endpoint picker's own account and permissions (spec.router.mode InferencePool); the
    # InferencePool itself is not watched: its CRD may be absent, and a kopf watch on a missing
    # resource fails (a deleted pool comes back at the next reconcile of its InferenceService).
    # Nor are LeaderWorkerSets (multi-node pools), for the same reason: a deleted one comes back
    # at the next reconcile, and their pods' events (pod_needs_reconcile) refresh the counts.
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
)

CACHED_RESOURCES: Final = (*CHILD_RESOURCES, ("", "v1", "secrets"))
"""What the child cache keeps: the kopf-watched children and the Secrets of :mod:`.secret_watch`."""


def retry_delay(attempt: int) -> float:
    """1, 2, 4, ... seconds, capped at :data:`MAX_RETRY_DELAY_SECONDS`."""
    return float(min(MAX_RETRY_DELAY_SECONDS, 2 ** max(0, attempt)))


def progress_message(text: str) -> str:
    """``text`` bounded for kopf, which keeps a retried handler's error message in an
    annotation (all annotations share 256 KiB; an API server's message may quote the spec)."""
    return text if len(text) <= failures.MAX_MESSAGE_CHARS else text[: failures.MAX_MESSAGE_CHARS - 3] + "..."


def not_paused(body: Mapping[str, Any], **_: Any) -> bool:
    return not reconcile.is_paused(body)


def pod_unschedulable(body: Mapping[str, Any], **_: Any) -> bool:
    conditions = (body.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "PodScheduled" and c.get("status") == "False" for c in conditions)


def pod_needs_reconcile(body: Mapping[str, Any], **_: Any) -> bool:
    """Pod events worth a reconcile: unschedulable, or unable to run (failing at start-up,
    an image that cannot be pulled, a container that cannot be configured), and any change of a
    multi-node pool's pod: its groups are counted from the pods (LeaderWorkerSets are not
    watched)."""
    return (
        pod_unschedulable(body)
        or failures.pod_failure(body) is not None
        or leader_worker_set.SET_NAME_LABEL in ((body.get("metadata") or {}).get("labels") or {})
    )


def owner_key(obj: Mapping[str, Any]) -> Key | None:
    """(namespace, name) of the InferenceService controlling a child, if any."""
    meta = obj.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if (
            ref.get("controller")
            and ref.get("kind") == contract.KIND
            and str(ref.get("apiVersion", "")).startswith(f"{contract.API_GROUP}/")
        ):
            return (str(meta.get("namespace")), str(ref.get("name")))
    return None


async def in_lane(lane: concurrent.futures.Executor, call: Callable[[], T]) -> T:
    """``call()`` on one of ``lane``'s threads, in this task's context (like
    :func:`asyncio.to_thread`), so what the handler's context carries (kopf's logging
    prefixes) carries on into the reconcile."""
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(lane, context.run, call)


def child_event_target(
    *, event: Mapping[str, Any], body: Mapping[str, Any], children: child_cache.ChildCache, known: Mapping[Key, None]
) -> Key | None:
    """Keep what a child's watch event shows in ``children``, and say which InferenceService
    to reconcile for it: its controlling one, except for the initial listing of a known one (its
    own resume handler covers it) and for the echo of our own write (the reconcile that sent it
    saw the answer). None: nothing to do."""
    raw: Mapping[str, Any] = event.get("object") or body
    if event.get("type") == "DELETED":
        children.forget(raw)
        echo = False
    else:
        echo = children.observe(raw)
    key = owner_key(body)
    if key is None:
        return None  # labelled like ours but not controlled by an InferenceService: not ours
    if event.get("type") is None and key in known:
        return None
    return None if echo else key


def secret_event_target(
    *, event_type: str | None, secret: Mapping[str, Any], children: child_cache.ChildCache
) -> Key | None:
    """Keep what the Secret watch shows in ``children``, and say which InferenceService to
    reconcile for it: for a deletion or a change by anyone else (not the echo of our own
    create, not the initial listing), the one that controls it, else the one its instance
    label names (a Secret stripped of its owner reference is no longer ours: a conflict to
    report). None: nothing to do."""
    if event_type == "DELETED":
        children.forget(secret)
        echo = False
    else:
        echo = children.observe(secret)
    if event_type is None or echo:
        return None
    key = owner_key(secret)
    if key is not None:
        return key
    meta = secret.get("metadata") or {}
    instance = (meta.get("labels") or {}).get(contract.LABEL_INSTANCE)
    return (str(meta.get("namespace")), str(instance)) if instance else None


def unpause_target(*, event: Mapping[str, Any], body: Mapping[str, Any], paused: set[Key]) -> Key | None:
    """Track which InferenceServices are paused (``paused``, updated in place) and say which
    one was just unpaused: it is reconciled at once. None: nothing to do."""
    meta = body.get("metadata") or {}
    key = (str(meta.get("namespace")), str(meta.get("name")))
    if event.get("type") == "DELETED":
        paused.discard(key)
        return None
    if reconcile.is_paused(body):
        paused.add(key)
        return None
    if key in paused:
        paused.discard(key)
        return key
    return None


class Coalescer:
    """At most one reconcile per object at a time; requests during a run cause one re-run.

    The kopf handler path and the child-event path share the per-object lock, so two
    reconciles of the same InferenceService never interleave."""

    def __init__(self, *, run: Callable[[Key], Awaitable[bool]]) -> None:
        self._run = run  # returns True when done, False to retry later
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self._again: set[Key] = set()
        self._locks: dict[Key, asyncio.Lock] = {}
        self._users: dict[Key, int] = {}

    def lock(self, key: Key) -> _KeyLock:
        return _KeyLock(self, key)

    def from_thread(self) -> Callable[[Key], None]:
        """A ``request`` that other threads may call (the Secret watch's), bound to this loop.
        Call it on the loop. (Events do not depend on the context a reconcile runs in:
        :mod:`.events` posts through its own poster.)"""
        loop = asyncio.get_running_loop()

        def request(key: Key) -> None:
            loop.call_soon_threadsafe(self.request, key)

        return request

    def request(self, key: Key) -> None:
        if key in self._tasks:
            self._again.add(key)
            return
        self._tasks[key] = asyncio.create_task(self._loop(key), name=f"reconcile {key[0]}/{key[1]}")

    async def _loop(self, key: Key) -> None:
        try:
            attempt = 0
            while True:
                self._again.discard(key)
                async with self.lock(key):
                    done = await self._run(key)
                if not done:
                    if attempt >= CHILD_RETRY_ATTEMPTS:
                        logger.error(
                            "Giving up child-triggered reconcile of %s/%s after %d attempts",
                            key[0],
                            key[1],
                            attempt + 1,
                        )
                        return
                    await asyncio.sleep(retry_delay(attempt))
                    attempt += 1
                    continue
                if key not in self._again:
                    return
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - never let a background task die silently
            logger.exception("Child-triggered reconcile of %s/%s crashed", key[0], key[1])
        finally:
            self._tasks.pop(key, None)
            self._again.discard(key)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def pending(self) -> int:
        return len(self._tasks)


class _KeyLock:
    def __init__(self, owner: Coalescer, key: Key) -> None:
        self._owner = owner
        self._key = key

    async def __aenter__(self) -> None:
        o = self._owner
        o._users[self._key] = o._users.get(self._key, 0) + 1
        lock = o._locks.setdefault(self._key, asyncio.Lock())
        await lock.acquire()

    async def __aexit__(self, *_exc: object) -> None:
        o = self._owner
        o._locks[self._key].release()
        o._users[self._key] -= 1
        if o._users[self._key] == 0:  # bounded memory over create/delete cycles
            del o._users[self._key]
            del o._locks[self._key]


@dataclasses.dataclass
class OperatorContext:
    """Everything the handlers need, built once by :mod:`main`."""

    api: kube.Kube
    settings: reconcile.ReconcileSettings
    metrics: OperatorMetrics
    nodes: reconcile.NodeCache = dataclasses.field(default_factory=reconcile.NodeCache)
    known: dict[Key, None] = dataclasses.field(default_factory=dict)
    """InferenceServices this operator has seen (for the autoscaler loop)."""
    children: child_cache.ChildCache = dataclasses.field(
        default_factory=lambda: child_cache.ChildCache.for_resources(CACHED_RESOURCES)
    )
    """The children as the child watch delivers them (:mod:`.child_cache`)."""
    spec_lane: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(SPEC_WORKERS, thread_name_prefix="spec")
    )
    """Where the kopf handlers' reconciles run (:data:`SPEC_WORKERS`)."""
    namespaces: tuple[str, ...] = ()
    """The namespaces served (namespace scopes), () for all: where the Secret watch looks (one
    watch each: the operator may list Secrets only in those)."""
    paused: set[Key] = dataclasses.field(default_factory=set)
    """InferenceServices last seen paused (:func:`unpause_target`)."""

    def run_reconcile(self, obj: Mapping[str, Any]) -> reconcile.Result:
        started = time.monotonic()
        outcome = "Error"
        try:
            result = reconcile.reconcile(
                api=self.api, obj=obj, settings=self.settings, nodes=self.nodes, children=self.children
            )
            outcome = result.outcome
            return result
        except reconcile.RetryableError:
            self.metrics.reconcile_errors_total.inc()
            raise
        finally:
            self.metrics.reconcile_seconds.labels(outcome=outcome).observe(time.monotonic() - started)


def build_registry(*, ctx: OperatorContext) -> tuple[kopf.OperatorRegistry, Coalescer]:
    """All handlers of the operator, bound to ``ctx``."""
    registry = kopf.OperatorRegistry()
    group, version, plural = contract.API_GROUP, contract.API_VERSION, contract.PLURAL

    async def run_from_child(key: Key) -> bool:
        try:
            obj = await asyncio.to_thread(ctx.api.get, kind=kube.INFERENCE_SERVICE, namespace=key[0], name=key[1])
        except Exception as exc:  # noqa: BLE001
            logger.warning("Reading InferenceService %s/%s failed: %s", key[0], key[1], kube.error_message(exc))
            return False
        if obj is None or reconcile.is_paused(obj) or obj["metadata"].get("deletionTimestamp"):
            return True
        try:
            await asyncio.to_thread(ctx.run_reconcile, obj)
        except reconcile.RetryableError as exc:
            logger.warning("Reconcile of %s/%s failed, will retry: %s", key[0], key[1], exc)
            return False
        except Exception:  # noqa: BLE001
            logger.exception("Reconcile of %s/%s failed unexpectedly", key[0], key[1])
            return False
        return True

    coalescer = Coalescer(run=run_from_child)

    async def reconcile_handler(body: kopf.Body, retry: int, **_: Any) -> None:
        key = (str(body.metadata.namespace), str(body.metadata.name))
        ctx.known[key] = None
        if body.metadata.get("deletionTimestamp"):
            return
        try:
            async with coalescer.lock(key):
                # Re-read inside the lock: kopf's body may predate a reconcile that just ran.
                obj = await in_lane(
                    ctx.spec_lane,
                    functools.partial(ctx.api.get, kind=kube.INFERENCE_SERVICE, namespace=key[0], name=key[1]),
                )
                if obj is None or reconcile.is_paused(obj):
                    return
                await in_lane(ctx.spec_lane, functools.partial(ctx.run_reconcile, obj))
        except reconcile.RetryableError as exc:
            raise kopf.TemporaryError(progress_message(str(exc)), delay=retry_delay(retry)) from exc
        except Exception as exc:  # noqa: BLE001 - problems are retried, never crash the operator
            logger.exception("Reconcile of %s/%s failed unexpectedly", key[0], key[1])
            raise kopf.TemporaryError(
                progress_message(f"{type(exc).__name__}: {exc}"), delay=retry_delay(retry)
            ) from exc

    kopf.on.login(registry=registry)(kopf.login_via_client)
    kopf.on.resume(group, version, plural, registry=registry, when=not_paused, id="reconcile-resume")(reconcile_handler)
    kopf.on.create(group, version, plural, registry=registry, when=not_paused, id="reconcile-create")(reconcile_handler)
    kopf.on.update(group, version, plural, registry=registry, when=not_paused, id="reconcile-update")(reconcile_handler)

    @kopf.on.event(group, version, plural, registry=registry, id="track")
    async def track(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        key = (str(body.metadata.namespace), str(body.metadata.name))
        if unpause_target(event=event, body=body, paused=ctx.paused) is not None:
            coalescer.request(key)
        if event.get("type") == "DELETED":
            ctx.known.pop(key, None)
            ctx.metrics.conditions.forget(key)
            ctx.children.forget_owner(key)
        else:
            ctx.known[key] = None
            ctx.metrics.conditions.observe(key, (body.get("status") or {}).get("conditions") or [])

    async def child_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        key = child_event_target(event=event, body=body, children=ctx.children, known=ctx.known)
        if key is not None:
            coalescer.request(key)

    labels = {contract.LABEL_MANAGED_BY: contract.MANAGED_BY_VALUE}

    @kopf.on.event("v1", "pods", registry=registry, labels=labels, when=pod_needs_reconcile, id="pod-problems")
    async def pod_event(body: kopf.Body, **_: Any) -> None:
        # Pods are owned by ReplicaSets; the instance label names the InferenceService. Only
        # unschedulable pods (capacity) and pods that cannot run (their termination or
        # waiting message) matter here; Deployment status covers the rest.
        instance = (body.metadata.labels or {}).get(contract.LABEL_INSTANCE)
        if instance:
            coalescer.request((str(body.metadata.namespace), str(instance)))

    for child_group, child_version, child_plural in CHILD_RESOURCES:
        api_version = f"{child_group}/{child_version}" if child_group else child_version
        kopf.on.event(api_version, child_plural, registry=registry, labels=labels, id=f"child-{child_plural}")(
            child_event
        )

    watch: list[secret_watch.SecretWatch] = []

    @kopf.on.startup(registry=registry, id="secret-watch-start")
    async def start_secret_watch(**_: Any) -> None:
        request = coalescer.from_thread()

        def on_change(event_type: str | None, secret: Mapping[str, Any]) -> None:  # the watch's thread
            key = secret_event_target(event_type=event_type, secret=secret, children=ctx.children)
            if key is not None:
                request(key)

        for namespace in ctx.namespaces or (None,):
            watch.append(secret_watch.SecretWatch(api=ctx.api, namespace=namespace, on_change=on_change))
            watch[-1].start()

    @kopf.on.cleanup(registry=registry, id="secret-watch-stop")
    async def stop_secret_watch(**_: Any) -> None:
        for w in watch:
            w.stop()

    return registry, coalescer
