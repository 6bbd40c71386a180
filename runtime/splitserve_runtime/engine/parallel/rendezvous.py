"""Who may take part in a parallel group: where its sockets listen, and the key its control
messages are authenticated with.

Why: the ranks of one replica meet at a ``TCPStore`` on rank 0 (the rendezvous), exchange the
addresses of their gloo (or NCCL) connections through it, and then every host-side control
message (each step's batch, KV block reads and writes, the handoff's orders) is a pickled
object rank 0 sends the others (:meth:`~.group.ParallelGroup.broadcast_object`). torch's store
listens on every interface and authenticates nobody, and unpickling runs code: whoever could
reach the store could have joined the group's connections and made every rank run anything.

So, two rules:

- **A replica on one machine listens on loopback only.** A one-pod replica (every rank in one
  pod) binds its store to ``127.0.0.1`` (a socket bound here, handed to the store) and its gloo
  connections to ``127.0.0.1``; with CUDA, NCCL's bootstrap sockets use the loopback
  interface (``NCCL_SOCKET_IFNAME=lo`` unless set). Nothing of the group is reachable from
  outside the pod. A group of several pods without a key is allowed only when every pod runs
  on this machine (a loopback ``--leader-address``: development), with a warning.
- **Every control message carries an HMAC-SHA256** under the group's key, over a header
  (version, sender rank, the message's sequence number in the group) and the pickled bytes; a
  receiver checks it in constant time *before* it unpickles anything, and refuses a message
  whose MAC, sender or sequence number is not the one due (so a recorded message cannot be
  replayed either). The key: for a one-pod replica, 32 random bytes drawn by rank 0 and handed
  to its worker processes in their environment (never on a command line); for a group of
  several pods, derived from ``--rendezvous-key-file`` (the operator mounts the
  InferenceService's Secret) and the group's name (its leader's address, the same on every pod
  of a LeaderWorkerSet group), ``HMAC(secret, "splitserve rendezvous" | leader address)``, so
  two groups of one pool do not accept each other's messages.

What the key does not cover: the store's own keys (heartbeats, readiness, failure reports,
KV pull reports) and the tensors of the collectives themselves are not authenticated, so a
group of several pods still relies on its NetworkPolicy to admit the rendezvous port and the
collective ports only from the pool's own pods (the operator renders that rule).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import struct
import threading
from collections.abc import Mapping
from pathlib import Path

from splitserve_contract import ServeArgs
from splitserve_runtime.transfer.auth import is_loopback_host

from .placement import Placement, PlacementError

log = logging.getLogger(__name__)

ENV_GROUP_KEY = "SPLITSERVE_PARALLEL_GROUP_KEY"
"""How a server (or a worker pod's agent) hands its worker processes the group's key: hex, in
their environment (a command line is readable by every user of the host)."""
KEY_BYTES = 32
MIN_SECRET_BYTES = 16
DERIVATION_LABEL = b"splitserve rendezvous\x00"
UNAUTHENTICATED_KEY = b"splitserve: unauthenticated loopback rendezvous"
"""The key of a keyless group on one machine: public, so it only frames the messages."""

MAC_BYTES = hashlib.sha256().digest_size
_HEADER = struct.Struct("!4sBIQ")  # magic, version, sender rank, sequence number
_MAGIC = b"SSCM"
_VERSION = 1


class ControlAuthError(RuntimeError):
    """A control message that is not the group's: bad or missing MAC, or not the one due.
    A RuntimeError, as a broken connection is: the group cannot go on either way."""


# ---------------------------------------------------------------------------- keys
def read_secret(path: str | Path) -> bytes:
    """The file's bytes (less one trailing newline), at least :data:`MIN_SECRET_BYTES` of them.
    Raises :class:`PlacementError` naming the file, never its content."""
    try:
        secret = Path(path).read_bytes().removesuffix(b"\n")
    except OSError as exc:
        raise PlacementError(
            f"cannot read --rendezvous-key-file {str(path)!r}: {exc.strerror or type(exc).__name__}"
        ) from None
    if len(secret) < MIN_SECRET_BYTES:
        raise PlacementError(
            f"--rendezvous-key-file {str(path)!r} holds {len(secret)} bytes; a key needs at least {MIN_SECRET_BYTES}"
        )
    return secret


def derive_group_key(secret: bytes, group: str) -> bytes:
    """The key of one group (``group``: its leader's address) from the pool's secret."""
    return hmac.new(secret, DERIVATION_LABEL + group.encode("utf-8"), hashlib.sha256).digest()


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """How this pod's ranks meet: the group's key and where rank 0's sockets listen."""

    key: bytes = dataclasses.field(repr=False)
    authenticated: bool
    """False only for a keyless group of several pods on one machine (public key)."""
    loopback: bool
    """Every rank of the group runs on this machine: the store, gloo and NCCL's bootstrap
    listen on loopback only."""
    store_host: str | None
    """Where rank 0's store listens: a loopback address, or None (every interface: an
    authenticated group of several pods)."""

    def worker_env(self) -> dict[str, str]:
        """What a worker process of this pod needs in its environment."""
        return {ENV_GROUP_KEY: self.key.hex()}


def one_pod() -> Rendezvous:
    """A replica whose ranks all run in this pod: a fresh random key, loopback only."""
    return Rendezvous(key=secrets.token_bytes(KEY_BYTES), authenticated=True, loopback=True, store_host="127.0.0.1")


def multinode(args: ServeArgs, placement: Placement) -> Rendezvous:
    """A group of several pods: keyed by ``--rendezvous-key-file``, or, without one, allowed
    only on loopback addresses (every pod on this machine), with a warning. Raises
    :class:`PlacementError` when neither holds."""
    if not placement.is_multinode:
        raise ValueError("a one-pod replica draws its own key (one_pod())")
    leader = placement.leader_address
    if args.rendezvous_key_file:
        if not leader:
            raise PlacementError(
                "the group's key is derived from its leader's address, but neither "
                "--leader-address nor $LWS_LEADER_ADDRESS names it on this pod"
            )
        return Rendezvous(
            key=derive_group_key(read_secret(args.rendezvous_key_file), leader),
            authenticated=True,
            loopback=False,
            store_host=None,
        )
    # the leader may not know its own address (flags only): then where it listens, if loopback
    host = leader or (args.host if is_loopback_host(args.host) else "127.0.0.1")
    if not is_loopback_host(host):
        raise PlacementError(
            f"a group of {placement.nnodes} pods meets at {host}:{placement.rendezvous_port}, and its ranks "
            f"run what the leader sends them: pass --rendezvous-key-file (a secret every pod of the group "
            f"holds; the operator mounts one) so that only the group's own pods take part, or, on one "
            f"machine, a loopback --leader-address"
        )
    log.warning(
        "the parallel group's control messages are not authenticated (no --rendezvous-key-file): "
        "allowed because every pod meets on loopback (%s:%d); never expose this port",
        host,
        placement.rendezvous_port,
    )
    return Rendezvous(key=UNAUTHENTICATED_KEY, authenticated=False, loopback=True, store_host=host.strip("[]"))


def from_environment(*, loopback: bool, env: Mapping[str, str] | None = None) -> Rendezvous:
    """A worker process's view: the key its parent put in :data:`ENV_GROUP_KEY` (removed from
    this process's environment once read, so that its own children do not inherit it)."""
    source = os.environ if env is None else env
    raw = source.get(ENV_GROUP_KEY, "")
    if env is None:
        os.environ.pop(ENV_GROUP_KEY, None)
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        key = b""
    if not key:
        raise RuntimeError(f"a parallel worker needs the group's key in ${ENV_GROUP_KEY} (its server sets it)")
    return Rendezvous(key=key, authenticated=key != UNAUTHENTICATED_KEY, loopback=loopback, store_host=None)


# ---------------------------------------------------------------------------- messages
class ControlCodec:
    """Seals and opens the control messages of one group member (see the module docstring).

    Every member numbers the group's control collectives in the same order (they are
    collectives: every rank calls them in the same order), so the sequence number a message
    must carry is known to its receivers without being trusted from the wire."""

    def __init__(self, key: bytes) -> None:
        if not key:
            raise ValueError("a control codec needs a key")
        self._key = key
        self._lock = threading.Lock()
        self._next = 0

    def next_sequence(self) -> int:
        """The number of the next control collective (every member calls this once per collective)."""
        with self._lock:
            sequence = self._next
            self._next += 1
            return sequence

    def _mac(self, signed: bytes | memoryview) -> bytes:
        return hmac.new(self._key, signed, hashlib.sha256).digest()

    def seal(self, payload: bytes, *, sender: int, sequence: int) -> bytes:
        """``MAC | header | payload``."""
        signed = _HEADER.pack(_MAGIC, _VERSION, sender, sequence) + payload
        return self._mac(signed) + signed

    def open(self, frame: bytes | memoryview, *, sender: int, sequence: int) -> bytes:
        """The payload of ``frame``, once its MAC (constant-time compare), version, sender and
        sequence number are the ones due; raises :class:`ControlAuthError` otherwise, before
        anything of the payload is looked at."""
        view = memoryview(frame)
        if len(view) < MAC_BYTES + _HEADER.size:
            raise ControlAuthError(
                f"a control message from rank {sender} is {len(view)} bytes, too short to carry a MAC: refused"
            )
        mac, signed = view[:MAC_BYTES], view[MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(signed)):
            raise ControlAuthError(
                f"a control message from rank {sender} failed authentication (bad MAC): "
                f"refused before decoding; do all pods of the group hold the same "
                f"--rendezvous-key-file and leader address?"
            )
        magic, version, got_sender, got_sequence = _HEADER.unpack_from(signed)
        if magic != _MAGIC or version != _VERSION:
            raise ControlAuthError(f"a control message from rank {sender} has format {version}, not {_VERSION}")
        if (got_sender, got_sequence) != (sender, sequence):
            raise ControlAuthError(
                f"a control message claimed rank {got_sender}, message {got_sequence}; rank "
                f"{sender}'s message {sequence} was due: refused (replayed or out of step)"
            )
        return bytes(signed[_HEADER.size :])
