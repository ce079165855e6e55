"""Drives a plughost server's Messages API through the official anthropic client: a plain
answer and its stream agree, a forced tool comes back as a `tool_use` block whose input
matches its schema (streaming and not), a tool result continues the conversation,
count_tokens counts the prompt, and a bad request raises the client's typed error.

Usage: anthropic_client_check.py BASE_URL MODEL. Prints "ok" or exits non-zero with the first failure.
"""
import json
import sys

import anthropic
import jsonschema

from client_checks import WEATHER, check, fail

base, model = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)

TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# The test model is random and would never end a reasoning block, after which a forced call
# starts: thinking off, so the call is forced from the first token.
NO_THINKING = {"type": "disabled"}


def check_tool_use(message, where):
    calls = [b for b in message.content if b.type == "tool_use"]
    check(calls, f"{where}: no tool_use block in {message.content}")
    for call in calls:
        check(call.name == "get_weather", f"{where}: called {call.name}")
        check(call.id, f"{where}: a tool_use block without an id")
        try:
            jsonschema.validate(call.input, WEATHER)
        except jsonschema.ValidationError as e:
            fail(f"{where}: input {call.input} does not match the schema: {e.message}")
    check(message.stop_reason == "tool_use", f"{where}: stop_reason {message.stop_reason}")
    return calls[0]


# A plain answer, greedy, and the same answer streamed.
# This client version has no `temperature` argument; the server still takes the field.
GREEDY = {"temperature": 0}
plain = dict(model=model, max_tokens=12, system="Be terse.", messages=MESSAGES, thinking=NO_THINKING, extra_body=GREEDY)
whole = client.messages.create(**plain)
check(whole.type == "message" and whole.role == "assistant", f"not a message: {whole}")
check(whole.id.startswith("msg_"), f"id {whole.id}")
check(whole.stop_reason in ("max_tokens", "end_turn"), f"stop_reason {whole.stop_reason}")
check(whole.usage.output_tokens >= 1, f"usage {whole.usage}")
check(whole.usage.output_tokens <= 12, f"usage {whole.usage}")
text = "".join(b.text for b in whole.content if b.type == "text")
with client.messages.stream(**plain) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
check(streamed == text, f"stream {streamed!r} != whole {text!r}")
check(final.stop_reason == whole.stop_reason, f"stream stop_reason {final.stop_reason}")
check(final.usage.output_tokens == whole.usage.output_tokens, f"stream usage {final.usage}")

# A stop sequence taken from the greedy answer ends the same answer there, and is named.
check(len(text) >= 3, f"too short an answer to take a stop sequence from: {text!r}")
stop = text[-3:]
stopped = client.messages.create(**{**plain, "stop_sequences": [stop]})
stopped_text = "".join(b.text for b in stopped.content if b.type == "text")
check(stopped.stop_reason == "stop_sequence", f"stop_reason {stopped.stop_reason} for {stop!r} in {text!r}")
check(stopped.stop_sequence == stop, f"stop_sequence {stopped.stop_sequence!r}, sent {stop!r}")
check(stopped_text == text[: text.find(stop)], f"{stopped_text!r} is not {text!r} cut at {stop!r}")

# The prompt's tokens: what create counted, cached or not.
counted = client.messages.count_tokens(model=model, system="Be terse.", messages=MESSAGES, thinking=NO_THINKING)
prompt = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
check(counted.input_tokens == prompt, f"count_tokens {counted.input_tokens} != {prompt}")

# A forced tool, whole and streamed; then its result continues the conversation.
forced = dict(
    model=model,
    max_tokens=200,
    messages=MESSAGES,
    tools=TOOLS,
    tool_choice={"type": "tool", "name": "get_weather"},
    thinking=NO_THINKING,
)
call = check_tool_use(client.messages.create(**forced), "forced")
with client.messages.stream(**forced) as stream:
    events = [event.type for event in stream]
    final = stream.get_final_message()
check_tool_use(final, "forced, streamed")
for expected in ("message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"):
    check(expected in events, f"no {expected} event in {events}")
follow_up = MESSAGES + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 degrees."}]},
]
after = client.messages.create(model=model, max_tokens=4, messages=follow_up, tools=TOOLS, thinking=NO_THINKING)
check(after.usage.input_tokens + (after.usage.cache_read_input_tokens or 0) > prompt, f"usage {after.usage}")

# Structured output: the text is JSON that matches the schema.
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"], "additionalProperties": False}
shaped = client.messages.create(
    model=model, max_tokens=120, messages=MESSAGES, thinking=NO_THINKING,
    output_config={"format": {"type": "json_schema", "schema": CITY}},
)
jsonschema.validate(json.loads("".join(b.text for b in shaped.content if b.type == "text")), CITY)

# A request the server cannot honour: the client's typed error, in Anthropic's shape.
try:
    client.messages.create(
        model=model,
        max_tokens=4,
        messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}]}],
    )
    fail("an image block was accepted")
except anthropic.BadRequestError as e:
    check(e.body["type"] == "error", f"error body {e.body}")
    check(e.body["error"]["type"] == "invalid_request_error", f"error body {e.body}")
    check("messages[0].content[0].type" in e.body["error"]["message"], f"error body {e.body}")

print("ok")
