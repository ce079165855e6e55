"""Calls a plughost server that requires an API key with the official openai client: the right key
works, a wrong one raises the client's AuthenticationError with the server's OpenAI error body.

Usage: openai_api_key_check.py BASE_URL MODEL KEY. Exits non-zero with a message on the first failure.
"""
import sys

import openai
from openai import OpenAI

base, model, key = sys.argv[1], sys.argv[2], sys.argv[3]


def check(condition, message):
    if not condition:
        print(f"FAILED: {message}", file=sys.stderr)
        sys.exit(1)


client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
models = client.models.list()
check([m.id for m in models.data] == [model], f"models: {models}")
completion = client.completions.create(model=model, prompt="Hello, the", max_tokens=2, temperature=0,
                                       extra_body={"ignore_eos": True})
check(completion.usage.completion_tokens == 2, f"completion: {completion}")

wrong = OpenAI(base_url=f"{base}/v1", api_key=key + "-wrong", max_retries=0)
try:
    wrong.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    check(False, "a wrong key must be refused")
except openai.AuthenticationError as error:
    check(error.status_code == 401, f"status: {error!r}")
    check(error.code == "invalid_api_key" and error.type == "authentication_error", f"body: {error.body!r}")

print("ok")
