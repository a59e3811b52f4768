#!/usr/bin/env python3
"""Through Ray Serve vs `kiln serve`: one streaming client's TTFT and decode tok/s, then N clients' aggregate
generated tok/s, against a running server on loopback (docs/PERF.md, "kiln on Ray Serve").

    python scripts/ray_bench.py --url http://127.0.0.1:8000 --model smollm2:135m --clients 8
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def stream_once(client: httpx.Client, url: str, model: str, max_tokens: int, topic: str,
                filler: str = "") -> tuple[float, float, int]:
    """(TTFT seconds, decode tok/s, tokens) of one streamed chat, as the client sees them. The client keeps
    its connection between requests, as an API client does: a new httpx client costs tens of ms to set up."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Write about {topic}.{filler}"}]}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
                tokens += 1
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
    return first - start, decode, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--single", type=int, default=5, help="one client's requests (the median is reported)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--per-client", type=int, default=3, help="requests each of the --clients sends back to back")
    p.add_argument("--prompt-words", type=int, default=0,
                   help="words added to each prompt after its topic (a longer prompt, none of it cached)")
    args = p.parse_args()
    if urlparse(args.url).hostname not in LOOPBACK:
        sys.exit("ray_bench.py only measures servers on loopback")
    filler = "".join(f" word{i}" for i in range(args.prompt_words))
    run = secrets.token_hex(4)  # no prompt of this run is in a server's prompt cache from an earlier one

    with httpx.Client() as one:
        stream_once(one, args.url, args.model, 8, "warming up")
        single = [stream_once(one, args.url, args.model, args.max_tokens, f"topic {i} of run {run}", filler)
                  for i in range(args.single)]
    ttft = statistics.median(s[0] for s in single) * 1e3
    decode = statistics.median(s[1] for s in single)

    def client(i: int, own: httpx.Client) -> int:
        return sum(stream_once(own, args.url, args.model, args.max_tokens, f"client {i} topic {j} of run {run}",
                               filler)[2] for j in range(args.per_client))

    clients = [httpx.Client() for _ in range(args.clients)]

    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        generated = sum(pool.map(client, range(args.clients), clients))
    aggregate = generated / (time.perf_counter() - start)
    for own in clients:
        own.close()
    print(json.dumps({"ttft_ms": round(ttft, 1), "decode_tps": round(decode, 1), "clients": args.clients,
                      "aggregate_tps": round(aggregate, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
