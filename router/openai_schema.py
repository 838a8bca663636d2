"""The OpenAI API's JSON both ways: a request body into handoff's GenerateRequest (or a 400 naming the
parameter), GenerateResponse messages into completion objects and stream chunks, failures into errors.

Nothing here validates ranges: the GenerateRequest goes through the router's RequestValidator, exactly as
a gRPC request does. This module checks only what JSON adds (types, parameter names, OpenAI-only options).
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from common.engine.sampling import MAX_LOGPROBS, MAX_SEED
from common.engine.tokenizer import Tokenizer
from protos import handoff_pb2
from router.tools import ToolCallParser, parse_tool_calls

MAX_N = 16  # choices per request; each is a generation of its own
_INT32 = (-2**31, 2**31 - 1)

FINISH_REASONS = {handoff_pb2.FINISH_REASON_STOP: "stop", handoff_pb2.FINISH_REASON_LENGTH: "length"}

# OpenAI parameters that would change the output and that handoff does not implement, each with a test of
# the value that means "not used": anything else is refused (400) rather than silently ignored.
_UNSUPPORTED = {
    "logit_bias": lambda v: not v,
    "echo": lambda v: not v,
    "suffix": lambda v: not v,
    "best_of": lambda v: v in (None, 1),
    "functions": lambda v: not v,  # the deprecated form of tools
    "function_call": lambda v: v in (None, "none"),
    "audio": lambda v: not v,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: not v,
    "web_search_options": lambda v: not v,
}

_STATUS_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_TYPE_OF = {429: "rate_limit_error", 500: "server_error", 503: "server_error", 504: "server_error"}
_CODE_OF = {401: "invalid_api_key", 404: "not_found", 409: "conflict", 413: "request_too_large",
            429: "rate_limit_exceeded", 503: "service_unavailable", 504: "timeout"}


class APIError(Exception):
    """A failure as the OpenAI API reports it: an HTTP status and {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or _CODE_OF.get(status)
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPE_OF.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    @classmethod
    def from_status(cls, code: grpc.StatusCode, message: str) -> "APIError":
        """A gRPC status as the HTTP status OpenAI clients expect; 429 and 503 say when to retry."""
        status = _STATUS_OF.get(code, 500)
        headers = {"Retry-After": "1"} if status in (429, 503) else {}
        if status in (400, 404, 409):
            headers["X-Should-Retry"] = "false"  # the openai client retries 409 unless told not to
        return cls(status, message, param=param_named_in(message) if status == 400 else None, headers=headers)


def bad_param(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


# The GenerateRequest fields RequestValidator's messages start with; some under another OpenAI name.
_KNOWN_FIELDS = {"prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "request_id",
                 "ignore_eos", "logprobs", "top_logprobs", "prompt_token_ids", "tools", "tool_choice", "tool_name"}
_PARAM_OF_FIELD = {"prompt_token_ids": "prompt", "request_id": None, "tool_name": "tool_choice"}
_FIELD_RE = re.compile(r"[a-z_]+(\[\d+\](\.[a-z_]+)?)?")


def param_named_in(message: str) -> str | None:
    """The parameter a validation message names first ("max_tokens must be ..." -> "max_tokens")."""
    match = _FIELD_RE.match(message)
    if match is None:
        return None
    name = match.group(0)
    field = name.split("[")[0]
    return _PARAM_OF_FIELD.get(field, name) if field in _KNOWN_FIELDS else None



# --------------------------------------------------------------------------- requests

@dataclass(frozen=True)
class ParsedRequest:
    """One /v1/completions or /v1/chat/completions body: the GenerateRequest of each of its n choices
    (seed and request id aside, which differ per choice), and what only the HTTP answer needs."""

    chat: bool
    request: handoff_pb2.GenerateRequest
    n: int
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    logprobs: bool  # the answer carries logprobs (request.top_logprobs alternatives each)
    return_token_ids: bool = False  # vLLM's extension: each choice lists its completion token ids too
    constraint_param: str | None = None  # the parameter that asked for request.structured_output
    tool_calls: bool = False  # the answer's text is parsed into message.tool_calls (tools given, not "none")


class _Body:
    """Typed reads of a JSON body's parameters: a wrong type is a 400 naming the parameter; null = unset."""

    def __init__(self, body: dict):
        self.body = body

    def get(self, name: str, kinds: tuple[type, ...], what: str):
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise bad_param(name, f"{name} must be {what}, got {_show(value)}")
        return value

    def int(self, name: str) -> int | None:
        value = self.get(name, (int,), "an integer")
        if value is not None and not _INT32[0] <= value <= _INT32[1]:
            raise bad_param(name, f"{name} is out of range: {value}")
        return value

    def number(self, name: str) -> float | None:
        value = self.get(name, (int, float), "a number")
        return None if value is None else float(value)

    def bool(self, name: str) -> bool | None:
        return self.get(name, (bool,), "true or false")

    def str(self, name: str) -> str | None:
        return self.get(name, (str,), "a string")


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_request(body: object, *, chat: bool, model_names: Sequence[str]) -> ParsedRequest:
    """A /v1/chat/completions (chat) or /v1/completions body as a GenerateRequest; APIError (400, 404)
    for what JSON or the OpenAI API adds. Ranges are left to RequestValidator. `model`, when given, must
    be one of `model_names` (the served names, never the model's path: vLLM's rule)."""
    if not isinstance(body, dict):
        raise bad_param(None, "the request body must be a JSON object")
    p = _Body(body)
    model = p.str("model")
    if model is not None and model not in model_names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{', '.join(map(repr, model_names))} (GET /v1/models)",
                       param="model", code="model_not_found")
    for name, unused in _UNSUPPORTED.items():
        if not unused(body.get(name)):
            raise bad_param(name, f"{name} is not supported by this server (use tools and tool_choice)")
    req = handoff_pb2.GenerateRequest()
    constraint_param = _set_structured_output(req, body)
    tool_calls = _set_tools(req, body, chat)
    if chat:
        req.messages.extend(_messages(body.get("messages")))
        max_tokens = p.int("max_completion_tokens")
        if max_tokens is None:
            max_tokens = p.int("max_tokens")
    else:
        if "messages" in body:
            raise bad_param("messages", "messages belongs to /v1/chat/completions; /v1/completions takes prompt")
        _set_prompt(req, body.get("prompt"))
        max_tokens = p.int("max_tokens")
    if max_tokens is not None:
        req.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = p.number(name)
        if value is not None:
            setattr(req, name, value)
    top_k = p.int("top_k")
    if top_k is not None:
        req.top_k = 0 if top_k == -1 else top_k  # vLLM's "off" is -1; handoff's is 0
    seed = p.get("seed", (int,), "an integer")
    if seed is not None:
        if not 0 <= seed <= MAX_SEED:
            raise bad_param("seed", f"seed must be in [0, {MAX_SEED}], got {seed}")
        req.seed = seed
    req.stop.extend(_stop(body.get("stop")))
    stop_ids = p.get("stop_token_ids", (list,), "a list of token ids") or []
    if not all(isinstance(t, int) and not isinstance(t, bool) and _INT32[0] <= t <= _INT32[1] for t in stop_ids):
        raise bad_param("stop_token_ids", "stop_token_ids must be a list of token ids")
    req.stop_token_ids.extend(stop_ids)
    req.ignore_eos = bool(p.bool("ignore_eos"))
    p.str("user")  # accepted (OpenAI's end-user id for abuse monitoring); handoff has no use for it
    n = p.int("n")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise bad_param("n", f"n must be in [1, {MAX_N}], got {n}")
    stream = bool(p.bool("stream"))
    options = p.get("stream_options", (dict,), "an object")
    if options is not None and not stream:
        raise bad_param("stream_options", "stream_options is only allowed when stream is true")
    include_usage = bool(_Body(options or {}).bool("include_usage"))
    logprobs = _set_logprobs(req, p, chat)
    return ParsedRequest(chat=chat, request=req, n=n, stream=stream, include_usage=include_usage,
                         logprobs=logprobs, return_token_ids=bool(p.bool("return_token_ids")),
                         constraint_param=constraint_param, tool_calls=tool_calls)


# vLLM's structured_outputs object (and its older top-level guided_* extras): which StructuredOutput field each sets.
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
               "json_object": "json_object"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _set_structured_output(req: handoff_pb2.GenerateRequest, body: dict) -> str | None:
    """response_format json_object / json_schema, vLLM's structured_outputs or guided_* extras, into
    req.structured_output; the parameter that set it (errors name it), or None. Their compiling is the
    validator's (RequestValidator), as for a gRPC request."""
    asked = [name for name in ("response_format", "structured_outputs", *_GUIDED) if body.get(name) is not None]
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "text" and set(fmt) <= {"type"}:
        asked.remove("response_format")
    if not asked:
        return None
    if len(asked) > 1:
        raise bad_param(asked[1], f"give one of {' and '.join(asked)}, not both: each constrains the whole output")
    name = asked[0]
    out = req.structured_output
    if name == "response_format":
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise bad_param("response_format", 'response_format must be {"type": "text"}, {"type": "json_object"} '
                                               'or {"type": "json_schema", "json_schema": {...}}')
        if fmt["type"] == "json_object":
            out.json_object = True
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise bad_param("response_format", "response_format.json_schema must be an object with name and "
                                                   "schema")
            schema = spec.get("schema", {})  # OpenAI's default: no schema is any JSON value
            if not isinstance(schema, (dict, bool)):
                raise bad_param("response_format", "response_format.json_schema.schema must be a JSON schema "
                                                   "object")
            if not isinstance(spec.get("strict", False), (bool, type(None))):
                raise bad_param("response_format", "response_format.json_schema.strict must be true or false")
            out.json_schema = json.dumps(schema)  # strict or not, the schema is enforced
        else:
            raise bad_param("response_format", 'response_format {"type": "text"} takes no other keys')
        return name
    spec = body[name]
    if name in _GUIDED:
        spec = {_GUIDED[name]: spec}
    elif not isinstance(spec, dict):
        raise bad_param(name, f"{name} must be an object with one of {', '.join(_VLLM_KINDS)}")
    kinds = [k for k, v in spec.items() if v is not None and v is not False]
    unknown = [k for k in kinds if k not in _VLLM_KINDS]
    if unknown:
        raise bad_param(name, f"{name}.{unknown[0]} is not supported by this server (supported: "
                              f"{', '.join(_VLLM_KINDS)})")
    if len(kinds) != 1:
        raise bad_param(name, f"{name} must set exactly one of {', '.join(_VLLM_KINDS)}, got "
                              f"{', '.join(kinds) or 'none'}")
    kind, value = kinds[0], spec[kinds[0]]
    field = _VLLM_KINDS[kind]
    if kind == "json":
        if isinstance(value, str):
            out.json_schema = value
        elif isinstance(value, (dict, bool)):
            out.json_schema = json.dumps(value)
        else:
            raise bad_param(name, f"{name}.json must be a JSON schema (an object, or its JSON text)")
    elif kind == "choice":
        if not (isinstance(value, list) and all(isinstance(c, str) for c in value)):
            raise bad_param(name, f"{name}.choice must be a list of strings")
        out.choice.choices.extend(value)
    elif kind == "json_object":
        if value is not True:
            raise bad_param(name, f"{name}.json_object must be true")
        out.json_object = True
    else:
        if not isinstance(value, str):
            raise bad_param(name, f"{name}.{kind} must be a string")
        setattr(out, field, value)
    return name


def _set_tools(req: handoff_pb2.GenerateRequest, body: dict, chat: bool) -> bool:
    """tools, tool_choice and parallel_tool_calls into req; whether the answer is parsed into tool calls."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not chat:
        if tools or choice not in (None, "none"):
            raise bad_param("tools" if tools else "tool_choice", "tools belong to /v1/chat/completions")
        return False
    if tools is not None and not isinstance(tools, list):
        raise bad_param("tools", "tools must be a list of {type: function, function: {name, ...}} objects")
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)):
            raise bad_param(f"tools[{i}]", f"tools[{i}] must be {{type: function, function: {{name, description, "
                                           f"parameters}}}}")
        name, description, params = fn.get("name"), fn.get("description") or "", fn.get("parameters")
        if not isinstance(name, str) or not isinstance(description, str):
            raise bad_param(f"tools[{i}]", f"tools[{i}].function.name and description must be strings")
        if params is not None and not isinstance(params, dict):
            raise bad_param(f"tools[{i}]", f"tools[{i}].function.parameters must be a JSON schema object")
        req.tools.add(name=name, description=description, parameters_json=json.dumps(params) if params else "")
    if isinstance(choice, dict):
        fn = choice.get("function")
        if not (choice.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise bad_param("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                           '{"type": "function", "function": {"name": ...}}')
        req.tool_choice, req.tool_name = "function", fn["name"]
    elif choice is not None:
        if choice not in ("none", "auto", "required"):
            raise bad_param("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                           '{"type": "function", "function": {"name": ...}}')
        req.tool_choice = choice
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_param("parallel_tool_calls", "parallel_tool_calls must be true or false")
    # A forced call ("required") is one call unless parallel_tool_calls is true: OpenAI's default is true, but a
    # small model constrained to "one or more" tends to go on calling until max_tokens. A named function: once.
    req.parallel_tool_calls = req.tool_choice == "required" and parallel is True
    return bool(tools) and req.tool_choice != "none"


def _set_logprobs(req: handoff_pb2.GenerateRequest, p: _Body, chat: bool) -> bool:
    """Chat: logprobs (bool) and top_logprobs (0-20); completions: logprobs, the number of alternatives."""
    if chat:
        wanted = bool(p.bool("logprobs"))
        top = p.int("top_logprobs")
        if top is not None and not wanted:
            raise bad_param("top_logprobs", "top_logprobs needs logprobs set to true")
        name = "top_logprobs"
    else:
        top = p.int("logprobs")
        wanted = top is not None
        name = "logprobs"
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_param(name, f"{name} must be in [0, {MAX_LOGPROBS}], got {top}")
    req.logprobs = wanted
    if top is not None:
        req.top_logprobs = top
    return wanted


def _set_prompt(req: handoff_pb2.GenerateRequest, prompt) -> None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_param("prompt", "prompt must not be empty")
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
        if not all(_INT32[0] <= t <= _INT32[1] for t in prompt):
            raise bad_param("prompt", "prompt holds a token id outside the vocabulary")
        req.prompt_token_ids.extend(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(x, (str, list)) for x in prompt):
        raise bad_param("prompt", "one prompt per request: send one request per prompt (n gives several "
                                  "completions of one prompt)")
    elif prompt is None:
        raise bad_param("prompt", "prompt is required")
    else:
        raise bad_param("prompt", "prompt must be a string or a non-empty list of token ids")


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise bad_param("stop", "stop must be a string or a list of strings")


def _messages(messages) -> list[handoff_pb2.ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_param(f"messages[{i}]", f"messages[{i}] must be an object with role and content")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_param(f"messages[{i}].role", f"messages[{i}].role must be a string")
        tool_call_id = m.get("tool_call_id") or ""
        if not isinstance(tool_call_id, str):
            raise bad_param(f"messages[{i}].tool_call_id", f"messages[{i}].tool_call_id must be a string")
        out.append(handoff_pb2.ChatMessage(role="system" if role == "developer" else role,
                                           content=_content(m.get("content"), i), tool_call_id=tool_call_id,
                                           tool_calls=_message_tool_calls(m.get("tool_calls"), i)))
    return out


def _message_tool_calls(calls, i: int) -> list[handoff_pb2.ToolCall]:
    """An assistant turn's tool_calls, as an earlier answer gave them."""
    if not calls:
        return []
    what = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_param(what, f"{what} must be a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", ""), str) and isinstance(c.get("id", ""), str)):
            raise bad_param(what, f"{what}[{j}] must be {{id, type: function, function: {{name, arguments}}}}")
        out.append(handoff_pb2.ToolCall(id=c.get("id", ""), name=fn["name"], arguments_json=fn.get("arguments", "")))
    return out


def _content(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_param(f"messages[{i}].content", "only text content parts ({type: text, text}) are "
                                                          "supported")
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins text parts
    raise bad_param(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")


# --------------------------------------------------------------------------- responses

class TokenText:
    """A token id as OpenAI's logprobs show it: the token decoded alone (a piece of a multi-byte character
    comes out as U+FFFD, as in vLLM), with its UTF-8 bytes."""

    def __init__(self, tokenizer: Tokenizer):
        self._text = functools.lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)

    def entry(self, token_id: int, logprob: float) -> dict:
        text = self(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


class ResponseBuilder:
    """The JSON of one request's answer: stream chunks as messages arrive, or the whole response at once."""

    def __init__(self, parsed: ParsedRequest, *, response_id: str, created: int, model: str, fingerprint: str,
                 token_text: TokenText):
        self.chat = parsed.chat
        self.logprobs = parsed.logprobs
        self.include_usage = parsed.include_usage
        self.return_token_ids = parsed.return_token_ids
        self.token_text = token_text
        self.head = {"id": response_id, "object": "chat.completion.chunk" if parsed.chat else "text_completion",
                     "created": created, "model": model, "system_fingerprint": fingerprint}
        self._text_offset = [0] * parsed.n  # completions' logprobs.text_offset continues across chunks
        self._started = [False] * parsed.n
        # With tools: each choice's text is split into content and tool calls as it streams.
        self._calls = [ToolCallParser() for _ in range(parsed.n)] if parsed.tool_calls else None

    # ---- streaming

    def chunk(self, index: int, msg: handoff_pb2.GenerateResponse) -> dict | None:
        """A stream chunk for one message of choice `index`; None when it carries nothing to show."""
        reason = FINISH_REASONS.get(msg.finish_reason)
        first = not self._started[index]
        self._started[index] = True
        lps = self._logprobs(index, msg.logprobs) if self.logprobs and msg.logprobs else None
        text, calls = msg.text, []
        if self._calls is not None:
            parser = self._calls[index]
            text, calls = parser.feed(msg.text)
            if reason is not None:
                text += parser.finish()
                if parser.calls and reason == "stop":
                    reason = "tool_calls"
        if not (text or calls or lps or reason or (first and self.chat) or (self.return_token_ids and msg.token_ids)):
            return None
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            if calls:
                offset = len(self._calls[index].calls) - len(calls)
                delta["tool_calls"] = [{"index": offset + k, **_tool_call(c)} for k, c in enumerate(calls)]
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": reason}
        else:
            choice = {"index": index, "text": msg.text, "logprobs": lps, "finish_reason": reason}
        if self.return_token_ids:
            choice["token_ids"] = list(msg.token_ids)
        out = {**self.head, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, finals: Sequence[handoff_pb2.GenerateResponse]) -> dict:
        return {**self.head, "choices": [], "usage": usage(finals)}

    # ---- all at once

    def response(self, choices: Sequence[Sequence[handoff_pb2.GenerateResponse]]) -> dict:
        """The whole answer from every choice's messages (the last of each has its finish reason)."""
        out_choices = []
        for index, msgs in enumerate(choices):
            text = "".join(m.text for m in msgs)
            lps = None
            if self.logprobs:
                lps = self._logprobs(index, [lp for m in msgs for lp in m.logprobs])
            reason = FINISH_REASONS.get(msgs[-1].finish_reason)
            if self.chat:
                message = {"role": "assistant", "content": text}
                if self._calls is not None:
                    content, calls = parse_tool_calls(text)
                    message["content"] = content or None
                    if calls:
                        message["tool_calls"] = [_tool_call(c) for c in calls]
                        reason = "tool_calls" if reason == "stop" else reason
                out_choices.append({"index": index, "message": message, "logprobs": lps, "finish_reason": reason})
            else:
                out_choices.append({"index": index, "text": text, "logprobs": lps, "finish_reason": reason})
            if self.return_token_ids:
                out_choices[-1]["token_ids"] = [t for m in msgs for t in m.token_ids]
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self.head, "object": obj, "choices": out_choices, "usage": usage([m[-1] for m in choices])}

    def _logprobs(self, index: int, lps: Sequence[handoff_pb2.TokenLogprob]) -> dict:
        text = self.token_text
        if self.chat:
            return {"content": [{**text.entry(lp.token_id, lp.logprob),
                                 "top_logprobs": [text.entry(t.token_id, t.logprob) for t in lp.top_logprobs]}
                                for lp in lps]}
        tokens = [text(lp.token_id) for lp in lps]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset[index])
            self._text_offset[index] += len(token)
        # OpenAI's completions list the sampled token among the alternatives too (up to logprobs + 1).
        top = [{**{text(t.token_id): t.logprob for t in lp.top_logprobs}, token: lp.logprob}
               for lp, token in zip(lps, tokens)]
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": top,
                "text_offset": offsets}


def _tool_call(call) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def usage(finals: Sequence[handoff_pb2.GenerateResponse]) -> dict:
    """Prompt tokens once (every choice has the same prompt), completion tokens of every choice."""
    prompt = finals[0].prompt_tokens if finals else 0
    completion = sum(m.completion_tokens for m in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def models_list(model_names: Sequence[str], created: int, max_model_len: int) -> dict:
    """/v1/models: one entry per served name, all of them the same model (as vLLM lists them)."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "handoff",
                                        "max_model_len": max_model_len} for name in model_names]}
