"""The request router of kiln's Ray Serve deployment (kiln/ray.py): prefix affinity, else least loaded.

Ray Serve ships a router's module to each process that holds a handle by value, so what the ingress
reads (the decision counters, the routers themselves) lives in kiln.ray and is reached through it.
"""

from __future__ import annotations

import random
from collections import deque

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

import kiln.ray


def shared_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Sends a request to the replica whose slots hold the longest prefix of its prompt, else (none holds
    `min_chars` of it, or the holder has no free slot) to the least loaded one.

    What a replica holds is what was routed to it lately: the keys of its last `memory` requests (its
    slots keep the KV of as many prompts, the prompt cache reuses the longest shared prefix). A replica
    that dies forgets everything."""

    def initialize_state(self, affinity: bool = True, memory: int = 4, min_chars: int = 32):
        self.affinity, self.memory, self.min_chars = affinity, memory, min_chars
        self.held: dict = {}  # ReplicaID -> deque of routing keys
        self.intent: dict[str, tuple] = {}  # internal request id -> (decision if routed to holder, holder)
        kiln.ray.ROUTERS.append(self)

    def _holder(self, key: str, candidates: list[RunningReplica]) -> tuple[RunningReplica | None, int]:
        best, best_len = None, 0
        for replica in candidates:
            n = max((shared_prefix(key, k) for k in self.held.get(replica.replica_id, ())), default=0)
            if n > best_len:
                best, best_len = replica, n
        return best, best_len

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get("routing_key") if pending_request is not None else None
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        # shuffled first, so replicas equally loaded take turns (Ray takes the first of the shortest queues)
        by_load = sorted(random.sample(candidate_replicas, len(candidate_replicas)), key=self._queue_len)
        if key is None or not self.affinity:
            self.intent[request_id] = ("unkeyed" if key is None else "balanced", None)
            return [by_load]  # Ray picks the shortest queue among them
        holder, matched = self._holder(key, candidate_replicas)
        model = key.index("\n") + 1  # the key's first line names the model: sharing only it shares no KV
        if holder is None or matched - model < self.min_chars:
            self.intent[request_id] = ("balanced", None)
            return [by_load]
        self.intent[request_id] = ("affinity", holder.replica_id)
        others = [r for r in by_load if r is not holder]
        if self.select_available_replicas([holder]):
            return [[holder], *([others] if others else [])]
        return [others] if others else [[holder]]

    def _queue_len(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        decision, holder = self.intent.pop(pending_request.metadata.internal_request_id, ("unkeyed", None))
        if decision == "affinity" and holder != replica_id:
            decision = "fallback"
        kiln.ray.ROUTES.labels(decision).inc()
        key = pending_request.kwargs.get("routing_key")
        if key is not None:
            held = self.held.setdefault(replica_id, deque(maxlen=self.memory))
            for old in list(held):
                if key.startswith(old):  # the conversation went on: its slot now holds the longer prompt
                    held.remove(old)
            held.append(key)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.held.pop(replica_id, None)

    def replica_stats(self) -> dict:
        """Each live replica's last report: {replica id: routing stats}."""
        return {rid.unique_id: r.routing_stats for rid, r in self.curr_replicas.items()}
