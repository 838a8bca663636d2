"""What the cluster is doing, from Redis: workers, recent requests, one request's record; and drain.

    python -m router.status                       # workers by role, then the newest requests
    python -m router.status --watch 2 --json      # one JSON object per refresh
    python -m router.status request ID            # one request's record and its history
    python -m router.status drain WORKER_ID       # what SIGTERM does, on demand; waits until done

Reads Redis only (REDIS_URL or --redis-url, password from REDIS_PASSWORD); `drain` writes one key
that the worker's heartbeat picks up. In Kubernetes: kubectl -n handoff exec deploy/handoff-router
-- python -m router.status
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime

from common import cli
from common.redis_server import connect
from common.state import TERMINAL_STATES, RequestState, StateStore, StateUnavailable, WorkerInfo

DRAIN_POLL_S = 0.1


class StatusError(Exception):
    """A problem the operator can act on: one line, exit 1."""


# ---- what Redis holds, as plain dicts (the --json output)

def ttft_s(record: dict) -> float | None:
    """Queued → first token, from the record's stamps.

    The router records `transferring` right after streaming the first token (the KV push
    starts then), so the first `transferring` stamp marks the first token; a request that
    ended on its first token has only its terminal stamp. None while no token was sent.
    """
    history = record.get("history") or []
    if not history:
        return None
    t_queued = history[0][1]
    for state, ts in history:
        if state == RequestState.TRANSFERRING:
            return ts - t_queued
    state, ts = history[-1]
    if state in TERMINAL_STATES and record.get("completion_tokens", 0) > 0:
        return ts - t_queued
    return None


_NUMERIC_FIELDS = {"kv_bytes": int, "transfer_s": float, "exposed_s": float, "prefill_s": float, "kv_segments": int}


def request_summary(record: dict, now: float) -> dict:
    history = record["history"]
    t_queued, (last_state, t_last) = history[0][1], history[-1]
    done = last_state in TERMINAL_STATES
    out = {k: v for k, v in record.items() if k != "history" and not k.startswith("t_")}
    for name, kind in _NUMERIC_FIELDS.items():  # what the router writes besides the store's own counts
        if name in out:
            try:
                out[name] = kind(out[name])
            except ValueError:
                pass
    out.update(state=str(record["state"]), t_queued=t_queued, age_s=now - t_queued, ttft_s=ttft_s(record),
               e2e_s=t_last - t_queued if done else None,
               history=[[str(state), ts] for state, ts in history])
    return out


def worker_summary(state: StateStore, w: WorkerInfo, drains: dict, now: float) -> dict:
    out = {"worker_id": w.worker_id, "role": w.role, "address": w.address, "epoch": w.epoch,
           "model_id": w.model_id, "up_s": max(0.0, now - w.started_at), "total_blocks": w.total_blocks,
           "free_blocks": w.free_blocks, "num_running": w.num_running, "num_waiting": w.num_waiting,
           "draining": drains.get(w.worker_id, (None,))[0] == w.epoch}
    if w.role == "decode":
        leases = state.reservations(w.worker_id)
        out.update(kv_address=w.kv_address, available_blocks=w.available_blocks, num_leases=len(leases),
                   leased_blocks=sum(leases.values()))
    return out


def snapshot(state: StateStore, limit: int) -> dict:
    now = state.redis_time()
    drains = state.drain_requests()
    workers = sorted(state.list_workers(), key=lambda w: (w.role != "prefill", w.worker_id))
    ids, num_records = state.recent_request_ids(limit)
    # A record may expire between the scan and the read: skip it.
    records = [(rid, r) for rid, r in ((rid, state.get_request(rid)) for rid in ids) if r is not None]
    registered = {w.worker_id for w in workers}
    return {"redis": state.url, "time": now,
            "workers": [worker_summary(state, w, drains, now) for w in workers],
            # Drain requests for workers that have already left the registry: still finishing their work.
            "draining": [{"worker_id": wid, "epoch": epoch, "expires_in_s": ttl}
                         for wid, (epoch, ttl) in sorted(drains.items()) if wid not in registered],
            "num_records": num_records,
            "requests": [dict(request_id=rid, **request_summary(r, now)) for rid, r in records]}


# ---- human-readable

def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours < 24 else f"{hours // 24}d{hours % 24:02d}h"


def table(header: list[str], rows: list[list[object]]) -> str:
    cells = [header] + [["-" if c is None or c == "" else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def format_overview(snap: dict) -> str:
    stamp = datetime.fromtimestamp(snap["time"]).isoformat(sep=" ", timespec="seconds")
    lines = [f"handoff at {snap['redis']}, {stamp}", ""]
    workers = snap["workers"]
    for role in ("prefill", "decode"):
        of_role = [w for w in workers if w["role"] == role]
        lines.append(f"{role} workers: {len(of_role)}")
        if not of_role:
            lines.append("")
            continue
        header = ["worker", "epoch", "up", "free/total blocks", "running", "waiting", "address"]
        if role == "decode":
            header[4:4] = ["available", "leases (blocks)"]
        rows = []
        for w in of_role:
            row = [w["worker_id"] + (" (draining)" if w["draining"] else ""), w["epoch"][:8], duration(w["up_s"]),
                   f"{w['free_blocks']}/{w['total_blocks']}", w["num_running"], w["num_waiting"], w["address"]]
            if role == "decode":
                row[4:4] = [w["available_blocks"], f"{w['num_leases']} ({w['leased_blocks']})"]
            rows.append(row)
        lines += [table(header, rows), ""]
    for d in snap["draining"]:
        lines.append(f"draining: {d['worker_id']} has left the registry and is finishing its work "
                     f"(request expires in {duration(d['expires_in_s'])})")
    if snap["draining"]:
        lines.append("")
    reqs = snap["requests"]
    lines.append(f"recent requests: {len(reqs)} newest of {snap['num_records']} records")
    if reqs:
        header = ["request", "state", "age", "prefill", "decode", "ttft", "total", "prompt", "completion",
                  "finish", "error"]
        rows = [[r["request_id"], r["state"], duration(r["age_s"]), r.get("prefill_worker"), r.get("decode_worker"),
                 duration(r["ttft_s"]), duration(r["e2e_s"]), r.get("prompt_tokens"), r.get("completion_tokens"),
                 r.get("finish_reason"), _one_line(r.get("error"), 60)] for r in reqs]
        lines.append(table(header, rows))
    return "\n".join(lines)


def format_request(rid: str, summary: dict) -> str:
    s = dict(summary)
    history = s.pop("history")
    lines = [f"request {rid}: {s.pop('state')}" + (f" ({s['finish_reason']})" if s.get("finish_reason") else "")]
    s.pop("finish_reason", None)
    lines.append(f"  tokens: prompt {s.pop('prompt_tokens', '-')}, completion {s.pop('completion_tokens', '-')}"
                 f" of max {s.pop('max_tokens', '-')}")
    lines.append(f"  workers: prefill {s.pop('prefill_worker', '-')}, decode {s.pop('decode_worker', '-')}")
    lines.append(f"  time to first token {duration(s.pop('ttft_s'))}, total {duration(s.pop('e2e_s'))}, "
                 f"queued {duration(s.pop('age_s'))} ago")
    if "kv_bytes" in s:
        segments = s.pop("kv_segments", None)
        lines.append(f"  KV: {s.pop('kv_bytes') / 1e6:.2f} MB in {duration(s.pop('transfer_s', None))}"
                     + (f" ({segments} segments streamed while prefilling)" if segments and segments > 1 else "")
                     + (f", {duration(s.pop('exposed_s'))} after the first token" if "exposed_s" in s else ""))
    error = s.pop("error", None)
    t_queued = s.pop("t_queued")
    lines += [f"  {name}: {value}" for name, value in sorted(s.items())]  # seed and whatever else the router wrote
    lines.append("  history:")
    for state, ts in history:
        stamp = datetime.fromtimestamp(ts).isoformat(sep=" ", timespec="milliseconds")
        lines.append(f"    {state:<13} {stamp}  +{duration(ts - t_queued)}")
    if error:
        lines.append(f"  error: {error}")
    return "\n".join(lines)


def _one_line(text: str | None, num_chars: int) -> str | None:
    if not text:
        return None
    text = " ".join(text.split())
    return text if len(text) <= num_chars else text[:num_chars - 1] + "…"


# ---- commands

def show_request(state: StateStore, rid: str) -> dict:
    record = state.get_request(rid)
    if record is None:
        raise StatusError(f"no record of request {rid!r} in Redis: a wrong id, or its record expired "
                          f"(finished records are kept {duration(state.record_ttl_s)})")
    return request_summary(record, state.redis_time())


def drain(state: StateStore, worker_id: str, timeout_s: float, say) -> dict:
    """Asks the worker to drain and waits until it has left the registry and finished its work."""
    worker = state.get_worker(worker_id)
    if worker is None:
        live = ", ".join(sorted(w.worker_id for w in state.list_workers())) or "none"
        raise StatusError(f"no worker {worker_id!r} in the registry (live workers: {live})")
    t0 = time.monotonic()
    # The request outlives the wait, so while we wait its disappearance can only mean the worker removed it.
    state.request_drain(worker_id, worker.epoch, ttl_s=timeout_s + 60)
    say(f"{worker_id} ({worker.role}, epoch {worker.epoch[:8]}, {worker.num_running} running, "
        f"{worker.num_waiting} waiting): drain requested")
    result = {"worker_id": worker_id, "epoch": worker.epoch, "left_registry_s": None, "drained_s": None}
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        now = state.get_worker(worker_id)
        if now is None or now.epoch != worker.epoch:
            result["left_registry_s"] = time.monotonic() - t0
            say(f"{worker_id} left the registry after {duration(result['left_registry_s'])}; "
                f"finishing its work in flight")
            break
        time.sleep(DRAIN_POLL_S)
    else:
        # Withdrawn, so that it does not fire later by surprise; a worker that saw it drains anyway.
        state.end_drain(worker_id, worker.epoch, worker.role)
        raise StatusError(f"{worker_id} did not act on the drain request within {duration(timeout_s)} and is "
                          f"still registered; request withdrawn. Its heartbeat (every 0.5 s) checks for it: "
                          f"is the worker hung, or running a version without drain support?")
    while time.monotonic() < deadline:
        if state.drained(worker.role, worker_id, worker.epoch):
            state.end_drain(worker_id, worker.epoch, worker.role)  # the request and its answer
            result["drained_s"] = time.monotonic() - t0
            say(f"{worker_id} drained in {duration(result['drained_s'])}")
            return result
        time.sleep(DRAIN_POLL_S)
    raise StatusError(f"{worker_id} left the registry but was still finishing its work after {duration(timeout_s)}; "
                      f"its --drain-timeout-s bounds that, then it cancels what is left")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m router.status", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="overview", metavar="{request,drain}",
                   help="request ID: one request's record; drain WORKER_ID: drain a worker; none: the overview")
    p.add_argument("id", nargs="?", help="the request id or worker id")
    cli.add_flag(p, "--redis-url", "REDIS_URL", None, "the cluster's Redis (redis://host:port/db; the password "
                 "comes from env REDIS_PASSWORD, never from the URL)")
    p.add_argument("--json", action="store_true", help="JSON instead of tables (one object per refresh)")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--limit", type=int, default=20, help="recent requests to show (default 20)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="drain: how long to wait for the worker to finish (default 60)")
    args = p.parse_args(argv)
    if args.command not in ("overview", "request", "drain"):
        p.error(f"unknown command {args.command!r}: use `request ID`, `drain WORKER_ID`, or none")
    if args.command == "overview" and args.id is not None:
        p.error(f"unexpected argument {args.id!r}")
    if args.command != "overview" and not args.id:
        p.error(f"{args.command} needs an id: python -m router.status {args.command} "
                f"{'ID' if args.command == 'request' else 'WORKER_ID'}")
    if args.command == "drain" and args.watch is not None:
        p.error("--watch does not apply to drain (it waits by itself)")
    if args.watch is not None and args.watch <= 0:
        p.error("--watch needs a positive number of seconds")
    if args.limit <= 0 or args.timeout_s <= 0:
        p.error("--limit and --timeout-s must be positive")
    if not args.redis_url:
        p.error("no Redis to read: set --redis-url or REDIS_URL (e.g. redis://handoff-redis:6379/0)")
    return args


def _render(args, state: StateStore) -> str:
    if args.command == "request":
        summary = show_request(state, args.id)
        return json.dumps(dict(request_id=args.id, **summary)) if args.json else format_request(args.id, summary)
    snap = snapshot(state, args.limit)
    return json.dumps(snap) if args.json else format_overview(snap)


def _unreachable(exc: StateUnavailable) -> str:
    return (f"{str(exc).rstrip('.')}. Check --redis-url / REDIS_URL, that Redis runs and is reachable from here "
            f"(in Kubernetes: run this in a handoff pod, or kubectl port-forward svc/handoff-redis 6379), "
            f"and REDIS_PASSWORD")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    client, _ = connect(args.redis_url, password=cli.redis_password(), username=cli.redis_username())
    state = StateStore(client)
    try:
        if args.command == "drain":
            say = (lambda line: None) if args.json else (lambda line: print(line, flush=True))
            result = drain(state, args.id, args.timeout_s, say)
            if args.json:
                print(json.dumps(result))
            return 0
        if args.watch is None:
            print(_render(args, state))
            return 0
        # Watching rides out a Redis restart: the error is shown until Redis answers again.
        clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() and not args.json else ""
        while True:
            try:
                text = _render(args, state)
            except (StateUnavailable, StatusError) as exc:
                text = json.dumps({"error": str(exc)}) if args.json else f"error: {exc}"
            print(clear + text, flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    except StateUnavailable as exc:
        print(f"router.status: {_unreachable(exc)}", file=sys.stderr)
        return 1
    except StatusError as exc:
        print(f"router.status: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
