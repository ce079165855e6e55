"""Drives a plughost server's Responses API through the official openai client and the OpenAI
Agents SDK: a plain answer and its stream agree (typed events, increasing sequence numbers),
a stored response is retrieved, continued with previous_response_id and deleted, a forced
function call comes back as a `function_call` item whose arguments match the schema
(streaming and not), structured output matches its schema, a built-in tool is refused with
400 naming it, and an agent with one function tool runs it.

Usage: responses_client_check.py BASE_URL MODEL. Prints "ok" or exits non-zero with the first failure.
"""
import asyncio
import json
import os
import sys

# Before the Agents SDK loads: its traces would go to OpenAI's servers.
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"

import jsonschema
import openai
from openai import AsyncOpenAI, OpenAI

from client_checks import WEATHER, check, fail

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER, "strict": True}]


def calls_of(response, where):
    calls = [item for item in response.output if item.type == "function_call"]
    check(calls, f"{where}: no function_call item in {response.output}")
    for call in calls:
        check(call.name == "get_weather", f"{where}: called {call.name}")
        check(call.call_id.startswith("call_"), f"{where}: call_id {call.call_id}")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    return calls


# A plain answer, greedy, and the same answer streamed.
plain = dict(model=model, input="Tell me a story.", instructions="Be terse.", max_output_tokens=8, temperature=0)
whole = client.responses.create(**plain)
check(whole.object == "response" and whole.id.startswith("resp_"), f"not a response: {whole}")
check(whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens", f"status {whole.status} {whole.incomplete_details}")
check(whole.usage.output_tokens == 8 and whole.usage.input_tokens > 0, f"usage {whole.usage}")
check(whole.instructions == "Be terse." and whole.max_output_tokens == 8, f"echo {whole}")
check(whole.output_text, f"no output_text in {whole.output}")
with client.responses.stream(**plain) as stream:
    events = list(stream)
# The client's get_final_response() waits for `response.completed`; an answer cut by
# max_output_tokens ends with `response.incomplete`, which carries the response.
final = events[-1].response
check(final.output_text == whole.output_text, f"stream {final.output_text!r} != whole {whole.output_text!r}")
numbers = [event.sequence_number for event in events]
check(numbers == list(range(len(events))), f"sequence numbers {numbers}")
kinds = [event.type for event in events]
check(kinds[:2] == ["response.created", "response.in_progress"], f"events {kinds}")
check(kinds[-1] == "response.incomplete", f"events {kinds}")
for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
             "response.output_text.done", "response.content_part.done", "response.output_item.done"):
    check(kind in kinds, f"no {kind} in {kinds}")
deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
check(deltas == whole.output_text, f"deltas {deltas!r}")

# The store: retrieve, continue, delete.
got = client.responses.retrieve(whole.id)
check(got.id == whole.id and got.output_text == whole.output_text, f"retrieved {got}")
follow = client.responses.create(model=model, input="And then?", previous_response_id=whole.id, max_output_tokens=2)
check(follow.previous_response_id == whole.id, f"follow-up {follow}")
alone = client.responses.create(model=model, input="And then?", max_output_tokens=2, store=False)
# The follow-up's prompt holds the first turn (its input and its answer) before the same input.
check(follow.usage.input_tokens > alone.usage.input_tokens + whole.usage.output_tokens, f"follow-up usage {follow.usage}, alone {alone.usage}")
try:
    client.responses.retrieve(alone.id)
    fail("a response made with store: false was stored")
except openai.NotFoundError:
    pass
client.responses.delete(whole.id)
try:
    client.responses.retrieve(whole.id)
    fail("a deleted response was retrieved")
except openai.NotFoundError:
    pass
try:
    client.responses.create(model=model, input="x", previous_response_id=whole.id, max_output_tokens=1)
    fail("a deleted previous_response_id was accepted")
except openai.NotFoundError as e:
    check(e.body["param"] == "previous_response_id", f"error {e.body}")

# A forced function call, whole and streamed, then its output continues the conversation.
forced = dict(model=model, input="What is the weather in Paris?", tools=TOOLS,
              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=150)
called = client.responses.create(**forced)
call = calls_of(called, "forced")[0]
check(called.status == "completed", f"forced status {called.status}")
with client.responses.stream(**forced) as stream:
    kinds = [event.type for event in stream]
    calls_of(stream.get_final_response(), "forced, streamed")
for kind in ("response.function_call_arguments.delta", "response.function_call_arguments.done", "response.completed"):
    check(kind in kinds, f"no {kind} in {kinds}")
items = [{"role": "user", "content": "What is the weather in Paris?"},
         {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
         {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}]
after = client.responses.create(model=model, input=items, tools=TOOLS, max_output_tokens=2)
check(after.usage.input_tokens > called.usage.input_tokens, f"usage {after.usage}")

# Structured output.
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"], "additionalProperties": False}
shaped = client.responses.create(model=model, input="A city, as JSON.", max_output_tokens=200,
                                 text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
jsonschema.validate(json.loads(shaped.output_text), CITY)

# A built-in tool is refused, naming it.
try:
    client.responses.create(model=model, input="x", tools=[{"type": "web_search"}])
    fail("a web_search tool was accepted")
except openai.BadRequestError as e:
    check(e.body["param"] == "tools[0].type", f"error {e.body}")

# An agent with one function tool: the forced first call runs the tool, whose result is the
# agent's answer.
from typing import Annotated  # noqa: E402

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool  # noqa: E402
from pydantic import Field  # noqa: E402


# The city's length is bounded so that the random test model's call ends within max_tokens.
@function_tool
def get_weather(city: Annotated[str, Field(min_length=1, max_length=12)]) -> str:
    """The weather in a city."""
    return f"Sunny in {city}."


agent = Agent(
    name="weather",
    instructions="Answer with the weather.",
    tools=[get_weather],
    model=OpenAIResponsesModel(model=model, openai_client=AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)),
    model_settings=ModelSettings(tool_choice="get_weather", max_tokens=120, temperature=0),
    tool_use_behavior="stop_on_first_tool",
)
result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=2))
check(str(result.final_output).startswith("Sunny in "), f"agent answered {result.final_output!r}")

print("ok")
