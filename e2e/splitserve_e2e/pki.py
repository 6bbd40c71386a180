"""The certificates and keys of the local control plane.

The API server runs with TLS, client-certificate authentication and RBAC on, as a real cluster
does, so every client (controllers, kwok, Prometheus, the tests) authenticates with a
certificate signed by one throw-away CA. Service-account tokens are signed with their own RSA
key so that TokenRequest tokens are verified exactly as in production.

Files are written once per state directory and reused on restart.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CERT_VALIDITY = datetime.timedelta(days=365)
SERVICE_CLUSTER_IP = "10.96.0.1"  # first address of the service range (apiserver.SERVICE_CIDR)
API_SERVER_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclasses.dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


@dataclasses.dataclass(frozen=True)
class ClusterPki:
    """Paths of everything the components and clients need."""

    ca_cert: Path
    ca_key: Path
    apiserver: CertPair
    admin: CertPair
    controller_manager: CertPair
    scheduler: CertPair
    service_account_key: Path  # RSA private key (signing)
    service_account_pub: Path  # its public key (verification)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL
            if isinstance(key, rsa.RSAPrivateKey)
            else serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + CERT_VALIDITY)
    )


def _issue(
    *,
    directory: Path,
    stem: str,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    organization: str | None,
    server: bool,
) -> CertPair:
    pair = CertPair(cert=directory / f"{stem}.crt", key=directory / f"{stem}.key")
    if pair.cert.is_file() and pair.key.is_file():
        return pair
    key = _new_key()
    builder = (
        _builder(_name(common_name, organization), ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_encipherment=False,
                content_commitment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    if server:
        names: list[x509.GeneralName] = [x509.DNSName(n) for n in API_SERVER_DNS_NAMES]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", SERVICE_CLUSTER_IP)]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_key(pair.key, key)
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return pair


def ensure_pki(*, directory: Path) -> ClusterPki:
    """Create the CA, serving/client certificates and the SA key in ``directory`` if absent."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert_path, ca_key_path = directory / "ca.crt", directory / "ca.key"
    if ca_cert_path.is_file() and ca_key_path.is_file():
        ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
        loaded = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{ca_key_path} is not an EC key; delete {directory} to regenerate")
        ca_key = loaded
    else:
        ca_key = _new_key()
        name = _name("splitserve-e2e-ca")
        ca_cert = (
            _builder(name, name, ca_key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_encipherment=False,
                    content_commitment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write_key(ca_key_path, ca_key)
        ca_cert_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    def issue(stem: str, cn: str, org: str | None = None, *, server: bool = False) -> CertPair:
        return _issue(
            directory=directory,
            stem=stem,
            ca_cert=ca_cert,
            ca_key=ca_key,
            common_name=cn,
            organization=org,
            server=server,
        )

    sa_key, sa_pub = directory / "sa.key", directory / "sa.pub"
    if not (sa_key.is_file() and sa_pub.is_file()):
        rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        _write_key(sa_key, rsa_key)
        sa_pub.write_bytes(
            rsa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
    return ClusterPki(
        ca_cert=ca_cert_path,
        ca_key=ca_key_path,
        apiserver=issue("apiserver", "kube-apiserver", server=True),
        admin=issue("admin", "kubernetes-admin", "system:masters"),
        controller_manager=issue("controller-manager", "system:kube-controller-manager"),
        scheduler=issue("scheduler", "system:kube-scheduler"),
        service_account_key=sa_key,
        service_account_pub=sa_pub,
    )


def client_ssl_context(*, ca_cert: Path, client: CertPair | None) -> ssl.SSLContext:
    """An SSL context that trusts the cluster CA and presents ``client`` (if given)."""
    context = ssl.create_default_context(cafile=str(ca_cert))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    return context
