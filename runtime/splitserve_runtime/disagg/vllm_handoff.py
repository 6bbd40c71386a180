"""vLLM's prefill → decode handoff (its ``NixlConnector``), as the router drives it.

vLLM pods speak the same two-request protocol as the bundled runtime: the prefill pod is sent the
client's request with ``max_tokens: 1``, ``stream: false`` and ``kv_transfer_params:
{"do_remote_decode": true}`` (:func:`.prefill_request.prefill_request_body`, unchanged), and the
decode pod the client's request with the ``kv_transfer_params`` the prefill pod answered. What
differs is those parameters: the bundled runtime's are this project's signed schema
(:class:`~splitserve_contract.handoff.HandoffParams`), vLLM's are NixlConnector's own dictionary
(``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``, ``tp_size`` and
more in later versions), which the decode pod must get as it was written. So they are kept
whole, checked only for what the router relies on:

* ``do_remote_prefill`` is true: the prefill pod kept the prompt's KV for a decode pod (it does
  not when the request ended otherwise, e.g. aborted);
* ``remote_host`` is the prefill pod the router asked. The decode pod connects to that host and
  pulls the KV from it, so parameters naming another host would let one pod steer another's
  connection (the bundled runtime's must likewise name the pod's own KV endpoint).

Standard library only, like :mod:`.prefill_request`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from splitserve_contract import KV_TRANSFER_PARAMS_FIELD

REQUIRED_FIELDS: Final[Mapping[str, type]] = {
    "do_remote_prefill": bool,
    "remote_engine_id": str,
    "remote_block_ids": list,
    "remote_host": str,
    "remote_port": int,
}
"""What NixlConnector's decode side reads to find and pull the KV (vLLM 0.32,
``kv_connector/v1/nixl``), with its type."""


class VllmHandoffError(ValueError):
    """A vLLM prefill pod's answer carries handoff parameters the router will not pass on."""


@dataclass(frozen=True)
class VllmHandoff:
    """A vLLM prefill pod's handoff parameters, as it wrote them."""

    params: Mapping[str, Any]

    @property
    def remote_host(self) -> str:
        return str(self.params["remote_host"])

    def to_json(self) -> dict[str, Any]:
        return dict(self.params)


def vllm_handoff(answer: object, *, prefill_host: str) -> VllmHandoff | None:
    """The handoff parameters in a vLLM prefill pod's (decoded JSON) answer; None when it has
    none. Raises :class:`VllmHandoffError` for parameters that are not NixlConnector's, that
    did not keep the KV, or that name another host than ``prefill_host`` (module docstring)."""
    params = answer.get(KV_TRANSFER_PARAMS_FIELD) if isinstance(answer, dict) else None
    if params is None:
        return None
    if not isinstance(params, dict):
        raise VllmHandoffError(f"{KV_TRANSFER_PARAMS_FIELD} must be an object, got {type(params).__name__}")
    for name, kind in REQUIRED_FIELDS.items():
        value = params.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise VllmHandoffError(f"{KV_TRANSFER_PARAMS_FIELD}.{name} must be a {kind.__name__}, got {value!r}")
    if params["do_remote_prefill"] is not True:
        raise VllmHandoffError(f"{KV_TRANSFER_PARAMS_FIELD}.do_remote_prefill is false: the prompt's KV was not kept")
    if params["remote_host"] != prefill_host:
        raise VllmHandoffError(
            f"{KV_TRANSFER_PARAMS_FIELD}.remote_host {params['remote_host']!r} is not the prefill pod ({prefill_host})"
        )
    return VllmHandoff(params=params)


__all__ = ["REQUIRED_FIELDS", "VllmHandoff", "VllmHandoffError", "vllm_handoff"]
