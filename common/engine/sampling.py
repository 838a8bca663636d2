"""Per-request sampling settings and a batched, seed-deterministic sampler over last-position logits."""
from __future__ import annotations

import math
import numbers
import secrets
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from common.engine.grammar import Constraint, bitmask_bias

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids per request
MAX_SEED = 2**63 - 1
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PRESENCE_PENALTY = 2.0
MAX_ABS_FREQUENCY_PENALTY = 2.0
MAX_LOGPROBS = 20  # most likely alternatives a request may ask for per token (vLLM's default limit too)

# Below this a temperature-scaled distribution is argmax in all but name, and dividing by it risks overflow.
MIN_TEMPERATURE = 1e-5

# Top-p looks for the nucleus among the top 128, then 2048 tokens, and only sorts the whole vocabulary
# when neither holds it: a full sort of [32, 49152] costs ~45 ms on a 2-core CPU, topk(128) under 2 ms.
_TOP_P_CANDIDATES = (128, 2048)

_BLOCK = 256  # tokens per block in the two-level inverse-CDF draw

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. Build it, then call validate() before trusting it."""

    temperature: float = 1.0          # 0 = greedy (argmax); so is anything below MIN_TEMPERATURE
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # (0, 1]; smallest set of tokens whose cumulative prob reaches p
    min_p: float = 0.0                # [0, 1]; drop tokens with prob < min_p * max prob
    repetition_penalty: float = 1.0   # (0, 10]; HF/CTRL: over prompt + generated tokens, logit>0: /p, else *p
    presence_penalty: float = 0.0     # [-2, 2]; OpenAI: minus p once for every token generated so far
    frequency_penalty: float = 0.0    # [-2, 2]; OpenAI: minus p times the token's count in the output so far
    seed: int | None = None           # 0..2**63-1; None = the engine draws one (derive_seed)
    max_tokens: int = 256
    stop: tuple[str, ...] = ()        # at most MAX_STOP_STRINGS, each 1..MAX_STOP_LEN characters
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # None = off; k = each token's logprob and its k most likely alternatives
    constraint: Constraint | None = None  # structured output: the completion must match it (grammar.py)

    def __post_init__(self) -> None:
        # Callers hand over lists (JSON, protobuf repeated fields); store tuples so the params stay hashable.
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, Iterable) and not isinstance(value, (str, bytes, tuple)):
                object.__setattr__(self, name, tuple(value))

    @property
    def greedy(self) -> bool:
        return _f32(self.temperature) < MIN_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field and its allowed range."""
        t = _real("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {t}")
        k = _integer("top_k", self.top_k)
        if k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {k}")
        _in_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _in_range("min_p", self.min_p, 0.0, 1.0)
        _in_range("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, lo_open=True)
        _in_range("presence_penalty", self.presence_penalty,
                  -MAX_ABS_PRESENCE_PENALTY, MAX_ABS_PRESENCE_PENALTY)
        _in_range("frequency_penalty", self.frequency_penalty,
                  -MAX_ABS_FREQUENCY_PENALTY, MAX_ABS_FREQUENCY_PENALTY)
        if self.seed is not None:
            seed = _integer("seed", self.seed)
            if not 0 <= seed <= MAX_SEED:
                raise ValueError(f"seed must be in [0, 2**63-1], got {seed}")
        n = _integer("max_tokens", self.max_tokens)
        if n < 1:
            raise ValueError(f"max_tokens must be >= 1, got {n}")
        self._validate_stop()
        self._validate_stop_token_ids(vocab_size)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            k = _integer("logprobs", self.logprobs)
            if not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {k}")
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise ValueError(f"constraint must be a Constraint, got {type(self.constraint).__name__}")
            self.constraint.validate()
            if self.ignore_eos:
                # A constrained completion ends where its grammar does, with the end-of-sequence token.
                raise ValueError("ignore_eos cannot be combined with a structured output constraint (the "
                                 "completion ends with the end-of-sequence token where the constraint is met)")

    def _validate_stop(self) -> None:
        if not isinstance(self.stop, tuple):
            raise ValueError(f"stop must be a sequence of strings, got {type(self.stop).__name__}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str):
                raise ValueError(f"stop[{i}] must be a string, got {type(s).__name__}")
            if not 1 <= len(s) <= MAX_STOP_LEN:
                raise ValueError(f"stop[{i}] must be 1..{MAX_STOP_LEN} characters long, got {len(s)}")

    def _validate_stop_token_ids(self, vocab_size: int | None) -> None:
        if not isinstance(self.stop_token_ids, tuple):
            raise ValueError(f"stop_token_ids must be a sequence of integers, "
                             f"got {type(self.stop_token_ids).__name__}")
        hi = "vocab_size" if vocab_size is None else str(vocab_size)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(self.stop_token_ids)}")
        for i, tok in enumerate(self.stop_token_ids):
            tok = _integer(f"stop_token_ids[{i}]", tok)
            if tok < 0 or (vocab_size is not None and tok >= vocab_size):
                raise ValueError(f"stop_token_ids[{i}] must be in [0, {hi}), got {tok}")


def _f32(x: float) -> float:
    """x rounded to float32, as the sampler's tensors and the proto's float fields hold it. Every decision
    on a float param goes through this, so that 0.7 and a proto round trip of 0.7 sample the same tokens."""
    return array("f", (x,))[0]


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _in_range(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    v = _real(name, value)
    if v < lo or v > hi or (lo_open and v == lo):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}")


def derive_seed(request_seed: int | None) -> int:
    """The seed a request runs with: its own, or a fresh random 63-bit one (record it: a failover needs it)."""
    return secrets.randbits(63) if request_seed is None else request_seed


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN64) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, step): 53 bits of splitmix64(seed ^ step * golden)."""
    return (_splitmix64((seed ^ (step * _GOLDEN64)) & _MASK64) >> 11) * 2.0**-53


class Sampler:
    """Picks one token per row of a batch whose rows may all have different SamplingParams.

    A seeded row's token depends only on (its logits row, params, seed, step): the only randomness is one
    uniform per row computed from (seed, step) in plain Python (seeded_uniform), turned into a token by
    inverse-CDF over the row's masked distribution, and every tensor op works row by row. So neither the
    other rows of the batch nor any global RNG state can change it, and a sequence resumed on another
    worker continues identically (given bit-identical logits). Inverse-CDF needs one uniform per row,
    where Gumbel-max would draw and take two logs of B x V noise: about 12 ms per [32, 49152] step here.
    """

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None):
        # Greedy's pick: [B, V] fp32 → [B] int64, the first of each row's largest (native.DecodeKernels.argmax
        # where the decode kernels are, 5-10x torch's max(dim) on a [1, 49152] row).
        self._argmax = argmax or _argmax

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                 steps: Sequence[int], prompt_ids: Sequence[Sequence[int]],
                 output_ids: Sequence[Sequence[int]], mask_rows: Sequence[int] = (),
                 bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, V] (last position) -> token ids [B] int64, on logits.device.

        With a bitmask ([len(mask_rows), ceil(V / 32)] int32, a structured output's allowed tokens), row
        mask_rows[i] may pick only the tokens whose bit is set in bitmask[i]: the others' logits are -inf,
        after the penalties and before temperature, top-k, top-p and min-p. The other rows are untouched."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        bsz, vocab_size = logits.shape
        for name, seq in (("params", params), ("seeds", seeds), ("steps", steps),
                          ("prompt_ids", prompt_ids), ("output_ids", output_ids)):
            if len(seq) != bsz:
                raise ValueError(f"{name} has {len(seq)} rows, logits has {bsz}")
        logits = logits.float()  # [B, V]
        if bsz == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        logits = apply_penalties(logits, params, prompt_ids, output_ids)
        if mask_rows:
            logits = apply_bitmask(logits, mask_rows, bitmask)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return self._argmax(logits.contiguous())
        if len(rows) == bsz:
            return self._sample(logits, [params[i] for i in rows], [seeds[i] for i in rows],
                                [steps[i] for i in rows])
        idx = torch.tensor(rows, device=logits.device)
        tokens = self._argmax(logits.contiguous())  # [B]: right for the greedy rows, the rest overwritten
        tokens[idx] = self._sample(logits.index_select(0, idx), [params[i] for i in rows],
                                   [seeds[i] for i in rows], [steps[i] for i in rows])
        return tokens

    @staticmethod
    def _sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                steps: Sequence[int]) -> torch.Tensor:
        """One inverse-CDF draw per row from the truncated distribution. logits [R, V], no row greedy."""
        weights = _truncated_weights(logits, params)  # [R, V]
        u = torch.tensor([seeded_uniform(s, n) for s, n in zip(seeds, steps)],
                         dtype=torch.float64, device=logits.device)
        return _draw(weights, u)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    # max(dim).indices: the same first-of-ties index as argmax, about 3x faster on CPU (torch 2.x).
    return logits.max(dim=-1).indices


def allowed_tokens(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Which tokens a sampled (non-greedy) row may pick: [B, V] bool, for already-penalised logits [B, V]."""
    return _truncated_weights(logits.float(), params) > 0


def _truncated_weights(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """exp(logits / T - max), 0 where top-k, then top-p, then min-p drop the token: [R, V], a new tensor.

    Unnormalised probabilities, 1 at the top token, so min-p is a plain `w < min_p` and the draw needs
    no softmax division. Every filter is a per-row threshold, not a mask over sorted positions, so tokens
    tied with the last survivor survive too, whatever order a sort put them in; a row with a filter off
    gets threshold 0, so it comes out the same whether or not another row in the batch made the filter run.
    """
    rsz, vocab_size = logits.shape
    device = logits.device
    w = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]  # [R, V]
    w -= w.amax(dim=-1, keepdim=True)
    w.exp_()
    ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
    if any(ks):
        top = w.topk(max(ks), dim=-1).values  # [R, max k], descending
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device)[:, None])
        k_on = torch.tensor([k > 0 for k in ks], device=device)[:, None]
        w.masked_fill_(w < torch.where(k_on, kth, 0.0), 0.0)
    ps = [_f32(p.top_p) for p in params]
    threshold = _top_p_threshold(w, ps) if any(p < 1.0 for p in ps) else None  # [R, 1]
    min_ps = [p.min_p for p in params]
    if any(m > 0.0 for m in min_ps):
        # prob < min_p * max prob, and the top token (weight 1) survives top-k and top-p.
        min_p = torch.tensor(min_ps, device=device)[:, None]
        threshold = min_p if threshold is None else torch.maximum(threshold, min_p)
    if threshold is not None:
        w.masked_fill_(w < threshold, 0.0)
    return w


def _top_p_threshold(w: torch.Tensor, ps: Sequence[float]) -> torch.Tensor:
    """Per-row weight of the token whose cumulative prob (sorted) first reaches p; 0 where p = 1. [R, 1]

    The nucleus is searched among the top C tokens for growing C. Probabilities are normalised by the
    whole row's total and a running sum over the first C tokens does not depend on C, so every C that
    holds the crossing token gives the same threshold: which stage settles a row never changes its result.
    """
    rsz, vocab_size = w.shape
    device = w.device
    threshold = torch.zeros(rsz, 1, device=device)
    p_rows = [i for i, q in enumerate(ps) if q < 1.0]
    idx = torch.tensor(p_rows, device=device)
    sub = w if len(p_rows) == rsz else w.index_select(0, idx)  # [r, V]
    mass = torch.tensor([ps[i] for i in p_rows], device=device)[:, None] * sub.sum(dim=-1, keepdim=True)
    sub_threshold = torch.zeros_like(mass)  # [r, 1]
    todo = torch.arange(len(p_rows), device=device)  # rows of sub still without a threshold
    for num_cand in (*[c for c in _TOP_P_CANDIDATES if c < vocab_size], vocab_size):
        cand = (sub if len(todo) == len(p_rows) else sub.index_select(0, todo)).topk(num_cand, dim=-1).values
        num_below = (cand.cumsum(dim=-1) < mass[todo]).sum(dim=-1, keepdim=True)  # tokens before the crossing
        sub_threshold[todo] = cand.gather(1, num_below.clamp(max=num_cand - 1))
        # Settled: the crossing token is a candidate, or the candidates already hold every nonzero token.
        done = (num_below < num_cand) | (cand[:, -1:] == 0) | (num_cand == vocab_size)
        todo = todo[~done.squeeze(1)]
        if len(todo) == 0:
            break
    threshold[idx] = sub_threshold
    return threshold


def _draw(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row, the token where the running sum of w first exceeds u * sum(w). [R, V], [R] -> [R]

    Two levels, blocks of _BLOCK tokens then tokens within the chosen block, so that only a [R, V / _BLOCK]
    and a [R, _BLOCK] running sum are taken in float64 (float32 sums over the whole row would round the
    smallest tokens' widths to nothing; a float64 one over [R, V] costs several ms).
    """
    rsz, vocab_size = w.shape
    num_blocks = -(-vocab_size // _BLOCK)
    if num_blocks * _BLOCK != vocab_size:
        w = torch.nn.functional.pad(w, (0, num_blocks * _BLOCK - vocab_size))
    blocks = w.view(rsz, num_blocks, _BLOCK)
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1, dtype=torch.float64)  # [R, num_blocks]
    total = block_cdf[:, -1:]
    # u * total may round up to total; staying below it keeps the pick on a block with nonzero weight.
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    # The clamps only matter for a NaN row (a broken model): a wrong token then, never an IndexError.
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=num_blocks - 1)  # [R, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    chosen = blocks[torch.arange(rsz, device=w.device), block.squeeze(1)]  # [R, _BLOCK]
    inner_cdf = chosen.cumsum(dim=-1, dtype=torch.float64)
    inner_total = inner_cdf[:, -1:]  # equals the block's float32 sum up to rounding: clamp as above
    inner = torch.minimum(target - before, torch.nextafter(inner_total, torch.zeros_like(inner_total)))
    token = block * _BLOCK + torch.searchsorted(inner_cdf, inner, right=True)
    return token.squeeze(1).clamp_(max=vocab_size - 1)


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability under the model, and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def token_logprobs(log_probs: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """Per row of log_probs [R, V] (a log-softmax): the logprob of token_ids[r] and the ks[r] most likely.

    One host transfer for the whole batch; called only for rows whose request asked for logprobs.
    """
    rows = torch.arange(len(token_ids), device=log_probs.device)
    chosen = log_probs[rows, torch.tensor(token_ids, device=log_probs.device)].tolist()
    k_max = max(ks, default=0)
    top_ids, top_values = [[]] * len(ks), [[]] * len(ks)
    if k_max:
        top = log_probs.topk(k_max, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [TokenLogprobs(tok, lp, tuple(zip(ids[:k], values[:k])))
            for tok, lp, ids, values, k in zip(token_ids, chosen, top_ids, top_values, ks)]


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of logits [B, V] with -inf where bitmask [len(rows), W] clears the token of row rows[i]: the bias
    (0 or -inf) is added, so an allowed logit keeps its value and the other rows keep their bits."""
    rsz, vocab_size = logits.shape
    bias = bitmask_bias(bitmask.to(logits.device), vocab_size)  # [R, <= V]
    if bias.shape[1] < vocab_size:  # the model's vocabulary is padded past the tokenizer's: never allowed
        bias = torch.nn.functional.pad(bias, (0, vocab_size - bias.shape[1]), value=-math.inf)
    if list(rows) == list(range(rsz)):
        return logits + bias
    return logits.index_add(0, torch.tensor(list(rows), device=logits.device), bias)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Repetition (HF/CTRL) then presence/frequency (OpenAI) penalties; returns logits itself if none apply.

    Only the logits of tokens that occur are touched: work grows with the id lists, not with B x V.
    """
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    freq_rows = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not rep_rows and not freq_rows:
        return logits
    vocab_size = logits.shape[1]
    device = logits.device
    logits = logits.clone()  # the caller's tensor stays untouched
    flat = logits.view(-1)  # [B * V]
    if rep_rows:
        pos = _flat_positions(rep_rows, [chain(prompt_ids[i], output_ids[i]) for i in rep_rows],
                              vocab_size, device)
        pen = torch.tensor([p.repetition_penalty for p in params], device=device)[pos // vocab_size]
        x = flat[pos]
        flat[pos] = torch.where(x > 0, x / pen, x * pen)  # a repeated id writes the same value again
    if freq_rows:
        pos = _flat_positions(freq_rows, [output_ids[i] for i in freq_rows], vocab_size, device)
        pos, count = torch.unique(pos, return_counts=True)
        row = pos // vocab_size
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[row]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[row]
        flat[pos] -= freq * count + presence
    return logits


def _flat_positions(rows: Sequence[int], id_lists: Sequence[Iterable[int]], vocab_size: int,
                    device: torch.device) -> torch.Tensor:
    """row * V + id for every id in id_lists[j], row = rows[j]: indices into a flattened [B, V]. int64 [N]"""
    ids, lens = array("q"), []
    for id_list in id_lists:  # array.extend takes any iterable of ints at C speed, unlike torch.tensor
        before = len(ids)
        ids.extend(id_list)
        lens.append(len(ids) - before)
    if not ids:
        return torch.empty(0, dtype=torch.int64, device=device)
    ids_cpu = torch.frombuffer(ids, dtype=torch.int64)
    lo, hi = torch.aminmax(ids_cpu)
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got one in [{int(lo)}, {int(hi)}]")
    offsets = torch.repeat_interleave(torch.tensor(rows) * vocab_size, torch.tensor(lens))
    return (ids_cpu + offsets).to(device)
