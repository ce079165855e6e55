#!/usr/bin/env python3
"""Steady decode with the KV tiers on against off, while a stream of long requests finishes.

Run outside CI, against two `plughost serve` of the same model and options, one with
`--kv-offload-*` and one without (see docs/benchmarks.md). In each round, on each server in
turn (alternating which goes first), `--decoders` streaming requests decode `--output-len`
tokens past end-of-sequence while one client after another sends a new `--churn-input-len`
token prompt for `--churn-output-len` tokens: each of those, when it finishes, leaves its
blocks cached-free, and with offload on they are copied out of the device during the
decoders' steps. Both servers get the same prompts in a round, and no prompt repeats, so
nothing is a prefix hit. Reports the decoders' tokens per second (the first token excluded) and the
gaps between their tokens (p50, p99: a step's length as a client sees it), per round and as
medians, and the blocks copied down during the round. Standard library only.
"""

import argparse
import json
import random
import statistics
import threading
import time
import urllib.request


def served_model(base):
    with urllib.request.urlopen(f"{base}/v1/models", timeout=60) as response:
        return json.load(response)["data"][0]["id"]


def stored_blocks(base):
    with urllib.request.urlopen(f"{base}/metrics", timeout=60) as response:
        for line in response.read().decode().splitlines():
            if line.startswith('plughost_kv_tier_blocks_moved_total{direction="device_to_host"}'):
                return float(line.split()[-1])
    return 0.0


def completion(model, prompt, max_tokens):
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }


def post(base, body, stream):
    request = urllib.request.Request(
        f"{base}/v1/completions",
        json.dumps(dict(body, stream=stream)).encode(),
        {"content-type": "application/json"},
    )
    return urllib.request.urlopen(request, timeout=900)


def decode(base, model, prompt, output_len, out):
    stamps = []
    with post(base, completion(model, prompt, output_len), True) as response:
        for line in response:
            if line.startswith(b"data: {"):
                stamps.append(time.monotonic())
    out.append(stamps)


def churn(base, model, rng, input_len, output_len, stop, count):
    while not stop.is_set():
        prompt = [rng.randrange(100, 30000) for _ in range(input_len)]
        with post(base, completion(model, prompt, output_len), False) as response:
            response.read()
        count[0] += 1


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_round(base, model, args, seed):
    rng = random.Random(seed)
    stored_before = stored_blocks(base)
    stop, count = threading.Event(), [0]
    churner = threading.Thread(
        target=churn,
        args=(base, model, rng, args.churn_input_len, args.churn_output_len, stop, count),
    )
    results = []
    decoders = [
        threading.Thread(
            target=decode,
            args=(
                base,
                model,
                [rng.randrange(100, 30000) for _ in range(args.input_len)],
                args.output_len,
                results,
            ),
        )
        for _ in range(args.decoders)
    ]
    churner.start()
    for thread in decoders:
        thread.start()
    for thread in decoders:
        thread.join()
    stop.set()
    churner.join()
    rate = sum((len(s) - 1) / (s[-1] - s[0]) for s in results if len(s) > 1)
    gaps = [b - a for s in results for a, b in zip(s, s[1:])]
    return {
        "tok_s": rate,
        "gap_p50_ms": 1000 * percentile(gaps, 0.5),
        "gap_p99_ms": 1000 * percentile(gaps, 0.99),
        "churned": count[0],
        "stored_blocks": stored_blocks(base) - stored_before,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--off-url", required=True)
    parser.add_argument("--on-url", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decoders", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--churn-input-len", type=int, default=512)
    parser.add_argument("--churn-output-len", type=int, default=2)
    parser.add_argument(
        "--seed",
        type=int,
        default=int(time.time()),
        help="prompts of round r come from seed*1000+r: the same on both servers, new each round",
    )
    args = parser.parse_args()
    models = {url: served_model(url) for url in (args.off_url, args.on_url)}
    rows = {"off": [], "on": []}
    for round_number in range(args.rounds):
        order = [("off", args.off_url), ("on", args.on_url)]
        if round_number % 2:
            order.reverse()
        for name, url in order:
            row = run_round(url, models[url], args, seed=1000 * args.seed + round_number)
            rows[name].append(row)
            print(f"round {round_number} {name}: {json.dumps(row)}", flush=True)
        ratio = rows["on"][-1]["tok_s"] / rows["off"][-1]["tok_s"]
        print(f"round {round_number} on/off tok/s: {ratio:.3f}", flush=True)
    for name in ("off", "on"):
        medians = {
            key: statistics.median(row[key] for row in rows[name])
            for key in ("tok_s", "gap_p50_ms", "gap_p99_ms", "churned", "stored_blocks")
        }
        print(f"median {name}: {json.dumps(medians)}")
    ratios = [on["tok_s"] / off["tok_s"] for on, off in zip(rows["on"], rows["off"])]
    print(
        "on/off tok/s: median of medians "
        f"{statistics.median(r['tok_s'] for r in rows['on']) / statistics.median(r['tok_s'] for r in rows['off']):.3f}, "
        f"rounds {', '.join(f'{r:.3f}' for r in ratios)}"
    )


if __name__ == "__main__":
    main()
