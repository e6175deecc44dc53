"""Which replica has served which prompt prefixes: the prefix router's memory (imports no ray).

A prompt is cut into chunks of ``chunk_chars`` characters, and chunk i is keyed by a hash of the
whole text up to its end, chained as vLLM keys its KV blocks (``hash(parent, chunk)``). Each key holds
the replicas that were sent a prompt with that prefix. Walking a prompt's chunks from the first while
some replica holds them finds the replicas with the longest shared prefix: a radix tree's match, with
a dict instead of nodes. It approximates each replica's prefix cache from the router's side, as
SGLang's cache-aware router does with its per-worker radix trees (sgl-router, ``cache_aware``) and Ray
Serve's ``PrefixCacheAffinityRouter`` with its prefix tree actor; neither asks the engines.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Iterator

#: Characters per chunk: about one 16-token KV block of English text, so a match means a cached block.
DEFAULT_CHUNK_CHARS = 64
#: Chunk keys remembered (oldest forgotten first): 100,000 keys of 64 characters stand for 6.4 M
#: characters of prompts, more than the KV caches of a few replicas hold; each key costs ~200 bytes.
DEFAULT_MAX_KEYS = 100_000


class PrefixTree:
    """Prompt prefixes (hash chains of character chunks) -> the replicas that were sent them.

    Args:
        chunk_chars: characters per chunk; a prefix shorter than a chunk is not matched.
        max_keys: chunk keys kept; inserting more forgets the least recently used ones.

    Raises:
        ValueError: a ``chunk_chars`` or ``max_keys`` below 1.
    """

    def __init__(self, chunk_chars: int = DEFAULT_CHUNK_CHARS, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if chunk_chars < 1 or max_keys < 1:
            raise ValueError(f"chunk_chars and max_keys must be >= 1, got {chunk_chars} and {max_keys}")
        self.chunk_chars = chunk_chars
        self.max_keys = max_keys
        self._holders: OrderedDict[int, set[str]] = OrderedDict()  # least recently used first
        self._roots: set[int] = set()  # the keys of first chunks: one per distinct prefix
        self._prefixes: Counter[str] = Counter()  # replica -> first chunks it holds

    def _keys(self, text: str) -> Iterator[int]:
        """The chained key of each whole chunk of ``text``, first chunk first."""
        key = 0
        for start in range(0, len(text) - self.chunk_chars + 1, self.chunk_chars):
            key = hash((key, text[start:start + self.chunk_chars]))
            yield key

    def insert(self, text: str, replica: str) -> None:
        """Record that ``replica`` was sent ``text`` (every whole chunk of it)."""
        for depth, key in enumerate(self._keys(text)):
            holders = self._holders.get(key)
            if holders is None:
                holders = self._holders[key] = set()
            else:
                self._holders.move_to_end(key)
            if depth == 0:
                self._roots.add(key)
                self._prefixes[replica] += replica not in holders
            holders.add(replica)
        while len(self._holders) > self.max_keys:
            key, forgotten = self._holders.popitem(last=False)
            if key in self._roots:
                self._roots.discard(key)
                self._prefixes.subtract(forgotten)

    def match(self, text: str, replicas: Collection[str]) -> tuple[int, set[str]]:
        """The longest prefix of ``text`` that some of ``replicas`` were sent, and those replicas.

        Returns:
            ``(matched characters, the replicas holding that many)``; ``(0, set())`` when none holds
            even the first chunk.
        """
        matched, best = 0, set()
        alive = set(replicas)
        for key in self._keys(text):
            holders = self._holders.get(key, set()) & alive
            if not holders:
                break
            self._holders.move_to_end(key)
            matched, best, alive = matched + self.chunk_chars, holders, holders
        return matched, best

    def num_prefixes(self, replica: str) -> int:
        """Distinct prefixes (first chunks) ``replica`` holds: how many prompt families its cache serves."""
        return self._prefixes[replica]

    def remove(self, replica: str) -> None:
        """Forget ``replica`` (it died or left): its prefixes go to others from now on."""
        for holders in self._holders.values():
            holders.discard(replica)
        self._prefixes.pop(replica, None)
