#!/usr/bin/env python3
"""RSS of `plughost serve` around eight concurrent chat requests at the body-size limit.

Usage: measure_memory.py PLUGHOST_BINARY [--device LIB] [--model DIR] [--plugins-dir DIR]
                         [--concurrency 8] [--rounds 3] [-- extra serve flags]

Starts the server on a free port, finds the body limit from the 413 of an oversize body,
then runs ROUNDS rounds of CONCURRENCY chat requests whose bodies are just under the limit
(one user message of plain words). Prints the RSS (/proc/PID/status VmRSS) before the first
round, each round's peak (VmHWM after resetting it through /proc/PID/clear_refs, else VmRSS
sampled every 10 ms), and the RSS one and five seconds after each round. Python 3 standard
library only.
"""
import argparse, json, os, re, socket, subprocess, sys, threading, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def status_mib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field}")


def rss_mib(pid):
    return status_mib(pid, "VmRSS")


def reset_peak(pid):
    """Makes VmHWM start again from the current RSS (Linux 4.0+; needs to own the process)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def request(port, method, path, body=b"", timeout=600):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        s.sendall(head.encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def chat_body(size):
    words = ("the quick brown fox jumps over a lazy dog while seven wizards "
             "quietly hex every jolly vexing bog ").split()
    parts, n, i = [], 0, 0
    prefix = b'{"model":"tiny-qwen3","max_tokens":4,"messages":[{"role":"user","content":"'
    suffix = b'"}]}'
    budget = size - len(prefix) - len(suffix)
    while n < budget - 16:
        w = words[i % len(words)] + (" " if i % 13 else ". ")
        parts.append(w)
        n += len(w)
        i += 1
    return prefix + "".join(parts).encode() + suffix


def main():
    p = argparse.ArgumentParser()
    p.add_argument("binary")
    p.add_argument("--device", default=str(ROOT / "target/plugins/libplughost_device_mock.so"))
    p.add_argument("--model", default=str(ROOT / "tests/fixtures/tiny-qwen3"))
    p.add_argument("--plugins-dir", default=str(ROOT / "target/plugins"))
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("extra", nargs="*")
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [a.binary, "serve", "--model", a.model, "--device", a.device, "--plugins-dir",
         a.plugins_dir, "--port", str(port), *a.extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                if request(port, "GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline or server.poll() is not None:
                sys.exit("the server did not come up")
            time.sleep(0.1)
        status, body = request(port, "POST", "/v1/chat/completions", b" " * ((32 << 20) + 1))
        limit = int(re.search(rb"limit of (\d+) bytes", body).group(1)) if status == 413 else 16 << 20
        body = chat_body(limit - 64)
        # Warm up: the first requests allocate the server's lasting state.
        for _ in range(2):
            request(port, "POST", "/v1/chat/completions", chat_body(4096))
        time.sleep(1)
        before = rss_mib(server.pid)
        print(f"body limit {limit} bytes; bodies of {len(body)} bytes; {a.concurrency} concurrent")
        print(f"RSS before: {before:.0f} MiB")
        for r in range(a.rounds):
            statuses, peak, done = [], [before], threading.Event()

            def one():
                statuses.append(request(port, "POST", "/v1/chat/completions", body)[0])

            def sample():
                while not done.is_set():
                    peak[0] = max(peak[0], rss_mib(server.pid))
                    time.sleep(0.01)

            exact_peak = reset_peak(server.pid)
            sampler = threading.Thread(target=sample)
            sampler.start()
            threads = [threading.Thread(target=one) for _ in range(a.concurrency)]
            t0 = time.time()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            done.set()
            sampler.join()
            took = time.time() - t0
            if exact_peak:
                peak[0] = max(peak[0], status_mib(server.pid, "VmHWM"))
            time.sleep(1)
            after1 = rss_mib(server.pid)
            time.sleep(4)
            after5 = rss_mib(server.pid)
            print(f"round {r + 1}: statuses {sorted(set(statuses))} in {took:.1f} s; "
                  f"peak {peak[0]:.0f} MiB (+{peak[0] - before:.0f}); "
                  f"after 1 s {after1:.0f} MiB (+{after1 - before:.0f}); "
                  f"after 5 s {after5:.0f} MiB (+{after5 - before:.0f})")
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
