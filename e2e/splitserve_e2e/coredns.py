"""Cluster DNS for the kubelet node's pods: CoreDNS as a host process on the bridge gateway.

Pods find each other by name on a real cluster: a Service by its short name or FQDN, and a pod
with ``hostname``/``subdomain`` behind a headless Service as
``<hostname>.<subdomain>.<namespace>.svc.cluster.local``. LeaderWorkerSet hands its pods the
leader's address in that form (``LWS_LEADER_ADDRESS``), so without cluster DNS the harness could
not run what multi-node pools rely on. CoreDNS with its ``kubernetes`` plugin is what clusters
run for that; the binary is built from its Go module with only the plugins used here
(:data:`splitserve_e2e.build.COREDNS_PLUGINS`).

It runs on the host, not as a pod behind a ``kube-dns`` ClusterIP: no image registry holds its
image here, and a host process is up before the first pod starts and needs no kube-proxy rule.
It listens on the node's bridge gateway (UDP and TCP port 53), which every pod reaches, and the
kubelet's ``clusterDNS`` names that address directly, so pods get
``nameserver <gateway>``, ``search <ns>.svc.cluster.local svc.cluster.local cluster.local``
and ``options ndots:5`` as on any cluster.

The Corefile (:func:`corefile`) answers ``cluster.local`` and the reverse zones from the API
(the harness's admin kubeconfig; ``pods insecure`` for the ``1-2-3-4.<ns>.pod`` names; records
live 5 s, and the cache keeps them no longer) and every other name with NXDOMAIN: nothing leaves
the machine, and a definite "no such name" fails a lookup at once instead of after the
resolver's timeouts. There is no ``fallthrough`` for the reverse zones: with no plugin after
``kubernetes`` it would turn every unknown address into SERVFAIL instead of NXDOMAIN.
Health and readiness (``/health``, ``/ready``: the API synced) are served on loopback ports.

:func:`query` is a minimal DNS client (A, AAAA, PTR, SRV, over UDP or TCP) for asserting what
the server answers from the host, without a DNS library.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import random
import socket
import struct
import time
from pathlib import Path
from typing import Final

import httpx

from splitserve_e2e.net import LOOPBACK, free_port
from splitserve_e2e.process import ManagedProcess, start_process, wait_until

CLUSTER_DOMAIN: Final = "cluster.local"
DNS_PORT: Final = 53
RECORD_TTL_SECONDS: Final = 5
REVERSE_ZONES: Final = ("in-addr.arpa", "ip6.arpa")


class PortInUse(RuntimeError):
    """Something already holds the DNS port on the address CoreDNS must listen on."""


def corefile(
    *,
    address: str,
    kubeconfig: Path,
    health_port: int,
    ready_port: int,
    port: int = DNS_PORT,
    domain: str = CLUSTER_DOMAIN,
    ttl_seconds: int = RECORD_TTL_SECONDS,
) -> str:
    """The Corefile: ``domain`` and the reverse zones from the API server, NXDOMAIN for
    everything else, all on ``address:port`` only."""
    if ttl_seconds < 0:
        raise ValueError(f"ttl_seconds must be >= 0, got {ttl_seconds}")
    zones = " ".join((domain, *REVERSE_ZONES))
    return f"""\
{" ".join(f"{zone}:{port}" for zone in (domain, *REVERSE_ZONES))} {{
    bind {address}
    errors
    log
    health {LOOPBACK}:{health_port}
    ready {LOOPBACK}:{ready_port}
    kubernetes {zones} {{
        kubeconfig {kubeconfig}
        pods insecure
        ttl {ttl_seconds}
    }}
    cache {ttl_seconds}
}}
.:{port} {{
    bind {address}
    errors
    log
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
"""


def check_port_free(*, address: str, port: int = DNS_PORT) -> None:
    """Raise :class:`PortInUse` when ``address:port`` cannot be bound, over UDP or TCP. No
    SO_REUSEPORT here: CoreDNS sets it, so a second CoreDNS (or a stale one) would otherwise
    share the port silently and answer half of the queries."""
    for kind, name in ((socket.SOCK_DGRAM, "UDP"), (socket.SOCK_STREAM, "TCP")):
        with socket.socket(socket.AF_INET, kind) as probe:
            if kind == socket.SOCK_STREAM:  # as Go's listeners: TIME_WAIT does not block
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address, port))
            except OSError as error:
                raise PortInUse(
                    f"{name} {address}:{port} is taken ({error.strerror}); see "
                    f"`ss -lnup 'sport = :{port}'` and `ss -lntp 'sport = :{port}'`"
                ) from error


@dataclasses.dataclass
class ClusterDns:
    """A running CoreDNS: where pods send queries, and its probes."""

    address: str
    port: int
    process: ManagedProcess
    health_url: str
    ready_url: str
    corefile: Path
    kubeconfig: Path
    """Whose view of the API it serves (the same file starts another one)."""
    started_at: float
    """``time.monotonic()`` when the process was started."""

    def healthy(self) -> bool:
        return _answers_ok(self.health_url)

    def ready(self) -> bool:
        """True once every plugin is ready (the kubernetes plugin has synced with the API)."""
        return _answers_ok(self.ready_url)

    def answers(self) -> bool:
        """True when a query on the DNS port gets a reply. /ready turns 200 a moment before
        the DNS listeners open (they open once every plugin's startup hook has returned)."""
        try:
            query(
                server=self.address, port=self.port, name=f"{CLUSTER_DOMAIN}.", record_type="SOA", timeout_seconds=0.2
            )
        except (OSError, ValueError):
            return False
        return True

    def wait_ready(self, *, timeout_seconds: float = 30.0) -> float:
        """Wait until it is :meth:`ready` and :meth:`answers`; returns the seconds since the
        start."""
        wait_until(
            lambda: self.ready() and self.answers(),
            timeout_seconds=timeout_seconds,
            what="CoreDNS /ready and answering",
            alive=self.process,
            interval_seconds=0.05,
        )
        return time.monotonic() - self.started_at

    def stop(self) -> None:
        self.process.stop(grace_seconds=5.0)


def _answers_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


def start_coredns(
    *,
    binary: Path,
    address: str,
    kubeconfig: Path,
    directory: Path,
    log_dir: Path,
    pid_dir: Path | None,
    port: int = DNS_PORT,
) -> ClusterDns:
    """Write the Corefile into ``directory`` and start CoreDNS on ``address:port``; returns at
    once (:meth:`ClusterDns.wait_ready` waits until it serves from a synced cache)."""
    if not binary.is_file():
        raise FileNotFoundError(
            f"CoreDNS binary {binary} does not exist (`python -m splitserve_e2e.build --node` builds it)"
        )
    if not kubeconfig.is_file():
        raise FileNotFoundError(f"kubeconfig {kubeconfig} does not exist")
    check_port_free(address=address, port=port)
    health_port, ready_port = free_port(), free_port()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "Corefile"
    path.write_text(
        corefile(address=address, kubeconfig=kubeconfig, health_port=health_port, ready_port=ready_port, port=port)
    )
    started_at = time.monotonic()
    process = start_process(
        name="coredns",
        argv=[str(binary), "-conf", str(path)],
        log_path=log_dir / "coredns.log",
        pid_dir=pid_dir,
        cwd=directory,
    )
    return ClusterDns(
        address=address,
        port=port,
        process=process,
        corefile=path,
        kubeconfig=kubeconfig,
        started_at=started_at,
        health_url=f"http://{LOOPBACK}:{health_port}/health",
        ready_url=f"http://{LOOPBACK}:{ready_port}/ready",
    )


# --------------------------------------------------------------------------- a minimal client
RCODES: Final = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}
TYPES: Final = {"A": 1, "NS": 2, "CNAME": 5, "SOA": 6, "PTR": 12, "TXT": 16, "AAAA": 28, "SRV": 33, "ANY": 255}
_TYPE_NAMES: Final = {number: name for name, number in TYPES.items()}


@dataclasses.dataclass(frozen=True)
class DnsRecord:
    """One answer record; ``data`` is the address, the target name, or for SRV
    ``"<priority> <weight> <port> <target>"`` (other types: hex)."""

    name: str
    type: str
    ttl: int
    data: str


@dataclasses.dataclass(frozen=True)
class DnsReply:
    rcode: str
    answers: tuple[DnsRecord, ...]
    authoritative: bool

    def values(self, record_type: str = "A") -> list[str]:
        """The ``data`` of the answers of one type, sorted."""
        return sorted(record.data for record in self.answers if record.type == record_type)


def reverse_name(ip: str) -> str:
    """``10.96.0.1`` -> ``1.0.96.10.in-addr.arpa``."""
    return ipaddress.ip_address(ip).reverse_pointer


def query(
    *,
    server: str,
    name: str,
    record_type: str = "A",
    port: int = DNS_PORT,
    tcp: bool = False,
    timeout_seconds: float = 2.0,
) -> DnsReply:
    """Ask ``server`` one question (recursion desired, as a stub resolver asks)."""
    if record_type not in TYPES:
        raise ValueError(f"unsupported record type {record_type!r} (known: {sorted(TYPES)})")
    ident = random.randrange(1 << 16)
    message = (
        struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0)
        + _encode_name(name)
        + struct.pack("!HH", TYPES[record_type], 1)
    )
    if tcp:
        with socket.create_connection((server, port), timeout=timeout_seconds) as connection:
            connection.sendall(struct.pack("!H", len(message)) + message)
            length = struct.unpack("!H", _receive(connection, 2))[0]
            reply = _receive(connection, length)
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(timeout_seconds)
            sock.sendto(message, (server, port))
            while True:
                reply, _ = sock.recvfrom(65535)
                if len(reply) >= 2 and struct.unpack("!H", reply[:2])[0] == ident:
                    break
    return _parse(reply, ident)


def _receive(connection: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = connection.recv(count - len(data))
        if not chunk:
            raise ConnectionError("the DNS server closed the TCP connection early")
        data += chunk
    return data


def _encode_name(name: str) -> bytes:
    labels = [label for label in name.rstrip(".").split(".") if label]
    if any(len(label.encode()) > 63 for label in labels):
        raise ValueError(f"{name!r} has a label longer than 63 bytes")
    return b"".join(bytes([len(label.encode())]) + label.encode() for label in labels) + b"\0"


def _read_name(message: bytes, offset: int) -> tuple[str, int]:
    """A possibly compressed name at ``offset``; returns it and the offset after it."""
    labels: list[str] = []
    end: int | None = None
    for _ in range(128):  # bounds a pointer loop in a malformed reply
        length = message[offset]
        if length & 0xC0 == 0xC0:
            if end is None:
                end = offset + 2
            offset = struct.unpack("!H", message[offset : offset + 2])[0] & 0x3FFF
        elif length == 0:
            return ".".join(labels) + ".", end if end is not None else offset + 1
        else:
            labels.append(message[offset + 1 : offset + 1 + length].decode("ascii", "replace"))
            offset += 1 + length
    raise ValueError("DNS name compression loop")


def _parse(message: bytes, ident: int) -> DnsReply:
    got, flags, questions, answers, _, _ = struct.unpack("!HHHHHH", message[:12])
    if got != ident or not flags & 0x8000:
        raise ValueError(f"not a reply to query {ident}")
    offset = 12
    for _ in range(questions):
        _, offset = _read_name(message, offset)
        offset += 4
    records = []
    for _ in range(answers):
        owner, offset = _read_name(message, offset)
        kind, _, ttl, length = struct.unpack("!HHIH", message[offset : offset + 10])
        offset += 10
        rdata = message[offset : offset + length]
        type_name = _TYPE_NAMES.get(kind, str(kind))
        if type_name in ("A", "AAAA"):
            data = str(ipaddress.ip_address(rdata))
        elif type_name in ("PTR", "CNAME", "NS"):
            data = _read_name(message, offset)[0]
        elif type_name == "SRV":
            priority, weight, target_port = struct.unpack("!HHH", rdata[:6])
            data = f"{priority} {weight} {target_port} {_read_name(message, offset + 6)[0]}"
        else:
            data = rdata.hex()
        records.append(DnsRecord(name=owner, type=type_name, ttl=ttl, data=data))
        offset += length
    return DnsReply(
        rcode=RCODES.get(flags & 0xF, str(flags & 0xF)), answers=tuple(records), authoritative=bool(flags & 0x0400)
    )
