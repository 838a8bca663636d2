"""Structured outputs and tool calls through the OpenAI API, driven by the official `openai` client against a real
in-process cluster (one prefill, one decode worker) on the real model: response_format json_schema / json_object on
chat and completions, vLLM's structured_outputs extras, the same constraint over gRPC Generate, tools with
tool_choice required / named / auto (stream and not, as the client assembles them), a second turn with the tool's
result, and constraints that do not compile refused with 400 naming the parameter and the problem. Every
constrained output is checked against its schema with jsonschema."""
from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest

from protos import handoff_pb2, handoff_pb2_grpc
from router.cluster import Cluster
from router.tools import ToolCallParser, parse_tool_calls
from tests.support.cluster import wait_idle

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Give me a JSON object describing a person named Bob who is 42."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(num_prefill=1, num_decode=1, kv_memory_gib=0.075, threads=1).start()
    yield c
    c.stop(drain_timeout_s=2)


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def person_format(strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


def streamed_text(stream) -> tuple[str, str]:
    chunks = list(stream)
    text = "".join((c.choices[0].delta.content if hasattr(c.choices[0], "delta") else c.choices[0].text) or ""
                   for c in chunks if c.choices)
    return text, next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)


def test_json_schema_on_chat_and_completions_greedy_and_seeded(cluster, client):
    whole = client.chat.completions.create(model="smollm2", messages=ASK_PERSON, max_tokens=40, temperature=0,
                                           response_format=person_format())
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert whole.choices[0].finish_reason == "stop"
    streamed, reason = streamed_text(client.chat.completions.create(
        model="smollm2", messages=ASK_PERSON, max_tokens=40, temperature=0, response_format=person_format(False),
        stream=True))
    assert (streamed, reason) == (text, "stop")
    seeded = client.chat.completions.create(model="smollm2", messages=ASK_PERSON, max_tokens=40, temperature=1.0,
                                            seed=3, n=3, response_format=person_format())
    for choice in seeded.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    completion = client.completions.create(model="smollm2", prompt="A person as JSON:", max_tokens=40, temperature=0,
                                           extra_body={"response_format": person_format()})
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)
    wait_idle(cluster)


def test_the_clients_parse_helper_gets_its_pydantic_model(client):
    import pydantic

    class Person(pydantic.BaseModel):
        name: str
        age: int

    r = client.chat.completions.parse(model="smollm2", messages=ASK_PERSON, max_tokens=40, temperature=0,
                                      response_format=Person)
    assert r.choices[0].message.parsed == Person(name="Bob", age=42)


def test_json_object_is_an_object(client):
    msgs = [{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}]
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=24, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"grammar": 'root ::= "It is " ("sunny" | "raining") "."'}},  # GBNF
     lambda t: t in ("It is sunny.", "It is raining.")),
    ({"structured_outputs": {"grammar": 'start: "x=" /[0-9]{2}/'}}, lambda t: re.fullmatch(r"x=[0-9]{2}", t)),  # Lark
    ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
])
def test_vllm_structured_outputs_extras(client, extra, check):
    for temperature in (0.0, 1.0):
        r = client.completions.create(model="smollm2", prompt="The answer:", max_tokens=40, temperature=temperature,
                                      seed=1, extra_body=extra)
        assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), r.choices[0].text


def test_grpc_structured_output_gives_the_http_tokens(cluster, client):
    with grpc.insecure_channel(cluster.address) as ch:
        msgs = list(handoff_pb2_grpc.RouterStub(ch).Generate(handoff_pb2.GenerateRequest(
            messages=[handoff_pb2.ChatMessage(**m) for m in ASK_PERSON], max_tokens=40, temperature=0.0,
            structured_output=handoff_pb2.StructuredOutput(json_schema=json.dumps(PERSON))), timeout=120))
        with pytest.raises(grpc.RpcError) as err:
            list(handoff_pb2_grpc.RouterStub(ch).Generate(handoff_pb2.GenerateRequest(
                prompt="x", structured_output=handoff_pb2.StructuredOutput(regex="(")), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_output" in err.value.details()
    r = client.chat.completions.create(model="smollm2", messages=ASK_PERSON, max_tokens=40, temperature=0,
                                       response_format=person_format(), extra_body={"return_token_ids": True})
    assert [t for m in msgs for t in m.token_ids] == r.choices[0].token_ids
    assert "".join(m.text for m in msgs) == r.choices[0].message.content


@pytest.mark.parametrize("params, param, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format", "Invalid type: foo"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}}}}), "response_format", "regex"),
    (dict(response_format={"type": "xml"}), "response_format", "json_schema"),
    (dict(extra_body={"structured_outputs": {"regex": "[a-"}}), "structured_outputs", "unclosed character class"),
    (dict(extra_body={"structured_outputs": {"grammar": "start: missing_rule"}}), "structured_outputs",
     "missing_rule"),
    (dict(extra_body={"structured_outputs": {"choice": []}}), "structured_outputs", "choice"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}), "structured_outputs", "exactly one"),
    (dict(extra_body={"guided_regex": "a", "structured_outputs": {"regex": "b"}}), "guided_regex", "not both"),
    (dict(response_format={"type": "json_object"}, extra_body={"ignore_eos": True}), "ignore_eos", "ignore_eos"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].name", "bad name!"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bar"}}}],
          tool_choice="required"), "tools", "Invalid type: bar"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "cannot be combined"),
])
def test_constraints_that_do_not_compile_are_400_naming_the_problem(client, params, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{"model": "smollm2", "messages": ASK_PERSON, "max_tokens": 8, **params})
    body = err.value.body
    assert err.value.status_code == 400 and body["type"] == "invalid_request_error"
    assert body["param"] == param and words in body["message"], body


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_stream_and_not(cluster, client, choice):
    kw = dict(model="smollm2", messages=ASK_WEATHER, max_tokens=60, temperature=0, tools=[WEATHER, TIME],
              tool_choice=choice)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    [call] = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == \
        [(0, call.function.name, call.function.arguments)]
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The second turn: the call and its result go back, and the model answers.
    follow = client.chat.completions.create(model="smollm2", max_tokens=12, temperature=0, tools=[WEATHER, TIME],
                                            messages=[*ASK_WEATHER, msg.model_dump(exclude_none=True),
                                                      {"role": "tool", "tool_call_id": call.id,
                                                       "content": '{"temperature": 21}'}])
    assert follow.choices[0].message.content
    wait_idle(cluster)


def test_auto_parses_calls_out_of_free_text(client):
    """tool_choice auto leaves the text free; here a grammar makes the model write a call after some text, and
    the answer is that text as content and the call as tool_calls, streamed or not."""
    schema = {"type": "object", "properties": {"name": {"const": "get_time"}, "arguments": TIME["function"]["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False}
    grammar = f'start: "Let me check.\\n<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"'
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "What time is it in Tokyo?"}], max_tokens=60,
              temperature=0, tools=[WEATHER, TIME], extra_body={"structured_outputs": {"grammar": grammar}})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == "Let me check." and r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and "city" in json.loads(call.function.arguments)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    assert [tc.function.arguments for d in deltas for tc in d.tool_calls or ()] == [call.function.arguments]
    plain = client.chat.completions.create(model="smollm2", messages=ASK_WEATHER, max_tokens=8, temperature=0,
                                           tools=[WEATHER])
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls


# --------------------------------------------------------------------------- parsing, without a cluster

def test_tool_call_parser_gives_the_same_whatever_the_chunks():
    text = ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\nnot json\n'
            '</tool_call>\n<tool_call>\n{"name": "g", "arguments": "{\\"b\\": 2}"}\n</tool_call>\n')
    content, calls = parse_tool_calls(text)
    assert content == "Sure.\n\n<tool_call>\nnot json\n</tool_call>"  # a call that is not JSON stays text
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {"b": 2})]
    for size in (1, 2, 3, 7):
        parser = ToolCallParser()
        got_content, got_calls = "", []
        for i in range(0, len(text), size):
            piece, new = parser.feed(text[i:i + size])
            got_content += piece
            got_calls += new
        got_content += parser.finish()
        assert got_content == content and [(c.name, c.arguments) for c in got_calls] == \
            [(c.name, c.arguments) for c in calls]
    assert parse_tool_calls('<tool_call>\n{"name": "f", "argu') == ('<tool_call>\n{"name": "f", "argu', [])
    assert parse_tool_calls("a < b <tool") == ("a < b <tool", [])


def test_tools_reach_a_template_that_takes_them_and_a_system_message_otherwise():
    from pathlib import Path

    from common.engine.tokenizer import ChatTemplate
    from router.tools import Tool, ToolCall, template_messages
    tools = [Tool("get_weather", "weather", WEATHER["function"]["parameters"])]
    history = [{"role": "user", "content": "Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [ToolCall("call_1", "get_weather", '{"city": "Paris"}')]},
               {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}]
    template = ChatTemplate("{% for t in tools %}<{{ t.function.name }}>{% endfor %}{% for m in messages %}"
                            "[{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                            "{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}]{% endfor %}",
                            {}, Path("inline"))
    assert template.takes_tools
    rendered = template.render(template_messages(history, tools, True), add_generation_prompt=False,
                               tools=[t.as_openai() for t in tools])
    assert rendered == "<get_weather>[user:Paris?][assistant:get_weather(Paris)][tool:21 C]"
    generic = template_messages(history, tools, False)
    assert [m["role"] for m in generic] == ["system", "user", "assistant", "user"]
    assert "<tools>\n" + json.dumps(tools[0].as_openai()) in generic[0]["content"]
    assert generic[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert generic[3]["content"] == "<tool_response>\n21 C\n</tool_response>"
