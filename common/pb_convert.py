"""Conversions between domain types and their protobuf messages (from_pb / to_pb), in one place."""
from __future__ import annotations

from common.engine.grammar import Constraint
from common.engine.output import FinishReason
from common.engine.sampling import SamplingParams, TokenLogprobs
from protos import handoff_pb2, internal_pb2

FINISH_TO_PB = {
    FinishReason.STOP: handoff_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: handoff_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: handoff_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: handoff_pb2.FINISH_REASON_ERROR,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}


def sampling_to_pb(params: SamplingParams, seed: int) -> internal_pb2.SamplingParams:
    pb = internal_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, seed=seed, max_tokens=params.max_tokens,
        stop=list(params.stop), stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos)
    if params.logprobs is not None:
        pb.logprobs = params.logprobs
    if params.constraint is not None:
        pb.structured_output.CopyFrom(constraint_to_pb(params.constraint))
    return pb


def constraint_to_pb(c: Constraint) -> handoff_pb2.StructuredOutput:
    if c.kind == "json_object":
        return handoff_pb2.StructuredOutput(json_object=True)
    if c.kind == "choice":
        return handoff_pb2.StructuredOutput(choice=handoff_pb2.Choices(choices=c.choices))
    return handoff_pb2.StructuredOutput(**{c.kind: c.value})


def constraint_from_pb(pb: handoff_pb2.StructuredOutput) -> Constraint | None:
    """None when no kind is set; ValueError for json_object false (it would mean nothing)."""
    kind = pb.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        if not pb.json_object:
            raise ValueError("structured_output.json_object must be true when set")
        return Constraint("json_object")
    if kind == "choice":
        return Constraint("choice", choices=tuple(pb.choice.choices))
    return Constraint(kind, getattr(pb, kind))


def sampling_from_pb(pb: internal_pb2.SamplingParams, vocab_size: int) -> tuple[SamplingParams, int]:
    """Internal callers are trusted less than they seem: validate, so a bad peer gets INVALID_ARGUMENT."""
    params = SamplingParams(
        temperature=pb.temperature, top_k=pb.top_k, top_p=pb.top_p, min_p=pb.min_p,
        repetition_penalty=pb.repetition_penalty, presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty, seed=pb.seed, max_tokens=pb.max_tokens,
        stop=tuple(pb.stop), stop_token_ids=tuple(pb.stop_token_ids), ignore_eos=pb.ignore_eos,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        constraint=constraint_from_pb(pb.structured_output) if pb.HasField("structured_output") else None)
    params.validate(vocab_size)
    return params, pb.seed


def logprobs_to_pb(lp: TokenLogprobs) -> handoff_pb2.TokenLogprob:
    return handoff_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_logprobs=[
        handoff_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def check_request_id(request_id: str) -> str:
    """Every KV push and lease is keyed by the request id: an empty one could never be served."""
    if not request_id:
        raise ValueError("request_id must not be empty")
    return request_id


def check_token_ids(ids, vocab_size: int, max_len: int, name: str = "prompt_ids") -> list[int]:
    ids = list(ids)
    if not ids:
        raise ValueError(f"{name} must not be empty")
    if len(ids) > max_len:
        raise ValueError(f"{name} has {len(ids)} tokens; at most {max_len} fit the model's context")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    return ids
