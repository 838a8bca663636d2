"""Command-line flags with environment-variable defaults: the one place services read the environment."""
from __future__ import annotations

import argparse
import logging
import os
import socket

from common.security import TLSConfig


def env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def add_flag(parser: argparse.ArgumentParser, flag: str, env_name: str, default, help: str, type=str) -> None:
    """A command's flag (not a service's: those are in common/settings.py) whose default comes from
    `env_name`; the flag wins over the environment."""
    raw = env(env_name)
    try:
        value = type(raw) if raw is not None else default
    except ValueError:
        parser.error(f"environment variable {env_name}={raw!r} is not a valid {type.__name__}")
    parser.add_argument(flag, type=type, default=value, help=f"{help} (env {env_name}; default {default!r})")


def add_switch(parser: argparse.ArgumentParser, flag: str, help: str, default: bool = False) -> None:
    """A yes/no flag in the services' syntax: --flag alone = true, --flag true|false."""
    parser.add_argument(flag, type=boolean, nargs="?", const=True, default=default, metavar="true|false",
                        help=f"{help} (default {str(default).lower()})")


def boolean(text: str | bool) -> bool:
    """A flag's or environment variable's yes/no (1/0, true/false, yes/no, on/off)."""
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def tls_config(args: dict) -> TLSConfig:
    """The TLS settings of parsed `args` as one TLSConfig."""
    return TLSConfig(cert=args.get("tls_cert"), key=args.get("tls_key"), ca=args.get("tls_ca"),
                     server_name=args.get("tls_server_name"),
                     require_client_cert=args.get("tls_require_client_cert", False),
                     public_cert=args.get("public_tls_cert"), public_key=args.get("public_tls_key"))


def redis_password() -> str | None:
    """From the environment only (a Kubernetes Secret), never from a flag that `ps` would show."""
    return env("REDIS_PASSWORD")


def redis_username() -> str | None:
    """The Redis ACL user; unset = the default user (requirepass)."""
    return env("REDIS_USERNAME")


def api_keys_env() -> str | None:
    """Comma-separated API keys, from the environment only (never a flag that `ps` would show)."""
    return env("HANDOFF_API_KEYS")


def default_host() -> str:
    return socket.gethostname()
