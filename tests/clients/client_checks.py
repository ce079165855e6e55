"""What the client checks share: failing with a message, and the schema of the weather tool
their forced calls must match."""
import sys

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}


def fail(message):
    print(f"FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)
