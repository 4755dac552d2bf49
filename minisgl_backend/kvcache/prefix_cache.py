"""Prefix cache: a radix tree over token ids at block granularity: a request whose prompt starts
with a cached prefix skips computing it.

Each node below the root is one full KV block, keyed by the `block_size` token ids it holds; the
path from the root spells the token prefix whose K/V the blocks contain. The tree owns one
reference on every block in it, so cached blocks stay READ_ONLY in the BlockPool's state machine;
a request that reuses a prefix `share()`s the blocks (one more reference each) and releases them
like its own when it finishes. Eviction drops the tree's reference on least-recently-used leaves
whose block nobody else holds, so the block goes READ_ONLY -> PENDING_RECLAIM -> FREE behind the
usual fence: a cached block is never reused while an in-flight iteration may still read it.

Only the scheduler thread touches the tree, so there is no lock on the lookup path; with
`prefix_cache: async` a finished request's blocks are inserted at the loop's idle point instead of
on the path that plans the next batch (see scheduler/prefix_admission.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from minisgl_backend.kvcache.block_pool import BlockPool


def prefix_hashes(tokens: Sequence[int], block_size: int, num_blocks: int) -> list[int]:
    """Chained hashes of the first `num_blocks` full blocks: entry i names the whole prefix that ends
    with block i (cheap to compare, unlike the prefix itself)."""
    h, out = 0, []
    for i in range(num_blocks):
        h = hash((h, tuple(tokens[i * block_size : (i + 1) * block_size])))
        out.append(h)
    return out


class _Node:
    __slots__ = ("key", "block", "parent", "children", "last_used")

    def __init__(self, key: tuple[int, ...], block: int, parent: _Node | None) -> None:
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_used = 0


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._root = _Node((), -1, None)
        self._clock = itertools.count(1)  # LRU order: a logical clock, cheaper and steadier than time
        self.num_blocks = 0  # blocks the tree holds a reference on

    def _keys(self, tokens: Sequence[int], num_blocks: int):
        bs = self.block_size
        for i in range(num_blocks):
            yield tuple(tokens[i * bs : (i + 1) * bs])

    def match(self, tokens: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks holding the longest cached prefix of `tokens`, at most `max_blocks` of them.
        Marks the path used (LRU); the caller `share()`s what it keeps."""
        node, blocks, now = self._root, [], next(self._clock)
        for key in self._keys(tokens, max_blocks):
            node = node.children.get(key)  # type: ignore[assignment]
            if node is None:
                break
            node.last_used = now
            blocks.append(node.block)
        return blocks

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Cache `blocks` (READ_ONLY, holding the K/V of tokens[:len(blocks) * block_size]).
        Where a node already holds that prefix the tree keeps its own block and the caller's copy
        stays the caller's. Returns how many blocks were added."""
        node, added, now = self._root, 0, next(self._clock)
        for key, block in zip(self._keys(tokens, len(blocks)), blocks):
            child = node.children.get(key)
            if child is None:
                self.pool.share(block)  # the tree's own reference
                child = node.children[key] = _Node(key, block, node)
                added += 1
            child.last_used = now
            node = child
        self.num_blocks += added
        return added

    def _evictable(self, node: _Node) -> bool:
        # refcount 1 = only the tree holds it: no running request reads this prefix.
        return not node.children and self.pool.refcount[node.block] == 1

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            yield n

    def evict(self, num_blocks: int, fence: int) -> int:
        """Drop up to `num_blocks` least-recently-used unreferenced leaves (a parent whose last child
        goes becomes a leaf in turn). Their blocks wait in PENDING_RECLAIM behind `fence`."""
        heap = [(n.last_used, id(n), n) for n in self._nodes() if self._evictable(n)]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_blocks:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            freed.append(node.block)
            if parent is not self._root and self._evictable(parent):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        self.pool.release(freed, fence)
        self.num_blocks -= len(freed)
        return len(freed)

    def blocks(self) -> list[int]:
        return [n.block for n in self._nodes()]

    def num_idle_blocks(self) -> int:
        """Blocks only the tree holds (no request reads them: evictable, in time)."""
        rc = self.pool.refcount
        return sum(1 for n in self._nodes() if rc[n.block] == 1)
