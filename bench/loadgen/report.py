"""loadgen's summary lines: goodput per mode and mix, what saturated, the issue's ratios, the machine."""
from __future__ import annotations

import json
import os

from bench.harness import emit, emit_machine, emit_skipped
from bench.loadgen.workload import SLO_ATTAINMENT, goodput


def report_goodput(all_points: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, float]]:
    """Goodput per mode and mix, and for a mode that misses the SLOs somewhere: what saturated there."""
    out: dict[str, dict[str, float]] = {}
    for mode, by_mix in all_points.items():
        for mix, points in by_mix.items():
            g, every = goodput({p["rate_rps"]: p["attainment"] for p in points})
            out.setdefault(mode, {})[mix] = g
            emit("goodput_rps", g, f"req/s: the highest swept rate at which it and every lower rate had >= "
                 f"{SLO_ATTAINMENT:.0%} of requests within both SLOs", mode=mode, mix=mix,
                 lower_bound=every, rates=[p["rate_rps"] for p in points])
            failed = next((p for p in points if p["attainment"] < SLO_ATTAINMENT), None)
            if failed is not None:
                busiest = max(failed["busy"], key=failed["busy"].get)
                shown = ("statuses", "misses_ttft", "misses_tpot", "ttft_growth", "busy", "prefill_concurrency",
                         "placement", "load_avg_1min")
                emit("saturation", failed["rate_rps"], "req/s: the first swept rate that missed the SLOs, and "
                     "what the processes did there", mode=mode, mix=mix, busiest=busiest,
                     **{k: failed[k] for k in shown})
    return out


def _best(good: dict[str, dict[str, float]], mix: str, names: list[str]) -> tuple[str | None, float]:
    present = [(good[m][mix], m) for m in names if mix in good.get(m, {})]
    if not present:
        return None, 0.0
    g, m = max(present)
    return m, g


def _goodput_ratio(name: str, value: float, unit: str, peer: str, peer_value: float, target: str,
                   met) -> None:
    """A goodput ratio with its target; a peer goodput of 0 (it missed the SLOs at the lowest swept rate)
    has no ratio, and says so instead of dividing by it."""
    if peer_value:
        emit(name, value, unit, peer=peer, peer_value=peer_value, target=target, met=met(value / peer_value))
        return
    print(json.dumps({"name": name, "value": value, "unit": unit, "peer": peer, "peer_value": 0.0, "ratio": None,
                      "target": target, "met": False, "why": f"{peer} missed the SLOs at the lowest swept rate; "
                      "a lower --rates would give it a goodput"}), flush=True)


def report_ratios(all_points: dict, good: dict[str, dict[str, float]], mixes: list[str]) -> None:
    """The issue's targets. A ratio whose modes did not run is printed as skipped, with why."""
    colocated = [m for m in ("colocated-1x2t", "colocated-2x1t") if m in good]
    for mix in ("long", "blend"):
        if mix not in mixes:
            continue
        if "disaggregated" not in good or mix not in good["disaggregated"] or not colocated:
            emit_skipped(f"tpot_p99_disaggregated_vs_colocated_{mix}", "needs the disaggregated and a colocated "
                         "mode on this mix", "python -m bench.loadgen (all modes; colocated needs the router's "
                         "--prefill-mode)")
            emit_skipped(f"goodput_disaggregated_vs_colocated_{mix}", "needs disaggregated and colocated modes",
                         "python -m bench.loadgen")
            continue
        dis = {p["rate_rps"]: p for p in all_points["disaggregated"][mix]}
        for co in colocated:
            if mix not in all_points[co]:
                continue
            both = [(r, dis[r]["tpot_p99_s"], p["tpot_p99_s"]) for r, p in
                    ((p["rate_rps"], p) for p in all_points[co][mix]) if r in dis]
            both = [(r, a, b) for r, a, b in both if a is not None and b is not None]
            if not both:
                emit_skipped(f"tpot_p99_disaggregated_vs_{co}_{mix}", "no common rate at which both finished "
                             ">= 90 % of requests", "a lower --rates")
                continue
            r, a, b = both[-1]  # the highest common rate at which both modes finished their requests
            emit(f"tpot_p99_disaggregated_vs_{co}_{mix}", a * 1e3, f"ms, disaggregated TPOT p99 at {r} req/s "
                 f"(ratio = disaggregated / {co})", peer=co, peer_value=b * 1e3, target="ratio <= 0.333",
                 met=a / b <= 1 / 3, rate_rps=r, per_rate={str(x): round(y / z, 3) for x, y, z in both})
        co, g_co = _best(good, mix, colocated)
        g_dis = good["disaggregated"][mix]
        _goodput_ratio(f"goodput_disaggregated_vs_colocated_{mix}", g_dis, f"req/s (ratio = disaggregated / "
                       f"{co}, the better colocated variant)", co, g_co, "ratio >= 1.5", lambda x: x >= 1.5)
    others = [m for m in ("disaggregated", "colocated-1x2t", "colocated-2x1t") if "chat" in good.get(m, {})]
    if "chat" not in mixes:
        return
    if "chat" not in good.get("conditional", {}) or not others:
        emit_skipped("goodput_conditional_vs_best_chat", "needs the conditional mode and another on chat",
                     "python -m bench.loadgen (conditional needs the router's --prefill-mode)")
        return
    m, g = _best(good, "chat", others)
    _goodput_ratio("goodput_conditional_vs_best_chat", good["conditional"]["chat"], f"req/s (ratio = "
                   f"conditional / {m}, the best of the others)", m, g, "ratio >= 0.95", lambda x: x >= 0.95)


def machine_line(args, pinned: bool) -> None:
    from common.engine.hardware import auto_dtype

    emit_machine(cores=os.cpu_count(), dtype=args.dtype, dtype_auto=auto_dtype()[1],
                 pinning="taskset: each worker on its own core(s)" if pinned else
                 "taskset not found: workers run unpinned, pools share every core",
                 router_and_client="unpinned: they share cores 0-1 with the workers")
