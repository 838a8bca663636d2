"""Checks a public GenerateRequest before any work: a clear INVALID_ARGUMENT naming the field."""
from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass

from common.engine.config import ModelConfig
from common.engine.grammar import Constraint, GrammarCompiler
from common.engine.sampling import MAX_SEED, SamplingParams, derive_seed
from common.engine.tokenizer import Tokenizer, TokenizerError
from common.pb_convert import check_token_ids, constraint_from_pb
from protos import handoff_pb2
from router import tools as tool_calls

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # max_tokens resolved, seed resolved
    seed: int


# A request's sampling fields when neither it nor the model's files set them (protos/handoff.proto).
BUILTIN_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0}


class RequestValidator:
    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, *, default_max_tokens: int,
                 max_messages: int, sampling_defaults: dict | None = None):
        self.tokenizer = tokenizer
        self.context_len = model_config.max_position
        self.vocab_size = model_config.vocab_size
        # What a request leaves unset: the model files' settings (common/engine/generation_config.py), else ours.
        self.defaults = {**BUILTIN_DEFAULTS, "max_tokens": default_max_tokens, **(sampling_defaults or {})}
        self.max_messages = max_messages
        # Structured outputs are compiled here first, so that a constraint that does not compile is refused
        # before admission (INVALID_ARGUMENT naming the problem), never on a worker.
        self.grammars = GrammarCompiler(tokenizer)

    def validate(self, r: handoff_pb2.GenerateRequest) -> ValidRequest:
        request_id = r.request_id or uuid.uuid4().hex
        # fullmatch: with match(), "$" also matches before a trailing newline, so "abc\n" got through.
        if not _REQUEST_ID.fullmatch(request_id):
            raise ValueError("request_id must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
        tools, constraint = self._tools_and_constraint(r)
        prompt_ids = self._prompt_ids(r, tools)
        room = self.context_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens; the model's context is {self.context_len} "
                             f"tokens and at least one must be left to generate")
        max_tokens = r.max_tokens if r.HasField("max_tokens") else min(self.defaults["max_tokens"], room)
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if max_tokens > room:
            raise ValueError(f"max_tokens ({max_tokens}) plus the prompt ({len(prompt_ids)} tokens) exceeds the "
                             f"model's context of {self.context_len} tokens; max_tokens may be at most {room}")
        if r.HasField("seed") and r.seed > MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {r.seed}")

        def opt(name):
            return getattr(r, name) if r.HasField(name) else self.defaults[name]

        if r.HasField("top_logprobs") and not r.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")

        params = SamplingParams(
            temperature=opt("temperature"), top_k=opt("top_k"), top_p=opt("top_p"),
            min_p=opt("min_p"), repetition_penalty=opt("repetition_penalty"),
            presence_penalty=opt("presence_penalty"), frequency_penalty=opt("frequency_penalty"),
            seed=r.seed if r.HasField("seed") else None, max_tokens=max_tokens, stop=tuple(r.stop),
            stop_token_ids=tuple(r.stop_token_ids), ignore_eos=r.ignore_eos,
            logprobs=(r.top_logprobs if r.HasField("top_logprobs") else 0) if r.logprobs else None,
            constraint=constraint)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not math.isfinite(getattr(params, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(params, name)}")
        params.validate(self.vocab_size)
        if constraint is not None:
            try:
                self.grammars.check(constraint)
            except ValueError as exc:
                if r.tool_choice in ("required", "function"):  # the constraint is the tools' parameters
                    raise ValueError(f"tools: the functions' parameters do not compile as JSON schemas: {exc}") \
                        from None
                raise ValueError(f"structured_output: {exc}") from None
        return ValidRequest(request_id, prompt_ids, params, derive_seed(params.seed))

    def _tools_and_constraint(self, r: handoff_pb2.GenerateRequest) -> tuple[list[tool_calls.Tool], Constraint | None]:
        """The tools the prompt shows, and what the completion must match: structured_output, or the tool calls
        tool_choice "required" / "function" asks for."""
        try:
            constraint = constraint_from_pb(r.structured_output) if r.HasField("structured_output") else None
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        if constraint is not None:
            try:
                constraint.validate()
            except ValueError as exc:
                raise ValueError(f"structured_output: {exc}") from None
        choice = r.tool_choice or ("auto" if r.tools else "none")
        if choice not in tool_calls.TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(tool_calls.TOOL_CHOICES)}, got {choice!r}")
        if r.tool_name and choice != "function":
            raise ValueError(f"tool_name is for tool_choice \"function\", not {choice!r}")
        tools = tool_calls.check_tools(r.tools)
        if choice == "none":
            return [], constraint
        if not tools:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        if not r.messages:
            raise ValueError("tools need messages (a chat) to be shown to the model")
        if choice == "auto":
            return tools, constraint
        if constraint is not None:
            raise ValueError(f"tool_choice {choice!r} cannot be combined with structured_output: the completion is "
                             f"the tool calls")
        if choice == "function" and r.tool_name not in {t.name for t in tools}:
            raise ValueError(f"tool_choice names the function {r.tool_name!r}, which is not among the tools")
        return tools, tool_calls.call_constraint(tools, r.tool_name if choice == "function" else None,
                                                 r.parallel_tool_calls)

    def _prompt_ids(self, r: handoff_pb2.GenerateRequest, tools: list[tool_calls.Tool]) -> list[int]:
        if r.prompt_token_ids:
            if r.prompt or r.messages:
                raise ValueError("give one of prompt, messages and prompt_token_ids, not several")
            # The context check (with the room left to generate) follows in validate().
            return check_token_ids(r.prompt_token_ids, self.vocab_size, self.context_len, "prompt_token_ids")
        if r.prompt and r.messages:
            raise ValueError("give either prompt or messages, not both")
        if r.messages:
            if len(r.messages) > self.max_messages:
                raise ValueError(f"messages has {len(r.messages)} entries; at most {self.max_messages} are allowed")
            for i, m in enumerate(r.messages):
                if m.role not in _ROLES:
                    raise ValueError(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {m.role!r}")
                if m.tool_calls and m.role != "assistant":
                    raise ValueError(f"messages[{i}].tool_calls: only an assistant turn makes tool calls")
            takes_tools = self.tokenizer.chat_template.takes_tools
            messages = tool_calls.template_messages(
                [{"role": m.role, "content": m.content,
                  "tool_calls": [tool_calls.ToolCall(c.id, c.name, c.arguments_json) for c in m.tool_calls],
                  "tool_call_id": m.tool_call_id} for m in r.messages], tools, takes_tools)
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, tools=[t.as_openai() for t in tools] if takes_tools else None)
            except TokenizerError as exc:
                raise ValueError(f"messages: the model's chat template rejected them: {exc}") from exc
        elif r.prompt:
            text = r.prompt
        else:
            raise ValueError("prompt or messages is required (both are empty)")
        ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError("prompt encodes to no tokens")
        return ids
