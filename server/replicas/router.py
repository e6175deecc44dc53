"""Request routers for the engine replicas, on Ray Serve's custom request router interface.

A router lives in each process that holds a handle to the engine deployment (the ingress replica):
Ray Serve calls ``choose_replicas`` for each request and sends it to the replica with the shortest
queue among the first group returned that has room (``max_ongoing_requests``), then the next group.

``PrefixAffinityRouter`` sends a prompt to the replica that was sent the longest prefix of it, whose
prefix cache likely still holds that prefix's KV blocks, unless that replica is busy. It follows
SGLang's cache-aware router (sgl-router's ``cache_aware`` policy) and Ray Serve LLM's
``PrefixCacheAffinityRouter``, which does the same on this interface but does not import without
``ray[llm]``'s dependencies (pyarrow, vllm) and reads OpenAI request objects from the handle call, not
our forwarded HTTP requests. For each request:

1. no prompt (``/v1/models``, ``/metrics``), or one shorter than a chunk: the least-loaded replica
   (Ray's choice among all);
2. a replica holds at least ``match_threshold`` of the prompt (by ``PrefixTree``): the one holding
   the longest prefix, unless it has more than ``imbalance_threshold`` requests in flight beyond the
   least-loaded replica, which then gets it (the cache is worth less than a queue that long);
3. otherwise (a new prefix): the replica holding the fewest prefixes, so that new prefixes spread
   evenly, with the same load check.

The prompt is then recorded under the replica chosen, at once, so that requests sharing a new prefix
that arrive together follow the first. Loads are the requests in flight that Ray Serve's queue-length
cache holds for each replica, probed when missing. The router, and so the tree, lives in the one
ingress replica, as SGLang's lives in its router process.

``RoundRobinRouter`` sends requests to the replicas in turn and ``PowerOfTwoRouter`` as Ray Serve
does by default, for comparison (``benchmarks/router.py``); the prefix router routes in turn too a
request with ``x-pagedserve-router: round_robin``, so that both policies can be compared on the same
replicas. All three send a request that names a replica (``x-pagedserve-replica``) to it while it
runs (to read one replica's ``/metrics``, say).
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.server.replicas.forwarding import ForwardedRequest
from pagedserve.server.replicas.prefix_tree import DEFAULT_CHUNK_CHARS, DEFAULT_MAX_KEYS, PrefixTree


def _forwarded(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, ForwardedRequest) else None


def _pinned(request: ForwardedRequest | None, candidates: list[RunningReplica]) -> RunningReplica | None:
    """The replica a request names, when it is among ``candidates``; else None (routed as usual)."""
    if request is None or request.replica is None:
        return None
    return next((r for r in candidates if r.replica_id.unique_id == request.replica), None)


def _backing_off(pending_request: PendingRequest | None, groups: list[list[RunningReplica]]
                 ) -> list[list[RunningReplica]]:
    """``groups``, with Ray told to wait before asking again when every replica in them is full: Ray
    only sleeps between tries when a router sets ``should_backoff`` (its own routers do it through
    their locality step), and would otherwise call ``choose_replicas`` again in a tight loop."""
    if pending_request is not None:
        pending_request.routing_context.should_backoff = True
    return groups


class _InTurn:
    """Round robin over the replicas, by replica id."""

    turn = 0

    def next_in_turn(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        if not candidates:
            return []
        replicas = sorted(candidates, key=lambda r: r.replica_id.unique_id)
        # Counted per call: a replica found full is asked again after a backoff (_backing_off), and then
        # the next one is.
        self.turn += 1
        return [[replicas[self.turn % len(replicas)]]]


class RoundRobinRouter(_InTurn, RequestRouter):
    """Each request to the next replica in turn, for comparison with the prefix router."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pinned = _pinned(_forwarded(pending_request), candidate_replicas)
        return _backing_off(pending_request, [[pinned]] if pinned is not None else self.next_in_turn(
            candidate_replicas))


class PowerOfTwoRouter(RequestRouter):
    """The power of two choices, Ray Serve's default policy without its locality preferences: the
    shorter queue of two random replicas (which Ray picks among the two returned); here so that a
    pinned request reaches its replica under it too."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pinned = _pinned(_forwarded(pending_request), candidate_replicas)
        if pinned is not None:
            return _backing_off(pending_request, [[pinned]])
        return _backing_off(pending_request, [random.sample(candidate_replicas, min(2, len(candidate_replicas)))])


class PrefixAffinityRouter(_InTurn, RequestRouter):
    """Prefix-cache affinity with a load check (see the module's docstring); Ray Serve creates it and
    passes ``RequestRouterConfig.request_router_kwargs`` to ``initialize_state``. A request that asks for
    ``round_robin`` (``ROUTER_HEADER``) is routed in turn instead, and not recorded."""

    def initialize_state(self, imbalance_threshold: int = 8, match_threshold: float = 0.1,
                         chunk_chars: int = DEFAULT_CHUNK_CHARS, max_keys: int = DEFAULT_MAX_KEYS,
                         **_: Any) -> None:
        """Args:
            imbalance_threshold: requests in flight a replica may have beyond the least-loaded one
                and still get the prompts it holds.
            match_threshold: fraction of a prompt's characters a replica must hold to be preferred.
            chunk_chars, max_keys: the ``PrefixTree``'s.
        """
        self.imbalance_threshold = imbalance_threshold
        self.match_threshold = match_threshold
        self.tree = PrefixTree(chunk_chars, max_keys)

    async def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests in flight per replica: Ray's cached queue lengths, probed where missing or stale
        (as Ray's own routers do); a replica that does not answer counts as full."""
        cache = self.replica_queue_len_cache
        loads = {r.replica_id: cache.get(r.replica_id) for r in replicas}
        missing = [r for r in replicas if loads[r.replica_id] is None]
        if missing:
            for replica, queue_len in await self._probe_queue_lens(missing, 0):
                loads[replica.replica_id] = replica.max_ongoing_requests if queue_len is None else queue_len
        return loads

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        request = _forwarded(pending_request)
        pinned = _pinned(request, candidate_replicas)
        if pinned is not None:
            return _backing_off(pending_request, [[pinned]])
        if request is not None and request.router == "round_robin":
            return _backing_off(pending_request, self.next_in_turn(candidate_replicas))
        text = request.routing_text if request is not None else None
        if text is None or len(text) < self.tree.chunk_chars or not candidate_replicas:
            # Nothing to match or record (no prompt, or shorter than one chunk): Ray takes the shortest queue.
            return _backing_off(pending_request, [candidate_replicas])
        loads = await self._loads(candidate_replicas)
        # No await from here on: requests routed concurrently see each other's prefixes recorded.
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        matched, holders = self.tree.match(text, by_name)
        if matched >= self.match_threshold * len(text):
            preferred = [by_name[name] for name in holders]
        else:
            fewest = min(self.tree.num_prefixes(name) for name in by_name)
            preferred = [r for name, r in by_name.items() if self.tree.num_prefixes(name) == fewest]
        least = min(loads.values())
        # Ties go to the first replica by id, so that the same state routes the same way.
        choice = min(preferred, key=lambda r: (loads[r.replica_id], r.replica_id.unique_id))
        if loads[choice.replica_id] - least > self.imbalance_threshold:
            return _backing_off(pending_request, [candidate_replicas])
        self.tree.insert(text, choice.replica_id.unique_id)
        # The others follow, for when the choice turns out full (Ray asks before sending).
        return _backing_off(pending_request, [[choice], candidate_replicas])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Record the prompt under the replica that took it (which ``choose_replicas`` may not have
        preferred: a full replica, a busy one, no match)."""
        request = _forwarded(pending_request)
        if request is not None and request.routing_text and request.router != "round_robin":
            self.tree.insert(request.routing_text, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.tree.remove(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.tree.remove(replica_id.unique_id)


#: ``ReplicaSettings.request_router`` -> the router class.
ROUTER_CLASSES: dict[str, type[RequestRouter]] = {
    "prefix": PrefixAffinityRouter, "round_robin": RoundRobinRouter, "pow2": PowerOfTwoRouter}
