"""Upgrading an installation as docs/operator.md#upgrading says, and rolling it back.

"The previous version" is the chart with the CRD an earlier splitserve shipped
(``e2e/fixtures/crds/inferenceservices-b9e93fb.yaml``: no speculative decoding, KV dtype or hub
endpoint fields; parallelism and quantization limited to 1 and none; tolerations untyped; no
``interval >= 1s`` rule). It is installed with Helm, InferenceServices are created under it,
and then the commands in the Upgrading section's command blocks are run exactly as written
(parsed out of the page, so the docs and this test cannot drift; only the chart paths are
pointed at this checkout and at the previous chart).

CRDs are cluster-scoped and every other module uses today's, so this module runs its own
cluster: control plane and kwok nodes only (no kubelet node, no Prometheus; about 10 s to
start). With no node to run the operator's pods (the chart's operator pods land on a kwok node,
where nothing runs), the operator runs on the host as that pod would: the container's
``args`` read from the chart's Deployment, the chart's ServiceAccount token (so the chart's
RBAC is what it gets), started where the Deployment would start a pod and stopped (SIGTERM)
where the pod would be deleted. With no Prometheus the autoscaler holds each pool's count and
only moves it into ``[min, max]``, which is enough to see its decisions.

Checked: existing objects keep uid, generation, resourceVersion and spec through the CRD
upgrade, and show the new fields' defaults on read without a write; the new operator takes the
Lease at once and reconciles them; updates to an object the new rules refuse are ratcheted
(unrelated changes pass with a warning, changes next to the offending value are refused) and
fixing it brings it back; new objects get the new validations and fields; ``kubectl get sis -o
wide`` has the new columns; ``kubectl describe sis`` shows the pools' recent decisions; the
documented rollback prunes the fields the old CRD does not know.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import crdgen
import pytest

import splitserve_contract as contract
from splitserve_e2e.build import cache_root
from splitserve_e2e.cluster import ClusterOptions, LocalCluster
from splitserve_e2e.kwok import (
    GPU_COUNT_LABEL,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    KWOK_NODE_LABEL,
    KWOK_NODE_LABEL_VALUE,
    GpuNodeShape,
    gpu_node_manifest,
    kwok_toleration,
)
from splitserve_e2e.net import free_port
from splitserve_e2e.stack import MODEL_NAME
from splitserve_operator.api import rules

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "splitserve"
DOC = REPO / crdgen.DOC_PATH
PREVIOUS_CRD = REPO / "e2e" / "fixtures" / "crds" / "inferenceservices-b9e93fb.yaml"
RELEASE = "splitserve"  # as in the docs' commands
OPERATOR_NS = "splitserve-system"
TEAM = "team-a"
CRD_NAME = f"{contract.PLURAL}.{contract.API_GROUP}"
WAIT_SECONDS = 90.0  # kwok pools converge in seconds; the bound absorbs a loaded 2-core machine
KWOK = {"tolerations": [kwok_toleration()], "nodeSelector": {KWOK_NODE_LABEL: KWOK_NODE_LABEL_VALUE}}
NEW_DEFAULTS = {
    ("kvCache", "dtype"): "auto",
    ("engine", "speculative"): {"method": "none", "numTokens": 4, "maxNumSeqs": 16},
    ("runtime", "engine"): "splitserve",
}
"""Fields today's CRD adds with defaults, and those defaults."""


# --------------------------------------------------------------------------- the docs' commands
def documented_commands(marker: str) -> list[list[str]]:
    """The commands of the ``<!-- BEGIN {marker} ... -->`` block of docs/operator.md."""
    match = re.search(
        rf"<!-- BEGIN {marker} .*?-->\n```sh\n(.*?)```\n<!-- END {marker} -->", DOC.read_text(), flags=re.S
    )
    assert match is not None, f"docs/operator.md has no {marker} block"
    return [shlex.split(line) for line in match.group(1).splitlines() if line and not line.startswith("#")]


def run_documented(
    cluster: LocalCluster, marker: str, *, charts: Mapping[str, Path], after: Callable[[list[str]], None]
) -> list[str]:
    """Run the block's commands in order (chart paths in ``charts`` replaced by local ones),
    calling ``after(command)`` after each; returns their outputs."""
    outputs = []
    for command in documented_commands(marker):
        args = [_local_path(arg, charts) for arg in command[1:]]
        tool = {"kubectl": cluster.kubectl, "helm": cluster.helm}[command[0]]
        result = tool(*args, check=False, timeout_seconds=180)
        assert result.returncode == 0, f"{shlex.join(command)} failed: {result.stderr}"
        outputs.append(result.stdout + result.stderr)
        after(command)
    return outputs


def _local_path(arg: str, charts: Mapping[str, Path]) -> str:
    for documented, local in charts.items():
        if arg == documented or arg.startswith(documented + "/"):
            return str(local) + arg[len(documented) :]
    return arg


# --------------------------------------------------------------------------- the operator, on the host
@dataclasses.dataclass
class HostOperator:
    """The chart's operator container, run as a host process (see the module docstring)."""

    process: subprocess.Popen[bytes]
    pod_name: str
    lease: str
    log: Path

    @classmethod
    def start(cls, cluster: LocalCluster, *, pod_name: str, log_dir: Path) -> HostOperator:
        deployment = _get(cluster, OPERATOR_NS, "deployment", RELEASE)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        args: list[str] = list(container["args"])
        assert args[:2] == ["splitserve", "operator"], args
        ports = {"--metrics-port": free_port(), "--health-port": free_port()}  # not the pod's fixed ports
        args = [f"{a.split('=')[0]}={ports[a.split('=')[0]]}" if a.split("=")[0] in ports else a for a in args]
        lease = next(a.split("=", 1)[1] for a in args if a.startswith("--lease-name="))
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        kubeconfig = cluster.service_account_kubeconfig(namespace=OPERATOR_NS, service_account=account)
        env = dict(
            os.environ,
            KUBECONFIG=str(kubeconfig),
            **{
                contract.ENV_POD_NAME: pod_name,
                contract.ENV_POD_NAMESPACE: OPERATOR_NS,
                contract.ENV_POD_IP: "127.0.0.1",
            },
        )
        log = log_dir / f"{pod_name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "splitserve_cli", *args[1:]], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        return cls(process=process, pod_name=pod_name, lease=lease, log=log)

    def wait_leader(self, cluster: LocalCluster) -> float:
        """Seconds until this process holds the Lease."""
        started = time.monotonic()

        def holds() -> bool:
            assert self.process.poll() is None, f"operator {self.pod_name} exited: {self.tail()}"
            holder = _get(cluster, OPERATOR_NS, "lease", self.lease)["spec"].get("holderIdentity") or ""
            return str(holder).startswith(self.pod_name + "_")

        cluster.wait_for(holds, timeout_seconds=WAIT_SECONDS, interval_seconds=0.2, what=f"{self.pod_name} leading")
        return time.monotonic() - started

    def stop(self) -> int:
        """SIGTERM, as the kubelet sends it to a deleted pod; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


# --------------------------------------------------------------------------- objects
def _get(cluster: LocalCluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    if result.returncode != 0:
        raise KeyError(f"{kind}/{name}: {result.stderr.strip()}")
    return dict(json.loads(result.stdout))


def _isvc(cluster: LocalCluster, name: str) -> dict[str, Any]:
    return _get(cluster, TEAM, contract.PLURAL, name)


def _condition(obj: Mapping[str, Any], type_: str) -> dict[str, Any]:
    found = [c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_]
    return dict(found[0]) if found else {}


def _manifest(name: str, mode: str, *, interval: str = "2s", **extra: Any) -> dict[str, Any]:
    """An InferenceService valid under the previous CRD: kwok GPU pools, a short autoscaling
    interval, no hub token (the previous CRD refuses hubTokenSecretRef)."""
    pool = {"replicas": {"min": 1, "max": 3}, "resources": {"gpus": 1}, **copy.deepcopy(KWOK)}
    pools = {"aggregated": pool} if mode == "Aggregated" else {"prefill": pool, "decode": copy.deepcopy(pool)}
    spec: dict[str, Any] = {
        "model": {"uri": f"hf://{MODEL_NAME}", "dtype": "float32"},
        "mode": mode,
        **pools,
        "autoscaling": {"interval": interval},
    }
    if mode == "Disaggregated":
        spec["autoscaling"]["gpuBudget"] = 6
    spec.update(extra)
    return {
        "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
        "kind": contract.KIND,
        "metadata": {"name": name, "namespace": TEAM},
        "spec": spec,
    }


def _apply(cluster: LocalCluster, obj: Mapping[str, Any]) -> subprocess.CompletedProcess[str]:
    """``kubectl apply`` (client-side, as a user would) of ``obj``."""
    return cluster.kubectl("apply", "-f", "-", input_text=json.dumps(obj), check=False)


def _patch(cluster: LocalCluster, name: str, patch: Mapping[str, Any]) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(
        "patch", contract.PLURAL, name, "-n", TEAM, "--type=merge", "-p", json.dumps(patch), check=False
    )


def _ready(cluster: LocalCluster, name: str, *, generation: int | None = None) -> dict[str, Any] | None:
    obj = _isvc(cluster, name)
    status = obj.get("status") or {}
    if generation is not None and status.get("observedGeneration") != generation:
        return None
    return obj if _condition(obj, "Ready").get("status") == "True" else None


def _wait_ready(cluster: LocalCluster, name: str) -> dict[str, Any]:
    return cluster.wait_for(lambda: _ready(cluster, name), timeout_seconds=WAIT_SECONDS, what=f"{name} Ready")


def _subset(small: Any, big: Any) -> bool:
    """Whether every field of ``small`` is in ``big`` with the same value."""
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and _subset(v, big[k]) for k, v in small.items())
    return bool(small == big)


def _add_cpu_node(cluster: LocalCluster) -> None:
    """An untainted kwok node without GPUs: the routers' (and the chart's idle operator pods')
    place; the GPU pools tolerate the GPU nodes' taint."""
    node: Any = gpu_node_manifest(name="kwok-cpu-0", shape=GpuNodeShape(gpus_per_node=0))
    node["spec"] = {}
    for label in (GPU_PRODUCT_LABEL, GPU_COUNT_LABEL):
        node["metadata"]["labels"].pop(label)
    resources = {k: v for k, v in node["status"]["capacity"].items() if k != GPU_RESOURCE}
    node["status"] = {"capacity": resources, "allocatable": resources}
    cluster.core().create_node(node)


# --------------------------------------------------------------------------- the cluster
@pytest.fixture(scope="module")
def own_cluster() -> Iterator[LocalCluster]:
    runs = cache_root() / "e2e-runs"
    runs.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix=time.strftime("%m%d%H%M%S-upgrade-"), dir=runs))
    local = LocalCluster(
        state_dir=state, options=ClusterOptions(num_gpu_nodes=1, with_prometheus=False, with_kubelet_node=False)
    )
    passed = False
    try:
        local.start()
        print(f"\nupgrade cluster started in {local.start_seconds:.1f}s (state {state})")
        _add_cpu_node(local)
        yield local
        passed = True
    finally:
        local.stop()
        if passed:
            shutil.rmtree(state, ignore_errors=True)
        else:
            print(f"\nupgrade cluster logs kept in {state}")


@dataclasses.dataclass
class Timings:
    marks: dict[str, float] = dataclasses.field(default_factory=dict)

    @contextlib.contextmanager
    def measure(self, what: str) -> Iterator[None]:
        started = time.monotonic()
        yield
        self.marks[what] = round(time.monotonic() - started, 1)


# --------------------------------------------------------------------------- the test
def test_upgrade_and_rollback_as_documented(own_cluster: LocalCluster, tmp_path: Path) -> None:
    cluster, timings, operators = own_cluster, Timings(), []
    previous_chart = tmp_path / "previous" / "splitserve"
    shutil.copytree(CHART, previous_chart)
    for shipped in (previous_chart / "crds").iterdir():
        shipped.unlink()
    shutil.copy(PREVIOUS_CRD, previous_chart / "crds" / crdgen.CRD_FILENAME)
    charts = {"helm/splitserve": CHART, "previous/splitserve": previous_chart}
    try:
        # ---- the previous version, installed and serving
        with timings.measure("install previous chart"):
            cluster.kubectl("create", "namespace", TEAM)
            result = cluster.helm(
                "install",
                RELEASE,
                str(previous_chart),
                "-n",
                OPERATOR_NS,
                "--create-namespace",
                "--set",
                f"router.namespaces={{{TEAM}}}",
                check=False,
            )
            assert result.returncode == 0, result.stderr
            crd = _get(cluster, "", "crd", CRD_NAME)
            assert "speculative" not in json.dumps(crd["spec"]), "the previous CRD is not the one installed"
        old = HostOperator.start(cluster, pod_name="operator-previous", log_dir=tmp_path)
        operators.append(old)
        timings.marks["previous operator leading"] = round(old.wait_leader(cluster), 1)
        manifests = {
            "agg": _manifest("agg", "Aggregated"),
            "disagg": _manifest("disagg", "Disaggregated"),
            # valid under the previous CRD, refused by today's (interval >= 1s)
            "legacy": _manifest("legacy", "Aggregated", interval="500ms"),
        }
        for obj in manifests.values():
            result = _apply(cluster, obj)
            assert result.returncode == 0, result.stderr
        with timings.measure("previous operator converged"):
            for name in ("agg", "disagg"):
                _wait_ready(cluster, name)
            cluster.wait_for(
                lambda: _condition(_isvc(cluster, "legacy"), "Stalled").get("reason") == "InvalidSpec",
                timeout_seconds=WAIT_SECONDS,
                what="legacy Stalled (InvalidSpec)",
            )

        # Helm installed the CRD, so its fields are Helm's: the docs' --force-conflicts is needed
        refused = cluster.kubectl("apply", "--server-side", "-f", str(CHART / "crds"), check=False)
        assert refused.returncode != 0 and 'conflict with "helm"' in refused.stderr, refused.stderr

        # ---- the upgrade, command by command from the docs
        snapshots: dict[str, dict[str, dict[str, Any]]] = {}
        stopped_at: list[float] = []

        def snapshot(label: str) -> None:
            snapshots[label] = {name: _isvc(cluster, name) for name in manifests}

        def after_upgrade_step(command: list[str]) -> None:
            if command[:2] == ["kubectl", "scale"]:  # the operator pods are deleted: so is ours
                stopped_at.append(time.monotonic())
                assert old.stop() == 0, f"the previous operator did not exit cleanly: {old.tail()}"
            elif command[:2] == ["kubectl", "wait"]:
                snapshot("stopped")
            elif command[:2] == ["kubectl", "apply"]:
                # the API server swaps in a CRD's new schema asynchronously: a read right after
                # the apply may still default by the old one (it did once, on a loaded machine)
                cluster.wait_for(
                    lambda: all(
                        _isvc(cluster, name)["spec"][group][field] == default
                        for name in manifests
                        for (group, field), default in NEW_DEFAULTS.items()
                    ),
                    timeout_seconds=WAIT_SECONDS,
                    what="the new CRD's defaults on read",
                )
                snapshot("crd upgraded")
            elif command[:2] == ["helm", "upgrade"]:  # the Deployment starts a pod again: ours
                operators.append(HostOperator.start(cluster, pod_name="operator-upgraded", log_dir=tmp_path))
                operators[-1].wait_leader(cluster)
                timings.marks["operator down (scale to new leader)"] = round(time.monotonic() - stopped_at[0], 1)

        with timings.measure("documented upgrade steps"):
            run_documented(cluster, "UPGRADE STEPS", charts=charts, after=after_upgrade_step)
        new = operators[-1]

        # objects kept as they were; the new fields' defaults appear on read, without a write
        for name, obj in manifests.items():
            before, after = snapshots["stopped"][name], snapshots["crd upgraded"][name]
            for key in ("uid", "generation", "resourceVersion"):
                assert after["metadata"][key] == before["metadata"][key], (name, key)
            assert _subset(obj["spec"], after["spec"]), (name, after["spec"])
            assert _subset(before["spec"], after["spec"]), name
            for (group, field), default in NEW_DEFAULTS.items():
                assert field not in before["spec"][group], (name, group, field)
                assert after["spec"][group][field] == default, (name, group, field, after["spec"][group])
            assert after["status"]["conditions"] == before["status"]["conditions"], name
        assert "speculative" in json.dumps(_get(cluster, "", "crd", CRD_NAME)["spec"])

        # the new operator reconciles the old objects: a spec edit rolls the engine
        with timings.measure("old object edited and reconciled"):
            result = _patch(cluster, "agg", {"spec": {"engine": {"maxNumSeqs": 32}}})
            assert result.returncode == 0 and not result.stderr.strip(), result.stderr
            generation = _isvc(cluster, "agg")["metadata"]["generation"]
            cluster.wait_for(
                lambda: _ready(cluster, "agg", generation=generation),
                timeout_seconds=WAIT_SECONDS,
                what="agg reconciled at its new generation",
            )
            engine = _get(cluster, TEAM, "deployment", "agg-engine")
            args = " ".join(engine["spec"]["template"]["spec"]["containers"][0]["args"])
            assert re.search(r"--max-num-seqs[= ]32\b", args), args

        # ratcheting: the legacy object breaks a rule that did not exist when it was created
        for update in (
            ["label", contract.PLURAL, "legacy", "-n", TEAM, "team=ml"],
            [
                "patch",
                contract.PLURAL,
                "legacy",
                "-n",
                TEAM,
                "--type=merge",
                "-p",
                json.dumps({"spec": {"aggregated": {"replicas": {"max": 4}}}}),
            ],
        ):
            result = cluster.kubectl(*update, check=False)
            assert result.returncode == 0, result.stderr
            assert rules.INTERVAL_RULE_MESSAGE in result.stderr, f"no ratcheting warning: {result.stderr}"
        result = _apply(cluster, manifests["legacy"])  # the manifest as it was created: unchanged, so it passes
        assert result.returncode == 0, result.stderr
        refused = _patch(cluster, "legacy", {"spec": {"autoscaling": {"gpuBudget": 4}}})
        assert refused.returncode != 0 and rules.INTERVAL_RULE_MESSAGE in refused.stderr, refused.stderr
        stalled = _condition(_isvc(cluster, "legacy"), "Stalled")
        assert (stalled["status"], stalled["reason"]) == ("True", "InvalidSpec") and "interval" in stalled["message"]
        with timings.measure("legacy fixed and reconciled"):
            result = _patch(cluster, "legacy", {"spec": {"autoscaling": {"interval": "2s", "gpuBudget": 4}}})
            assert result.returncode == 0 and rules.INTERVAL_RULE_MESSAGE not in result.stderr, result.stderr
            generation = _isvc(cluster, "legacy")["metadata"]["generation"]
            cluster.wait_for(
                lambda: _ready(cluster, "legacy", generation=generation),
                timeout_seconds=WAIT_SECONDS,
                what="legacy Ready once fixed",
            )

        # new objects: today's rules and fields
        fresh = _manifest("fresh", "Aggregated", interval="500ms")
        refused = _apply(cluster, fresh)
        assert refused.returncode != 0 and rules.INTERVAL_RULE_MESSAGE in refused.stderr, refused.stderr
        newer = _manifest("newer", "Aggregated", engine={"speculative": {"method": "ngram"}})
        result = _apply(cluster, newer)
        assert result.returncode == 0, result.stderr
        _wait_ready(cluster, "newer")
        args = " ".join(
            _get(cluster, TEAM, "deployment", "newer-engine")["spec"]["template"]["spec"]["containers"][0]["args"]
        )
        assert re.search(r"--speculative-method[= ]ngram\b", args), args

        # kubectl get sis -o wide: today's columns, on objects created before the upgrade
        wide = cluster.kubectl("get", contract.PLURAL, "-n", TEAM, "-o", "wide").stdout
        header = wide.splitlines()[0].split()
        for column in ("METRICS", "PREFILL-SCALING", "DECODE-SCALING", "AGGREGATED-SCALING", "ENGINE"):
            assert column in header, wide
        assert re.search(r"^disagg\s+Disaggregated\s", wide, flags=re.M), wide

        # the autoscaler's decision history, in the status and in kubectl describe
        with timings.measure("decode min raised, scaled, recorded"):
            result = _patch(cluster, "disagg", {"spec": {"decode": {"replicas": {"min": 2}}}})
            assert result.returncode == 0, result.stderr

            def scaled() -> list[dict[str, Any]] | None:
                recent = (_isvc(cluster, "disagg")["status"].get("decode") or {}).get("recentDecisions") or []
                return recent if recent and (recent[0]["from"], recent[0]["to"]) == (1, 2) else None

            recent = cluster.wait_for(scaled, timeout_seconds=WAIT_SECONDS, what="disagg decode 1 -> 2 recorded")
        assert recent[0]["applied"] is True and recent[0]["reason"] == "MetricsUnavailable", recent
        assert "clamped [2,3] 2" in recent[0]["formula"], recent
        assert _get(cluster, TEAM, "deployment", "disagg-decode")["spec"]["replicas"] == 2
        describe = cluster.kubectl("describe", contract.PLURAL, "disagg", "-n", TEAM).stdout
        assert "Recent Decisions:" in describe, describe
        assert re.search(r"Formula:\s+hold 1 .*clamped \[2,3\] 2", describe), describe
        assert re.search(r"Reason:\s+MetricsUnavailable", describe), describe

        # ---- the documented rollback
        def after_rollback_step(command: list[str]) -> None:
            if command[:2] == ["kubectl", "scale"]:
                assert new.stop() == 0, f"the upgraded operator did not exit cleanly: {new.tail()}"

        with timings.measure("documented rollback steps"):
            run_documented(cluster, "ROLLBACK STEPS", charts=charts, after=after_rollback_step)
        crd = _get(cluster, "", "crd", CRD_NAME)
        assert "speculative" not in json.dumps(crd["spec"])
        rolled = _isvc(cluster, "newer")
        assert "speculative" not in rolled["spec"]["engine"] and "dtype" not in rolled["spec"]["kvCache"], rolled[
            "spec"
        ]
        for name in manifests:
            assert _isvc(cluster, name)["metadata"]["uid"] == snapshots["stopped"][name]["metadata"]["uid"], name
        history = cluster.helm("history", RELEASE, "-n", OPERATOR_NS, "-o", "json").stdout
        assert [h["description"].split()[0] for h in json.loads(history)][-1] == "Rollback", history
    finally:
        for operator in operators:
            operator.stop()
        print(f"\nupgrade timings (s): {timings.marks}")
