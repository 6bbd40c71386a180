"""The HTTP side of the prefill/decode KV handoff: which engine path a request takes.

A completion or chat request may carry ``contract.KV_TRANSFER_PARAMS_FIELD``:
- ``{"do_remote_decode": true}`` on a prefill pod: compute the prompt, export its KV and
  answer with the normal (non-streamed) response plus the handoff parameters;
- the prefill pod's handoff object on a decode pod: pull the KV and continue decoding, if the
  object is authenticated (signed with the InferenceService's handoff key, not expired, this
  pod's compat hash; without a key, naming a loopback endpoint: see
  :mod:`splitserve_runtime.transfer.auth`) and was computed for the very prompt this pod
  tokenized (its ``prompt_digest``, key or no key), else 403 before anything is connected to;
  an object this pod cannot use (a first token outside its vocabulary) is a 400;
- anything else, or any handoff on a pod of another role, is refused with a typed error.
A request without the field is computed locally on every role (the router sends short
prompts straight to decode).

:func:`route_handoff` returns a :class:`RoutedEngine`: an
:class:`~.engine_client.EngineClient` whose ``generate`` takes the chosen path, so
:class:`~.generation.Generation` (admission, cancellation, accounting) stays one code path.
The engine implementation (:mod:`splitserve_runtime.engine.remote`, torch) is imported
only when a handoff actually happens.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from splitserve_contract import KV_TRANSFER_PARAMS_FIELD, Role, ServeArgs
from splitserve_contract.wire import (
    KV_TRANSFER_PARAMS_INVALID_CODE,
    KV_TRANSFER_PARAMS_REJECTED_CODE,
)
from splitserve_runtime.engine.delegate import DelegatingEngine
from splitserve_runtime.engine.errors import HandoffRefused
from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.server.engine_client import EngineClient
from splitserve_runtime.server.errors import INVALID_REQUEST, SERVER_ERROR, APIError, bad_request
from splitserve_runtime.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from splitserve_runtime.engine.remote import HandoffEngine, RemotePrefill

logger = logging.getLogger(__name__)


class RoutedEngine(DelegatingEngine):
    """``engine`` for one request, with ``generate`` bound to its handoff path.
    ``kv_transfer_params`` is set once a prefill pod has exported the request's KV."""

    def __init__(self, *, engine: EngineClient, handoff: HandoffEngine | None = None,
                 export: bool = False, source: RemotePrefill | None = None) -> None:
        super().__init__(engine=engine)
        self._engine: EngineClient = engine
        self._handoff = handoff
        self._export = export
        self._source = source
        self.kv_transfer_params: dict[str, Any] | None = None

    async def start(self) -> None:
        raise RuntimeError("a RoutedEngine wraps an engine that is already running")

    async def shutdown(self) -> None:
        raise RuntimeError("a RoutedEngine does not own its engine")

    def generate(self, *, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self._handoff is not None and self._export:
            return self._handoff.generate_for_export(
                request_id=request_id, prompt_token_ids=prompt_token_ids, params=params,
                on_export=self._exported)
        if self._handoff is not None and self._source is not None:
            return self._handoff.generate_from_remote(
                request_id=request_id, prompt_token_ids=prompt_token_ids, params=params,
                source=self._source)
        return self._engine.generate(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                     params=params)

    def _exported(self, source: RemotePrefill) -> None:
        self.kv_transfer_params = source.to_params()

    def decorate(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The JSON answer, plus the handoff parameters on a prefill pod."""
        if self.kv_transfer_params is not None:
            answer[KV_TRANSFER_PARAMS_FIELD] = self.kv_transfer_params
        return answer


def _refuse(message: str) -> APIError:
    return bad_request(message, param=KV_TRANSFER_PARAMS_FIELD, code=KV_TRANSFER_PARAMS_INVALID_CODE)


def _forbid(exc: HandoffRefused) -> APIError:
    """Handoff parameters that are not from a prefill pod of this pool: the caller's mistake
    (403, the OpenAI client's PermissionDeniedError), never the server's."""
    return APIError(status_code=403, type=INVALID_REQUEST, param=KV_TRANSFER_PARAMS_FIELD,
                    code=KV_TRANSFER_PARAMS_REJECTED_CODE, message=str(exc))


def route_handoff(*, engine: EngineClient, role: str, params: dict[str, Any] | None,
                  stream: bool, prompt_token_ids: Sequence[int]) -> RoutedEngine:
    """The engine path for a request with these ``kv_transfer_params`` and this prompt (as
    this pod tokenized it; see the module docstring); raises APIError for a handoff this pod
    cannot take part in."""
    if params is None:
        return RoutedEngine(engine=engine)
    if role == Role.AGGREGATED.value:  # the client's mistake: no handoff on this pod
        raise bad_request(f"{KV_TRANSFER_PARAMS_FIELD} is only accepted by prefill and decode "
                          f"pods; this pod's role is {role}", param=KV_TRANSFER_PARAMS_FIELD,
                          code="handoff_unavailable")
    handoff = _handoff_engine(engine)
    if handoff is None:  # a prefill/decode pod built without the handoff engine: our bug
        raise APIError(status_code=501, type=SERVER_ERROR, code="handoff_unavailable",
                       param=KV_TRANSFER_PARAMS_FIELD,
                       message="this server does not take part in the prefill/decode KV "
                               f"handoff ({KV_TRANSFER_PARAMS_FIELD})")
    if params.get("do_remote_decode") is True:
        if role != Role.PREFILL.value:
            raise _refuse(f"do_remote_decode goes to a prefill pod; this pod's role is {role}")
        if stream:
            raise _refuse("a prefill request for remote decode must not stream")
        return RoutedEngine(engine=engine, handoff=handoff, export=True)
    if "remote_endpoint" in params:
        if role != Role.DECODE.value:
            raise _refuse(f"remote KV goes to a decode pod; this pod's role is {role}")
        try:
            source = handoff.accept_remote(params, prompt_token_ids=prompt_token_ids)
        except HandoffRefused as exc:
            raise _forbid(exc) from None
        except ValueError as exc:
            raise _refuse(str(exc)) from None
        return RoutedEngine(engine=engine, handoff=handoff, source=source)
    raise _refuse(f"{KV_TRANSFER_PARAMS_FIELD} needs do_remote_decode (to a prefill pod) or "
                  "remote_endpoint (to a decode pod)")


def _handoff_engine(engine: EngineClient) -> HandoffEngine | None:
    if not hasattr(engine, "generate_from_remote"):
        return None
    from splitserve_runtime.engine.remote import HandoffEngine

    return engine if isinstance(engine, HandoffEngine) else None


def build_handoff_engine(*, engine: EngineClient, args: ServeArgs, kv_endpoint: str,
                         metrics: ServerMetrics) -> EngineClient:
    """Wrap the role's AsyncEngine for the handoff (prefill: KV server on ``--kv-port``,
    bound to ``--host``; decode: the pulling connector); transfers feed ``metrics``. The
    handoff is authenticated with ``--handoff-key-file`` (a key file that cannot be read
    fails the start-up); without one it is confined to loopback, with a warning."""
    from splitserve_runtime.engine.async_engine import AsyncEngine
    from splitserve_runtime.engine.remote import HandoffEngine
    from splitserve_runtime.transfer.auth import HandoffAuth, HandoffKey

    if not isinstance(engine, AsyncEngine):
        raise TypeError(f"the handoff needs an AsyncEngine, got {type(engine).__name__}")
    key = HandoffKey.from_file(args.handoff_key_file) if args.handoff_key_file else None
    if key is None:
        logger.warning("role %s without a KV handoff key (--handoff-key-file): the prefill/decode "
                       "handoff is limited to loopback addresses", args.role)

    def observe(num_bytes: int, seconds: float, ok: bool) -> None:
        metrics.record_kv_transfer(num_bytes=num_bytes, seconds=seconds, ok=ok)

    return HandoffEngine(engine=engine, role=args.role, compat_hash=args.compat_hash,
                         kv_host=args.host, kv_port=args.kv_port, kv_endpoint=kv_endpoint,
                         kv_ttl_seconds=args.kv_ttl_seconds, observer=observe,
                         auth=HandoffAuth(key=key))
