"""The engine when something fails on its thread (invariant 1 (one terminal state) and invariant 2 (every KV
block freed)): K/V that cannot be placed in the pool fails its own request only; a failure of the thread itself
(a bug, a device error, running out of memory in a step no request can be blamed for) ends every sequence
it holds with the cause, answers every park and submit, now and later, and tells its listeners (a worker
takes itself out of service there: tests/faults/test_faults_engine.py).

HANDOFF_TEST_DEVICE=cuda runs them with the model and the pool on the GPU (`make gpu-check`).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace

import pytest
import torch

from common.engine.engine import Engine, EngineConfig
from common.engine.kv_cache import KVCache
from common.engine.model import Llama
from common.engine.output import FinishReason
from common.engine.runner import ModelRunner
from common.engine.sampling import SamplingParams
from tests.support.engine import CHAT_QUESTION, Sinks

DEVICE = os.environ.get("HANDOFF_TEST_DEVICE", "cpu")
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
FIRST = [504]  # a decode worker's sequence continues from the first token its prefill sampled
WAIT_S = 60  # generous for a shared 2-core host; every wait below ends as soon as its condition holds


class Fault:
    """Makes a function raise on demand: `wrap(fn)` behaves as fn until `arm()`, then its next call raises
    `exc`. With `hold`, that call first waits for `release()` (the test hands the engine more work while
    its thread is stuck in the failing call)."""

    def __init__(self, exc: BaseException, hold: bool = False):
        self.exc = exc
        self.armed = threading.Event()
        self.entered = threading.Event()  # the failing call has begun
        self._released = threading.Event()
        if not hold:
            self._released.set()
        self.fired_at: float | None = None  # time.monotonic() of the raise

    def arm(self) -> None:
        self.armed.set()

    def release(self) -> None:
        self._released.set()

    def wrap(self, fn):
        def wrapped(*args, **kwargs):
            if self.armed.is_set():
                self.armed.clear()
                self.entered.set()
                self._released.wait(WAIT_S)
                self.fired_at = time.monotonic()
                raise self.exc
            return fn(*args, **kwargs)
        return wrapped


@pytest.fixture(scope="module")
def model(smollm2_weights):
    w = smollm2_weights
    m = Llama(w.config, w.tensors, dtype=torch.float32, device=DEVICE)
    m.weights_id = w.weights_id
    return m


@pytest.fixture
def make(model, smollm2_tokenizer):
    """make(num_blocks=64, **EngineConfig fields) → a started Engine on DEVICE; stopped after the test."""
    engines = []

    def build(num_blocks: int = 64, **config) -> Engine:
        cache = KVCache(model.config, num_blocks, BLOCK, model.dtype, model.device)
        engine = Engine(ModelRunner(model, cache, packed_decode=False), smollm2_tokenizer, EngineConfig(**config))
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.stop()


@pytest.fixture(scope="module")
def prompt(chat_ids) -> list[int]:
    return chat_ids(CHAT_QUESTION)


def wait_for(condition, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.01)


def all_free(engine: Engine) -> bool:
    return engine.pool.num_free_blocks == engine.pool.num_blocks and engine.pool.num_seqs == 0


def zeros_kv(engine: Engine, num_tokens: int, device: str | torch.device = "cpu") -> torch.Tensor:
    c = engine.runner.model.config
    return torch.zeros(c.num_layers, 2, num_tokens, c.num_kv_heads, c.head_dim, dtype=engine.runner.model.dtype,
                       device=device)


# --------------------------------------------------------------------------- K/V that cannot be placed

def test_kv_on_another_device_is_refused_alone_and_the_engine_serves_on(make, prompt):
    """K/V on a device the pool cannot read from ("meta", which any host has; on a GPU host that is what a
    push's host buffer was to a CUDA pool before the copy was explicit): park() refuses that request with
    an error that names both devices, its blocks are freed at once, and the engine goes on serving others,
    parked and submitted. The same K/V handed to submit(kv=...) fails that sequence only."""
    engine = make().start()
    sinks = Sinks()
    engine.submit("other", prompt, replace(GREEDY, max_tokens=200), sinks.sink("other"))
    wait_for(lambda: len(sinks["other"].token_ids) >= 2, "the other request decodes")

    refused = engine.park("alien", zeros_kv(engine, len(prompt), "meta")).result(timeout=WAIT_S)
    assert refused is not None and refused.code == "unplaceable", refused
    assert "cannot be placed" in str(refused) and "meta" in str(refused) and str(DEVICE) in str(refused)
    assert engine.num_parked == 0 and engine.failure is None

    engine.submit("alien-submit", prompt, GREEDY, sinks.sink("alien-submit"), output_ids=FIRST,
                  kv=zeros_kv(engine, len(prompt), "meta"))
    wait_for(lambda: sinks["alien-submit"].done, "the submit with alien K/V ends")
    assert sinks["alien-submit"].finish_reason == FinishReason.ERROR
    assert "cannot be placed" in sinks["alien-submit"].error and "meta" in sinks["alien-submit"].error

    # K/V on the pool's own terms is placed, claimed and decoded meanwhile; the first request never stopped.
    assert engine.park("fine", zeros_kv(engine, len(prompt))).result(timeout=WAIT_S) is None
    engine.submit("fine", prompt, GREEDY, sinks.sink("fine"), parked=True, output_ids=FIRST)
    wait_for(lambda: sinks["fine"].done, "the parked request decodes")
    assert sinks["fine"].finish_reason == FinishReason.LENGTH
    assert len(sinks["fine"].token_ids) == GREEDY.max_tokens - len(FIRST)
    before = len(sinks["other"].token_ids)
    wait_for(lambda: len(sinks["other"].token_ids) > before, "the first request goes on")
    engine.cancel("other")
    wait_for(lambda: sinks["other"].done and engine.num_active == 0, "the first request ends")
    wait_for(lambda: all_free(engine), "every block free")
    engine.check_integrity()
    assert engine.failure is None


# --------------------------------------------------------------------------- the thread fails

@pytest.mark.parametrize("where", ["decode step", "inbox drain"])
def test_a_failed_engine_thread_ends_everything_and_refuses_what_comes_later(make, prompt, where, caplog):
    """The thread fails in a decode step (the model raises, as a CUDA error or an OOM would), or while it
    drains its inbox (outside any step: where a failure used to kill the thread silently). Every sequence
    it held ends with ERROR naming the cause, parked K/V is freed, a park and a submit that were waiting
    are answered, and so is everything handed in later, at once; the listeners hear of it first; the
    cause is in the log with its traceback."""
    engine = make()
    boom = RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
    fault = Fault(boom, hold=True)
    if where == "decode step":
        engine.runner.decode = fault.wrap(engine.runner.decode)
    else:
        engine.scheduler.add = fault.wrap(engine.scheduler.add)
    heard: list[BaseException] = []
    engine.failure_listeners.append(lambda exc: heard.append(exc) or time.sleep(0.2))  # a slow listener
    engine.start()
    sinks = Sinks()
    engine.submit("running", prompt, replace(GREEDY, max_tokens=10_000), sinks.sink("running"))
    wait_for(lambda: len(sinks["running"].token_ids) >= 2, "the request decodes")
    assert engine.park("parked", zeros_kv(engine, len(prompt))).result(timeout=WAIT_S) is None

    with caplog.at_level(logging.ERROR, logger="common.engine.engine"):
        fault.arm()
        # The drain fails on this submit's arrival; the decode step at the next step anyway. While the
        # thread is in the failing call, a park waits in the inbox.
        engine.submit("arriving", prompt, GREEDY, sinks.sink("arriving"))
        assert fault.entered.wait(WAIT_S)
        waiting = engine.park("waiting", zeros_kv(engine, len(prompt)))
        fault.release()
        wait_for(lambda: engine.failure is not None and engine._thread is not None and not engine._thread.is_alive(),
                 "the engine thread ends")
    assert heard == [boom] and engine.failure is boom

    for name in ("running", "arriving"):
        assert sinks[name].done, f"{name}: no last event"
        assert sinks[name].finish_reason == FinishReason.ERROR, name
        assert "illegal memory access" in sinks[name].error and "RuntimeError" in sinks[name].error, name
    refused = waiting.result(timeout=0)
    assert refused is not None and refused.code == "failed" and "illegal memory access" in str(refused)
    assert engine.num_parked == 0 and engine.num_active == 0
    assert all_free(engine)
    engine.check_integrity()

    # Handed in after the thread ended: answered at once, on the caller's thread.
    engine.submit("late", prompt, GREEDY, sinks.sink("late"))
    assert sinks["late"].finish_reason == FinishReason.ERROR and "illegal memory access" in sinks["late"].error
    late = engine.park("late", zeros_kv(engine, len(prompt)))
    assert late.done() and late.result().code == "failed"
    engine.cancel("late")  # nothing to cancel: no error either

    failed = [r for r in caplog.records if r.name == "common.engine.engine" and r.levelno == logging.ERROR]
    assert failed and failed[0].exc_info is not None and failed[0].exc_info[1] is boom, caplog.text
