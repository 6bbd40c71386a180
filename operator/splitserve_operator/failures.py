"""Why a child cannot make progress, in the child's own words.

Argo CD, Flux and ``kubectl wait`` read only the InferenceService's conditions. A pool that can
never come up (a PriorityClass that does not exist, an image that cannot be pulled, a model
that cannot be loaded) must therefore show there as ``Stalled=True`` with the child's reason
and message, not as an endless ``RolloutInProgress``. The evidence, all from objects the
reconciler already holds:

* Deployment conditions (:func:`replica_failures`, :func:`stuck_rollouts`):
  ``ReplicaFailure=True`` (reason ``FailedCreate``: the ReplicaSet cannot create pods) and
  ``Progressing=False`` with reason ``ProgressDeadlineExceeded``;
* pods whose container keeps exiting at start-up (:func:`pod_start_failure`): the kubelet
  says why (``OOMKilled``: the message names the pool, the container and its memory limit), or
  the termination message does (``ModelUnavailable``), else ``PodStartFailed``;
* pods whose container cannot be started at all (:func:`pod_waiting_failure`):
  ``ImagePullBackOff``, ``ErrImagePull``, ``CreateContainerConfigError`` and the like, with
  the kubelet's message;
* pods the scheduler cannot place (:func:`pod_unschedulable`: ``PodScheduled=False``, reason
  ``Unschedulable``), with the scheduler's message: ``InsufficientGPUCapacity`` only when it
  names ``nvidia.com/gpu`` as the only resource lacking, else ``Unschedulable`` (memory or CPU
  beyond every node, a nodeSelector or affinity no node matches, a missing
  PersistentVolumeClaim). Without this, such a pool reads "in progress" until its Deployment's
  progress deadline, and then only "ReplicaSet has timed out progressing".

Pod evidence counts only for pools without a ready replica (:func:`pod_failures`): one
failing replica beside serving ones is the rollout's business, and a rollout stuck for good
shows as ``ProgressDeadlineExceeded``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Final

import splitserve_contract as contract
from splitserve_contract import Reason, Role

from . import capacity

MAX_MESSAGE_CHARS: Final = 1024
"""A child's message is trimmed to this in conditions and Events."""
MODEL_FAILURE_MARKERS: Final = ("is not in the local cache", "ModelLoadError", "model '")
"""Text of a termination message that says the model could not be loaded (most specific first)."""
WAITING_FAILURES: Final = frozenset(
    {
        Reason.IMAGE_PULL_BACK_OFF,
        Reason.ERR_IMAGE_PULL,
        "InvalidImageName",
        "ErrImageNeverPull",
        Reason.CREATE_CONTAINER_CONFIG_ERROR,
        "CreateContainerError",
        "RunContainerError",
    }
)
"""Waiting reasons of a container that the kubelet cannot start (not "still starting")."""
_REASON: Final = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
"""What a condition reason may be (metav1.Condition)."""


def _trim(text: str) -> str:
    """The end of a long text (the end of a log tail says most)."""
    text = text.strip()
    return text if len(text) <= MAX_MESSAGE_CHARS else "..." + text[-(MAX_MESSAGE_CHARS - 3) :]


def condition_reason(reason: str) -> str:
    """``reason`` if it may be a condition reason, else :attr:`Reason.CHILD_FAILED`."""
    return reason if len(reason) <= 1024 and _REASON.match(reason) else Reason.CHILD_FAILED


# ---------------------------------------------------------------------------- pods
@dataclasses.dataclass(frozen=True)
class PodStartFailure:
    """A container of a pod that keeps exiting at start-up (crash loop)."""

    pod: str
    role: str
    container: str
    exit_code: int
    model_unavailable: bool
    message: str
    """The container's termination message (the runtime's load error, or the log tail)."""
    termination_reason: str = ""
    """The kubelet's reason for the last exit (``Error``, ``OOMKilled``)."""
    memory_limit: str = ""
    """The container's ``resources.limits.memory`` ("" when it has none)."""

    @property
    def oom_killed(self) -> bool:
        return self.termination_reason == Reason.OOM_KILLED

    @property
    def reason(self) -> str:
        if self.model_unavailable:
            return Reason.MODEL_UNAVAILABLE
        if self.oom_killed:
            return Reason.OOM_KILLED
        return Reason.POD_START_FAILED

    def describe(self) -> str:
        if self.oom_killed:
            pool = f"pool {self.role}, " if self.role else ""
            limit = (
                f"at its memory limit of {self.memory_limit}"
                if self.memory_limit
                else "with no memory limit of its own"
            )
            head = (
                f"pod {self.pod} ({pool}container {self.container}) was OOMKilled {limit} (exit code {self.exit_code})"
            )
        else:
            head = f"pod {self.pod} (container {self.container}) exited with code {self.exit_code}"
        return f"{head}: {self.message}" if self.message else head


@dataclasses.dataclass(frozen=True)
class PodWaitingFailure:
    """A container the kubelet cannot start (image pull, configuration)."""

    pod: str
    role: str
    container: str
    waiting_reason: str
    message: str

    @property
    def reason(self) -> str:
        return condition_reason(self.waiting_reason)

    def describe(self) -> str:
        head = f"pod {self.pod} (container {self.container}) cannot start: {self.waiting_reason}"
        return f"{head}: {self.message}" if self.message else head


@dataclasses.dataclass(frozen=True)
class PodUnschedulable:
    """A Pending pod the scheduler cannot place."""

    pod: str
    role: str
    message: str
    """The scheduler's message ("0/3 nodes are available: 1 Insufficient memory, ...")."""

    @property
    def reason(self) -> str:
        if capacity.lacks_only_gpus(self.message):
            return Reason.INSUFFICIENT_GPU_CAPACITY
        return Reason.UNSCHEDULABLE

    def describe(self) -> str:
        head = f"pod {self.pod} cannot be scheduled"
        return f"{head}: {self.message}" if self.message else head


PodFailure = PodStartFailure | PodWaitingFailure | PodUnschedulable


def _relevant_text(message: str) -> tuple[bool, str]:
    """(mentions a model load failure, the part worth showing, at most ~1 KiB)."""
    text = message.strip()
    for marker in MODEL_FAILURE_MARKERS:
        lines = [line.strip() for line in text.splitlines() if marker in line]
        if lines:
            return True, lines[-1][-MAX_MESSAGE_CHARS:]
    return False, _trim(text)


def _failed_termination(container_status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The failed termination of a container that keeps failing at start-up, else None."""
    if container_status.get("ready"):
        return None
    state = container_status.get("state") or {}
    current = state.get("terminated") or {}
    last = (container_status.get("lastState") or {}).get("terminated") or {}
    crash_loop = (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff"
    restarted_after_failure = (
        int(container_status.get("restartCount") or 0) >= 1 and int(last.get("exitCode") or 0) != 0
    )
    if not (crash_loop or restarted_after_failure):
        return None
    if int(current.get("exitCode") or 0) != 0:
        return dict(current)
    return dict(last)


def _identity(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(name, role) of a pod that is not being deleted."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None
    return str(meta.get("name", "")), str((meta.get("labels") or {}).get(contract.LABEL_ROLE, ""))


def _memory_limit(pod: Mapping[str, Any], container: str) -> str:
    """``resources.limits.memory`` of ``container`` in ``pod``'s spec, "" when none."""
    for spec in (pod.get("spec") or {}).get("containers") or []:
        if spec.get("name") == container:
            limit = ((spec.get("resources") or {}).get("limits") or {}).get("memory")
            return "" if limit is None else str(limit)
    return ""


def pod_start_failure(pod: Mapping[str, Any]) -> PodStartFailure | None:
    """The first container of ``pod`` that keeps failing at start-up (restartCount >= 1 after
    a non-zero exit, or CrashLoopBackOff), with its termination message (and, when the
    kubelet OOM-killed it, its memory limit); None otherwise."""
    identity = _identity(pod)
    if identity is None:
        return None
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = _failed_termination(cs)
        if term is None:
            continue
        name = str(cs.get("name", ""))
        reason = str(term.get("reason") or "")
        text = str(term.get("message") or "")
        if reason == Reason.OOM_KILLED:
            # The kubelet's word: the message is the log tail (FallbackToLogsOnError), which
            # may well mention a model without the model being the problem.
            model_unavailable, message = False, _trim(text)
        else:
            model_unavailable, message = _relevant_text(text)
        return PodStartFailure(
            pod=identity[0],
            role=identity[1],
            container=name,
            exit_code=int(term.get("exitCode") or 0),
            model_unavailable=model_unavailable,
            message=message,
            termination_reason=reason,
            memory_limit=_memory_limit(pod, name),
        )
    return None


def pod_waiting_failure(pod: Mapping[str, Any]) -> PodWaitingFailure | None:
    """The first container of ``pod`` that the kubelet cannot start (:data:`WAITING_FAILURES`)."""
    identity = _identity(pod)
    if identity is None:
        return None
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in WAITING_FAILURES:
            return PodWaitingFailure(
                pod=identity[0],
                role=identity[1],
                container=str(cs.get("name", "")),
                waiting_reason=str(waiting["reason"]),
                message=_trim(str(waiting.get("message") or "")),
            )
    return None


def pod_unschedulable(pod: Mapping[str, Any]) -> PodUnschedulable | None:
    """``pod`` with the scheduler's message when it is Pending and cannot be placed."""
    identity = _identity(pod)
    message = capacity.scheduling_failure(pod)
    if identity is None or message is None:
        return None
    return PodUnschedulable(pod=identity[0], role=identity[1], message=_trim(message))


def pod_failure(pod: Mapping[str, Any]) -> PodFailure | None:
    """Why ``pod`` cannot run, if it cannot: a start failure, else a waiting failure, else the
    scheduler's refusal."""
    return pod_start_failure(pod) or pod_waiting_failure(pod) or pod_unschedulable(pod)


def _rank(failure: PodFailure) -> tuple[int, str]:
    """A model failure says the most, then any other start failure, then a waiting one, then
    the scheduler's."""
    if isinstance(failure, PodStartFailure):
        return (0 if failure.model_unavailable else 1, failure.pod)
    if isinstance(failure, PodWaitingFailure):
        return (2, failure.pod)
    return (3, failure.pod)


def pod_failures(*, roles: Collection[Role], pods: Sequence[Mapping[str, Any]]) -> list[PodFailure]:
    """One failing pod for each of ``roles`` (the pools without a ready replica) that has one."""
    found = [f for f in map(pod_failure, pods) if f is not None]
    out: list[PodFailure] = []
    for role in roles:
        mine = sorted((f for f in found if f.role == role.value), key=_rank)
        if mine:
            out.append(mine[0])
    return out


# ---------------------------------------------------------------------------- Deployments
@dataclasses.dataclass(frozen=True)
class DeploymentFailure:
    """A condition of a pool's Deployment that says it cannot progress."""

    deployment: str
    role: str
    condition_reason: str
    message: str

    @property
    def reason(self) -> str:
        return condition_reason(self.condition_reason)

    def describe(self) -> str:
        head = f"Deployment {self.deployment}: {self.condition_reason}"
        return f"{head}: {self.message}" if self.message else head


def _deployment_failures(
    deployments: Mapping[Role, Mapping[str, Any]], *, type_: str, status: str, reasons: Collection[str] | None
) -> list[DeploymentFailure]:
    out = []
    for role, dep in deployments.items():
        for cond in (dep.get("status") or {}).get("conditions") or []:
            if cond.get("type") != type_ or cond.get("status") != status:
                continue
            reason = str(cond.get("reason") or type_)
            if reasons is None or reason in reasons:
                out.append(
                    DeploymentFailure(
                        deployment=str(dep["metadata"]["name"]),
                        role=role.value,
                        condition_reason=reason,
                        message=_trim(str(cond.get("message") or "")),
                    )
                )
    return out


def replica_failures(deployments: Mapping[Role, Mapping[str, Any]]) -> list[DeploymentFailure]:
    """Deployments whose ReplicaSet cannot create or delete pods (``ReplicaFailure=True``)."""
    return _deployment_failures(deployments, type_="ReplicaFailure", status="True", reasons=None)


def stuck_rollouts(deployments: Mapping[Role, Mapping[str, Any]]) -> list[DeploymentFailure]:
    """Deployments past their progress deadline (``Progressing=False``, ``ProgressDeadlineExceeded``)."""
    return _deployment_failures(
        deployments, type_="Progressing", status="False", reasons={Reason.PROGRESS_DEADLINE_EXCEEDED}
    )


ChildFailure = PodFailure | DeploymentFailure
