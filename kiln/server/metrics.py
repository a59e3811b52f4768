"""Prometheus metrics for `GET /metrics`, in a registry of the app's own (so several apps can coexist)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self, stats: Callable[[], dict]):
        """`stats()` gives the schedulers' running/waiting/KV numbers at scrape time, summed over the loaded
        models (zeros when none is)."""
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of finished requests (embeddings' too), cached "
                                     "ones included", registry=r)
        self.cached_tokens = Counter("kiln_prompt_cached_tokens", "Prompt tokens reused from the KV cache", registry=r)
        self.generated_tokens = Counter("kiln_generated_tokens", "Tokens generated", registry=r)
        self.draft_tokens = Counter("kiln_draft_tokens", "Tokens proposed by speculative decoding", registry=r)
        self.draft_accepted = Counter("kiln_draft_accepted_tokens", "Proposed tokens the target model accepted",
                                      registry=r)
        self.requests = Counter("kiln_requests", "Generation requests by API and how they ended", ["api", "finish_reason"],
                                registry=r)
        self.embedding_inputs = Counter("kiln_embedding_inputs", "Inputs embedded, by API", ["api"], registry=r)
        self.rejected = Counter("kiln_requests_rejected", "Requests turned away before generating", ["reason"], registry=r)
        self.duration = Histogram("kiln_request_duration_seconds", "Whole request: queue, prefill and decode",
                                  buckets=_LATENCY, registry=r)
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "From getting a slot to the first token",
                              buckets=_LATENCY, registry=r)
        self.queue_wait = Histogram("kiln_queue_wait_seconds", "Time spent waiting for a KV slot",
                                    buckets=_LATENCY, registry=r)
        self.prefill_tps = Histogram("kiln_prefill_tokens_per_second", "Prompt tokens computed per second, per request",
                                     buckets=(10, 25, 50, 100, 250, 500, 1000, 2500, 5000), registry=r)
        self.decode_tps = Histogram("kiln_decode_tokens_per_second", "Tokens generated per second, per request",
                                    buckets=(1, 2.5, 5, 10, 25, 50, 100, 250, 500), registry=r)
        gauges = {
            "running": ("kiln_requests_running", "Requests holding a KV slot"),
            "waiting": ("kiln_requests_waiting", "Requests queued for a KV slot"),
            "kv_used": ("kiln_kv_cache_tokens_used", "KV positions held by running requests"),
            "kv_cached": ("kiln_kv_cache_tokens_cached", "KV positions kept in idle slots for prompt reuse"),
        }
        for key, (name, doc) in gauges.items():
            Gauge(name, doc, registry=r).set_function(lambda key=key: stats()[key])
        Gauge("kiln_kv_cache_usage_ratio", "KV positions held by running requests / all KV positions",
              registry=r).set_function(lambda: stats()["kv_used"] / max(stats()["kv_capacity"], 1))
        self.loads = Counter("kiln_model_loads", "Models loaded (first loads, reloads after an eviction, an expiry "
                             "or another num_ctx), by model", ["model"], registry=r)

    def observe(self, api: str, finish_reason: str, timings) -> None:
        t = timings
        self.requests.labels(api, finish_reason).inc()
        self.prompt_tokens.inc(t.prompt_tokens)
        self.cached_tokens.inc(t.cached_tokens)
        self.generated_tokens.inc(t.completion_tokens)
        self.draft_tokens.inc(t.draft_tokens)
        self.draft_accepted.inc(t.draft_accepted)
        self.queue_wait.observe(t.queue_ms / 1e3)
        self.duration.observe((t.queue_ms + t.total_ms) / 1e3)
        if t.completion_tokens:
            self.ttft.observe(t.ttft_ms / 1e3)
        if t.prefill_tps:
            self.prefill_tps.observe(t.prefill_tps)
        if t.decode_tps:
            self.decode_tps.observe(t.decode_tps)

    def render(self) -> bytes:
        return generate_latest(self.registry)
