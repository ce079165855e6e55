#!/usr/bin/env python3
"""Steady decode speed with the KV tiers on against off: two servers, alternating rounds.

Run outside CI, against two `plughost serve` of the same model and options, one with
`--kv-offload-*` and one without (see docs/benchmarks.md). Each round sends the same short
prompt to each server in turn and asks for `--output-len` tokens past end-of-sequence; the
time per output token excludes the first token. Prints every round and the medians.
Standard library only.
"""

import argparse
import json
import random
import statistics
import time
import urllib.request


def served_model(base):
    with urllib.request.urlopen(f"{base}/v1/models", timeout=60) as response:
        return json.load(response)["data"][0]["id"]


def decode_tokens_per_second(base, model, prompt, output_len):
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": output_len,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"{base}/v1/completions", body, {"content-type": "application/json"}
    )
    started = time.monotonic()
    first = None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data: {") and first is None:
                first = time.monotonic()
    ended = time.monotonic()
    return (output_len - 1) / (ended - (first or started))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--off-url", required=True)
    parser.add_argument("--on-url", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    rng = random.Random(7)
    models = {url: served_model(url) for url in (args.off_url, args.on_url)}
    off, on = [], []
    for round_number in range(args.rounds):
        prompt = [rng.randrange(100, 30000) for _ in range(args.input_len)]
        # Alternate which goes first, so neither always meets the other's leftovers.
        order = [(args.off_url, off), (args.on_url, on)]
        if round_number % 2:
            order.reverse()
        for url, results in order:
            results.append(decode_tokens_per_second(url, models[url], prompt, args.output_len))
        print(f"round {round_number}: off {off[-1]:.2f} tok/s, on {on[-1]:.2f} tok/s")
    print(
        f"median: off {statistics.median(off):.2f} tok/s, on {statistics.median(on):.2f} tok/s, "
        f"on/off {statistics.median(on) / statistics.median(off):.3f}"
    )


if __name__ == "__main__":
    main()
