#!/usr/bin/env python3
"""Load test for a running `kiln serve` on loopback.

Phase 1 (stress): N streaming chat clients for T seconds, each disconnecting early at random. Checks that
no response is a 5xx other than a queue-full 503, that every stream that ran to the end is well formed
(one finish_reason, a usage chunk that agrees with it, `[DONE]` last), and that afterwards /metrics shows
no running or waiting request (no slot leak).

Phase 2 (throughput): 1 client, then K clients, each streaming fixed-length answers back to back for S
seconds; prints the aggregate generated tok/s of each and their ratio (how much batching buys).

Phase 3 (burst): one request puts a long system prompt in one slot, then B requests that share it arrive
at once, for R rounds; prints each round's cached prompt tokens and TTFT (the server's timings).

Bounded: time by --duration/--ratio-seconds, count by --max-requests and at most 256 clients; only
loopback URLs are accepted. Exit status 0 when every check passed.

    python scripts/loadtest.py --url http://127.0.0.1:11500 --clients 32 --duration 120
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
TOPICS = ["the sea", "a lighthouse keeper", "volcanoes", "a robot learning to paint", "the history of bread",
          "why the sky is blue", "a chess match", "migrating birds"]
SYSTEM = "You are a helpful assistant. Answer in plain prose."  # shared by every prompt: the prompt cache reuses it
BURST_SYSTEM = " ".join(["You answer questions about parcels for a shipping company, briefly and politely."] * 20)


@dataclass
class Stats:
    started: int = 0
    completed: int = 0
    disconnected: int = 0
    queue_full: int = 0
    tokens: int = 0
    statuses: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    ttft_ms: list = field(default_factory=list)  # as the client sees it: queue wait included
    queue_ms: list = field(default_factory=list)  # the server's timings
    server_ttft_ms: list = field(default_factory=list)

    def fail(self, message: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(message)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:11500")
    p.add_argument("--model", default="smollm2:135m")
    p.add_argument("--api-key")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of the stress phase")
    p.add_argument("--disconnect", type=float, default=0.25, help="share of streams the client drops early")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-requests", type=int, default=100_000, help="stop starting requests after this many")
    p.add_argument("--ratio-clients", type=int, default=8)
    p.add_argument("--ratio-seconds", type=float, default=30.0, help="seconds of each throughput run (0 skips them)")
    p.add_argument("--burst-clients", type=int, default=8, help="requests of each burst")
    p.add_argument("--burst-rounds", type=int, default=2, help="bursts (0 skips them)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if urlparse(args.url).hostname not in LOOPBACK:
        p.error(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))}), not {args.url}")
    if not all(1 <= n <= 256 for n in (args.clients, args.ratio_clients, args.burst_clients)):
        p.error("--clients, --ratio-clients and --burst-clients must be between 1 and 256")
    return args


def body(args, max_tokens: int, topic: str) -> dict:
    return {"model": args.model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Write a long, detailed story about {topic}."}]}


async def stream_once(client: httpx.AsyncClient, args, stats: Stats, max_tokens: int, drop_after: int | None,
                      topic: str) -> int:
    """One streamed chat request; returns the completion tokens of a stream read to the end (else 0)."""
    stats.started += 1
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body(args, max_tokens, topic)) as r:
        stats.statuses[r.status_code] = stats.statuses.get(r.status_code, 0) + 1
        if r.status_code != 200:
            error = json.loads(await r.aread()).get("error", {})
            if r.status_code == 503 and error.get("code") == "queue_full":
                stats.queue_full += 1
                await asyncio.sleep(float(r.headers.get("retry-after", 1)) * random.uniform(0.5, 1.5))
            elif r.status_code >= 500:
                stats.fail(f"HTTP {r.status_code}: {error}")
            else:
                stats.fail(f"unexpected HTTP {r.status_code}: {error}")
            return 0
        chunks, done, first = [], False, None
        async for line in r.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                done = True
                continue
            if done or not line.startswith("data: "):
                stats.fail(f"malformed stream line {line[:80]!r}")
                return 0
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
            chunks.append(chunk)
            if drop_after is not None and len(chunks) >= drop_after:
                stats.disconnected += 1
                return 0  # leaving the block closes the connection mid-stream
    problem = check_stream(chunks, done, max_tokens)
    if problem:
        stats.fail(problem)
        return 0
    stats.completed += 1
    if first is not None:
        stats.ttft_ms.append((first - t0) * 1e3)
    stats.queue_ms.append(chunks[-1]["timings"]["queue_ms"])
    stats.server_ttft_ms.append(chunks[-1]["timings"]["ttft_ms"])
    tokens = chunks[-1]["usage"]["completion_tokens"]
    stats.tokens += tokens
    return tokens


def check_stream(chunks: list[dict], done: bool, max_tokens: int) -> str | None:
    if not done:
        return "stream ended without data: [DONE]"
    if any("error" in c for c in chunks):
        return f"stream carried an error: {next(c['error'] for c in chunks if 'error' in c)}"
    if len({c["id"] for c in chunks}) != 1:
        return "chunks of one stream have different ids"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    if len(finishes) != 1 or finishes[0] not in ("stop", "length"):
        return f"expected one finish_reason of stop/length, got {finishes}"
    usage = chunks[-1].get("usage")
    if chunks[-1]["choices"] != [] or not usage:
        return "the last chunk is not the usage chunk"
    n = usage["completion_tokens"]
    texts = sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))
    if not 1 <= n <= max_tokens or texts > n or (finishes[0] == "length") != (n == max_tokens):
        return f"usage {usage} disagrees with {texts} text chunks, finish_reason {finishes[0]}, max_tokens {max_tokens}"
    if "timings" not in chunks[-1] or chunks[-1]["timings"]["completion_tokens"] != n:
        return "the usage chunk has no matching timings"
    return None


async def stress(args, client: httpx.AsyncClient) -> Stats:
    stats, deadline = Stats(), time.monotonic() + args.duration

    async def worker(i: int):
        rng = random.Random(i)
        while time.monotonic() < deadline and stats.started < args.max_requests:
            drop = rng.randint(1, args.max_tokens // 2) if rng.random() < args.disconnect else None
            try:
                await stream_once(client, args, stats, rng.randint(8, args.max_tokens), drop, rng.choice(TOPICS))
            except (httpx.HTTPError, ValueError, KeyError) as e:
                stats.fail(f"{type(e).__name__}: {e}")

    await asyncio.gather(*(worker(i) for i in range(args.clients)))
    return stats


async def throughput(args, client: httpx.AsyncClient, n_clients: int) -> dict:
    """Aggregate generated tokens per second of wall time with n clients streaming back to back."""
    stats, start = Stats(), time.perf_counter()
    deadline, ends = time.monotonic() + args.ratio_seconds, []

    async def worker(i: int):
        while time.monotonic() < deadline:
            await stream_once(client, args, stats, args.max_tokens, None, TOPICS[i % len(TOPICS)])
            ends.append(time.perf_counter())

    await asyncio.gather(*(worker(i) for i in range(n_clients)))
    elapsed = (max(ends) if ends else time.perf_counter()) - start
    return {"clients": n_clients, "requests": stats.completed, "tokens": stats.tokens, "seconds": round(elapsed, 2),
            "tok_per_s": round(stats.tokens / elapsed, 2) if elapsed > 0 else 0.0, "failures": stats.failures}


async def burst(args, client: httpx.AsyncClient, stats: Stats) -> list[dict]:
    """Bursts of requests sharing a long system prompt that one slot holds: what each reuses, and its TTFT."""
    def chat(question: str, max_tokens: int) -> dict:
        return {"model": args.model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "system", "content": BURST_SYSTEM}, {"role": "user", "content": question}]}

    rounds = []
    for r in range(args.burst_rounds):
        await client.post("/v1/chat/completions", json=chat(f"Round {r}: is the office open?", 1))
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(
            f"Round {r}, question {i}: where is parcel {1000 * r + i}?", 8)) for i in range(args.burst_clients)))
        timings = []
        for reply in replies:
            body = reply.json()
            if reply.status_code == 503 and body.get("error", {}).get("code") == "queue_full":
                stats.queue_full += 1
            elif reply.status_code != 200 or "timings" not in body:
                stats.fail(f"burst: HTTP {reply.status_code}: {str(body)[:200]}")
            else:
                timings.append(body["timings"])
        ttft = [t["ttft_ms"] for t in timings]
        rounds.append({"requests": len(timings), "prompt_tokens": [t["prompt_n"] + t["cache_n"] for t in timings],
                       "cached_tokens": [t["cache_n"] for t in timings],
                       "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_max": round(max(ttft), 1) if ttft else None})
    return rounds


async def gauge(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


def percentile(values: list, p: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(int(len(ordered) * p / 100), len(ordered) - 1)], 1) if ordered else None


async def main(args) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.clients, args.ratio_clients) + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=300, limits=limits) as client:
        print(f"stress: {args.clients} clients for {args.duration:.0f} s, {args.disconnect:.0%} disconnect early",
              file=sys.stderr)
        t0 = time.perf_counter()
        stats = await stress(args, client)
        stress_seconds = time.perf_counter() - t0
        leak_deadline = time.monotonic() + 30
        while (running := await gauge(client, "kiln_requests_running")) or await gauge(client, "kiln_requests_waiting"):
            if time.monotonic() > leak_deadline:
                stats.fail(f"slot leak: {running} requests still running 30 s after the clients stopped")
                break
            await asyncio.sleep(0.2)
        ratio = {}
        if args.ratio_seconds > 0:
            print(f"throughput: 1 client, then {args.ratio_clients}, {args.ratio_seconds:.0f} s each", file=sys.stderr)
            one = await throughput(args, client, 1)
            many = await throughput(args, client, args.ratio_clients)
            for run in (one, many):
                for failure in run["failures"]:
                    stats.fail(f"throughput run with {run['clients']} clients: {failure}")
            ratio = {"one": one, "many": many, "ratio": round(many["tok_per_s"] / one["tok_per_s"], 2) if one["tok_per_s"] else None}
        bursts = await burst(args, client, stats)
    samples = ("ttft_ms", "queue_ms", "server_ttft_ms")
    summary = {k: v for k, v in asdict(stats).items() if k not in samples}
    for name in samples:
        summary[f"{name}_p50"], summary[f"{name}_p95"] = percentile(getattr(stats, name), 50), percentile(getattr(stats, name), 95)
    result = {"stress": {**summary, "seconds": round(stress_seconds, 1), "tok_per_s": round(stats.tokens / stress_seconds, 2)},
              "throughput": ratio, "burst": bursts, "ok": not stats.failures}
    s = result["stress"]
    print(f"stress: {s['started']} requests, {s['completed']} completed, {s['disconnected']} dropped by the client, "
          f"{s['queue_full']} queue-full 503s, statuses {s['statuses']}, {s['tokens']} tokens "
          f"({s['tok_per_s']} tok/s); p50/p95: client TTFT {s['ttft_ms_p50']}/{s['ttft_ms_p95']} ms, server queue wait "
          f"{s['queue_ms_p50']}/{s['queue_ms_p95']} ms, server TTFT {s['server_ttft_ms_p50']}/{s['server_ttft_ms_p95']} ms")
    if ratio:
        print(f"throughput: 1 client {ratio['one']['tok_per_s']} tok/s, {ratio['many']['clients']} clients "
              f"{ratio['many']['tok_per_s']} tok/s, ratio {ratio['ratio']}")
    for i, b in enumerate(bursts):
        print(f"burst {i}: {b['requests']} requests of {min(b['prompt_tokens'], default=0)}-{max(b['prompt_tokens'], default=0)} "
              f"prompt tokens, cached {sorted(b['cached_tokens'])}; TTFT median {b['ttft_ms_p50']} ms, max {b['ttft_ms_max']} ms")
    for failure in stats.failures:
        print(f"FAIL: {failure}")
    print("ok" if result["ok"] else "FAILED")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
