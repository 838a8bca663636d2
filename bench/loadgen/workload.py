"""What loadgen sends and how it scores it: request shapes and mixes, Poisson arrivals, one request's
timings, percentiles, SLO attainment and goodput."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from bench.harness import percentile

# Prompt token ids are drawn at random from this range: ordinary word pieces of SmolLM2's 49,152-token
# vocabulary (the special tokens sit below 100). Random ids, not a repeated sentence, so that no two
# prompts share a 256-token chunk and the prefix cache never turns a prefill into a lookup; the compute
# of a forward pass does not depend on which ids it reads.
PROMPT_ID_RANGE = (1000, 40000)
SLO_ATTAINMENT = 0.90  # DistServe: goodput is the highest rate at which >= 90 % of requests meet both SLOs
TTFT_SLO_FACTOR = 4.0  # SLOs: TTFT <= 4x and TPOT <= 2x the unloaded (single-request) figure of the shape
TPOT_SLO_FACTOR = 2.0


@dataclass(frozen=True)
class Shape:
    """One kind of request; prompt and output lengths drawn uniformly within +-spread of the nominal ones."""

    name: str
    prompt_len: int
    output_len: int
    spread: float = 0.0

    def sample(self, rng: random.Random) -> tuple[int, int]:
        def draw(n: int) -> int:
            return max(2, round(rng.uniform(n * (1 - self.spread), n * (1 + self.spread))))
        return draw(self.prompt_len), draw(self.output_len)


CHAT = Shape("chat", 200, 128, 0.5)
LONG = Shape("long", 1536, 64)
MIXES: dict[str, tuple[tuple[Shape, float], ...]] = {
    "chat": ((CHAT, 1.0),),
    "long": ((LONG, 1.0),),
    "blend": ((CHAT, 0.5), (LONG, 0.5)),
}


@dataclass(frozen=True)
class Planned:
    """One request of a rate point, fixed before the point starts (same seed = same workload)."""

    shape: str
    prompt_ids: list[int]
    output_len: int
    at_s: float  # its arrival, seconds after the point's start


def plan(mix: str, rate_rps: float, num_requests: int, seed: int, max_output_len: int | None = None) -> list[Planned]:
    """Open-loop Poisson arrivals: exponential gaps of mean 1/rate, whatever the system does.
    max_output_len caps the outputs (the quick smoke run's shortcut)."""
    rng = random.Random(seed)
    shapes, weights = zip(*MIXES[mix])
    out, t = [], 0.0
    for _ in range(num_requests):
        shape = rng.choices(shapes, weights)[0]
        prompt_len, output_len = shape.sample(rng)
        output_len = min(output_len, max_output_len or output_len)
        out.append(Planned(shape.name, [rng.randrange(*PROMPT_ID_RANGE) for _ in range(prompt_len)], output_len, t))
        t += rng.expovariate(rate_rps)
    return out


@dataclass
class Result:
    """What one request looked like from the client."""

    shape: str
    prompt_len: int
    output_len: int
    sched_s: float  # planned send time (perf_counter)
    sent_s: float = 0.0  # actual send time; sent_s - sched_s is the load generator's own lag
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens in that message)
    status: str = "unfinished"  # "ok", a gRPC status name, "short" (fewer tokens than asked) or "unfinished"
    request_id: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0][0] - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.arrivals[-1][0] - self.sent_s

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / max(self.output_len - 1, 1)

    def itl_s(self) -> list[float]:
        """Gaps between token messages; a message of k tokens after a gap g counts as k gaps of g / k."""
        gaps = []
        for (t_prev, _), (t, k) in zip(self.arrivals, self.arrivals[1:]):
            gaps.extend([(t - t_prev) / k] * k)
        return gaps


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    @classmethod
    def from_unloaded(cls, ttft_s: float, tpot_s: float) -> "SLO":
        return cls(TTFT_SLO_FACTOR * ttft_s, TPOT_SLO_FACTOR * tpot_s)


def meets(r: Result, slos: dict[str, SLO]) -> bool:
    """Finished with every token, TTFT and TPOT within its shape's SLOs; a failure or a request still
    running at the point's deadline counts as a miss."""
    slo = slos[r.shape]
    return r.ok and r.ttft_s <= slo.ttft_s and r.tpot_s <= slo.tpot_s


def attainment(results: list[Result], slos: dict[str, SLO]) -> float:
    return sum(meets(r, slos) for r in results) / len(results) if results else 0.0


def goodput(attained: dict[float, float]) -> tuple[float, bool]:
    """Highest swept rate such that it and every lower swept rate reach SLO_ATTAINMENT (a noisy pass
    above a failed rate does not count); 0.0 if the lowest fails. Also whether every rate passed,
    in which case the goodput is only a lower bound."""
    best = 0.0
    for rate in sorted(attained):
        if attained[rate] < SLO_ATTAINMENT:
            return best, False
        best = rate
    return best, True


def percentiles(xs: list[float], qs=(50, 90, 99)) -> dict[str, float | None]:
    return {f"p{q}": (percentile(xs, q) if xs else None) for q in qs}
