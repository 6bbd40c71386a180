"""Issue 12 #4 (operator side): the per-InferenceService KV handoff key.

The operator creates Secret ``<isvc>-kv-handoff`` with 32 random bytes once (never rotated by
a later reconcile), owned by the InferenceService and labelled like its other children, and
mounts it read-only into the prefill and decode pods only, passing ``--handoff-key-file``."""

from __future__ import annotations

import argparse
import base64
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_testing import FakeKube, api_error, isvc_obj, record_events, run

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason, Role
from splitserve_operator import api, handoff_key, naming, render

REPO = Path(__file__).resolve().parents[3]
KEY_FILE = f"{contract.HANDOFF_KEY_MOUNT_DIR}/{contract.HANDOFF_KEY_SECRET_KEY}"


@pytest.fixture(autouse=True)
def _no_events(monkeypatch: pytest.MonkeyPatch) -> None:
    record_events(monkeypatch)


def _secret(fake: FakeKube) -> dict[str, Any] | None:
    found: dict[str, Any] | None = fake.objects.get(("Secret", naming.handoff_key_secret_name("tiny")))
    return found


def test_created_once_with_32_random_bytes_owned_and_labelled() -> None:
    fake = FakeKube()
    run(fake, isvc_obj(mode="Disaggregated"))
    secret = _secret(fake)
    assert (
        secret is not None
        and secret["metadata"]["name"] == "tiny-kv-handoff" == "tiny" + contract.HANDOFF_KEY_SECRET_SUFFIX
    )
    key = base64.b64decode(secret["data"][contract.HANDOFF_KEY_SECRET_KEY])
    assert len(key) == 32 and secret["type"] == "Opaque" and secret["immutable"] is True
    assert secret["metadata"]["ownerReferences"] == [
        {
            "apiVersion": api.API_VERSION_STRING,
            "kind": contract.KIND,
            "name": "tiny",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert secret["metadata"]["labels"] == {
        contract.LABEL_NAME: contract.LABEL_NAME_VALUE,
        contract.LABEL_INSTANCE: "tiny",
        contract.LABEL_MANAGED_BY: contract.MANAGED_BY_VALUE,
    }
    # Later reconciles (and spec changes) find it there and never replace the key.
    for generation in (1, 2, 3):
        run(fake, isvc_obj(mode="Disaggregated", generation=generation))
    again = _secret(fake)
    assert again is not None and again["data"] == secret["data"]
    verbs = [verb for what, verb in fake.writes if what == "Secret/tiny-kv-handoff"]
    assert verbs and set(verbs) == {"create"}  # never applied, patched or read


def test_keys_are_random_per_service() -> None:
    keys = set()
    for _ in range(3):
        fake = FakeKube()
        run(fake, isvc_obj(mode="Disaggregated"))
        secret = _secret(fake)
        assert secret is not None
        keys.add(secret["data"][contract.HANDOFF_KEY_SECRET_KEY])
    assert len(keys) == 3


def test_aggregated_services_get_no_key() -> None:
    fake = FakeKube()
    run(fake, isvc_obj(mode="Aggregated"))
    assert _secret(fake) is None


def test_a_failed_create_is_an_api_error_and_retried() -> None:
    fake = FakeKube()
    fake.errors["Secret/tiny-kv-handoff"] = api_error(403, "Forbidden", 'secrets is forbidden: User "x" cannot create')
    with pytest.raises(Exception, match="creating Secret/tiny-kv-handoff failed: 403"):
        run(fake, isvc_obj(mode="Disaggregated"))
    conds = {c["type"]: c for c in fake.objects[("InferenceService", "tiny")]["status"]["conditions"]}
    assert conds[ConditionType.READY]["reason"] == Reason.API_ERROR


def test_ensure_reports_whether_it_created() -> None:
    fake = FakeKube()
    owner = {"apiVersion": "v1", "kind": "X", "name": "tiny", "uid": "u", "controller": True}
    assert handoff_key.ensure(
        api=fake, isvc_name="tiny", namespace="n", owner_reference=owner, random_bytes=lambda n: b"\x01" * n
    )
    assert not handoff_key.ensure(
        api=fake, isvc_name="tiny", namespace="n", owner_reference=owner, random_bytes=lambda n: b"\x02" * n
    )
    secret = _secret(fake)
    assert secret is not None and base64.b64decode(secret["data"]["key"]) == b"\x01" * 32


def _pod_specs(example: str) -> dict[str, dict[str, Any]]:
    isvc = api.InferenceService.parse(yaml.safe_load((REPO / "examples" / example).read_text()))
    return {
        d["metadata"]["labels"][contract.LABEL_ROLE]: d["spec"]["template"]["spec"]
        for d in render.render_children(isvc=isvc, runtime_image="img", router_service_account="sa")
        if d["kind"] == "Deployment"
    }


def test_prefill_and_decode_mount_the_key_read_only_and_get_the_flag() -> None:
    pods = _pod_specs("tiny-disaggregated.yaml")
    for role in (Role.PREFILL, Role.DECODE):
        spec = pods[role.value]
        volume = next(v for v in spec["volumes"] if v["name"] == handoff_key.VOLUME_NAME)
        assert volume["secret"]["secretName"] == "tiny-kv-handoff"
        container = spec["containers"][0]
        mount = next(m for m in container["volumeMounts"] if m["name"] == handoff_key.VOLUME_NAME)
        assert mount == {"name": handoff_key.VOLUME_NAME, "mountPath": contract.HANDOFF_KEY_MOUNT_DIR, "readOnly": True}
        command = container["args"]
        assert command[command.index("--handoff-key-file") + 1] == KEY_FILE
        # the runtime's own parser (built from the same table) reads it back
        parser = argparse.ArgumentParser()
        contract.add_serve_arguments(parser)
        assert contract.serve_args_from_namespace(parser.parse_args(command[2:])).handoff_key_file == KEY_FILE
    router = pods[Role.ROUTER.value]
    assert handoff_key.VOLUME_NAME not in {v["name"] for v in router["volumes"]}
    assert "--handoff-key-file" not in router["containers"][0]["args"]


def test_aggregated_pods_do_not_mount_it() -> None:
    for spec in _pod_specs("tiny-aggregated.yaml").values():
        assert handoff_key.VOLUME_NAME not in {v["name"] for v in spec["volumes"]}
        assert "--handoff-key-file" not in spec["containers"][0]["args"]
