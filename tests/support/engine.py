"""Driving an Engine by hand: sinks that collect what each sequence streams, stepping until done, HF's
greedy reference."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine.engine import Engine, TokenEvent
from common.engine.output import FinishReason
from common.engine.sampling import SamplingParams

CHAT_QUESTION = "What is the capital of France?"


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF generate(do_sample=False) with no EOS (it runs on through one, as ignore_eos does): the new tokens.

    eos_token_id=[]: None would fall back to the model's generation_config, which stops on EOS.
    """
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=0)
    with torch.inference_mode():
        input_ids = torch.tensor([prompt_ids])
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    new = out[0, len(prompt_ids):].tolist()
    assert len(new) == max_new_tokens, f"HF stopped after {len(new)} tokens"
    return new


@dataclass
class Collected:
    """Everything one sequence streamed."""

    events: list[TokenEvent] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def done(self) -> bool:
        # A prefill_only engine ends a sequence with finish_reason None and the exported K/V.
        return bool(self.events) and (self.events[-1].finish_reason is not None or self.events[-1].kv is not None)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.events[-1].finish_reason if self.events else None

    @property
    def error(self) -> str | None:
        return self.events[-1].error if self.events else None

    @property
    def kv(self):
        return self.events[-1].kv if self.events else None


class Sinks(dict):
    """seq_id → Collected; sink(seq_id) is the callback to hand to Engine.submit."""

    def sink(self, seq_id: str):
        collected = self.setdefault(seq_id, Collected())

        def receive(event: TokenEvent) -> None:
            assert event.seq_id == seq_id
            assert not collected.done, f"{seq_id}: event after the last one: {event}"
            collected.events.append(event)

        return receive


def run_until_done(engine: Engine, sinks: Sinks, max_steps: int = 2000) -> int:
    """Step the engine synchronously until every sink got its last event; returns the steps taken."""
    for n in range(max_steps):
        if all(c.done for c in sinks.values()) and engine.num_active == 0:
            return n
        engine.step()
    raise AssertionError(f"engine did not finish in {max_steps} steps: "
                         f"{ {k: len(c.token_ids) for k, c in sinks.items() if not c.done} }")



def first_greedy_tokens(make_engine, ids: list[int], n: int, **engine_kw) -> list[int]:
    engine = make_engine(num_blocks=16, **engine_kw)
    sinks = Sinks()
    engine.submit("q", ids, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n), sinks.sink("q"))
    run_until_done(engine, sinks)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    return sinks["q"].token_ids

