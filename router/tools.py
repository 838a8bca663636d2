"""Tool calls: the tools into the prompt, tool_choice into a constraint, and the model's text back into calls.

The calls are written in Hermes' format (NousResearch's, which Qwen 2 / 2.5 / 3 were trained on and their chat
templates ask for), one per block:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that takes `tools` (Qwen's, Llama 3.1's, Mistral's...) renders them itself. One that does not
(SmolLM2's) gets them as a system message in Qwen 2.5's own words, with the same format asked for: joined to
the conversation's first system message, or a new one before it. vLLM leaves such a template without tools; here
the model at least sees them (a 135M model follows the format only when constrained: tool_choice "required").
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.engine.grammar import Constraint

MAX_TOOLS = 128
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = ("auto", "none", "required", "function")

# JSON as json.dumps writes it, also inside a call (grammar.py's options, for a schema embedded in Lark).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema of an object

    def as_openai(self) -> dict:
        """The tool as OpenAI's API and the chat templates that take tools write it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text


def check_tools(tools: Sequence) -> list[Tool]:
    """GenerateRequest.tools as Tools; ValueError naming tools[i] and what is wrong."""
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed")
    out, seen = [], set()
    for i, t in enumerate(tools):
        if not _NAME.fullmatch(t.name):
            raise ValueError(f"tools[{i}].name must be 1-64 letters, digits, '_' or '-', got {t.name!r}")
        if t.name in seen:
            raise ValueError(f"tools[{i}].name {t.name!r} is given twice")
        seen.add(t.name)
        params = {"type": "object", "properties": {}}
        if t.parameters_json:
            try:
                params = json.loads(t.parameters_json)
            except ValueError as exc:
                raise ValueError(f"tools[{i}].parameters is not valid JSON: {exc}") from None
            if not isinstance(params, dict):
                raise ValueError(f"tools[{i}].parameters must be a JSON schema object")
        out.append(Tool(t.name, t.description, params))
    return out


def call_constraint(tools: Sequence[Tool], name: str | None, parallel: bool) -> Constraint:
    """The completion as tool calls of `tools` (or of the one named), each call's arguments valid against the
    function's parameters: a Lark grammar with the calls' JSON embedded as a schema (llguidance's %json)."""
    chosen = [t for t in tools if name is None or t.name == name]
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                         "required": ["name", "arguments"], "additionalProperties": False} for t in chosen],
              "x-guidance": _JSON_OPTIONS}
    call = f'"{CALL_START}\\n" %json {json.dumps(schema)} "\\n{CALL_END}"'
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return Constraint("grammar", f"{start}\ncall: {call}\n")


def tools_system_text(tools: Sequence[Tool]) -> str:
    """The tools for a chat template that takes none: Qwen 2.5's template's words, Hermes' format."""
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{CALL_START}{CALL_END} XML tags:\n"
            f'{CALL_START}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_END}')


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it."""
    try:
        args = json.loads(arguments) if arguments else {}
    except ValueError:
        args = arguments  # not JSON: kept as the string it is
    return f"{CALL_START}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CALL_END}"


def template_messages(messages: Sequence[Mapping], tools: Sequence[Tool], template_takes_tools: bool) -> list[dict]:
    """The messages for the chat template. A template that takes tools gets assistant tool calls and tool
    results as transformers passes them; for one that does not, they become text in Hermes' format (calls in
    the assistant's turn, a result as a user turn in <tool_response> tags, as Qwen's template writes it) and
    the tools a system message."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if template_takes_tools:
            msg = {"role": m["role"], "content": m["content"]}
            if calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": _json_or_text(c.arguments)}} for c in calls]
            if m.get("tool_call_id"):
                msg["tool_call_id"] = m["tool_call_id"]
            out.append(msg)
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            text = "\n".join([m["content"]] * bool(m["content"]) + [call_text(c.name, c.arguments) for c in calls])
            out.append({"role": m["role"], "content": text})
    if tools and not template_takes_tools:
        system = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}" if out[0]["content"] else system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _parse_call(body: str) -> ToolCall | None:
    """A call's JSON, or None when it is not one (then it stays text, as vLLM's Hermes parser leaves it)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        args = _json_or_text(args)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """The text of one completion as it streams, split into content and tool calls. A call comes out whole once
    its closing tag arrives; text that may be the start of an opening tag is held back until it is not, and so
    is whitespace until something follows it (the newlines around calls are not content)."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._space = ""  # whitespace held back
        self._started = False  # content has begun (leading whitespace is dropped)
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content this text releases, and the calls it completes."""
        self._buf += text
        content, calls = "", []
        while True:
            if not self._in_call:
                i = self._buf.find(CALL_START)
                if i < 0:
                    hold = _partial_tail(self._buf, CALL_START)
                    content += self._buf[:len(self._buf) - hold]
                    self._buf = self._buf[len(self._buf) - hold:]
                    break
                content += self._buf[:i]
                self._buf, self._in_call = self._buf[i + len(CALL_START):], True
            else:
                j = self._buf.find(CALL_END)
                if j < 0:
                    break
                body, self._buf, self._in_call = self._buf[:j], self._buf[j + len(CALL_END):], False
                call = _parse_call(body)
                if call is None:
                    content += CALL_START + body + CALL_END
                else:
                    calls.append(call)
        self.calls += calls
        return self._content(content), calls

    def finish(self) -> str:
        """At the end: what is still held (an unclosed call, cut short by max_tokens, is text)."""
        rest = (CALL_START if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        return self._content(rest)  # trailing whitespace stays held: dropped

    def _content(self, text: str) -> str:
        if not text:
            return ""
        if not text.strip():
            if self._started:
                self._space += text
            return ""
        out = self._space + (text if self._started else text.lstrip())
        self._space, self._started = "", True
        stripped = out.rstrip()
        self._space = out[len(stripped):]
        return stripped


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole completion's content (stripped) and tool calls."""
    parser = ToolCallParser()
    content, _ = parser.feed(text)
    content += parser.finish()
    return content, parser.calls


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of text that is a proper prefix of tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
