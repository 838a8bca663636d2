"""One Redis ACL user per role, with only the commands and key patterns that role's code runs (common/state.py).

Scripts run with their caller's permissions (every redis.call is checked against the user's commands and
keys), so granting EVALSHA grants nothing beyond the lists here. What each role may touch, under the
store's prefix:

    role      read                                  write
    router    workers:*, worker:*, prefixes:*       leases:*, lease_blocks:*, request:*, routers,
                                                    router_requests:*, reaped_at (the reaper's clock)
    prefill   drain:*                               workers:prefill, worker:prefill:*, prefixes:prefill:*,
                                                    drained:prefill:*
    decode    drain:*, leases:*, lease_blocks:*     workers:decode, worker:decode:*, prefixes:decode:*,
                                                    drained:decode:*, leases:* and lease_blocks:* (its
                                                    deregistration deletes its leases, a drained worker
                                                    drops those left)
    operator  everything                            drain:*, drained:*

So a router cannot register or deregister a worker, a worker cannot register as the other role nor
write any request record, and only the operator can drain. No role can run admin commands (CONFIG, ACL,
FLUSHALL, KEYS, DEBUG, SHUTDOWN, MONITOR, SCRIPT FLUSH, ...).

    python -m common.redis_acl                 # the rules of every role, one line each (a users.acl without passwords)
    python -m common.redis_acl --write deploy/k8s/base/redis-acl   # one file per role: what deploy/ gives Redis
"""
from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

ROLES = ("router", "prefill", "decode", "operator")
DEFAULT_PREFIX = "handoff:"

# Every client: connect, authenticate, ping (health checks), run the store's scripts by hash (and load
# them after a restart), the Redis clock.
_CONNECTION = ("auth", "hello", "ping", "select", "client|setinfo", "client|setname", "client|getname",
               "acl|whoami", "evalsha", "eval", "script|load", "script|exists", "time", "multi", "exec", "discard")
# What the registry's scripts and pipelines run on a worker's own keys.
_REGISTRY = ("hset", "hget", "hgetall", "hmget", "pexpire", "zadd", "zrem", "zremrangebyscore", "zrangebyscore",
             "del", "sadd", "get", "set")
_LEASES_READ = ("zscore", "hget", "hgetall", "zrange", "zrangebyscore")

COMMANDS: dict[str, tuple[str, ...]] = {
    "router": _CONNECTION + ("hgetall", "hget", "hmget", "hset", "hdel", "exists", "del", "pexpire", "pexpireat",
                             "zadd", "zrem", "zscore", "zrange", "zrangebyscore", "sadd", "srem", "smembers",
                             "smismember", "get", "set"),
    "prefill": _CONNECTION + _REGISTRY,
    "decode": _CONNECTION + _REGISTRY + _LEASES_READ + ("hdel",),  # hdel: drop_leases after a drain
    "operator": _CONNECTION + ("hgetall", "hget", "hmget", "zscore", "zrange", "zrangebyscore", "smembers",
                               "smismember", "get", "set", "del", "pttl", "scan", "type", "ttl", "pexpire"),
}


def key_patterns(role: str, prefix: str = DEFAULT_PREFIX) -> tuple[str, ...]:
    """The role's key patterns in ACL syntax: %R~ read, %W~ write, ~ both."""
    p = _glob_literal(prefix)
    if role == "router":
        return (f"%R~{p}workers:*", f"%R~{p}worker:*", f"%R~{p}prefixes:*", f"~{p}leases:*", f"~{p}lease_blocks:*",
                f"~{p}request:*", f"~{p}routers", f"~{p}router_requests:*", f"~{p}reaped_at")
    if role in ("prefill", "decode"):
        own = (f"~{p}workers:{role}", f"~{p}worker:{role}:*", f"~{p}prefixes:{role}:*", f"~{p}drained:{role}:*",
               f"%R~{p}drain:*")
        return own + ((f"~{p}leases:*", f"~{p}lease_blocks:*") if role == "decode" else ())
    if role == "operator":
        return (f"%R~{p}*", f"~{p}drain:*", f"~{p}drained:*")
    raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")


def username(role: str) -> str:
    return f"handoff-{role}"


def rules(role: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The ACL rules of `role`'s user, without its password: reset, then only what is listed."""
    return " ".join(["resetkeys", "resetchannels", "-@all", *(f"+{c}" for c in COMMANDS[role]),
                     *key_patterns(role, prefix)])


def user_line(role: str, password: str, prefix: str = DEFAULT_PREFIX) -> str:
    """A users.acl / redis.conf line for `role`, its password given as its SHA-256 (never in plain text)."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    return f"user {username(role)} on #{digest} {rules(role, prefix)}"


def _glob_literal(text: str) -> str:
    """`text` matched literally by a Redis glob."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m common.redis_acl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="the store's key prefix")
    p.add_argument("--write", metavar="DIR", help="write each role's rules to DIR/<role> instead")
    args = p.parse_args(argv)
    if args.write:
        for role in ROLES:
            (Path(args.write) / role).write_text(rules(role, args.prefix) + "\n")
        return
    for role in ROLES:
        print(f"user {username(role)} on <password> {rules(role, args.prefix)}")


if __name__ == "__main__":
    main()
