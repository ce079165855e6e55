"""Scrapes a plughost server's /metrics with prometheus_client's parser and checks what a router's
endpoint picker reads: the waiting, running and KV-usage gauges and cache_config_info, under
plughost's names and vLLM's, idle, under load and idle again.

Usage: metrics_contract_check.py BASE_URL MODEL BLOCK_SIZE NUM_BLOCKS. Prints "ok" or exits
non-zero with the first failure.
"""
import sys
import threading
import time
import urllib.request

from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

base, model, block_size, num_blocks = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
DEADLINE_S = 60


def fail(message):
    print(f"FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def scrape():
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


# (family name as the parser reports it, label of the block count)
NAMINGS = [("plughost_", "num_blocks"), ("vllm:", "num_gpu_blocks")]
GAUGES = ["num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"]


def load(families):
    """Per naming, the three gauges' values for the model, checked for type, labels and range."""
    values = {}
    for prefix, blocks_label in NAMINGS:
        for gauge in GAUGES:
            family = families.get(prefix + gauge)
            if family is None:
                fail(f"no {prefix}{gauge} family")
            if family.type != "gauge":
                fail(f"{prefix}{gauge} is a {family.type}, not a gauge")
            samples = [s for s in family.samples if s.labels.get("model_name") == model]
            if len(samples) != 1 or set(samples[0].labels) != {"model_name"}:
                fail(f"{prefix}{gauge} samples: {family.samples}")
            value = samples[0].value
            if gauge == "kv_cache_usage_perc" and not 0.0 <= value <= 1.0:
                fail(f"{prefix}{gauge} = {value} is outside 0..1")
            if gauge != "kv_cache_usage_perc" and (value < 0 or value != int(value)):
                fail(f"{prefix}{gauge} = {value} is not a count")
            values[prefix + gauge] = value
        info = families.get(prefix + "cache_config_info")
        if info is None or info.type != "gauge":
            fail(f"{prefix}cache_config_info: {info}")
        wanted = {"model_name": model, "block_size": block_size, blocks_label: num_blocks}
        if len(info.samples) != 1 or info.samples[0].value != 1.0 or \
                any(info.samples[0].labels.get(k) != v for k, v in wanted.items()) or \
                info.samples[0].labels.get("cache_dtype") not in ("f32", "f16", "bf16"):
            fail(f"{prefix}cache_config_info samples {info.samples}, wanted labels {wanted}")
    for gauge in GAUGES:
        if values["plughost_" + gauge] != values["vllm:" + gauge]:
            fail(f"{gauge}: plughost {values['plughost_' + gauge]} != vllm {values['vllm:' + gauge]}")
    return values


def wait_for(condition, what):
    started = time.monotonic()
    while True:
        values = load(scrape())
        if condition(values):
            return values
        if time.monotonic() - started > DEADLINE_S:
            fail(f"{what}: still {values} after {DEADLINE_S} s")
        time.sleep(0.05)


idle = wait_for(lambda v: all(v["plughost_" + g] == 0 for g in GAUGES), "idle")

client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
streams, started = [], threading.Semaphore(0)
stop = threading.Event()


def stream_one(i):
    stream = client.completions.create(model=model, prompt=f"Count to a thousand, {i}:", max_tokens=400,
                                       stream=True, extra_body={"ignore_eos": True})
    streams.append(stream)
    for n, _ in enumerate(stream):
        if n == 0:
            started.release()
        if stop.is_set():
            break
    stream.close()


threads = [threading.Thread(target=stream_one, args=(i,), daemon=True) for i in range(3)]
for t in threads:
    t.start()
for _ in threads:
    if not started.acquire(timeout=DEADLINE_S):
        fail("a stream never started")
busy = wait_for(lambda v: v["plughost_num_requests_running"] >= 1 and v["plughost_kv_cache_usage_perc"] > 0,
                "under load")
stop.set()
for t in threads:
    t.join(timeout=DEADLINE_S)
wait_for(lambda v: all(v["plughost_" + g] == 0 for g in GAUGES), "idle after the load")
print("ok")
