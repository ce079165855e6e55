"""Calls a plughost server with the official openai client: completions and chat, streaming and not.

Usage: openai_client_check.py BASE_URL MODEL. Exits non-zero with a message on the first failure.
"""
import sys

from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=f"{base}/v1", api_key="unused")


def check(condition, message):
    if not condition:
        print(f"FAILED: {message}", file=sys.stderr)
        sys.exit(1)


models = client.models.list()
check([m.id for m in models.data] == [model], f"models: {models}")

completion = client.completions.create(model=model, prompt="Hello, the", max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
check(len(completion.choices) == 1 and completion.choices[0].finish_reason == "length", f"completion: {completion}")
check(completion.usage.completion_tokens == 8 and completion.usage.prompt_tokens > 0, f"usage: {completion.usage}")

streamed = client.completions.create(model=model, prompt="Hello, the", max_tokens=8, temperature=0, stream=True,
                                     stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
text, usage = "", None
for chunk in streamed:
    if chunk.choices:
        text += chunk.choices[0].text
    if chunk.usage is not None:
        usage = chunk.usage
check(text == completion.choices[0].text, f"streamed text {text!r} != {completion.choices[0].text!r}")
check(usage is not None and usage.completion_tokens == 8, f"streamed usage: {usage}")

messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, seed=3)
check(chat.choices[0].message.role == "assistant", f"chat: {chat}")
check(chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens, f"chat usage: {chat.usage}")

stream = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, seed=3,
                                        stream=True, stream_options={"include_usage": True})
content, usage = "", None
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        content += chunk.choices[0].delta.content
    if chunk.usage is not None:
        usage = chunk.usage
check(content == (chat.choices[0].message.content or ""), f"streamed chat {content!r} != {chat.choices[0].message.content!r}")
check(usage is not None and usage.completion_tokens == chat.usage.completion_tokens, f"streamed chat usage: {usage}")

try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    check(False, "an unknown model must fail")
except Exception as error:  # the client raises NotFoundError with the OpenAI body
    check(getattr(error, "status_code", None) == 404, f"unknown model: {error!r}")

print("ok")
