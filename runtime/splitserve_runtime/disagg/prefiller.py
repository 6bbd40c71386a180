"""A decode pod that drives its own prefill: the prefill pod an endpoint picker names in a header.

Behind a Gateway (the operator's ``spec.router.mode: InferencePool``) no splitserve router
sits in front of the pods: a Gateway API Inference Extension endpoint picker sends each request
to a decode pod, and a picker that disaggregates names the prefill pod it chose in a header:
``x-prefiller-host-port`` (llm-d's convention: one ``host:port``) or the proposed
``x-gateway-prefill-endpoints`` (a comma-separated list; the first that answers wins). llm-d
puts a routing sidecar beside vLLM for this; a splitserve decode pod does the sidecar's job
itself. It sends the named pod the prefill-only request the builtin router sends
(:mod:`.prefill_request`: the client's request, one token, KV kept), takes the signed handoff
parameters from the answer (parsed once, :class:`~splitserve_contract.handoff.HandoffParams`)
and continues exactly as if the router had brought them: :func:`~.routes.route_handoff`
verifies them and the KV is pulled over the pods' own transfer.

What can go wrong, and what the client sees:

* a malformed header (not ``host:port``, an empty list, too many endpoints), or the header
  together with the client's own ``kv_transfer_params``: 400 in the OpenAI error shape, before
  any work (:func:`prefill_endpoints`, a :class:`~.routes.HandoffRouteError` the server answers);
* a named pod that cannot be reached, answers with an error, answers without handoff
  parameters, or with parameters this pod refuses (another compat hash during a rollout, a bad
  signature, computed for another prompt or tokenization, a first token outside this pod's
  vocabulary): the next endpoint is tried, and when none is left this pod computes the prompt
  itself. Each such request is logged (WARNING, with the reasons) and counted in
  ``splitserve_kv_transfer_failures_total``: the client gets its answer, never a 5xx for what
  a picker sent.

Without either header nothing changes. Pods of other roles ignore the headers (an aggregated pod
has no KV to import; a picker that counts it as "both" may still name a prefill pod).

The named pod is contacted on plain HTTP at the path of the request, with the client's API key
(as the router forwards it), on a new connection each time (no pooled connection for a prefill
pod to drop as idle under us). It is an address a caller chose (a client that reaches this pod
can write the header itself), so the request and the key go to it only after it proved that it
is a prefill pod holding the InferenceService's handoff key: one GET of its pod-info route with a
fresh nonce, answered with HMAC(nonce, role) (:meth:`Prefiller.identity_problem`; without a key,
loopback addresses only). Any other address gets that GET and nothing else; what it answers is
never returned to the caller, and the request is computed here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol, runtime_checkable

import httpx
from starlette.datastructures import Headers

from splitserve_contract import (
    HEADER_REQUEST_ID,
    INFO_PATH,
    KV_TRANSFER_PARAMS_FIELD,
    Role,
    defaults,
)
from splitserve_contract.handoff import IDENTITY_PROOF, NONCE, HandoffParams, HandoffParamsError

from .prefill_request import FORWARDED_HEADERS, handoff_params, prefill_request_body
from .routes import HandoffRouteError, RoutedEngine, ServingEngine, TransferMetrics, route_handoff

logger = logging.getLogger(__name__)

PREFILLER_HEADER: Final = "x-prefiller-host-port"
PREFILL_ENDPOINTS_HEADER: Final = "x-gateway-prefill-endpoints"
MAX_PREFILL_ENDPOINTS: Final = 8
"""More named endpoints than this is not a picker's choice: refused with 400."""
CONNECT_TIMEOUT_SECONDS: Final = 3.0
IDENTITY_TIMEOUT: Final = httpx.Timeout(5.0, connect=CONNECT_TIMEOUT_SECONDS)
"""The bound of the pod-info GET that checks a named pod before it gets the request."""
PREFILL_TIMEOUT_SECONDS: Final = defaults.PREFILL_TIMEOUT_SECONDS
"""The total budget of the prefill stage of one request, every named endpoint and its identity
GET together (``--prefill-timeout-seconds``; why this default: the contract's
``PREFILL_TIMEOUT_SECONDS``). A pod that accepts and never answers, or drips, costs a request
this much, then the prompt is computed here."""
MAX_ENDPOINT_CHARS: Final = 261
"""A DNS name (253) or a bracketed IPv6 address, a colon and a port."""

_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
_PORT = re.compile(r"^[0-9]{1,5}$")


def _header_error(header: str, message: str) -> HandoffRouteError:
    return HandoffRouteError(
        status_code=400, code="invalid_prefill_endpoint", param=None, message=f"header {header}: {message}"
    )


def parse_endpoint(value: str, *, header: str) -> str:
    """``value`` as a ``host:port`` this pod may connect to (host: an IPv4 address, a bracketed
    IPv6 address or a DNS name; port 1-65535), normalised; a 400 naming ``header`` otherwise."""
    text = value.strip()
    if not text:
        raise _header_error(header, "an endpoint is empty; expected host:port")
    if len(text) > MAX_ENDPOINT_CHARS:
        raise _header_error(header, f"endpoint {text[:32]!r}... is longer than {MAX_ENDPOINT_CHARS} characters")
    host, sep, port = text.rpartition(":")
    if not sep or not _PORT.match(port) or not 1 <= int(port) <= 65535:
        raise _header_error(header, f"{text!r} is not host:port with a port from 1 to 65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise _header_error(header, f"{host!r} is not an IPv6 address") from None
        return f"{host.lower()}:{int(port)}"
    if not _HOSTNAME.match(host):
        raise _header_error(header, f"{host!r} is not an IPv4 address, a bracketed IPv6 address or a DNS name")
    return f"{host.lower()}:{int(port)}"


def prefill_endpoints(headers: Headers, *, role: str, has_kv_transfer_params: bool) -> tuple[str, ...]:
    """The prefill pods a picker named for this request, in the order to try them (duplicates
    dropped); () without the headers or on a pod that is not a decode pod. Raises the 400s of
    the module docstring."""
    if role != Role.DECODE.value:
        return ()
    single = headers.getlist(PREFILLER_HEADER)
    listed = headers.getlist(PREFILL_ENDPOINTS_HEADER)
    if not single and not listed:
        return ()
    if has_kv_transfer_params:
        raise HandoffRouteError(
            status_code=400,
            code="invalid_prefill_endpoint",
            message=(
                f"give either the {PREFILLER_HEADER} / {PREFILL_ENDPOINTS_HEADER} header or "
                f"{KV_TRANSFER_PARAMS_FIELD}, not both"
            ),
        )
    if len(single) > 1:
        raise _header_error(PREFILLER_HEADER, "given more than once; it names one host:port")
    endpoints = [parse_endpoint(value, header=PREFILLER_HEADER) for value in single]
    for value in listed:
        endpoints += [parse_endpoint(item, header=PREFILL_ENDPOINTS_HEADER) for item in value.split(",")]
    unique = tuple(dict.fromkeys(endpoints))
    if len(unique) > MAX_PREFILL_ENDPOINTS:
        raise _header_error(
            PREFILL_ENDPOINTS_HEADER, f"{len(unique)} endpoints; at most {MAX_PREFILL_ENDPOINTS} are tried"
        )
    return unique


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """The outcome of asking the named prefill pods: their handoff parameters, or None when
    this pod computes the prompt itself."""

    params: HandoffParams | None
    endpoint: str = ""


@runtime_checkable
class IdentityChecker(Protocol):
    """What :class:`Prefiller` needs of this pod's handoff policy
    (:class:`~splitserve_runtime.transfer.auth.HandoffAuth`, the handoff engine's ``auth``)."""

    @property
    def keyed(self) -> bool: ...

    def new_nonce(self) -> str: ...

    def check_identity(self, *, endpoint: str, nonce: str, role: str, proof: object) -> None: ...


@runtime_checkable
class IdentityProver(Protocol):
    """The pod-info route's side of the same policy: proof that this pod holds the key."""

    def identity_proof(self, *, nonce: str, role: str, endpoint: str) -> str | None: ...


class Prefiller:
    """Sends the prefill-only request to the named pods (one server's, shared by its requests)."""

    def __init__(
        self,
        *,
        metrics: TransferMetrics,
        budget_seconds: float = PREFILL_TIMEOUT_SECONDS,
        timeout: httpx.Timeout | None = None,
    ) -> None:
        self._metrics = metrics
        self._budget_seconds = budget_seconds
        """Deadline of one request's whole prefill stage (0: none); httpx's timeouts bound only
        the gaps between bytes, which a drip never exceeds."""
        self._timeout = timeout or httpx.Timeout(budget_seconds or None, connect=CONNECT_TIMEOUT_SECONDS)
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:  # made on the event loop that uses it
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=httpx.Limits(max_keepalive_connections=0))
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def prefill(
        self,
        *,
        path: str,
        body: Mapping[str, Any],
        endpoints: Sequence[str],
        headers: Headers,
        request_id: str,
        auth: object,
    ) -> Prefilled:
        """Ask ``endpoints`` in turn to prefill the request ``body`` sent to ``path``; the first
        answer with handoff parameters wins. None of them: logged, counted, computed here.
        ``auth`` is this pod's handoff policy (:class:`IdentityChecker`): an endpoint gets the
        request, and the client's credentials with it, only once it proved it is a prefill pod
        of this InferenceService (:meth:`identity_problem`); no policy, no endpoint."""
        problems: list[str] = []
        budget = self._budget_seconds
        try:
            async with asyncio.timeout(budget if budget > 0 else None):
                prefilled = await self._ask(
                    path=path,
                    body=body,
                    endpoints=endpoints,
                    headers=headers,
                    request_id=request_id,
                    auth=auth,
                    problems=problems,
                )
        except TimeoutError:
            problems.append(f"no answer within the prefill budget of {budget:g} s")
            prefilled = None
        if prefilled is not None:
            return prefilled
        self.fall_back(request_id=request_id, reason="; ".join(problems))
        return Prefilled(params=None)

    async def _ask(
        self,
        *,
        path: str,
        body: Mapping[str, Any],
        endpoints: Sequence[str],
        headers: Headers,
        request_id: str,
        auth: object,
        problems: list[str],
    ) -> Prefilled | None:
        """:meth:`prefill` without its budget: the first endpoint's handoff, or None with each
        endpoint's problem in ``problems``."""
        prefill_body = prefill_request_body(body)
        forwarded = {k: v for k, v in headers.items() if k.lower() in FORWARDED_HEADERS}
        forwarded[HEADER_REQUEST_ID] = request_id
        for endpoint in endpoints:
            problems.append(f"{endpoint}: no answer yet")  # replaced by what it answered
            started = time.perf_counter()
            problem = await self.identity_problem(endpoint=endpoint, auth=auth)
            if problem is not None:
                problems[-1] = f"{endpoint}: {problem}"
                continue
            try:
                response = await self._http().post(f"http://{endpoint}{path}", json=prefill_body, headers=forwarded)
            except httpx.HTTPError as exc:
                problems[-1] = f"{endpoint}: {type(exc).__name__}: {exc}"
                continue
            if response.status_code != 200:
                problems[-1] = f"{endpoint}: answered {response.status_code}: {response.text[:200]}"
                continue
            try:
                params = handoff_params(response.json())
            except HandoffParamsError as exc:
                problems[-1] = f"{endpoint}: answered malformed {KV_TRANSFER_PARAMS_FIELD}: {exc}"
                continue
            except ValueError:
                params = None
            if params is None:
                problems[-1] = f"{endpoint}: answered without {KV_TRANSFER_PARAMS_FIELD}"
                continue
            logger.debug("request %s prefilled by %s in %.3f s", request_id, endpoint, time.perf_counter() - started)
            return Prefilled(params=params, endpoint=endpoint)
        return None

    async def identity_problem(self, *, endpoint: str, auth: object) -> str | None:
        """Why ``endpoint`` must not get the request (None: it proved it is a prefill pod of
        this InferenceService). One GET of its pod-info route with a fresh nonce; without a
        key, :meth:`IdentityChecker.check_identity` allows loopback addresses only."""
        if not isinstance(auth, IdentityChecker):
            return "this pod has no KV handoff policy to check a prefill pod with"
        from splitserve_runtime.transfer.auth import HandoffRejected  # the engine has loaded it

        nonce = auth.new_nonce()
        proof: object = None
        if auth.keyed:
            try:
                answer = await self._http().get(
                    f"http://{endpoint}{INFO_PATH}", params={NONCE: nonce}, timeout=IDENTITY_TIMEOUT
                )
                proof = answer.json().get(IDENTITY_PROOF) if answer.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                return f"its pod info could not be read ({type(exc).__name__})"
        try:
            auth.check_identity(endpoint=endpoint, nonce=nonce, role=Role.PREFILL.value, proof=proof)
        except HandoffRejected as exc:
            return exc.message
        return None

    def fall_back(self, *, request_id: str, reason: str) -> None:
        """Log and count a request whose named prefill pods could not hand it over."""
        logger.warning(
            "request %s: no named prefill pod handed over its KV (%s); computing the prompt on this pod",
            request_id,
            reason,
        )
        self._metrics.record_kv_transfer(num_bytes=0, seconds=0.0, ok=False)

    def route(
        self,
        *,
        engine: ServingEngine,
        role: str,
        prefilled: Prefilled,
        stream: bool,
        request_id: str,
        prompt_token_ids: Sequence[int],
    ) -> RoutedEngine:
        """:func:`route_handoff` for parameters a named prefill pod gave: parameters this pod
        refuses (another compat hash, a bad signature, another prompt) or cannot use are that
        pod's problem, not the client's, so the prompt is computed here instead of answering 4xx."""
        if prefilled.params is None:
            return route_handoff(
                engine=engine, role=role, params=None, stream=stream, prompt_token_ids=prompt_token_ids
            )
        try:
            return route_handoff(
                engine=engine, role=role, params=prefilled.params, stream=stream, prompt_token_ids=prompt_token_ids
            )
        except HandoffRouteError as exc:
            self.fall_back(
                request_id=request_id,
                reason=f"{prefilled.endpoint}: its {KV_TRANSFER_PARAMS_FIELD} were refused: {exc}",
            )
            return route_handoff(
                engine=engine, role=role, params=None, stream=stream, prompt_token_ids=prompt_token_ids
            )
