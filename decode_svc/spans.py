"""A request's spans on a decode worker (`claim`, `decode`), and the batch sizes the decode spans report.

Both are per request or per engine step, never per token; with tracing off (common/tracing.py) every span
is the no-op one and no batch size is kept.
"""
from __future__ import annotations

import array

from common import tracing
from common.engine.output import FinishReason
from protos import internal_pb2


class BatchSizes:
    """The decode batch's size at each of the engine's last `capacity` steps, for the decode spans' largest
    batch. Kept only while tracing is on: one store per engine step, read once per request."""

    def __init__(self, engine, capacity: int = 4096):
        self.engine = engine
        self.capacity = capacity
        self.sizes = array.array("I", bytes(4 * capacity))  # [step % capacity] -> sequences running

    def record(self) -> None:
        """A step listener (the engine thread, after each step that did work)."""
        self.sizes[self.engine.num_steps % self.capacity] = len(self.engine.running)

    def largest(self, after_step: int) -> int:
        """The largest batch of the steps after step `after_step` (engine.num_steps then), within the last
        `capacity` steps; 0 when none ran since."""
        last = self.engine.num_steps
        first = max(after_step + 1, last - self.capacity + 1)
        return max((self.sizes[s % self.capacity] for s in range(first, last + 1)), default=0)


class DecodeSpans:
    """One request's spans on a decode worker, children of the router's attempt (`parent`): `claim`, the wait
    for its pushed K/V (none when it prefills here), then `decode`, from its submission to the engine to its
    end, with its token count and the batch it ran in."""

    def __init__(self, worker, request: internal_pb2.DecodeRequest, parent):
        self.w = worker
        self.parent = parent
        self.attributes = {"handoff.request_id": request.request_id, "handoff.attempt": request.attempt,
                           "handoff.worker_id": worker.config.worker_id}
        self.claim = (tracing.INVALID_SPAN if request.prefill_here
                      else tracing.start("claim", parent, attributes=self.attributes))
        self.decode = tracing.INVALID_SPAN
        self._first_step = 0

    def refused(self, why: Exception | str) -> None:
        """Ended before its decode began (refused at its start, its K/V never came, its call ended): the claim
        span says why, or a decode span when it was to prefill here."""
        span, self.claim = self.claim, tracing.INVALID_SPAN
        if span is tracing.INVALID_SPAN:
            span = tracing.start("decode", self.parent, attributes=self.attributes)
        tracing.fail(span, why)
        span.end()

    def claimed(self) -> None:
        """Its K/V is parked here and it goes to the engine (or it prefills here: there was no claim)."""
        self.claim.end()
        self.claim = tracing.INVALID_SPAN

    def decoding(self, job) -> None:
        """Submitted to the engine (job: decode_svc.worker.DecodeJob): the decode span starts."""
        if not tracing.enabled():
            return
        engine = self.w.engine
        self._first_step = engine.num_steps
        self.decode = tracing.start("decode", self.parent, attributes={
            **self.attributes, "handoff.prefill_here": job.prefill_here, "handoff.prompt_tokens": len(job.prompt),
            "handoff.resumed_tokens": len(job.output), "handoff.batch_at_start": len(engine.running)})

    def ended(self, num_tokens: int, finish: FinishReason | None, error: str | None = None) -> None:
        """The decode is over: num_tokens sent, why it ended, and what failed if it did. Once; later calls
        are no-ops."""
        span, self.decode = self.decode, tracing.INVALID_SPAN
        if not span.is_recording():
            return
        sizes = self.w.batch_sizes
        span.set_attributes({"handoff.completion_tokens": num_tokens,
                             "handoff.batch_max": sizes.largest(self._first_step) if sizes is not None else 0,
                             "handoff.finish_reason": finish.value if finish is not None else "error"})
        if error is not None:
            tracing.fail(span, error)
        span.end()
