"""An agent library from PyPI, unmodified, against `tllm serve` with SmolLM2: the OpenAI
Agents SDK runs a two-step tool loop (the model must call the tool; the tool's result goes
back as a `role: "tool"` message through the chat template; the model then answers)."""
from __future__ import annotations

import asyncio

import openai
import pytest

from tests.serve.conftest import MODEL
from tests.serve.helpers import wait_until_idle

agents = pytest.importorskip("agents")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chat_model(server):
    agents.set_tracing_disabled(True)   # nothing may leave the machine
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                max_retries=0)
    return agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)


def weather_agent(model, calls: list[str]):
    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    return agents.Agent(name="weather", instructions="You answer questions about the "
                        "weather. Use the get_weather tool.", tools=[get_weather],
                        model=model, model_settings=agents.ModelSettings(
                            tool_choice="required", temperature=0, max_tokens=64))


def test_two_step_tool_loop(chat_model, smollm2):
    calls: list[str] = []
    result = asyncio.run(agents.Runner.run(weather_agent(chat_model, calls),
                                           "What is the weather in Paris?", max_turns=4))
    assert calls == ["Paris"]
    first, second = result.raw_responses     # a tool call, then the answer
    assert second.usage.input_tokens > first.usage.input_tokens   # the call and its result
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str) and result.final_output.strip()
    wait_until_idle(smollm2)
