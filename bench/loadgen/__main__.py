"""python -m bench.loadgen: open-loop Poisson load on real service processes, per placement mode and mix.

    python -m bench.loadgen                         # the full sweep (about 15 minutes on 2 cores)
    python -m bench.loadgen --quick                 # CI smoke: disaggregated, chat (32-token outputs), 2 rates, < 2 min
    python -m bench.loadgen --modes disaggregated colocated-2x1t --mixes long --rates 0.1 0.2

Each mode (bench.loadgen.cluster.modes) starts as separate processes, every worker pinned to its core(s)
with taskset, so a pool is a real core; the router and this load generator are not pinned. Requests go
through the public Generate API with ignore_eos and exact prompt and output lengths (bench.loadgen.workload).
First the unloaded figures: single requests, one at a time, on the first mode (disaggregated by default);
the SLOs are TTFT <= 4x and TPOT <= 2x those, per request shape. Then, per mix and rate, a fixed
Poisson schedule (the same seed in every mode) is sent open-loop, a thread per request.

Prints one JSON object per figure on stdout, as every benchmark here does: latency percentiles per mode,
mix and rate; SLO attainment and what the cores were doing per rate; goodput per mode and mix; the
ratios the issue asks for, with "target" and "met". Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from common import cli, settings
from bench.harness import emit, emit_load_avg, emit_skipped, log
from router.config import RouterConfig
from bench.loadgen.cluster import PinnedCluster, modes, router_prefill_modes
from bench.loadgen.report import machine_line, report_goodput, report_ratios
from bench.loadgen.workload import (CHAT, LONG, MIXES, PROMPT_ID_RANGE, SLO, SLO_ATTAINMENT,
                                   Planned, Result, attainment, percentiles, plan)

# Sizing (docs/benchmarks.md): per rate point, requests = rate x window_s, clamped to [min, max]; each
# point then waits, after its last arrival, until no request still running could meet the SLOs (at most
# max_drain_s) before it cancels what runs and counts it unfinished: a miss either way.
FULL = dict(modes=("disaggregated", "colocated-1x2t", "colocated-2x1t", "conditional"), mixes=tuple(MIXES),
            multiples=(1.0, 2.0, 3.5), window_s=15.0, min_requests=5, max_requests=24, max_drain_s=60.0,
            unloaded=3, max_output_len=None)
# Quick: the chat mix's prompts with outputs cut to 32 tokens, so that a smoke run on two shared cores
# stays under 2 minutes (most of it is the services' start).
QUICK = dict(modes=("disaggregated",), mixes=("chat",), multiples=(0.5, 1.5), window_s=4.0, min_requests=3,
             max_requests=4, max_drain_s=20.0, unloaded=1, max_output_len=32)
IDLE_TIMEOUT_S = 30.0  # between points: until the workers report nothing running or waiting
SHAPES = {s.name: s for s in (CHAT, LONG)}


class LoadGen:
    """Sends planned requests to one router, each on its own thread, and collects their Results."""

    def __init__(self, address: str, tag: str):
        from common import grpc_common
        from protos import handoff_pb2_grpc

        self.channel = grpc_common.channel(address, max_message_bytes=grpc_common.MAX_PUBLIC_MESSAGE_BYTES)
        self.stub = handoff_pb2_grpc.RouterStub(self.channel)
        self.tag, self._n = tag, 0
        self._calls: list = []
        self._lock = threading.Lock()

    def _one(self, r: Result, p: Planned, timeout_s: float) -> None:
        from protos import handoff_pb2

        req = handoff_pb2.GenerateRequest(prompt_token_ids=p.prompt_ids, max_tokens=p.output_len, ignore_eos=True,
                                          temperature=0.0, request_id=r.request_id)
        r.sent_s = time.perf_counter()
        call = self.stub.Generate(req, timeout=timeout_s)
        with self._lock:
            self._calls.append(call)
        try:
            for msg in call:
                if msg.token_ids:
                    r.arrivals.append((time.perf_counter(), len(msg.token_ids)))
            r.status = "ok" if sum(k for _, k in r.arrivals) == p.output_len else "short"
        except grpc.RpcError as exc:
            r.status = "unfinished" if exc.code() == grpc.StatusCode.CANCELLED else exc.code().name

    def run(self, planned: list[Planned], drain_s: float) -> tuple[list[Result], float]:
        """Sends each request at its planned time; returns the results and the point's wall time. What has
        not finished drain_s after the last arrival is cancelled (status "unfinished")."""
        t0 = time.perf_counter() + 0.05
        hard_end = t0 + planned[-1].at_s + drain_s
        results, threads = [], []
        for p in planned:
            self._n += 1
            r = Result(p.shape, len(p.prompt_ids), p.output_len, t0 + p.at_s, request_id=f"{self.tag}-{self._n}")
            results.append(r)
            time.sleep(max(0.0, r.sched_s - time.perf_counter()))
            t = threading.Thread(target=self._one, args=(r, p, hard_end - time.perf_counter() + 5.0), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(max(0.0, hard_end - time.perf_counter()))
        with self._lock:
            for call in self._calls:
                call.cancel()  # a no-op on finished calls
            self._calls = []
        for t in threads:
            t.join(5.0)
        return results, time.perf_counter() - t0

    def close(self) -> None:
        self.channel.close()


def wait_idle(cl: PinnedCluster) -> None:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while any(w.num_running or w.num_waiting for w in cl.state.list_workers()):
        if time.monotonic() > deadline:
            log(f"workers still busy after {IDLE_TIMEOUT_S} s; going on")
            return
        time.sleep(0.2)


@dataclass(frozen=True)
class Baseline:
    """The unloaded figures of each request shape and the SLOs made from them."""

    mode: str  # where they were measured
    slos: dict[str, SLO]
    e2e_s: dict[str, float]  # unloaded end-to-end: 1 / e2e is the rate of a closed loop of one client


def measure_unloaded(cl: PinnedCluster, gen: LoadGen, shapes: list[str], size: dict) -> Baseline:
    """One request at a time at each shape's nominal lengths (after a warm-up); the SLOs from the medians."""
    import random

    rng = random.Random(7)
    slos, e2e_s = {}, {}
    for name in shapes:
        s = SHAPES[name]
        runs = []
        reps = size["unloaded"]
        for i in range(reps + 1):
            output_len = min(s.output_len, size["max_output_len"] or s.output_len)
            p = Planned(name, [rng.randrange(*PROMPT_ID_RANGE) for _ in range(s.prompt_len)], output_len, 0.0)
            (r,), _ = gen.run([p], drain_s=120.0)
            if not r.ok:
                raise RuntimeError(f"unloaded {name} request ended {r.status}")
            if i:  # the first is the warm-up
                runs.append(r)
        ttft, tpot = statistics.median(r.ttft_s for r in runs), statistics.median(r.tpot_s for r in runs)
        e2e_s[name] = statistics.median(r.e2e_s for r in runs)
        slos[name] = SLO.from_unloaded(ttft, tpot)
        emit(f"unloaded_ttft_ms_{name}", ttft * 1e3, "ms, median of single requests", mode=cl.mode.name,
             prompt_len=s.prompt_len, output_len=output_len, samples=reps)
        emit(f"unloaded_tpot_ms_{name}", tpot * 1e3, "ms, median of single requests", mode=cl.mode.name,
             prompt_len=s.prompt_len, output_len=output_len, samples=reps)
        print(json.dumps({"name": f"slo_{name}", "ttft_ms": round(slos[name].ttft_s * 1e3, 1),
                          "tpot_ms": round(slos[name].tpot_s * 1e3, 2), "from_mode": cl.mode.name,
                          "rule": "TTFT <= 4x, TPOT <= 2x the unloaded median"}), flush=True)
    return Baseline(cl.mode.name, slos, e2e_s)


def sweep_rates(mix: str, base: Baseline, multiples) -> list[float]:
    """Multiples of 1 / (mean unloaded end-to-end time of the mix): the rate one client sending a request
    at a time would reach. Batching takes a system beyond it; how far is what the sweep finds. Tied to
    the measured speed, so the sweep fits whatever machine it runs on."""
    mean_e2e_s = sum(w * base.e2e_s[s.name] for s, w in MIXES[mix])
    return [float(f"{m / mean_e2e_s:.3g}") for m in multiples]


def placements(cl: PinnedCluster, results: list[Result]) -> dict[str, int]:
    """Where each request was prefilled, from its Redis record's prefill_placement ("remote" or "local";
    "unrecorded" where the router does not write it, as before the placement modes)."""
    out: dict[str, int] = {}
    for r in results:
        record = cl.state.get_request(r.request_id) or {}
        where = record.get("prefill_placement", "unrecorded")
        out[where] = out.get(where, 0) + 1
    return out


def drain_s(planned: list[Planned], slos: dict[str, SLO], max_drain_s: float) -> float:
    """How long after the last arrival a request of the point can still meet its SLOs: TTFT at its SLO,
    then every token at the TPOT SLO (+1 s for the bookkeeping); what runs after that has missed."""
    longest = max(slos[p.shape].ttft_s + (p.output_len - 1) * slos[p.shape].tpot_s for p in planned)
    return min(longest + 1.0, max_drain_s)


def run_point(cl: PinnedCluster, gen: LoadGen, mix: str, rate: float, size: dict, slos: dict[str, SLO],
              seed: int) -> dict:
    n = int(min(max(round(rate * size["window_s"]), size["min_requests"]), size["max_requests"]))
    planned = plan(mix, rate, n, seed, size["max_output_len"])
    cpu0, pre0, wall0 = cl.cpu_seconds(), cl.prefill_seconds(), time.perf_counter()
    results, _ = gen.run(planned, drain_s(planned, slos, size["max_drain_s"]))
    wall_s = time.perf_counter() - wall0
    cpu1, pre1 = cl.cpu_seconds(), cl.prefill_seconds()
    cl.check_alive()
    ok = [r for r in results if r.ok]
    where = dict(mode=cl.mode.name, mix=mix, rate_rps=rate)
    latency_ms = {}
    for metric, xs in (("ttft", [r.ttft_s for r in ok]), ("tpot", [r.tpot_s for r in ok]),
                       ("itl", [g for r in ok for g in r.itl_s()]), ("e2e", [r.e2e_s for r in ok])):
        p = latency_ms[metric] = {k: (round(v * 1e3, 2) if v is not None else None)
                                  for k, v in percentiles(xs).items()}
        print(json.dumps({"name": f"{metric}_ms", "value": p["p50"], "unit": "ms (p50; p90, p99 beside)", **p,
                          **where, "samples": len(xs)}), flush=True)
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    # What saturates: TTFT (over its shape's SLO, so that a blend compares like with like) of the last
    # third of arrivals against the first third grows when a queue builds; busy = CPU seconds per wall
    # second of each process (1.0 = one core all the time); prefill_concurrency = prefill seconds summed
    # over requests per wall second (prompts in prefill on average: above 1 they wait on each other).
    third = max(1, len(results) // 3)
    first = [r.ttft_s / slos[r.shape].ttft_s for r in results[:third] if r.ok]
    last = [r.ttft_s / slos[r.shape].ttft_s for r in results[-third:] if r.ok]
    point = dict(where, requests=n, statuses=statuses, attainment=attainment(results, slos),
                 placement=placements(cl, results),
                 misses_ttft=sum(r.ok and r.ttft_s > slos[r.shape].ttft_s for r in results),
                 misses_tpot=sum(r.ok and r.tpot_s > slos[r.shape].tpot_s for r in results),
                 ttft_growth=(statistics.median(last) / statistics.median(first)) if first and last else None,
                 busy={k: round((cpu1.get(k, 0.0) - v) / wall_s, 2) for k, v in cpu0.items()},
                 prefill_concurrency={k: round((pre1.get(k, 0.0) - v) / wall_s, 2) for k, v in pre0.items()},
                 output_tok_s=sum(r.output_len for r in ok) / wall_s,
                 client_lag_ms_max=max(r.sent_s - r.sched_s for r in results) * 1e3, wall_s=wall_s,
                 load_avg_1min=os.getloadavg()[0])
    emit("slo_attainment", point["attainment"], f"share of requests meeting both SLOs (goodput needs "
         f">= {SLO_ATTAINMENT})", **{k: v for k, v in point.items() if k != "attainment"})
    point["latency_ms"] = latency_ms
    point["results"] = results  # not printed: for the plots and the test
    point["tpot_p99_s"] = percentiles([r.tpot_s for r in ok])["p99"] if len(ok) >= 0.9 * n else None
    log(f"{cl.mode.name} {mix} {rate} req/s: {statuses}, attainment {point['attainment']:.2f}, busy {point['busy']}")
    return point


def same_as_disaggregated(mode, mix: str, args) -> bool:
    """Conditional on a mix whose shortest prompt is above the threshold, and too long for the queue rule
    (or with the rule off), is disaggregated by definition; the full run leaves it out (docs/benchmarks.md,
    "Figures behind the code": Conditional left out where it is disaggregated); asked for by name (--modes
    and --mixes), it runs. Chat always runs: the conditional target is measured there."""
    if mode.prefill_mode != "conditional" or mix == "chat" or (args.modes_asked and args.mixes_asked):
        return False
    shortest = min(round(s.prompt_len * (1 - s.spread)) for s, _ in MIXES[mix])
    if args.remote_prefill_max_queue_ratio and shortest <= RouterConfig.remote_prefill_queue_max_tokens:
        return False  # a queued prefill worker sends some of these prompts to the decode worker
    return shortest >= args.remote_prefill_min_tokens


def run_mode(mode, args, size: dict, base: Baseline | None, log_dir: Path, rates: dict) -> tuple[dict, Baseline]:
    """Starts the mode's processes, measures the unloaded figures if none yet, sweeps every mix."""
    points: dict[str, list[dict]] = {}
    t0 = time.perf_counter()
    with PinnedCluster(mode, log_dir, dtype=args.dtype, kv_memory_gib=args.kv_memory_gib,
                       remote_prefill_min_tokens=args.remote_prefill_min_tokens,
                       remote_prefill_max_queue_ratio=args.remote_prefill_max_queue_ratio) as cl:
        log(f"mode {mode.name}: services serving after {time.perf_counter() - t0:.0f} s")
        gen = LoadGen(cl.router_address, f"lg-{mode.name}-{os.getpid()}")
        try:
            if base is None:
                shapes = sorted({s.name for m in args.mixes for s, _ in MIXES[m]})
                base = measure_unloaded(cl, gen, shapes, size)
            else:  # a warm-up per worker, so no point pays for first calls
                gen.run(plan("chat", 10.0, len(mode.workers), seed=1, max_output_len=16), drain_s=60.0)
            for mix in args.mixes:
                if same_as_disaggregated(mode, mix, args):
                    emit_skipped(f"mode_{mode.name}_{mix}", f"every prompt of this mix has at least "
                                 f"{args.remote_prefill_min_tokens} tokens, so conditional prefills them all "
                                 "remotely: the disaggregated figures", "--remote-prefill-min-tokens above "
                                 "the mix's prompts, or --modes conditional --mixes " + mix, mode=mode.name, mix=mix)
                    continue
                rates.setdefault(mix, args.rates or sweep_rates(mix, base, size["multiples"]))
                points[mix] = []
                for i, rate in enumerate(rates[mix]):
                    wait_idle(cl)
                    points[mix].append(run_point(cl, gen, mix, rate, size, base.slos, seed=1000 * i + len(mix)))
        finally:
            gen.close()
    return points, base


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_switch(p, "--quick", "CI smoke: disaggregated, chat, 2 rates, 4 requests each")
    p.add_argument("--modes", nargs="+", choices=list(modes(0)), help="default: all (quick: disaggregated)")
    p.add_argument("--mixes", nargs="+", choices=list(MIXES), help="default: all (quick: chat)")
    p.add_argument("--rates", nargs="+", type=float, help="req/s for every mix; default: multiples of 1 / "
                   "the mix's unloaded end-to-end time (full 1 2 3.5, quick 0.5 1.5)")
    p.add_argument("--dtype", default=settings.default("dtype"), choices=settings.DTYPES)
    p.add_argument("--kv-memory-gib", type=float, default=settings.default("kv_memory_gib"), help="KV pool of each decode worker")
    p.add_argument("--remote-prefill-min-tokens", type=int, default=RouterConfig.remote_prefill_min_tokens,
                   help="conditional mode: prompts of at least this many tokens are prefilled remotely "
                   "(default: the router's)")
    p.add_argument("--remote-prefill-max-queue-ratio", type=float,
                   default=RouterConfig.remote_prefill_max_queue_ratio,
                   help="conditional mode: ... unless more than this many times their length is queued on the "
                   "prefill worker (default: the router's; 0 = length alone)")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots here (default: docs/ after a full run, "
                   "none after --quick or a partial one: --modes, --mixes or --rates)")
    p.add_argument("--logs", metavar="DIR", help="service logs (default: a temporary folder)")
    args = p.parse_args(argv)
    all_modes = modes(args.remote_prefill_min_tokens, args.remote_prefill_max_queue_ratio)
    size = QUICK if args.quick else FULL
    args.modes_asked, args.mixes_asked = bool(args.modes), bool(args.mixes)
    full_run = not (args.quick or args.modes or args.mixes or args.rates)
    args.modes = args.modes or list(size["modes"])
    args.mixes = args.mixes or list(size["mixes"])
    # The unloaded figures (and so the SLOs) come from the first mode: disaggregated, when it runs.
    args.modes.sort(key=lambda m: m != "disaggregated")
    # SIGTERM as Ctrl-C, so that a kill stops the services too (run_mode's `with`); put back after.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run(args, size, all_modes, full_run)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args, size: dict, all_modes: dict, full_run: bool) -> dict:
    t_start = time.perf_counter()
    machine_line(args, pinned=shutil.which("taskset") is not None)
    emit_load_avg("start")
    has_modes = router_prefill_modes()
    log_dir = Path(args.logs or tempfile.mkdtemp(prefix="loadgen-"))
    all_points: dict[str, dict[str, list[dict]]] = {}
    base, rates = None, {}
    for name in args.modes:
        mode = all_modes[name]
        if mode.prefill_mode != "disaggregated" and not has_modes:
            emit_skipped(f"mode_{name}", "this router has no --prefill-mode (colocated / conditional placement "
                         "not there yet)", "merge the branch that adds it, then rerun", mode=name)
            continue
        log(f"mode {name}: {mode.about}; logs in {log_dir}")
        try:
            all_points[name], base = run_mode(mode, args, size, base, log_dir, rates)
        except RuntimeError as exc:  # a service that would not start or died: the other modes still run
            emit_skipped(f"mode_{name}", f"failed: {str(exc).splitlines()[0]}", f"see the service logs in {log_dir}",
                         mode=name)
    good = report_goodput(all_points)
    report_ratios(all_points, good, args.mixes)
    emit_load_avg("end")
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    plots = args.plots or ("docs" if full_run else None)
    if plots and all_points:
        from bench.loadgen.plot import plot
        for path in plot(all_points, good, Path(plots)):
            log(f"wrote {path}")
    return {"points": all_points, "goodput": good, "slos": base.slos if base else {}}


if __name__ == "__main__":
    main()
