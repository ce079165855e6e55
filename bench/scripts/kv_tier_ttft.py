#!/usr/bin/env python3
"""Time to first token of a long shared prefix from each KV tier against recomputing it.

Run outside CI, against a `plughost serve` whose device pool holds one prefix at a time (see
docs/benchmarks.md for the commands). Each round sends, side by side on one server:

1. a prefix never seen before (recomputed; it also evicts the shared prefix from the device);
2. the shared prefix with a new suffix (a hit in the tier below the device that holds it).

Each request asks for one token, so its time is its time to first token. Prints one line per
round and the medians. Standard library only.
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


def complete(base, model, prompt):
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"{base}/v1/completions", body, {"content-type": "application/json"}
    )
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.load(response)
    seconds = time.monotonic() - started
    cached = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return seconds, cached


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--prefix-len", type=int, default=6144)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only-shared",
        action="store_true",
        help="send the shared prefix once and stop (the first request after a restart)",
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    model = served_model(args.base_url)

    def tokens(n, r):
        return [r.randrange(100, 30000) for _ in range(n)]

    shared = tokens(args.prefix_len, random.Random(1_000_003))
    if args.only_shared:
        seconds, cached = complete(args.base_url, model, shared + tokens(args.suffix_len, rng))
        print(f"shared prefix: {seconds:.3f} s, cached_tokens {cached}")
        return
    # Computes the shared prefix once, so every round's shared request is a hit.
    seconds, cached = complete(args.base_url, model, shared + tokens(args.suffix_len, rng))
    print(f"first use of the shared prefix: {seconds:.3f} s, cached_tokens {cached}")
    fresh, hit = [], []
    for round_number in range(args.rounds):
        f, f_cached = complete(args.base_url, model, tokens(args.prefix_len + args.suffix_len, rng))
        h, h_cached = complete(args.base_url, model, shared + tokens(args.suffix_len, rng))
        fresh.append(f)
        hit.append(h)
        print(
            f"round {round_number}: recompute {f:.3f} s (cached {f_cached}), "
            f"shared prefix {h:.3f} s (cached {h_cached}), ratio {f / h:.1f}x"
        )
    print(
        f"median: recompute {statistics.median(fresh):.3f} s, shared prefix "
        f"{statistics.median(hit):.3f} s, ratio {statistics.median(fresh) / statistics.median(hit):.1f}x"
    )


if __name__ == "__main__":
    main()
