"""Several models served at once by a running `kiln serve`: aggregate decode throughput with clients split
over the models against all of them on one, and what switching from one model to another costs.

    python scripts/models_bench.py --url http://127.0.0.1:11500 --models a,b --clients 16 --seconds 20
    python scripts/models_bench.py --url ... --models a,b --switches 6

Throughput: `--clients` clients in all, split evenly over `--models`, each sending back-to-back
chat completions (scripts/loadtest.py's stories) of up to `--max-tokens`; tokens counted from the replies' usage, over the wall time until the last
reply. Switches: one short request to each model in turn; the latency of each request that follows a
request to another model (with both resident it is a request; with one resident, a reload and a request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from loadtest import TOPICS  # the script beside this one: the same stories as its load


async def complete(client: httpx.AsyncClient, url: str, model: str, max_tokens: int, topic: str = TOPICS[0]) -> int:
    r = await client.post(f"{url}/v1/chat/completions", json={
        "model": model, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": f"Write a long, detailed story about {topic}."}]})
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def throughput(url: str, models: list[str], clients: int, seconds: float, max_tokens: int) -> dict:
    tokens = {m: 0 for m in models}
    ends: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:
        for m in models:  # loaded before the clock starts
            await complete(client, url, m, 1)
        start = time.perf_counter()
        deadline = time.monotonic() + seconds

        async def worker(i: int):
            model = models[i % len(models)]
            while time.monotonic() < deadline:
                n = await complete(client, url, model, max_tokens, TOPICS[i % len(TOPICS)])
                tokens[model] += n  # after the await: `+= await` would add to the count read before it
                ends.append(time.perf_counter())

        await asyncio.gather(*(worker(i) for i in range(clients)))
    elapsed = max(ends) - start
    return {"models": models, "clients": clients, "seconds": round(elapsed, 2), "tokens": tokens,
            "tok_per_s": round(sum(tokens.values()) / elapsed, 1)}


async def switches(url: str, models: list[str], rounds: int) -> dict:
    latencies = []
    async with httpx.AsyncClient(timeout=600) as client:
        for m in models:
            await complete(client, url, m, 1)
        for i in range(rounds * len(models)):
            t0 = time.perf_counter()
            await complete(client, url, models[i % len(models)], 1)
            latencies.append((time.perf_counter() - t0) * 1e3)
    return {"models": models, "switches": len(latencies), "median_ms": round(statistics.median(latencies), 1),
            "min_ms": round(min(latencies), 1), "max_ms": round(max(latencies), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:11500")
    p.add_argument("--models", required=True, help="comma-separated tags")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--switches", type=int, default=0, help="rounds of switching instead of a throughput run")
    args = p.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.switches:
        result = asyncio.run(switches(args.url, models, args.switches))
    else:
        result = asyncio.run(throughput(args.url, models, args.clients, args.seconds, args.max_tokens))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
