"""bench.loadgen: the workload and scoring rules on their own, then the quick mode against real processes."""
from __future__ import annotations

import json

import pytest

from bench.loadgen import __main__ as loadgen
from router.config import RouterConfig
from bench.loadgen.workload import (LONG, SLO, TPOT_SLO_FACTOR, TTFT_SLO_FACTOR, Result, attainment, goodput, meets,
                                   percentiles, plan)


def test_plan_is_open_loop_poisson_with_exact_lengths():
    planned = plan("blend", rate_rps=2.0, num_requests=2000, seed=3)
    assert planned == plan("blend", rate_rps=2.0, num_requests=2000, seed=3)  # same seed, same workload
    gaps = [b.at_s - a.at_s for a, b in zip(planned, planned[1:])]
    mean_gap = sum(gaps) / len(gaps)
    assert 0.45 < mean_gap < 0.55  # exponential gaps of mean 1 / rate
    # Poisson: the gaps' standard deviation equals their mean (a fixed-interval schedule would have 0).
    sd = (sum((g - mean_gap) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert 0.85 < sd / mean_gap < 1.15
    chat = [p for p in planned if p.shape == "chat"]
    long = [p for p in planned if p.shape == "long"]
    assert 0.45 < len(chat) / len(planned) < 0.55
    assert all(len(p.prompt_ids) == LONG.prompt_len and p.output_len == LONG.output_len for p in long)
    lens = [len(p.prompt_ids) for p in chat]
    assert 100 <= min(lens) < 110 and 290 < max(lens) <= 300  # 200 +- 50 %, uniform
    assert all(64 <= p.output_len <= 192 for p in chat)
    assert len({tuple(p.prompt_ids[:16]) for p in planned}) == len(planned)  # no shared prefix to cache


def _result(ttft_s: float, tpot_s: float, output_len: int = 11, status: str = "ok", shape: str = "chat") -> Result:
    r = Result(shape, 100, output_len, sched_s=0.0, sent_s=10.0, status=status)
    if status == "ok":
        r.arrivals = [(10.0 + ttft_s, 1), (10.0 + ttft_s + tpot_s * (output_len - 1), output_len - 1)]
    return r


def test_request_figures():
    r = _result(0.5, 0.1, output_len=11)
    assert r.ttft_s == pytest.approx(0.5) and r.e2e_s == pytest.approx(1.5) and r.tpot_s == pytest.approx(0.1)
    # one message of 10 tokens after a 1 s gap counts as 10 gaps of 0.1 s
    assert r.itl_s() == pytest.approx([0.1] * 10)


def test_slo_attainment_and_goodput():
    slos = {"chat": SLO.from_unloaded(ttft_s=0.25, tpot_s=0.05)}
    assert slos["chat"] == SLO(ttft_s=TTFT_SLO_FACTOR * 0.25, tpot_s=TPOT_SLO_FACTOR * 0.05)
    assert meets(_result(1.0, 0.1), slos)  # both at the limit
    assert not meets(_result(1.01, 0.05), slos) and not meets(_result(0.3, 0.11), slos)
    failed = [_result(0, 0, status="RESOURCE_EXHAUSTED"), _result(0, 0, status="unfinished")]
    assert attainment([_result(0.3, 0.05)] * 8 + failed, slos) == pytest.approx(0.8)  # failures are misses
    assert goodput({0.5: 1.0, 1.0: 0.9, 2.0: 0.5}) == (1.0, False)
    assert goodput({0.5: 0.95, 1.0: 0.5, 2.0: 0.95}) == (0.5, False)  # a noisy pass above a miss does not count
    assert goodput({0.5: 0.5}) == (0.0, False)
    assert goodput({0.5: 1.0, 1.0: 1.0}) == (1.0, True)  # only a lower bound
    p = percentiles([float(i) for i in range(101)])
    assert p == {"p50": 50.0, "p90": 90.0, "p99": 99.0}


def test_plots(tmp_path):
    from bench.loadgen.plot import plot

    lat = {m: {"p50": 10.0, "p90": 20.0, "p99": 30.0} for m in ("ttft", "tpot", "itl", "e2e")}
    points = {"disaggregated": {"chat": [dict(rate_rps=r, latency_ms=lat) for r in (0.5, 1.0)]}}
    paths = plot(points, {"disaggregated": {"chat": 0.5}}, tmp_path)
    assert [p.name for p in paths] == ["loadgen-latency.png", "loadgen-goodput.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


@pytest.mark.timeout(170)  # the quick mode's budget is 2 minutes on 2 shared cores
def test_quick_run_against_real_processes(tmp_path, capsys):
    out = loadgen.main(["--quick", "--logs", str(tmp_path)])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    by_name = {}
    for line in lines:
        by_name.setdefault(line["name"], []).append(line)
    pinned = by_name["machine"][0]["pinning"].startswith("taskset:")
    assert "load_avg_1min_at_start" in by_name and "load_avg_1min_at_end" in by_name

    # The SLOs are 4x / 2x the unloaded figures printed before them.
    ttft_ms, tpot_ms = by_name["unloaded_ttft_ms_chat"][0]["value"], by_name["unloaded_tpot_ms_chat"][0]["value"]
    slo = by_name["slo_chat"][0]
    assert slo["ttft_ms"] == pytest.approx(4 * ttft_ms, rel=1e-2)
    assert slo["tpot_ms"] == pytest.approx(2 * tpot_ms, rel=1e-2)
    slos = out["slos"]

    points = out["points"]["disaggregated"]["chat"]
    assert len(points) == 2 and points[0]["rate_rps"] < points[1]["rate_rps"]
    assert points[0]["statuses"].get("ok", 0) >= 1, points[0]["statuses"]  # at half the closed-loop rate
    for p in points:
        results = p["results"]
        # every request sent is accounted for: finished with all its tokens, failed with a status, or cancelled
        assert len(results) == p["requests"] == sum(p["statuses"].values()) >= 3
        for r in results:
            assert r.status == "ok" or r.status in ("short", "unfinished") or r.status.isupper()
            if r.ok:
                assert sum(k for _, k in r.arrivals) == r.output_len
                assert 0 < r.ttft_s <= r.e2e_s and r.tpot_s > 0
        assert sum(p["placement"].values()) == len(results)  # one Redis record per request
        assert set(p["placement"]) <= {"remote", "unrecorded"}  # disaggregated: never prefilled locally
        for metric in ("ttft", "tpot", "itl", "e2e"):
            q = p["latency_ms"][metric]
            assert q["p50"] <= q["p90"] <= q["p99"], (metric, q)
        # the printed attainment is the SLO definition applied to the requests
        assert p["attainment"] == pytest.approx(sum(meets(r, slos) for r in results) / len(results))
        if pinned:
            assert 0 < p["busy"]["decode-0"] <= 1.05  # pinned to one core
    # goodput from the attainments, as DistServe defines it
    good = by_name["goodput_rps"][0]
    assert good["value"] == goodput({p["rate_rps"]: p["attainment"] for p in points})[0]
    assert out["goodput"]["disaggregated"]["chat"] == good["value"]
    # ratios that need the other modes say they were skipped rather than print a number
    assert all("skipped" in line for line in by_name["goodput_conditional_vs_best_chat"])


def test_modes_pin_workers_and_set_the_routers_placement(tmp_path):
    from bench.loadgen.cluster import PinnedCluster, modes

    all_modes = modes(remote_prefill_min_tokens=300)
    assert list(all_modes) == ["disaggregated", "colocated-1x2t", "colocated-2x1t", "conditional"]

    def argvs(name: str) -> tuple[list[list[str]], list[str]]:
        cl = PinnedCluster(all_modes[name], tmp_path, remote_prefill_min_tokens=300)
        cl.taskset = "/usr/bin/taskset"  # as found on PATH
        return [cl.worker_argv(w, 1000 + i, 2000 + i) for i, w in enumerate(cl.mode.workers)], cl.router_argv(3000)

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    workers, router = argvs("disaggregated")
    assert [(w[:3], w[4:6], flag(w, "--threads")) for w in workers] == [
        (["/usr/bin/taskset", "-c", "0"], ["-m", "prefill_svc"], "1"),
        (["/usr/bin/taskset", "-c", "1"], ["-m", "decode_svc"], "1")]
    assert "--prefill-mode" not in router  # the default: runs on a router that predates the flag
    workers, router = argvs("colocated-1x2t")
    assert [(w[2], w[5], flag(w, "--threads")) for w in workers] == [("0-1", "decode_svc", "2")]
    assert flag(router, "--prefill-mode") == "colocated"
    workers, router = argvs("colocated-2x1t")
    assert [(w[2], w[5], flag(w, "--threads")) for w in workers] == [("0", "decode_svc", "1"), ("1", "decode_svc", "1")]
    assert flag(router, "--prefill-mode") == "colocated" and "--remote-prefill-min-tokens" not in router
    workers, router = argvs("conditional")
    assert [w[5] for w in workers] == ["prefill_svc", "decode_svc"]
    assert flag(router, "--prefill-mode") == "conditional" and flag(router, "--remote-prefill-min-tokens") == "300"
    assert float(flag(router, "--remote-prefill-max-queue-ratio")) == RouterConfig.remote_prefill_max_queue_ratio
    assert all(flag(a, "--host") == "127.0.0.1" for a in [*workers, router])  # loopback only


def test_conditional_is_left_out_of_the_full_run_where_it_is_disaggregated():
    from types import SimpleNamespace

    from bench.loadgen.cluster import modes

    all_modes = modes(remote_prefill_min_tokens=512)
    full = SimpleNamespace(modes_asked=False, mixes_asked=False, remote_prefill_min_tokens=512,
                           remote_prefill_max_queue_ratio=0)
    left_out = [(m, mix) for m in all_modes for mix in ("chat", "long", "blend")
                if loadgen.same_as_disaggregated(all_modes[m], mix, full)]
    assert left_out == [("conditional", "long")]  # 1,536-token prompts, all prefilled remotely
    # At the router's default threshold every prompt of every mix goes remote, yet chat still runs:
    # the conditional target is measured there.
    default = SimpleNamespace(modes_asked=False, mixes_asked=False, remote_prefill_min_tokens=64,
                              remote_prefill_max_queue_ratio=0)
    assert [mix for mix in ("chat", "long", "blend")
            if loadgen.same_as_disaggregated(all_modes["conditional"], mix, default)] == ["long", "blend"]
    low = SimpleNamespace(modes_asked=False, mixes_asked=False, remote_prefill_min_tokens=2048,
                          remote_prefill_max_queue_ratio=0)
    assert not loadgen.same_as_disaggregated(all_modes["conditional"], "long", low)
    asked = SimpleNamespace(modes_asked=True, mixes_asked=True, remote_prefill_min_tokens=512,
                            remote_prefill_max_queue_ratio=0)
    assert not loadgen.same_as_disaggregated(all_modes["conditional"], "long", asked)
    # With the queue rule on (the router's default), a queued prefill worker sends short prompts to the
    # decode worker, so the blend runs too; long documents are past the rule's limit and still go remote.
    queue = SimpleNamespace(modes_asked=False, mixes_asked=False, remote_prefill_min_tokens=64,
                            remote_prefill_max_queue_ratio=3.0)
    assert [mix for mix in ("chat", "long", "blend")
            if loadgen.same_as_disaggregated(all_modes["conditional"], mix, queue)] == ["long"]


def test_ratio_lines(capsys):
    from bench.loadgen.report import report_ratios

    def point(rate: float, tpot_p99_s: float | None) -> dict:
        return dict(rate_rps=rate, tpot_p99_s=tpot_p99_s)

    points = {"disaggregated": {"long": [point(0.1, 0.05), point(0.2, 0.06), point(0.4, None)],
                                "chat": [point(0.5, 0.04)]},
              "colocated-1x2t": {"long": [point(0.1, 0.2), point(0.2, 0.3), point(0.4, 0.9)],
                                 "chat": [point(0.5, 0.04)]},
              "colocated-2x1t": {"long": [point(0.1, 0.1), point(0.2, None), point(0.4, None)],
                                 "chat": [point(0.5, 0.04)]},
              "conditional": {"chat": [point(0.5, 0.04)]}}
    good = {"disaggregated": {"long": 0.2, "chat": 0.5}, "colocated-1x2t": {"long": 0.1, "chat": 0.0},
            "colocated-2x1t": {"long": 0.0, "chat": 0.0}, "conditional": {"chat": 0.5}}
    report_ratios(points, good, ["long", "chat"])
    lines = {d["name"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}
    tpot = lines["tpot_p99_disaggregated_vs_colocated-1x2t_long"]
    assert tpot["rate_rps"] == 0.2 and tpot["ratio"] == pytest.approx(0.2)  # the highest rate both finished
    assert tpot["met"] is True and tpot["per_rate"] == {"0.1": 0.25, "0.2": 0.2}
    assert lines["tpot_p99_disaggregated_vs_colocated-2x1t_long"]["rate_rps"] == 0.1
    g = lines["goodput_disaggregated_vs_colocated_long"]
    assert g["peer"] == "colocated-1x2t" and g["ratio"] == pytest.approx(2.0) and g["met"] is True
    c = lines["goodput_conditional_vs_best_chat"]
    assert c["peer"] == "disaggregated" and c["ratio"] == pytest.approx(1.0) and c["met"] is True
    assert "goodput_disaggregated_vs_colocated_blend" not in lines  # blend did not run

    good["colocated-1x2t"]["long"] = 0.0  # no colocated goodput: no ratio, and no division by zero
    report_ratios(points, good, ["long"])
    lines = {d["name"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}
    g = lines["goodput_disaggregated_vs_colocated_long"]
    assert g["ratio"] is None and g["met"] is False and "lowest swept rate" in g["why"]


def test_a_point_waits_until_no_request_can_still_meet_its_slo():
    slos = {"chat": SLO(ttft_s=2.0, tpot_s=0.1), "long": SLO(ttft_s=16.0, tpot_s=0.2)}
    planned = plan("blend", rate_rps=1.0, num_requests=20, seed=1)
    longest_chat = max(p.output_len for p in planned if p.shape == "chat")
    want = max(2.0 + (longest_chat - 1) * 0.1, 16.0 + 63 * 0.2) + 1.0
    assert loadgen.drain_s(planned, slos, max_drain_s=60.0) == pytest.approx(want)
    assert loadgen.drain_s(planned, slos, max_drain_s=10.0) == 10.0  # bounded
