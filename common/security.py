"""TLS credentials from PEM files, re-read when they change, and the router's API-key check.

Internal ports (prefill, decode, decode's KV port) use mutual TLS whenever TLS is on. Each service holds
the certificate of its role (common/pki.py: a SPIFFE ID spiffe://handoff/<namespace>/role/<role> and the
DNS name <role>.<server name>), presents it as server and as client, refuses a peer whose certificate
does not chain to the CA bundle, and authorizes every call by the caller's role (common/authz.py). A
caller expects the role of the server it dials in that server's certificate. The router's public port
serves its own certificate (--public-tls-cert; the router's identity without one) and asks for client
certificates only when told to; public clients authenticate with API keys.

Certificates, keys, CA bundles and API-key files are re-read when they change (checked at most once a
second, on the next handshake or call) or on SIGHUP: new connections use the new ones, connections and
streams already open keep going.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import signal
import ssl
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import grpc

from common import pki
from common.pki import Identity

log = logging.getLogger(__name__)

# Always reachable, even with API keys on: Kubernetes probes and grpcurl carry no key.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

# How often a file may be looked at for a change (a stat per file; the next handshake or call looks).
CHECK_INTERVAL_S = 1.0


class TLSError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class TLSConfig:
    """Where this process's certificate, key and CA bundle are; all None = plaintext."""

    cert: str | None = None  # PEM chain of this service's role: its server and its client certificate
    key: str | None = None  # PEM private key of `cert`
    ca: str | None = None  # PEM CA bundle that peers' certificates must chain to
    server_name: str | None = None  # internal name: a server of role R must carry R.<name> (default handoff-internal)
    require_client_cert: bool = False  # the router's public port; internal ports always require one
    public_cert: str | None = None  # the router's public port's certificate; None = `cert`
    public_key: str | None = None  # its private key

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key (HANDOFF_TLS_CERT, HANDOFF_TLS_KEY) go together: "
                             "give both or neither")
        if bool(self.public_cert) != bool(self.public_key):
            raise ValueError("--public-tls-cert and --public-tls-key go together: give both or neither")
        if self.require_client_cert and not (self.cert and self.ca):
            raise ValueError("--tls-require-client-cert needs --tls-cert, --tls-key and --tls-ca")

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def name_for(self, role: str) -> str:
        """The name a server of `role` must carry in its certificate."""
        return pki.server_name(role, self.server_name)

    def check_for_service(self) -> None:
        """A service both serves and calls internal ports, so its TLS is all three files or none."""
        if self.enabled and not (self.cert and self.ca):
            raise ValueError("TLS for a handoff service needs all of --tls-cert, --tls-key and --tls-ca "
                             "(HANDOFF_TLS_CERT, HANDOFF_TLS_KEY, HANDOFF_TLS_CA): internal ports use mutual TLS")

    @property
    def public(self) -> "TLSConfig":
        """The TLS of the router's public port: its own certificate when one is given."""
        if not self.public_cert:
            return self
        return TLSConfig(cert=self.public_cert, key=self.public_key, ca=self.ca,
                         require_client_cert=self.require_client_cert)


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
    # gRPC reports a bad PEM only as a failed bind or handshake; OpenSSL's parser names the fault. (A file
    # replaced between the two reads fails here; a reload then keeps the files in use and looks again.)
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
            ctx.load_verify_locations(cadata=ca.decode("ascii", errors="replace"))
        except ssl.SSLError as exc:
            raise TLSError(f"TLS CA bundle (--tls-ca) {cfg.ca}: unreadable PEM ({exc.reason or exc})") from None
    return _Material(cert, key, ca)


def check(cfg: TLSConfig, role: str | None = None) -> None:
    """Read and parse every configured file now, so a bad one stops the service at start; with `role`,
    the certificate must name that role (a decode worker holds the decode certificate)."""
    if cfg.enabled:
        m = _load(cfg)
        if role is not None and m.cert is not None:
            check_identity(cfg, m.cert, role)
    if cfg.public_cert:
        _load(cfg.public)


def check_identity(cfg: TLSConfig, cert_pem: bytes, role: str) -> Identity:
    identity = pki.identity_of_pem(cert_pem)
    if identity is None:
        raise TLSError(f"TLS certificate (--tls-cert) {cfg.cert} carries no handoff identity (one URI SAN "
                       f"{pki.spiffe_id('<namespace>', role)}); issue one per role, e.g. python -m common.pki")
    if identity.role != role:
        raise TLSError(f"TLS certificate (--tls-cert) {cfg.cert} is {identity.spiffe_id}, the identity of a "
                       f"{identity.role}; this {role} needs a {role} certificate")
    return identity


_live_files: weakref.WeakSet = weakref.WeakSet()  # every TLSFiles of this process, for reload_all()


class TLSFiles:
    """One process's TLS files, re-read when one changes (looked at on use, at most every check_interval_s)
    or on reload(). A change that does not load (a half-written file, a key of another certificate) is
    logged and the files in use are kept, so a bad rotation never takes a service down."""

    def __init__(self, cfg: TLSConfig, *, check_interval_s: float | None = None):
        self.cfg = cfg
        self.check_interval_s = CHECK_INTERVAL_S if check_interval_s is None else check_interval_s
        self._lock = threading.Lock()
        self._paths = [p for p in (cfg.cert, cfg.key, cfg.ca) if p]
        self._signature = self._stat()
        self._material = _load(cfg)
        # Who this process is (None without a handoff identity). A rotation keeps the role: a certificate
        # of another role is refused like a broken file.
        self.identity: Identity | None = pki.identity_of_pem(self._material.cert) if self._material.cert else None
        self._role = self.identity.role if self.identity else None
        self._next_check = time.monotonic() + self.check_interval_s
        self.generation = 0  # +1 at every change that loaded
        self._last_error = ""
        _live_files.add(self)

    def _stat(self) -> tuple:
        out = []
        for path in self._paths:
            try:
                st = os.stat(path)  # follows a Secret volume's ..data symlink to the file of the moment
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def material(self) -> _Material:
        self._maybe_reload(force=False)
        return self._material

    def reload(self) -> None:
        """Look at the files now (SIGHUP)."""
        self._maybe_reload(force=True)

    def _maybe_reload(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now < self._next_check:
            return
        with self._lock:
            self._next_check = now + self.check_interval_s
            signature = self._stat()
            if signature == self._signature and not force:
                return
            try:
                material = _load(self.cfg)
                if self._role is not None and material.cert is not None:
                    check_identity(self.cfg, material.cert, self._role)
            except TLSError as exc:
                # Looked at again next time: the rest of a rotation may still be on its way.
                if str(exc) != self._last_error:
                    log.error("TLS files changed but cannot be used, keeping the previous ones: %s", exc)
                self._last_error = str(exc)
                return
            self._signature, self._last_error = signature, ""
            if material == self._material:
                return
            self._material = material
            self.identity = pki.identity_of_pem(material.cert) if material.cert else None
            self.generation += 1
            log.warning("TLS files re-read (generation %d): new connections use them", self.generation)

    def server_credentials(self, *, require_client_cert: bool) -> grpc.ServerCredentials:
        """TLS for a server port that takes the files of the moment at each new connection."""
        m = self.material()
        if m.cert is None:
            raise TLSError("a TLS server needs --tls-cert and --tls-key")
        if require_client_cert and m.ca is None:
            raise TLSError("requiring client certificates needs --tls-ca, the CA they must chain to")
        served = [self.generation]

        def config(m: _Material):
            return grpc.ssl_server_certificate_configuration(
                [(m.key, m.cert)], root_certificates=m.ca if require_client_cert else None)

        def fetch():  # called by gRPC at each new handshake; None = keep the configuration it has
            m = self.material()
            if self.generation == served[0]:
                return None
            served[0] = self.generation
            return config(m)
        return grpc.dynamic_ssl_server_credentials(config(m), fetch, require_client_authentication=require_client_cert)

    def channel_credentials(self) -> tuple[grpc.ChannelCredentials, int]:
        """Credentials for a new outgoing channel, and the generation of the files they hold."""
        m = self.material()
        return (grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.key, certificate_chain=m.cert),
                self.generation)


class ClientTLS:
    """What a caller dials servers of one role with: the files of the moment and the name to expect."""

    def __init__(self, files: TLSFiles, role: str):
        self.files = files
        self.server_name = files.cfg.name_for(role)

    def credentials(self) -> tuple[grpc.ChannelCredentials, int]:
        return self.files.channel_credentials()


def reload_all() -> None:
    """Re-read every live TLSFiles and API-key file of this process now (SIGHUP)."""
    for files in list(_live_files):
        files.reload()
    for keys in list(_live_keys):
        keys.reload()


def rotating_ssl_context(ctx: ssl.SSLContext, cfg: TLSConfig, *, require_client_cert: bool) -> None:
    """Make a server SSLContext built from `cfg` (the router's HTTPS port, uvicorn's) take re-read files at
    each new handshake, as the gRPC ports do: OpenSSL asks the callback at every ClientHello, SNI or not."""
    files = TLSFiles(cfg)
    current = {"generation": files.generation, "ctx": ctx}

    def on_hello(sslobj: ssl.SSLObject, server_name, _ctx) -> None:
        m = files.material()
        if files.generation != current["generation"]:
            new = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                new.load_cert_chain(cfg.cert, cfg.key)
                if require_client_cert:
                    new.verify_mode = ssl.CERT_REQUIRED
                    new.load_verify_locations(cadata=m.ca.decode("ascii", errors="replace"))
            except (OSError, ssl.SSLError) as exc:  # changed again since the look: the next handshake retries
                log.warning("HTTPS: the re-read TLS files did not load (%s); this connection gets the previous", exc)
                return
            current.update(generation=files.generation, ctx=new)
        if current["ctx"] is not ctx:
            sslobj.context = current["ctx"]
    ctx.sni_callback = on_hello


def reload_on_sighup() -> None:
    """SIGHUP re-reads every TLS and API-key file of this process at once (call from the main thread)."""
    def handler(signum, frame):
        # Off the signal handler: a reload takes locks a gRPC thread may hold.
        threading.Thread(target=reload_all, name="sighup-reload", daemon=True).start()
    signal.signal(signal.SIGHUP, handler)


def role_tls(folder: str | Path, role: str, *, server_name: str | None = None,
             require_client_cert: bool = False) -> TLSConfig:
    """The TLSConfig of `role` in a folder of python -m common.pki's files (the router's with public.crt)."""
    folder = Path(folder)
    public = (folder / "public.crt", folder / "public.key") if role == "router" else (None, None)
    return TLSConfig(cert=str(folder / f"{role}.crt"), key=str(folder / f"{role}.key"), ca=str(folder / "ca.crt"),
                     server_name=server_name, require_client_cert=require_client_cert,
                     public_cert=str(public[0]) if public[0] and public[0].exists() else None,
                     public_key=str(public[1]) if public[0] and public[0].exists() else None)


def tls_files(cfg: TLSConfig) -> TLSFiles | None:
    return TLSFiles(cfg) if cfg.enabled else None


def server_credentials(cfg: TLSConfig, *, require_client_cert: bool) -> grpc.ServerCredentials | None:
    """TLS for a server port (None when TLS is off); with require_client_cert, mutual TLS."""
    if not cfg.enabled:
        return None
    if not cfg.cert:
        raise TLSError("a TLS server needs --tls-cert and --tls-key")
    return TLSFiles(cfg).server_credentials(require_client_cert=require_client_cert)


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
        digests = self._current()
        if not digests:
            return True
        candidate = hashlib.sha256((presented or "").encode()).digest()
        found = False
        for digest in digests:
            found |= hmac.compare_digest(digest, candidate)
        return found

    def _current(self) -> tuple[bytes, ...]:
        return self._digests

    def reload(self) -> None:
        """Keys from a file are re-read (APIKeyFile); fixed keys stay."""


_live_keys: weakref.WeakSet = weakref.WeakSet()  # every APIKeyFile of this process, for reload_all()


class APIKeyFile(APIKeys):
    """The keys of an API-keys file (plus fixed ones from the environment), re-read when the file changes
    (looked at on a check, at most every check_interval_s) or on reload(). A file that no longer reads
    (removed, emptied) is logged and the keys in use are kept: a bad rotation never locks every client out."""

    def __init__(self, path: str, env_value: str | None = None, *, check_interval_s: float | None = None):
        self.path, self._env_value = path, env_value
        self.check_interval_s = CHECK_INTERVAL_S if check_interval_s is None else check_interval_s
        self._lock = threading.Lock()
        self._signature = self._stat()
        super().__init__(read_api_keys(path, env_value))
        self._next_check = time.monotonic() + self.check_interval_s
        _live_keys.add(self)

    def _stat(self):
        try:
            st = os.stat(self.path)
            return st.st_ino, st.st_mtime_ns, st.st_size
        except OSError:
            return None

    def _current(self) -> tuple[bytes, ...]:
        if time.monotonic() >= self._next_check:
            self._maybe_reload(force=False)
        return self._digests

    def reload(self) -> None:
        self._maybe_reload(force=True)

    def _maybe_reload(self, force: bool) -> None:
        with self._lock:
            self._next_check = time.monotonic() + self.check_interval_s
            signature = self._stat()
            if signature == self._signature and not force:
                return
            try:
                keys = read_api_keys(self.path, self._env_value)
                digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys)
            except ValueError as exc:
                log.error("API keys file changed but cannot be used, keeping the previous keys: %s", exc)
                return
            self._signature = signature
            if digests != self._digests:
                self._digests = digests
                log.warning("API keys re-read from %s: %d keys", self.path, len(digests))


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
