"""Structured outputs: a constraint (JSON schema, any JSON object, regex, choice, grammar) compiled by llguidance
into a matcher per sequence, which gives the tokens allowed next as a bitmask and follows the tokens sampled.

llguidance (Microsoft's Rust engine behind guidance, also a vLLM and llama.cpp backend) was chosen over xgrammar
on this CPU by the per-token cost of its masks and by what it pulls in: nothing (xgrammar needs transformers
and triton at run time). bench/grammar.py measures both; docs/benchmarks.md has the figures.

    compiler = GrammarCompiler(tokenizer)
    compiler.check(constraint)            # ValueError naming what is wrong (the router's validation)
    matcher = compiler.matcher(constraint)  # compiled once per constraint (cached), copied per sequence
    fill_bitmask([matcher], bitmask)        # [R, ceil(V / 32)] int32: bit t of row r = token t allowed
    matcher.consume_token(tok)
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import torch

from common.engine.tokenizer import Tokenizer

MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema, regex or grammar; a choice's strings together
MAX_CHOICES = 256

# JSON the way json.dumps writes it: ", " and ": " between items, no other whitespace. A small model given
# free whitespace may spend its whole max_tokens on newlines inside an object; the keys and values are the
# same JSON either way. A schema may ask otherwise with llguidance's "x-guidance" options.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What a completion must match: one of KINDS and its text.

    json_schema: a JSON Schema as JSON text; json_object: any JSON object (value ""); regex: a regular
    expression the whole completion matches (Rust regex syntax); choice: exactly one of the strings in
    `choices`; grammar: a Lark grammar (llguidance's dialect, which may embed JSON schemas with %json) or a
    GBNF one (llama.cpp's), as vLLM's structured_outputs.grammar takes them.
    """

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()

    KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

    def __post_init__(self) -> None:
        if not isinstance(self.choices, tuple):
            object.__setattr__(self, "choices", tuple(self.choices))

    def validate(self) -> None:
        """ValueError naming what is wrong with the constraint's shape (its grammar is checked by compiling)."""
        if self.kind not in self.KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(self.KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"the {self.kind} constraint must be text")
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise ValueError(f"choice must list 1 to {MAX_CHOICES} strings, got {len(self.choices)}")
            if any(not isinstance(c, str) or not c for c in self.choices):
                raise ValueError("choice must list non-empty strings")
            size = sum(map(len, self.choices))
        else:
            if self.choices:
                raise ValueError(f"a {self.kind} constraint takes no choices")
            if self.kind != "json_object" and not self.value:
                raise ValueError(f"the {self.kind} constraint must not be empty")
            size = len(self.value)
        if size > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"the {self.kind} constraint is {size} characters long, at most "
                             f"{MAX_CONSTRAINT_CHARS} are allowed")

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint; ValueError when it cannot be read (bad JSON)."""
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema must be an object (or true / false), got {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", list(self.choices))
        return llguidance.grammar_from(self.kind, self.value)  # regex; grammar: Lark or GBNF


class GrammarCompiler:
    """The tokenizer's vocabulary as llguidance needs it, and compiled constraints, cached by constraint.

    Thread-safe. Compiling a JSON schema takes about a millisecond and a matcher's copy microseconds, so
    callers compile on their own thread (the router's validation, a worker's request handler) and the engine
    thread only copies a cached one.
    """

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 256):
        self.vocab_size = tokenizer.vocab_size
        self._tokenizer = tokenizer
        self._lltok: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (~0.4 s for a 49k vocabulary): a service that never sees a constraint skips it."""
        with self._lock:
            if self._lltok is None:
                self._lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(self._tokenizer)))
            return self._lltok

    def check(self, constraint: Constraint) -> None:
        """Compile (and cache) the constraint; ValueError with llguidance's message when it does not compile."""
        self._compiled(constraint)

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the constraint."""
        return self._compiled(constraint).deep_copy()

    def _compiled(self, constraint: Constraint) -> llguidance.LLMatcher:
        with self._lock:
            found = self._cache.get(constraint)
            if found is not None:
                self._cache.move_to_end(constraint)
                return found
        constraint.validate()
        grammar = constraint.grammar()
        lltok = self.lltokenizer
        error = llguidance.LLMatcher.validate_grammar(grammar, lltok, limits=_limits())
        if error:
            raise ValueError(f"the {constraint.kind} constraint does not compile: {error.strip()}")
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise ValueError(f"the {constraint.kind} constraint does not compile: {matcher.get_error()}")
        with self._lock:
            self._cache[constraint] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher


def _limits() -> llguidance.LLParserLimits:
    # llguidance's defaults, but errors without the parser's state and the whole grammar: they reach the
    # client and the logs.
    return llguidance.LLParserLimits(verbose_errors=False)


class _Vocab:
    """What llguidance's TokenizerWrapper reads of a tokenizer: ids' bytes, EOS, specials, and an encoder (for
    the text a grammar forces)."""

    def __init__(self, tokenizer: Tokenizer):
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = tokenizer.token_bytes()
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_bos=False, add_eos=False)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(matchers: list[llguidance.LLMatcher], bitmask: torch.Tensor) -> None:
    """Row i of bitmask ([R, W] int32, CPU, contiguous) = the tokens matchers[i] allows next."""
    row_bytes = bitmask.shape[1] * 4
    ptr = bitmask.data_ptr()
    for i, m in enumerate(matchers):
        m.unsafe_compute_mask_ptr(ptr + i * row_bytes, row_bytes)


# Byte b of a bitmask -> its 8 bits, least significant first: a little-endian int32 word's byte k holds the bits
# of tokens 32w + 8k ... 32w + 8k + 7, so a row's bytes in order are its tokens in order.
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).to(torch.uint8)  # [256, 8]
_BYTE_BIAS = torch.where(_BYTE_BITS.bool(), 0.0, -torch.inf)  # [256, 8] fp32


def allowed_from_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, min(vocab_size, 32 W)] bool."""
    bits = torch.nn.functional.embedding(bitmask.contiguous().view(torch.uint8).int(), _BYTE_BITS.to(bitmask.device))
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, min(vocab_size, 32 W)] fp32: 0 where allowed, -inf elsewhere. One table lookup
    per byte and no bool tensor: adding it to the logits is ~6x cheaper than a where() over the bits (32 rows of
    49,152: 0.9 against 6.4 ms on a loaded 2-core VM)."""
    bias = torch.nn.functional.embedding(bitmask.contiguous().view(torch.uint8).int(), _BYTE_BIAS.to(bitmask.device))
    return bias.view(bitmask.shape[0], -1)[:, :vocab_size]
