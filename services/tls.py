"""TLS for every gRPC port: credentials from PEM files, the learner identity a client
certificate carries, and a throwaway CA for a local cluster (`atoll up --tls`, tests).

A learner's slot is bound to its client certificate by a URI subject alternative name
`learner:<slot>`; `learner:<prefix>*` allows every slot starting with `<prefix>` (one
certificate for a pool of learners, as the Helm chart issues one per pool).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import grpc

SAN_SCHEME = "learner:"


class TlsError(ValueError):
    """Missing or unreadable certificate material; the message says what to pass."""


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise TlsError(f"cannot read the {what} {path}: {err.strerror}") from None


def server_credentials(cert: Path, key: Path, ca: Path | None) -> grpc.ServerCredentials:
    """The server's certificate and key; with `ca`, clients must present a certificate that
    chains to it (mTLS)."""
    pair = (_read(key, "TLS key (--tls-key)"), _read(cert, "TLS certificate (--tls-cert)"))
    roots = _read(ca, "CA (--tls-ca)") if ca is not None else None
    return grpc.ssl_server_credentials([pair], roots, require_client_auth=roots is not None)


def channel_credentials(
    ca: Path | None, cert: Path | None, key: Path | None
) -> grpc.ChannelCredentials:
    """A client's credentials: the CA that signed the synchronizers' certificates (None: the
    system's roots), and this learner's certificate and key for mTLS."""
    if (cert is None) != (key is None):
        raise TlsError("give both --tls-cert and --tls-key (the learner's client certificate)")
    return grpc.ssl_channel_credentials(
        _read(ca, "CA (--tls-ca)") if ca is not None else None,
        _read(key, "TLS key (--tls-key)") if key is not None else None,
        _read(cert, "TLS certificate (--tls-cert)") if cert is not None else None,
    )


def learner_credentials(
    insecure: bool, ca: Path | None, cert: Path | None, key: Path | None
) -> grpc.ChannelCredentials | None:
    """A learner's channel credentials from its flags; None: plaintext (--insecure)."""
    if insecure:
        return None
    if ca is None and cert is None:
        raise TlsError(
            "no TLS settings: pass --tls-ca (the CA of the synchronizers' certificates) and "
            "--tls-cert and --tls-key (this slot's certificate), or --insecure for plaintext "
            "on a trusted network"
        )
    return channel_credentials(ca, cert, key)


@lru_cache(maxsize=1024)
def learner_patterns(pem: bytes) -> tuple[str, ...]:
    """The slots a client certificate (PEM) speaks for: its `learner:` URI SANs' rest."""
    from cryptography import x509

    try:
        certificate = x509.load_pem_x509_certificate(pem)
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (ValueError, x509.ExtensionNotFound):
        return ()
    uris = names.value.get_values_for_type(x509.UniformResourceIdentifier)
    return tuple(u[len(SAN_SCHEME) :] for u in uris if u.startswith(SAN_SCHEME))


def pattern_allows(pattern: str, slot: str) -> bool:
    """`a-*` allows every slot starting with `a-`; anything else allows exactly itself."""
    if pattern.endswith("*"):
        return slot.startswith(pattern[:-1])
    return slot == pattern


# --- a throwaway CA ---------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """Where `generate` wrote a local cluster's certificates."""

    ca: Path
    server_cert: Path
    server_key: Path
    folder: Path

    def client(self, slot: str) -> tuple[Path, Path]:
        """A learner slot's certificate and key."""
        return self.folder / f"{slot}.crt", self.folder / f"{slot}.key"


def generate(folder: Path, slots: list[str], hosts: tuple[str, ...] = ("127.0.0.1",)) -> TlsFiles:
    """A new CA, a server certificate for localhost and `hosts`, and one client certificate
    per learner slot (URI SAN `learner:<slot>`), valid for a day."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write(stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Path:
        crt = folder / f"{stem}.crt"
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        path = folder / f"{stem}.key"
        path.touch(mode=0o600)
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return crt

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("atoll throwaway CA"))
        .issuer_name(name("atoll throwaway CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
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
    ca_path = write("ca", ca, ca_key)

    def leaf(
        common: str, sans: list[x509.GeneralName], usage: x509.ObjectIdentifier
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        return cert, key

    server_sans: list[x509.GeneralName] = [x509.DNSName("localhost")]
    for host in hosts:
        try:
            server_sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            server_sans.append(x509.DNSName(host))
    cert, key = leaf("atoll synchronizer", server_sans, ExtendedKeyUsageOID.SERVER_AUTH)
    server_cert = write("server", cert, key)
    for slot in slots:
        cert, key = leaf(
            f"learner {slot}",
            [x509.UniformResourceIdentifier(SAN_SCHEME + slot)],
            ExtendedKeyUsageOID.CLIENT_AUTH,
        )
        write(slot, cert, key)
    return TlsFiles(ca_path, server_cert, folder / "server.key", folder)
