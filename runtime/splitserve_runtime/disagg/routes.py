"""Which engine path a request takes on a prefill or decode pod, decided once per request.

A completion or chat request may carry ``contract.KV_TRANSFER_PARAMS_FIELD``:
- a :class:`~splitserve_contract.handoff.PrefillRequest` on a prefill pod: compute the prompt,
  export its KV and answer with the normal (non-streamed) response plus the handoff parameters;
- :class:`~splitserve_contract.handoff.HandoffParams` on a decode pod: pull the KV and continue
  decoding, if they are authenticated (signed with the InferenceService's handoff key, not
  expired, this pod's compat hash; without a key, naming a loopback endpoint: see
  :mod:`splitserve_runtime.transfer.auth`) and were computed for the very prompt this pod
  tokenized (their ``prompt_digest``, key or no key), else 403 before anything is connected to;
  parameters this pod cannot use (malformed, a first token outside its vocabulary) are a 400;
- anything else, or any handoff on a pod of another role, is refused.
A request without the field is computed locally on every role (the router sends short
prompts straight to decode). The parameters are parsed and authenticated here, once
(:meth:`~.engine.HandoffEngine.accept_remote`), and passed on typed.

The refusals are :class:`HandoffRouteError` (a status, an OpenAI error code, a message): this
package sits below the HTTP server, which answers them in its own error shape.

:func:`route_handoff` returns a :class:`RoutedEngine`: the engine with ``generate`` bound to
the chosen path, so the server's ``Generation`` (admission, cancellation, accounting) stays one
code path. The engine implementation (:mod:`.engine`, torch) is imported only when a handoff
actually happens.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from splitserve_contract import KV_TRANSFER_PARAMS_FIELD, Role, ServeArgs
from splitserve_contract.handoff import (
    DO_REMOTE_DECODE,
    REMOTE_ENDPOINT,
    HandoffParams,
    PrefillRequest,
)
from splitserve_contract.wire import (
    KV_TRANSFER_PARAMS_INVALID_CODE,
    KV_TRANSFER_PARAMS_REJECTED_CODE,
)

from ..engine.delegate import DelegatingEngine, ForwardedSurface
from ..engine.errors import HandoffRefused
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from .decode_import import VerifiedHandoff
    from .engine import HandoffEngine

logger = logging.getLogger(__name__)


class HandoffRouteError(Exception):
    """A handoff this pod cannot take part in: ``status_code`` 400 (malformed or the wrong
    role), 403 (not from a prefill pod of this pool, or for another prompt) or 501 (a pod built
    without the handoff engine); ``code`` is the OpenAI error code."""

    def __init__(
        self, *, status_code: int, code: str, message: str, param: str | None = KV_TRANSFER_PARAMS_FIELD
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.param = param


class ServingEngine(ForwardedSurface, Protocol):
    """What a request is generated with (the server's ``EngineClient`` is one)."""

    def generate(
        self, *, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]: ...


class TransferMetrics(Protocol):
    """Where KV transfer outcomes are counted (the server's ``ServerMetrics``)."""

    def record_kv_transfer(self, *, num_bytes: int, seconds: float, ok: bool) -> None: ...


class RoutedEngine(DelegatingEngine):
    """``engine`` for one request, with ``generate`` bound to its handoff path.
    ``kv_transfer_params`` is set once a prefill pod has exported the request's KV."""

    def __init__(
        self,
        *,
        engine: ServingEngine,
        handoff: HandoffEngine | None = None,
        export: bool = False,
        source: VerifiedHandoff | None = None,
    ) -> None:
        super().__init__(engine=engine)
        self._engine: ServingEngine = engine
        self._handoff = handoff
        self._export = export
        self._source = source
        self.kv_transfer_params: HandoffParams | None = None

    async def start(self) -> None:
        raise RuntimeError("a RoutedEngine wraps an engine that is already running")

    async def shutdown(self) -> None:
        raise RuntimeError("a RoutedEngine does not own its engine")

    def generate(
        self, *, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if self._handoff is not None and self._export:
            return self._handoff.generate_for_export(
                request_id=request_id, prompt_token_ids=prompt_token_ids, params=params, on_export=self._exported
            )
        if self._handoff is not None and self._source is not None:
            return self._handoff.generate_from_remote(
                request_id=request_id, prompt_token_ids=prompt_token_ids, params=params, source=self._source
            )
        return self._engine.generate(request_id=request_id, prompt_token_ids=prompt_token_ids, params=params)

    def _exported(self, params: HandoffParams) -> None:
        self.kv_transfer_params = params

    def decorate(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The JSON answer, plus the handoff parameters on a prefill pod."""
        if self.kv_transfer_params is not None:
            answer[KV_TRANSFER_PARAMS_FIELD] = self.kv_transfer_params.to_json()
        return answer


def _refuse(message: str) -> HandoffRouteError:
    return HandoffRouteError(status_code=400, code=KV_TRANSFER_PARAMS_INVALID_CODE, message=message)


def route_handoff(
    *,
    engine: ServingEngine,
    role: str,
    params: Mapping[str, Any] | HandoffParams | None,
    stream: bool,
    prompt_token_ids: Sequence[int],
) -> RoutedEngine:
    """The engine path for a request with these ``kv_transfer_params`` (as they arrived, or
    already parsed) and this prompt (as this pod tokenized it; see the module docstring);
    raises HandoffRouteError for a handoff this pod cannot take part in."""
    if params is None:
        return RoutedEngine(engine=engine)
    if role == Role.AGGREGATED.value:  # the client's mistake: no handoff on this pod
        raise HandoffRouteError(
            status_code=400,
            code="handoff_unavailable",
            message=(
                f"{KV_TRANSFER_PARAMS_FIELD} is only accepted by prefill and decode pods; this pod's role is {role}"
            ),
        )
    handoff = _handoff_engine(engine)
    if handoff is None:  # a prefill/decode pod built without the handoff engine: our bug
        raise HandoffRouteError(
            status_code=501,
            code="handoff_unavailable",
            message=(f"this server does not take part in the prefill/decode KV handoff ({KV_TRANSFER_PARAMS_FIELD})"),
        )
    if not isinstance(params, HandoffParams) and PrefillRequest.is_one(params):
        if role != Role.PREFILL.value:
            raise _refuse(f"{DO_REMOTE_DECODE} goes to a prefill pod; this pod's role is {role}")
        if stream:
            raise _refuse("a prefill request for remote decode must not stream")
        return RoutedEngine(engine=engine, handoff=handoff, export=True)
    if isinstance(params, HandoffParams) or HandoffParams.is_one(params):
        if role != Role.DECODE.value:
            raise _refuse(f"remote KV goes to a decode pod; this pod's role is {role}")
        try:
            source = handoff.accept_remote(params, prompt_token_ids=prompt_token_ids)
        except HandoffRefused as exc:  # not from a prefill pod of this pool: the caller's mistake
            raise HandoffRouteError(status_code=403, code=KV_TRANSFER_PARAMS_REJECTED_CODE, message=str(exc)) from None
        except ValueError as exc:
            raise _refuse(str(exc)) from None
        return RoutedEngine(engine=engine, handoff=handoff, source=source)
    raise _refuse(
        f"{KV_TRANSFER_PARAMS_FIELD} needs {DO_REMOTE_DECODE} (to a prefill pod) or {REMOTE_ENDPOINT} (to a decode pod)"
    )


def _handoff_engine(engine: ServingEngine) -> HandoffEngine | None:
    if not hasattr(engine, "generate_from_remote"):
        return None
    from .engine import HandoffEngine

    return engine if isinstance(engine, HandoffEngine) else None


def build_handoff_engine(
    *, engine: object, args: ServeArgs, kv_endpoint: str, metrics: TransferMetrics
) -> HandoffEngine:
    """Wrap the role's AsyncEngine for the handoff (prefill: KV server on ``--kv-port``,
    bound to ``--host``; decode: the pulling connector); transfers feed ``metrics``. The
    handoff is authenticated with ``--handoff-key-file`` (a key file that cannot be read
    fails the start-up); without one it is confined to loopback, with a warning."""
    from ..engine.async_engine import AsyncEngine
    from ..transfer.auth import HandoffAuth, HandoffKey
    from .engine import HandoffEngine

    if not isinstance(engine, AsyncEngine):
        raise TypeError(f"the handoff needs an AsyncEngine, got {type(engine).__name__}")
    key = HandoffKey.from_file(args.handoff_key_file) if args.handoff_key_file else None
    if key is None:
        logger.warning(
            "role %s without a KV handoff key (--handoff-key-file): the prefill/decode "
            "handoff is limited to loopback addresses",
            args.role,
        )

    def observe(num_bytes: int, seconds: float, ok: bool) -> None:
        metrics.record_kv_transfer(num_bytes=num_bytes, seconds=seconds, ok=ok)

    return HandoffEngine(
        engine=engine,
        role=args.role,
        compat_hash=args.compat_hash,
        kv_host=args.host,
        kv_port=args.kv_port,
        kv_endpoint=kv_endpoint,
        kv_ttl_seconds=args.kv_ttl_seconds,
        observer=observe,
        auth=HandoffAuth(key=key),
    )
