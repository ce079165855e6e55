"""Copies the response schemas of OpenAI's OpenAPI description, at a pinned commit of the
openai/openai-openapi repository, into tests/fixtures/openai-schemas/schemas.json for the
schema tests (tests/api/openai_schemas.rs).

Usage: openai_schemas.py CHECKOUT, where CHECKOUT is a clone of openai/openai-openapi (any
branch: the pinned commit is read with `git show`). The test suite only reads the output.

The output holds the root schemas below and every schema they reference, transitively, as
the spec states them, with one mechanical rewrite: the spec is OpenAPI 3.1 but still marks
some schemas `nullable: true`, OpenAPI 3.0's keyword that JSON Schema does not know. Each such
schema `S` becomes `{"anyOf": [S without nullable, {"type": "null"}]}`, which is what it means.
"""
import json
import subprocess
import sys
from pathlib import Path

COMMIT = "f85dbe223d40e1a31cba812ab2d755c7e98a92a3"
ROOTS = [
    "ListModelsResponse",
    "CreateCompletionResponse",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "ErrorResponse",
    "Response",
    "ResponseStreamEvent",
]
PREFIX = "#/components/schemas/"
OUT = Path(__file__).resolve().parent.parent / "fixtures" / "openai-schemas" / "schemas.json"


def refs(node):
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(PREFIX):
            yield ref[len(PREFIX):]
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def without_nullable(node):
    if isinstance(node, list):
        return [without_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: without_nullable(v) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


def main():
    checkout = sys.argv[1]
    text = subprocess.run(
        ["git", "-C", checkout, "show", f"{COMMIT}:openapi.json"],
        check=True, capture_output=True, text=True,
    ).stdout
    schemas = json.loads(text)["components"]["schemas"]
    wanted, todo = {}, list(ROOTS)
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted[name] = schemas[name]
        todo.extend(refs(schemas[name]))
    out = {
        "source": f"openai/openai-openapi {COMMIT} openapi.json",
        "roots": ROOTS,
        "components": {"schemas": {n: without_nullable(wanted[n]) for n in sorted(wanted)}},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{len(wanted)} schemas written to {OUT}")


if __name__ == "__main__":
    main()
