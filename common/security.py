"""TLS credentials from PEM files, and the router's API-key check.

Internal ports (prefill, decode, decode's KV port) use mutual TLS whenever TLS is on: each
service presents one certificate as server and as client, and refuses a peer whose
certificate does not chain to the CA bundle. The router's public port serves TLS and asks
for client certificates only when told to; public clients authenticate with API keys.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import grpc

log = logging.getLogger(__name__)

# Always reachable, even with API keys on: Kubernetes probes and grpcurl carry no key.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class TLSError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class TLSConfig:
    """Where this process's certificate, key and CA bundle are; all None = plaintext."""

    cert: str | None = None  # PEM certificate chain: the server cert, and the client cert on outgoing channels
    key: str | None = None  # PEM private key of `cert`
    ca: str | None = None  # PEM CA bundle that peers' certificates must chain to
    server_name: str | None = None  # name to expect in servers' certificates (workers register IPs)
    require_client_cert: bool = False  # the router's public port; internal ports always require one

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key (HANDOFF_TLS_CERT, HANDOFF_TLS_KEY) go together: "
                             "give both or neither")
        if self.require_client_cert and not (self.cert and self.ca):
            raise ValueError("--tls-require-client-cert needs --tls-cert, --tls-key and --tls-ca")

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def check_for_service(self) -> None:
        """A service both serves and calls internal ports, so its TLS is all three files or none."""
        if self.enabled and not (self.cert and self.ca):
            raise ValueError("TLS for a handoff service needs all of --tls-cert, --tls-key and --tls-ca "
                             "(HANDOFF_TLS_CERT, HANDOFF_TLS_KEY, HANDOFF_TLS_CA): internal ports use mutual TLS")


@dataclass(frozen=True)
class _Material:
    cert: bytes | None
    key: bytes | None
    ca: bytes | None


def _read(path: str, what: str, marker: str) -> bytes:
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise TLSError(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise TLSError(f"{what} {path}: is a directory, not a PEM file") from None
    except PermissionError:
        raise TLSError(f"{what} {path}: not readable by this user (permission denied)") from None
    if marker.encode() not in data:
        raise TLSError(f"{what} {path}: not a PEM file (no '{marker}' block)")
    return data


def _load(cfg: TLSConfig) -> _Material:
    cert = _read(cfg.cert, "TLS certificate (--tls-cert)", "-----BEGIN CERTIFICATE-----") if cfg.cert else None
    key = _read(cfg.key, "TLS key (--tls-key)", "PRIVATE KEY-----") if cfg.key else None
    ca = _read(cfg.ca, "TLS CA bundle (--tls-ca)", "-----BEGIN CERTIFICATE-----") if cfg.ca else None
    # gRPC reports a bad PEM only as a failed bind or handshake; OpenSSL's parser names the fault.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cert is not None:
        def encrypted() -> bytes:  # instead of OpenSSL's interactive passphrase prompt
            raise TLSError(f"TLS key (--tls-key) {cfg.key}: encrypted with a passphrase; "
                           f"give an unencrypted PEM key (protect it with file permissions)")
        try:
            ctx.load_cert_chain(cfg.cert, cfg.key, password=encrypted)
        except ssl.SSLError as exc:
            if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
                raise TLSError(f"TLS key (--tls-key) {cfg.key} does not belong to the certificate "
                               f"(--tls-cert) {cfg.cert}") from None
            raise TLSError(f"TLS certificate (--tls-cert) {cfg.cert} or key (--tls-key) {cfg.key}: "
                           f"unreadable PEM ({exc.reason or exc})") from None
    if ca is not None:
        try:
            ctx.load_verify_locations(cafile=cfg.ca)
        except ssl.SSLError as exc:
            raise TLSError(f"TLS CA bundle (--tls-ca) {cfg.ca}: unreadable PEM ({exc.reason or exc})") from None
    return _Material(cert, key, ca)


def check(cfg: TLSConfig) -> None:
    """Read and parse every configured file now, so a bad one stops the service at start."""
    if cfg.enabled:
        _load(cfg)


def server_credentials(cfg: TLSConfig, *, require_client_cert: bool) -> grpc.ServerCredentials | None:
    """TLS for a server port (None when TLS is off); with require_client_cert, mutual TLS."""
    if not cfg.enabled:
        return None
    if not cfg.cert:
        raise TLSError("a TLS server needs --tls-cert and --tls-key")
    m = _load(cfg)
    if require_client_cert and m.ca is None:
        raise TLSError("requiring client certificates needs --tls-ca, the CA they must chain to")
    return grpc.ssl_server_credentials([(m.key, m.cert)], root_certificates=m.ca if require_client_cert else None,
                                       require_client_auth=require_client_cert)


def channel_credentials(cfg: TLSConfig) -> grpc.ChannelCredentials | None:
    """TLS for outgoing channels (None when TLS is off): verify servers by the CA bundle (the
    system's roots without one) and present this service's certificate as the client's."""
    if not cfg.enabled:
        return None
    m = _load(cfg)
    return grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.key, certificate_chain=m.cert)


# --------------------------------------------------------------------------- API keys

def read_api_keys(path: str | None, env_value: str | None = None) -> tuple[str, ...]:
    """Keys from a file (one per line, '#' comments, blank lines ignored) plus a comma-separated list."""
    keys: list[str] = []
    if path:
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ValueError(f"API keys file (--api-keys-file) {path}: no such file") from None
        except (PermissionError, IsADirectoryError, UnicodeDecodeError) as exc:
            raise ValueError(f"API keys file (--api-keys-file) {path}: unreadable ({type(exc).__name__})") from None
        for line in text.splitlines():
            line = line.partition("#")[0].strip()
            if line:
                keys.append(line)
        if not keys:
            raise ValueError(f"API keys file (--api-keys-file) {path} holds no key: add one per line, "
                             f"or unset the flag to turn API keys off")
    if env_value:
        keys += [k.strip() for k in env_value.split(",") if k.strip()]
    for i, k in enumerate(keys):
        if any(c.isspace() for c in k):
            # Say where, never what: the message may reach a log.
            raise ValueError(f"API key #{i + 1} contains whitespace; a key is one token")
    return tuple(dict.fromkeys(keys))


class APIKeys:
    """The configured keys; `check` compares a presented key with every one in constant time.

    Keys are compared as SHA-256 digests, so neither a key's length nor its content shows
    in the time a check takes, and every configured key is compared (no early exit).
    No keys configured means authentication is off.
    """

    def __init__(self, keys: Iterable[str]):
        keys = tuple(keys)
        if not all(keys):
            raise ValueError("an API key must not be empty")
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:  # never the keys
        return f"APIKeys({len(self._digests)} keys)"

    def check(self, presented: str | None) -> bool:
        if not self._digests:
            return True
        candidate = hashlib.sha256((presented or "").encode()).digest()
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(digest, candidate)
        return found


def bearer_token(metadata) -> str | None:
    """The key in 'authorization: Bearer <key>', '' when the header is malformed, None when absent."""
    for name, value in metadata or ():
        if name == "authorization":
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class APIKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid API key (UNAUTHENTICATED), except health and reflection; for the
    router's asyncio server (grpc.aio), where handlers are coroutines."""

    def __init__(self, keys: APIKeys):
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        token = bearer_token(handler_call_details.invocation_metadata)
        if token and self.keys.check(token):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if token is None:
            message = "this API requires an API key: send metadata 'authorization: Bearer <key>'"
        elif token == "":
            message = "the authorization metadata must be 'Bearer <key>'"
        else:
            message = "the API key is not valid"

        async def deny(request_or_iterator, context):
            log.info("%s: UNAUTHENTICATED from %s: %s", method, context.peer(), message)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
                    if getattr(handler, k))
        return handler._replace(**{kind: deny})
