"""Function tools on POST /v1/responses: calls as function_call output items (auto parsed from
the model's format on a scripted engine, required / named by the grammar on SmolLM2), the
streamed events of a call (its arguments as deltas), function_call_output items sent back
through the chat template, previous_response_id over a call, and the OpenAI Agents SDK's
Responses model running a tool loop."""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from tests.serve.conftest import MODEL
from tests.serve.helpers import assert_openai_error, wait_until_idle
from tests.serve.scripted import ScriptedLLM
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12},
               "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}
HERMES = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "celsius"}}\n</tool_call>')


@pytest.fixture(scope="module")
def scripted():
    llm = ScriptedLLM()
    with ServerThread(build_app(llm, ServerConfig(model="fake", tool_call_parser="hermes"))) \
            as server:
        yield llm, openai.OpenAI(base_url=server.base_url + "/v1", api_key="x",
                                 max_retries=0), server


def test_auto_call_is_a_function_call_item(scripted):
    llm, client, _ = scripted
    llm.script = HERMES
    out = client.responses.create(model="fake", input="Weather in Paris?", tools=[WEATHER])
    message, call = out.output
    assert message.type == "message" and out.output_text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert out.status == "completed" and out.tools[0].name == "get_weather"
    assert "Weather in Paris?" in bytes(llm.last_prompt).decode()


def test_streamed_call_events(scripted):
    llm, client, _ = scripted
    llm.script = HERMES
    events = list(client.responses.create(model="fake", input="Weather?", tools=[WEATHER],
                                          stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    call_added = types.index("response.output_item.added", 3)
    assert types[call_added - 3:call_added] == ["response.output_text.done",
                                                "response.content_part.done",
                                                "response.output_item.done"]
    added = events[call_added]
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    pieces = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 5 and all(e.item_id == added.item.id for e in pieces)
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == "".join(e.delta for e in pieces)
    assert json.loads(done.arguments) == {"city": "Paris", "unit": "celsius"}
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == done.arguments
    assert final.output_text == "Checking."


def test_call_outputs_go_back_through_the_template(scripted):
    llm, client, _ = scripted
    llm.script = HERMES
    first = client.responses.create(model="fake", input="Weather?", tools=[WEATHER])
    call = first.output[1]
    llm.script = "Sunny."
    second = client.responses.create(
        model="fake", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    assert second.output_text == "Sunny."
    # FakeTokenizer: "role: content" lines (an assistant call has no text)
    assert bytes(llm.last_prompt).decode().endswith(
        "user: Weather?\nassistant: Checking.\ntool: 21 C\nassistant: ")


def test_no_call_is_text_and_none_leaves_the_text(scripted):
    llm, client, _ = scripted
    llm.script = "It is sunny."
    out = client.responses.create(model="fake", input="Weather?", tools=[WEATHER])
    assert [item.type for item in out.output] == ["message"]
    llm.script = HERMES
    out = client.responses.create(model="fake", input="Weather?", tools=[WEATHER],
                                  tool_choice="none")
    assert out.output_text == HERMES


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"tool_choice": "required"}, None),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, None),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {
        "type": "json_object"}}}, "tool_choice"),
])
def test_bad_tool_requests_are_400(scripted, body, param):
    _, _, server = scripted
    response = httpx.post(server.base_url + "/v1/responses",
                          json={"model": "fake", "input": "hi", **body}, timeout=10)
    error = assert_openai_error(response, 400)
    if param is not None:
        assert error["param"] == param, error


# ---- SmolLM2 ----

@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "name": "get_weather"}])
def test_forced_call_validates_and_its_output_is_answered(client, smollm2, tool_choice):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                    tools=[WEATHER, TIME], tool_choice=tool_choice,
                                    temperature=0, max_output_tokens=64)
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(item.type == "function_call" for item in first.output)
    for call in calls:
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.name]["parameters"]
        jsonschema.validate(json.loads(call.arguments), schema)
    answer = client.responses.create(
        model=MODEL, previous_response_id=first.id, temperature=0, max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
               for c in calls])
    assert answer.output[0].type == "message" and answer.output_text
    assert answer.usage.input_tokens > first.usage.input_tokens
    wait_until_idle(smollm2)


@pytest.mark.slow
def test_streamed_forced_call(client, smollm2):
    events = list(client.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=[WEATHER], stream=True,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=64))
    assert not any(e.type == "response.output_text.delta" for e in events)
    pieces = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(pieces), WEATHER["parameters"])
    (call,) = events[-1].response.output
    assert call.name == "get_weather" and call.arguments == pieces
    wait_until_idle(smollm2)


@pytest.mark.slow
def test_agents_sdk_responses_model_tool_loop(server, smollm2):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Use the get_weather tool.",
                         tools=[get_weather], model=model, model_settings=agents.ModelSettings(
                             tool_choice="required", temperature=0, max_tokens=64))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?",
                                           max_turns=4))
    assert calls == ["Paris"]
    assert [item.type for item in result.new_items][-1] == "message_output_item"
    assert result.final_output.strip()
    wait_until_idle(smollm2)
