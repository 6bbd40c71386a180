"""Snapshot the core/v1 schemas our free-form pod fields use, from a real API server.

``spec.<pool>.tolerations``, ``affinity`` and ``nodeSelector`` are passed into pod specs
unchanged, so the CRD must validate them exactly as the API server validates a Pod, or a bad
value passes admission and only fails later, when the Deployment is applied. Rather than
hand-writing a schema that drifts from Kubernetes, we copy Kubernetes' own: this tool reads
the API server's OpenAPI v3 document for ``/api/v1`` and writes the package data file
``splitserve_operator/api/corev1_snapshot.json`` (JSON: data the operator reads at import, not
code), which holds, verbatim, the PodSpec fields we expose and every component schema they
reach (Toleration, Affinity and its selector types). :mod:`splitserve_operator.api.corev1`
loads it and turns it into structural CRD schemas. A build-time tool, outside the package.

Refresh it from the pinned API server of the e2e cluster (``make cluster-up``)::

    kubectl get --raw /openapi/v3/api/v1 > /tmp/api_v1.json
    python operator/tools/corev1gen.py /tmp/api_v1.json
    make crds

``--check`` writes nothing and exits 1 when the snapshot differs from the document (the e2e
suite runs the same comparison against the live API server).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from splitserve_operator.api import corev1

COMMAND: Final = "python operator/tools/corev1gen.py"
SNAPSHOT_PATH: Final = Path(corev1.__file__).resolve().parent / corev1.SNAPSHOT_FILE
POD_SPEC: Final = "io.k8s.api.core.v1.PodSpec"
POD_SPEC_FIELDS: Final = ("affinity", "nodeSelector", "tolerations")
"""The PodSpec fields an InferenceService pool passes through (see ``PoolSpec``)."""
_REF_PREFIX: Final = "#/components/schemas/"


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value.removeprefix(_REF_PREFIX)
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def extract(document: Mapping[str, Any]) -> dict[str, Any]:
    """The snapshot of ``document`` (an OpenAPI v3 document of ``/api/v1``): the PodSpec
    fields in :data:`POD_SPEC_FIELDS` and the closure of the component schemas they reach,
    each copied unchanged."""
    schemas: Mapping[str, Any] = document["components"]["schemas"]
    fields = {name: schemas[POD_SPEC]["properties"][name] for name in POD_SPEC_FIELDS}
    reached: dict[str, Any] = {}
    todo = list(_refs(fields))
    while todo:
        name = todo.pop()
        if name not in reached:
            reached[name] = schemas[name]
            todo.extend(_refs(schemas[name]))
    info = document.get("info") or {}
    return {
        "source": "kube-apiserver GET /openapi/v3/api/v1",
        "kubernetesVersion": str(info.get("version", "")),
        "podSpecFields": fields,
        "schemas": dict(sorted(reached.items())),
    }


def render(snapshot: Mapping[str, Any]) -> str:
    """The JSON text of ``snapshot`` as committed (sorted keys, one-space indent, ASCII)."""
    return json.dumps(snapshot, indent=1, sort_keys=True, ensure_ascii=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    parser.add_argument("openapi", help="the API server's /openapi/v3/api/v1 document ('-': stdin)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed snapshot differs")
    parser.add_argument("--output", type=Path, default=SNAPSHOT_PATH, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    text = sys.stdin.read() if args.openapi == "-" else Path(args.openapi).read_text()
    wanted = render(extract(json.loads(text)))
    current = args.output.read_text() if args.output.exists() else ""
    if args.check:
        if current != wanted:
            print(f"{args.output} differs from {args.openapi}: regenerate it", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        args.output.write_text(wanted)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
