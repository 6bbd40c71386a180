"""The router's replica count is the reconciler's (no autoscaler scales it): an edit of
``spec.router.replicas`` reaches the router Deployment, and a hand-scaled router is put back,
while a pool Deployment's replicas stay with the autoscaler after creation."""

from __future__ import annotations

import copy

from kube_testing import FakeKube, isvc_obj, run


def _replicas(fake: FakeKube, name: str) -> int:
    return int(fake.objects[("Deployment", name)]["spec"]["replicas"])


def test_router_replicas_follow_the_spec_and_pool_replicas_stay_with_the_autoscaler() -> None:
    fake = FakeKube()
    obj = isvc_obj(mode="Disaggregated")
    obj["spec"]["router"] = {"replicas": 2}
    run(fake, obj)
    assert _replicas(fake, "tiny-router") == 2
    assert _replicas(fake, "tiny-prefill") == 1

    edited = copy.deepcopy(obj)
    edited["spec"]["router"]["replicas"] = 3
    edited["metadata"]["generation"] = 2
    fake.objects[("Deployment", "tiny-prefill")]["spec"]["replicas"] = 4  # the autoscaler's doing
    run(fake, edited)
    assert _replicas(fake, "tiny-router") == 3
    assert _replicas(fake, "tiny-prefill") == 4

    fake.objects[("Deployment", "tiny-router")]["spec"]["replicas"] = 7  # `kubectl scale` by hand
    run(fake, edited)
    assert _replicas(fake, "tiny-router") == 3
