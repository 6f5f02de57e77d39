"""`PrefixRouter`: which data-parallel replica serves a request.

A replica's prefix cache only helps requests sent to it, so a prompt goes where the longest
run of its leading full pages was sent before (that replica most likely still caches them);
with no such replica, or when that replica is much busier than the least loaded one, it goes
to the least loaded. The router keeps the page digests it has routed (a bounded LRU map), not
the replicas' caches: it never reads another thread's state, so the server's event loop can
call it while the engine threads run.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

MAX_ROUTED_PAGES = 1 << 16  # page digests remembered (oldest forgotten first)
MAX_AFFINITY_PAGES = 64  # leading pages of a prompt looked at


class PrefixRouter:
    """`pick(prompt_ids, loads)` -> replica index, where `loads[i]` is replica i's current work
    (requests in flight). `slack`: a prefix is followed only to a replica whose load is at most
    `slack` more than the least loaded (a popular system prompt must not pin all traffic to one
    replica); the prompt is then recorded there."""

    def __init__(self, num_replicas: int, page_size: int, *, slack: int = 4) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.page_size = page_size
        self.slack = slack
        self._owner: OrderedDict[bytes, int] = OrderedDict()  # chained page digest -> replica
        self.num_prefix_routed = 0  # requests sent after a prefix
        self.num_load_routed = 0  # requests sent to the least loaded

    def _digests(self, prompt_ids: Sequence[int]) -> list[bytes]:
        """Chained digests of the prompt's leading full pages (each covers every page before it)."""
        digests, h = [], b""
        num_pages = min(len(prompt_ids) // self.page_size, MAX_AFFINITY_PAGES)
        for p in range(num_pages):
            page = prompt_ids[p * self.page_size : (p + 1) * self.page_size]
            h = hashlib.blake2b(
                h + b"".join(int(t).to_bytes(4, "little") for t in page), digest_size=16
            ).digest()
            digests.append(h)
        return digests

    def pick(self, prompt_ids: Sequence[int], loads: Sequence[int]) -> int:
        current = list(loads)
        least = min(range(self.num_replicas), key=lambda i: (current[i], i))
        digests = self._digests(prompt_ids)
        choice = None
        for digest in reversed(digests):  # the longest routed prefix first
            owner = self._owner.get(digest)
            if owner is not None and current[owner] <= current[least] + self.slack:
                choice = owner
                break
        if choice is None:
            choice = least
            self.num_load_routed += 1
        else:
            self.num_prefix_routed += 1
        for digest in digests:
            self._owner[digest] = choice
            self._owner.move_to_end(digest)
        while len(self._owner) > MAX_ROUTED_PAGES:
            self._owner.popitem(last=False)
        return choice
