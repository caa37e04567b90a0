"""The host's side of a paged KV cache (``olmax.model.decode.paged_cache``): which pages each row
holds, pages handed out as a row grows and taken back when it ends, prompt pages shared, the KV
memory budget, and the choice of a row to preempt when the pool runs dry.

A row's table names a page for each ``page_size`` positions it has reached; page 0 is the null
page (unallocated entries). A prompt's whole pages (the positions before its last partial page)
are shared by every row of the same prompt while one of them holds them (a GRPO group, a request
with ``n > 1``): written once, by the first row's prefill write, counted by reference. With a
prefix cache (the server, where the platform makes a prompt's keys and values the same bits
whatever else was prefilled with it), a whole page is keyed by every token up to its end, so
requests that begin alike (a system prompt) share pages, and pages no row holds stay cached until
the pool needs them, the least recently used first. A row's partial last prompt page and every
page it decodes into are its own.

Nothing here changes a token: a paged row computes what a contiguous one does (the same bits on
the CPU), and a preempted row is recomputed from its prompt, which makes the same tokens again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from olmax.config import ConfigError, ModelConfig, parse_kv_budget
from olmax.model.decode import NULL_PAGE, cache_bytes, page_bytes, row_bytes

KV_CACHES = ("contiguous", "paged")
DEFAULT_PAGE_SIZE = 16
# A budget as given (--kv-budget, rl.kv_budget): parsed by the config layer, which checks rl.kv_budget.
parse_budget = parse_kv_budget


def budget_bytes(budget: float | int, devices: Sequence | None = None) -> int:
    """The bytes a budget names: a fraction of the first device's free memory (what it reports:
    TPUs and GPUs; a CPU reports none, so give it in MiB there), or the bytes themselves."""
    if isinstance(budget, int):
        return budget
    import jax
    device = (devices or jax.devices())[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        raise ConfigError(f"kv budget {budget} is a fraction of free device memory, but the {device.platform} "
                          "device reports none: give the budget as a size (e.g. 512MiB)")
    return int(budget * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))


def check_page_size(page_size: int, max_length: int) -> None:
    """A page size must be a positive power of two (the cache lengths are multiples of 64) that
    divides the cache's positions per row."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1 or page_size & (page_size - 1):
        raise ConfigError(f"page size {page_size!r} must be a positive power of two (tokens per page)")
    if max_length % page_size:
        raise ConfigError(f"page size {page_size} does not divide the cache's {max_length} positions per row: "
                          f"use a page size that divides {max_length} (16 does for every cache)")


def pool_pages(cfg: ModelConfig, slots: int, max_length: int, page_size: int, budget: int | None,
               dtype=None) -> int:
    """Pages (the null page included) of a paged cache of ``slots`` rows under ``budget`` bytes
    (what the rows' sliding rings and positions leave, in pages), or without a budget as many as
    the contiguous cache's rows hold (every row at ``max_length``). A budget that cannot hold one
    row at ``max_length`` is refused, naming what one row needs."""
    check_page_size(page_size, max_length)
    per_row = max_length // page_size
    if budget is None:
        return 1 + slots * per_row
    left = budget - slots * row_bytes(cfg, max_length, dtype)
    pages = left // page_bytes(cfg, page_size, dtype) if left > 0 else 0
    if pages < 1 + per_row:
        need = slots * row_bytes(cfg, max_length, dtype) + (1 + per_row) * page_bytes(cfg, page_size, dtype)
        raise ConfigError(f"kv budget of {budget / 2**20:.1f} MiB cannot hold one sequence of {max_length} "
                          f"positions beside {slots} rows' sliding windows and positions: that needs "
                          f"{need / 2**20:.1f} MiB; raise the budget or lower the batch size or max length")
    return int(pages)


def contiguous_rows(cfg: ModelConfig, max_length: int, budget: int, dtype=None) -> int:
    """Rows of ``max_length`` a contiguous cache holds within ``budget`` bytes (refused below one)."""
    one = cache_bytes(cfg, 1, max_length, dtype)
    if budget < one:
        raise ConfigError(f"kv budget of {budget / 2**20:.1f} MiB cannot hold one sequence of {max_length} "
                          f"positions ({one / 2**20:.1f} MiB in a contiguous cache): raise the budget or lower "
                          "the max length")
    return budget // one


@dataclass
class PageStats:
    """``pages_peak``: most pages held at once (the null page not counted); ``shared_prompt_tokens``:
    prompt positions rows found in pages another row (or the prefix cache) holds, not written
    again; ``preemptions``: rows preempted for pages (and recomputed later). Counters."""
    pages_peak: int = 0
    shared_prompt_tokens: int = 0
    preemptions: int = 0


class PagePool:
    """The pages of one paged cache (``pages`` of ``page_size`` positions, page 0 the null page)
    and the table of ``slots`` rows of ``max_length`` positions. ``prefix_cache``: share whole
    prompt pages between prompts that begin alike and keep pages no row holds until they are
    needed (LRU); otherwise only rows of the same prompt (and prompt bucket) share."""

    def __init__(self, pages: int, page_size: int, slots: int, max_length: int, prefix_cache: bool = False):
        check_page_size(page_size, max_length)
        per_row = max_length // page_size
        if pages < 1 + per_row:
            raise ConfigError(f"a pool of {pages} pages of {page_size} cannot hold one row of {max_length} "
                              f"positions ({per_row} pages and the null page)")
        self.pages, self.page_size, self.slots, self.max_length = pages, page_size, slots, max_length
        self.prefix_cache = prefix_cache
        self.table = np.full((slots, per_row), NULL_PAGE, np.int32)
        self.held = np.zeros(slots, np.int32)          # table entries a row holds (its first n)
        self.refs = np.zeros(pages, np.int32)          # rows (and the prefix cache) holding a page
        self._free = list(range(pages - 1, 0, -1))     # popped from the end: page 1 first
        self._key_of: dict[int, tuple] = {}            # a shared page -> its key
        self._page_of: dict[tuple, int] = {}           # a key -> its shared page
        self._cached: OrderedDict[tuple, int] = OrderedDict()  # prefix cache: keys of pages no row holds, LRU first
        self.stats = PageStats()
        self.dirty = True

    # -- what is free ---------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Pages held by rows or the prefix cache (the null page not counted)."""
        return self.pages - 1 - len(self._free)

    def available(self) -> int:
        """Pages a row could be given now: the free ones and those only the prefix cache holds."""
        return len(self._free) + len(self._cached)

    def _take(self) -> int:
        if not self._free:
            key, page = self._cached.popitem(last=False)  # the least recently used cached page
            del self._page_of[key], self._key_of[page]
            self.refs[page] = 0
            self._free.append(page)
        page = self._free.pop()
        self.refs[page] = 1
        return page

    def _drop(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] > 0:
            return
        key = self._key_of.get(page)
        if key is not None and self.prefix_cache:
            self._cached[key] = page  # kept, most recently used last
            self.refs[page] = 0
            return
        if key is not None:
            del self._key_of[page], self._page_of[key]
        self._free.append(page)

    # -- a row's prompt -------------------------------------------------------------------------

    def _keys(self, prompt: Sequence[int], bucket: int) -> list[tuple]:
        """The keys of a prompt's whole pages."""
        whole = len(prompt) // self.page_size
        ps = self.page_size
        if self.prefix_cache:
            return [tuple(int(t) for t in prompt[:(i + 1) * ps]) for i in range(whole)]
        full = (bucket, *(int(t) for t in prompt))
        return [(full, i) for i in range(whole)]

    def pages_to_admit(self, prompt: Sequence[int], bucket: int, ahead: int = 1) -> int:
        """Pages a row of ``prompt`` (prefilled at ``bucket``) would take from the pool: those of its
        prompt no row or cache holds and its first ``ahead`` decode positions."""
        shared = cached = 0
        for key in self._keys(prompt, bucket):
            if key not in self._page_of:
                break
            shared += 1
            cached += key in self._cached  # reused, but no longer there for another row
        need = -(-min(len(prompt) + ahead, self.max_length) // self.page_size)
        return need - shared + cached

    def admit(self, slot: int, prompt: Sequence[int], bucket: int) -> np.ndarray:
        """Give row ``slot`` the pages of ``prompt``'s positions and its next one (shared whole
        pages where a row or the cache holds them). The pages its prefill write goes to: one per
        page of the ``bucket``, past the pool (``pages``: written by no one) where the page is
        shared or not the row's."""
        if self.held[slot]:
            raise RuntimeError(f"row {slot} still holds pages")
        keys = self._keys(prompt, bucket)
        ps = self.page_size
        write = np.full(-(-bucket // ps), self.pages, np.int32)
        n = -(-min(len(prompt) + 1, self.max_length) // ps)
        reused = {}
        for i, key in enumerate(keys):  # the shared prefix, touched deepest first (LRU keeps ancestors)
            page = self._page_of.get(key)
            if page is None:
                break
            reused[i] = page
        for i in sorted(reused, reverse=True):
            page = reused[i]
            if keys[i] in self._cached:
                del self._cached[keys[i]]
            self.refs[page] += 1
            self.table[slot, i] = page
        for i in range(len(reused), n):
            page = self._take()
            self.table[slot, i] = page
            if i < len(write):
                write[i] = page
            if i < len(keys):
                self._page_of[keys[i]] = page
                self._key_of[page] = keys[i]
        self.held[slot] = n
        self.stats.shared_prompt_tokens += len(reused) * ps
        self._mark()
        return write

    # -- growth, ends ---------------------------------------------------------------------------

    def pages_to_reach(self, slot: int, positions: int) -> int:
        """More pages row ``slot`` needs to hold its first ``positions`` positions."""
        return max(0, -(-min(positions, self.max_length) // self.page_size) - int(self.held[slot]))

    def grow(self, slot: int, positions: int) -> None:
        """Give row ``slot`` pages up to its first ``positions`` positions (the caller checked
        ``available``)."""
        for _ in range(self.pages_to_reach(slot, positions)):
            self.table[slot, self.held[slot]] = self._take()
            self.held[slot] += 1
        self._mark()

    def release(self, slot: int) -> None:
        """Row ``slot`` ended (or was preempted): its pages go back (a shared one when its last row
        lets go; with the prefix cache a prompt page stays cached), its table to the null page."""
        for i in reversed(range(int(self.held[slot]))):  # deepest first: a cached prefix's root is its most recent
            self._drop(int(self.table[slot, i]))
        self.table[slot] = NULL_PAGE
        self.held[slot] = 0
        self.dirty = True

    def _mark(self) -> None:
        self.dirty = True
        self.stats.pages_peak = max(self.stats.pages_peak, self.used - len(self._cached))


def plan_growth(pool: PagePool, rows: dict[int, int], order: Sequence[int]) -> list[int]:
    """The rows to preempt so that every other row gets the pages it needs (``rows``: slot ->
    positions it must hold for the next round trip), the youngest first (``order``: slots from
    the oldest admitted to the youngest). The oldest row is never preempted: a pool holds one row
    at ``max_length`` (``PagePool``), so it always runs on."""
    need = {s: pool.pages_to_reach(s, p) for s, p in rows.items()}
    avail = pool.available()
    refs: dict[int, int] = {}
    out: list[int] = []
    young = [s for s in reversed(order) if s in rows]
    while sum(need.values()) > avail and len(young) > 1:
        s = young.pop(0)
        out.append(s)
        # Its pages come back once no row left holds them (a shared page another row holds stays).
        for i in range(int(pool.held[s])):
            page = int(pool.table[s, i])
            refs[page] = refs.get(page, int(pool.refs[page])) - 1
            avail += refs[page] == 0
        del need[s]
    return out
