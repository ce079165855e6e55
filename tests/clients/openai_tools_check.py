"""Calls a plughost server's chat completions with tools through the official openai client:
`tool_choice: "required"` and a named function, streaming and not, must come back as parsable
calls of a listed function whose arguments validate against its parameters schema.

Usage: openai_tools_check.py BASE_URL MODEL. Prints "ok" or exits non-zero with the first failure.
"""
import json
import sys

import jsonschema
from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# The test model is random and would never end a reasoning block, after which a forced call
# starts: thinking off, so the call is forced from the first token.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def fail(message):
    print(f"FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def check_calls(calls, allowed, where):
    if not calls:
        fail(f"{where}: no tool calls")
    for call in calls:
        if call["name"] not in allowed:
            fail(f"{where}: called {call['name']}, allowed {allowed}")
        try:
            arguments = json.loads(call["arguments"])
        except json.JSONDecodeError as e:
            fail(f"{where}: arguments {call['arguments']!r} do not parse: {e}")
        try:
            jsonschema.validate(arguments, SCHEMAS[call["name"]])
        except jsonschema.ValidationError as e:
            fail(f"{where}: arguments {arguments} do not match the schema: {e.message}")
        if not call["id"].startswith("call_"):
            fail(f"{where}: call id {call['id']!r}")


def whole(tool_choice, seed):
    response = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, max_tokens=300, temperature=0.8, seed=seed, extra_body=NO_THINKING)
    choice = response.choices[0]
    if choice.finish_reason != "tool_calls":
        fail(f"{tool_choice}: finish_reason {choice.finish_reason}: {choice}")
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []]
    return calls


def streamed(tool_choice, seed):
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, max_tokens=300, temperature=0.8, seed=seed, stream=True,
        extra_body=NO_THINKING)
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    if finish != "tool_calls":
        fail(f"{tool_choice} streamed: finish_reason {finish}")
    return [calls[i] for i in sorted(calls)]


named = {"type": "function", "function": {"name": "get_time"}}
for seed in range(3):
    check_calls(whole("required", seed), {"get_weather", "get_time"}, f"required, seed {seed}")
    check_calls(whole(named, seed), {"get_time"}, f"named, seed {seed}")
    streamed_calls = streamed("required", seed)
    check_calls(streamed_calls, {"get_weather", "get_time"}, f"required streamed, seed {seed}")
    again = whole("required", seed)
    if [(c["name"], c["arguments"]) for c in again] != [(c["name"], c["arguments"]) for c in streamed_calls]:
        fail(f"seed {seed}: streamed {streamed_calls} != whole {again}")
print("ok")
