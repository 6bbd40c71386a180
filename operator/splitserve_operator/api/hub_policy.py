"""Which model hubs this operator lets its pods send hub tokens to (``--allowed-hub-endpoints``).

Why: ``spec.model.hubTokenSecretRef`` may name any key of any Secret in the InferenceService's
namespace, and the runtime sends that value as a Bearer token to ``spec.model.hubEndpoint``. The
CRD refuses the addresses no hub has (loopback, link-local, cluster names: :mod:`.rules`), but a
public name may resolve anywhere, and which hosts deserve a token is the cluster operator's
call, not the InferenceService author's. So the operator serves only endpoints on its list; an
InferenceService with another is refused like any other invalid spec (``Stalled=True``,
``InvalidSpec``, the message naming the endpoint and the list) and nothing is rendered for it.

An entry is ``scheme://host[:port][/path]``. An endpoint matches it when the scheme and the host
are the same (hosts compare case-insensitively), the port is the entry's (an entry without a
port allows every port of the host), and the endpoint's path is the entry's path or below it.
``*`` allows every endpoint (every tenant is trusted with every Secret of its namespace).
InferenceServices without ``hubEndpoint`` download ``hf://`` models from
:data:`DEFAULT_HUB_ENDPOINT`, which must then be on the list too.

The list is enforced only where :func:`enforce` was called (the operator's ``main``); tools that
parse manifests elsewhere (the CLI, tests) see the API's own rules alone.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Iterable
from typing import Final
from urllib.parse import urlsplit

DEFAULT_HUB_ENDPOINT: Final = "https://huggingface.co"
"""Where the runtime downloads ``hf://`` models from when ``hubEndpoint`` is empty."""
DEFAULT_ALLOWED_HUB_ENDPOINTS: Final = (DEFAULT_HUB_ENDPOINT,)
ALLOW_ALL: Final = "*"
_ENTRY: Final = re.compile(r"^https?://[A-Za-z0-9.\[\]:-]+(:[0-9]{1,5})?(/[^\s?#]*)?$")


@dataclasses.dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int | None
    path: str

    @classmethod
    def of(cls, url: str) -> _Origin:
        parts = urlsplit(url)
        port = parts.port  # ValueError when out of range
        return cls(
            scheme=parts.scheme.lower(), host=(parts.hostname or "").lower(), port=port, path=parts.path.rstrip("/")
        )

    def allows(self, other: _Origin) -> bool:
        return (
            self.scheme == other.scheme
            and self.host == other.host
            and (self.port is None or self.port == _effective_port(other))
            and (other.path == self.path or other.path.startswith(self.path + "/"))
        )


def _effective_port(origin: _Origin) -> int:
    return origin.port if origin.port is not None else (443 if origin.scheme == "https" else 80)


@dataclasses.dataclass(frozen=True)
class HubAllowList:
    """The hubs an operator serves (see the module docstring for how entries match)."""

    entries: tuple[str, ...] = DEFAULT_ALLOWED_HUB_ENDPOINTS

    def __post_init__(self) -> None:
        for entry in self.entries:
            if entry == ALLOW_ALL:
                continue
            try:
                parts = urlsplit(entry)  # .port raises ValueError on a port out of range
                valid = bool(_ENTRY.match(entry)) and bool(parts.hostname) and parts.port != 0
            except ValueError:
                valid = False
            if not valid:
                raise ValueError(f"allowed hub endpoint {entry!r} is not scheme://host[:port][/path] (or '*')")

    @classmethod
    def parse(cls, text: str) -> HubAllowList:
        """The list from the flag's comma-separated form (empty: no hub is allowed)."""
        return cls(entries=tuple(e.strip() for e in text.split(",") if e.strip()))

    def allows(self, endpoint: str) -> bool:
        if ALLOW_ALL in self.entries:
            return True
        try:
            wanted = _Origin.of(endpoint)
        except ValueError:
            return False
        return any(_Origin.of(entry).allows(wanted) for entry in self.entries)

    def describe(self) -> str:
        return ", ".join(self.entries) if self.entries else "none"


_lock = threading.Lock()
_enforced: HubAllowList | None = None


def enforce(allow_list: HubAllowList | None) -> None:
    """Make every model parse in this process refuse endpoints ``allow_list`` does not allow
    (None: stop enforcing). Called once by the operator at start-up."""
    global _enforced
    with _lock:
        _enforced = allow_list


def enforced() -> HubAllowList | None:
    """The list being enforced, or None."""
    return _enforced


def problems(endpoint: str) -> list[str]:
    """Why this operator does not serve ``endpoint`` (empty when it does, or when no list is
    enforced)."""
    allow_list = _enforced
    if allow_list is None or allow_list.allows(endpoint):
        return []
    return [
        f"model hub {endpoint} is not on this operator's list of allowed hubs "
        f"({allow_list.describe()}): ask the cluster operator to add it (Helm value "
        f"hub.allowedEndpoints, flag --allowed-hub-endpoints) or use one of those"
    ]


def default_endpoint_problems(uris: Iterable[str]) -> list[str]:
    """:func:`problems` of :data:`DEFAULT_HUB_ENDPOINT` when any of ``uris`` is downloaded from
    it (an ``hf://`` URI of a spec without ``hubEndpoint``)."""
    if any(uri.startswith("hf://") for uri in uris):
        return problems(DEFAULT_HUB_ENDPOINT)
    return []
