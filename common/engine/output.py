"""Turning one sequence's sampled tokens into streamed text, and deciding when it ends."""
from __future__ import annotations

import enum

from common.engine.sampling import SamplingParams
from common.engine.stopping import StopStringMatcher
from common.engine.tokenizer import StreamDecoder, Tokenizer


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    CANCELLED = "cancelled"
    ERROR = "error"


class OutputProcessor:
    """Per sequence: detokenize incrementally, cut at stop strings, stop on stop ids and length.

    Deterministic in the tokens it is fed, so the router and a decode worker that see
    the same tokens agree on the text and on where the sequence ends.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_len: int, max_context: int,
                 detokenize: bool = True):
        self.params = params
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else tokenizer.stop_ids)
        # Without text to release or stop strings to match (a decode worker serving the router, which
        # detokenizes once itself), a token costs no text work at all: push() returns "".
        self._decoder = StreamDecoder(tokenizer) if detokenize or params.stop else None
        self._stops = StopStringMatcher(params.stop) if params.stop else None
        # Output may not grow past max_tokens nor past the model's context window.
        self.max_output_len = max(0, min(params.max_tokens, max_context - prompt_len))
        self.num_tokens = 0
        self.finish_reason: FinishReason | None = None

    def push(self, token_id: int) -> str:
        """Feed one sampled token; returns the text it releases. Sets finish_reason when done."""
        assert self.finish_reason is None, "token pushed after the sequence finished"
        self.num_tokens += 1
        text = ""
        if token_id in self.stop_ids:
            self.finish_reason = FinishReason.STOP
            return self._flush()
        if self._decoder is None:
            if self.num_tokens >= self.max_output_len:
                self.finish_reason = FinishReason.LENGTH
            return ""
        text = self._decoder.push(token_id)
        if self._stops is not None:
            text, stopped = self._stops.feed(text)
            if stopped:
                self.finish_reason = FinishReason.STOP
                return text
        if self.num_tokens >= self.max_output_len:
            self.finish_reason = FinishReason.LENGTH
            text += self._flush()
        return text

    def _flush(self) -> str:
        if self._decoder is None:
            return ""
        text = self._decoder.flush()
        if self._stops is None:
            return text
        text, _ = self._stops.feed(text)
        return text + self._stops.flush()
