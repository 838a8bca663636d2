"""Per-role identities in certificates, and a small CA that issues them for tests and local clusters.

Every internal certificate names one role of one deployment, twice:
  - a URI SAN, the SPIFFE ID  spiffe://handoff/<namespace>/role/<role>,  which servers read from the
    TLS peer to authorize each call (common/authz.py);
  - a DNS SAN  <role>.<server name>  (e.g. decode.handoff-internal), which callers expect of the server
    they dial (workers register pod IPs, which no certificate names): a router that dials a decode
    worker accepts only a decode certificate, so a registration naming some other server is refused.
Roles: router, prefill and decode (the services) and operator (python -m router.status, grpcurl).

    python -m common.pki --out certs/                  # CA + one certificate per role, namespace default
    python -m common.pki --out certs/ --ca-dir old/    # new leaves from an existing CA (rotation)
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

ROLES = ("router", "prefill", "decode", "operator")
TRUST_DOMAIN = "handoff"
DEFAULT_SERVER_NAME = "handoff-internal"
DEFAULT_NAMESPACE = "default"


@dataclass(frozen=True)
class Identity:
    """Who a certificate says its holder is."""

    namespace: str
    role: str

    @property
    def spiffe_id(self) -> str:
        return spiffe_id(self.namespace, self.role)

    def __str__(self) -> str:
        return self.spiffe_id


def spiffe_id(namespace: str, role: str) -> str:
    return f"spiffe://{TRUST_DOMAIN}/{namespace}/role/{role}"


def parse_spiffe_id(uri: str) -> Identity | None:
    """The Identity a SPIFFE ID names, or None when it is not one of handoff's."""
    head = f"spiffe://{TRUST_DOMAIN}/"
    if not uri.startswith(head):
        return None
    parts = uri[len(head):].split("/")
    if len(parts) != 3 or parts[1] != "role" or not parts[0] or parts[2] not in ROLES:
        return None
    return Identity(parts[0], parts[2])


def server_name(role: str, name: str | None) -> str:
    """The DNS name a server of `role` carries, under the deployment's internal name."""
    return f"{role}.{name or DEFAULT_SERVER_NAME}"


def identity_of_pem(cert_pem: bytes) -> Identity | None:
    """The handoff identity in the first certificate of a PEM chain (its URI SANs), or None."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    found = [i for i in map(parse_spiffe_id, sans.get_values_for_type(x509.UniformResourceIdentifier)) if i]
    return found[0] if len(found) == 1 else None


# --------------------------------------------------------------------------- issuing

@dataclass(frozen=True)
class Issued:
    cert_pem: bytes
    key_pem: bytes


class CA:
    """A self-signed EC P-256 CA that issues per-role leaf certificates."""

    def __init__(self, cert_pem: bytes, key_pem: bytes):
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        self.cert_pem, self.key_pem = cert_pem, key_pem
        self._cert = x509.load_pem_x509_certificate(cert_pem)
        self._key = serialization.load_pem_private_key(key_pem, password=None)

    @classmethod
    def create(cls, name: str = "handoff-ca", days: float = 365) -> "CA":
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        start, end = _validity(days)
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return cls(_cert_pem(cert), _key_pem(key))

    @classmethod
    def load(cls, folder: Path) -> "CA":
        return cls((folder / "ca.crt").read_bytes(), (folder / "ca.key").read_bytes())

    def issue(self, role: str, *, namespace: str = DEFAULT_NAMESPACE, name: str | None = None,
              days: float = 30, extra_dns: tuple[str, ...] = ()) -> Issued:
        """A certificate for `role` (both server and client use): its SPIFFE ID and <role>.<name>."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        from cryptography import x509

        sans = [x509.UniformResourceIdentifier(spiffe_id(namespace, role)), x509.DNSName(server_name(role, name))]
        sans += [x509.DNSName(d) for d in extra_dns]
        return self._leaf(f"{role}.{namespace}", sans, days)

    def issue_public(self, names: tuple[str, ...] = ("localhost", "127.0.0.1"), days: float = 30) -> Issued:
        """A server certificate for the router's public port: DNS and IP names, no role identity."""
        from cryptography import x509

        sans = []
        for n in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        return self._leaf(names[0], sans, days)

    def _leaf(self, common_name: str, sans: list, days: float) -> Issued:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        start, end = _validity(days)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
                .issuer_name(self._cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                               critical=False)
                .sign(self._key, hashes.SHA256()))
        return Issued(_cert_pem(cert), _key_pem(key))


def _validity(days: float) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)  # 5 min of clock skew


def _cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_private(path: Path, data: bytes) -> None:
    """Write a file readable by its owner only (keys), replacing it atomically (a reader never sees half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_role_files(folder: Path, role: str, issued: Issued) -> tuple[Path, Path]:
    cert, key = folder / f"{role}.crt", folder / f"{role}.key"
    write_private(key, issued.key_pem)
    write_private(cert, issued.cert_pem)
    return cert, key


def issue_all(folder: Path, *, namespace: str = DEFAULT_NAMESPACE, name: str | None = None, days: float = 30,
              ca: CA | None = None, roles: tuple[str, ...] = ROLES,
              public_names: tuple[str, ...] = ("localhost", "127.0.0.1")) -> CA:
    """ca.crt (+ ca.key, unless `ca` is given), <role>.crt/.key for every role and public.crt/.key."""
    folder.mkdir(parents=True, exist_ok=True)
    if ca is None:
        ca = CA.create(days=max(days, 365))
        write_private(folder / "ca.key", ca.key_pem)
    write_private(folder / "ca.crt", ca.cert_pem)
    for role in roles:
        write_role_files(folder, role, ca.issue(role, namespace=namespace, name=name, days=days))
    write_role_files(folder, "public", ca.issue_public(public_names, days=days))
    return ca


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m common.pki", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder to write ca.crt and <role>.crt/.key into")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="the deployment's namespace, in every SPIFFE ID")
    p.add_argument("--server-name", default=DEFAULT_SERVER_NAME,
                   help="the internal name (--tls-server-name); each role's certificate carries <role>.<name>")
    p.add_argument("--days", type=float, default=30, help="validity of the leaf certificates")
    p.add_argument("--ca-dir", type=Path, help="issue from the CA in this folder (ca.crt, ca.key) instead of a new one")
    p.add_argument("--public-name", action="append",
                   help="a name (DNS or IP) of the router's public port certificate, public.crt (repeatable; "
                        "default localhost and 127.0.0.1)")
    args = p.parse_args(argv)
    ca = CA.load(args.ca_dir) if args.ca_dir else None
    issue_all(args.out, namespace=args.namespace, name=args.server_name, days=args.days, ca=ca,
              public_names=tuple(args.public_name or ("localhost", "127.0.0.1")))
    print(f"wrote {args.out}/ca.crt{'' if ca else ' (+ ca.key)'}, public.crt and "
          f"{', '.join(f'{r}.crt' for r in ROLES)} with their keys; identities "
          f"{spiffe_id(args.namespace, '<role>')}")


if __name__ == "__main__":
    main()
