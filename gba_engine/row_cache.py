"""The worker-side hot-row cache in front of the parameter servers' tables (every mode, every server table).

The servers stay the only copy that trains: optimizer updates run on them alone, and every
row's gradient goes to them at every step boundary as without the cache (``record_rows``), so
no update is lost or delayed and the worker never holds a dirty row. A cached row is a read
copy that carries the server ``version`` and row clock (``stamp``, ``ParameterServer``: bumped by
every update or overwrite of rows) it was read at. A lookup serves a cached row only when the
rule below allows; every other row is asked with a *validating pull* (the id and the stamp held)
and the servers send back only the rows that changed since that stamp.

* sync (``max_age=0``): a row is served from the cache only if it was read at the version the
  step reads (the servers applied no update since); older ones are validated at that version,
  so training equals training without the cache exactly.
* gba (``max_age = gba.staleness.threshold``): a row is served if ``token - version <= max_age``,
  ``token`` being the step's dense token: cached reads are never staler than the gradients the
  servers still count; older rows are refreshed.

A prefetch (``prefetch``) posts the validating pull of the next step's rows while the current
one computes; its reply goes into the cache at the next lookup, where the same rule applies.

Example::

    cache = ServerRowCache(specs, CacheConfig(rows=1000, store="ps"), num_servers=2)
    rows, token = cache.fetch(client, {"user": unique_ids}, need=(7, 7), max_age=0, min_version=7)
    cache.prefetch(client, {"user": next_unique_ids}, min_version=8)
    cache.stats.as_dict()["hit_rate"]
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Mapping, Sequence

import torch
from torch import Tensor

from picasso_ops.cache.slot_index import SlotIndex
from picasso_ops.config import CacheConfig
from picasso_ops.eviction import eviction_scores, pick_victims

from .ps.client import PSClient, RowRequest, Token
from .ps.sharding import ServerTableSpec

logger = logging.getLogger(__name__)

AGE_EVERY = 64  # lookups between halvings of the LFU counts, so once-hot rows fade
ID_BYTES = 8  # an id or a stamp on the wire (int64)


@dataclasses.dataclass
class RowCacheStats:
    """What the cache did (plain data): lookups, where their rows came from, and the bytes it saved."""

    lookups: int = 0  # rows asked by training lookups (unique per lookup)
    hits: int = 0  # rows whose values came from the cache (served, or validated unchanged)
    served: int = 0  # rows served from the cache without asking the servers
    misses: int = 0  # rows not in the cache
    refreshes: int = 0  # cached rows past the rule, validated with the servers
    refreshed_changed: int = 0  # of those, rows the servers had changed (sent again)
    prefetched: int = 0  # rows a prefetch brought into the cache or refreshed
    prefetches_dropped: int = 0  # prefetches abandoned (asked for a version the lookup did not need)
    evictions: int = 0
    max_served_age: int = 0  # most versions a served cached row lagged the version its step reads
    max_held_age: int = 0  # most versions any cached row a lookup asked for lagged it (served or refreshed)
    row_bytes_saved: int = 0  # float bytes of rows not pulled, minus the stamps sent to validate

    def as_dict(self) -> dict:
        """The stats with the hit rate (hits / lookups)."""
        out = dataclasses.asdict(self)
        out["hit_rate"] = self.hits / self.lookups if self.lookups else 0.0
        return out


@dataclasses.dataclass
class _Prefetch:
    request: RowRequest
    ids: dict[str, Tensor]
    stamps: dict[str, Tensor]  # the stamps sent (-1: not held)


class _TableSlots:
    """One table's cached rows: id -> slot, and per slot the row, its version, stamp and use counts."""

    def __init__(self, capacity: int, dim: int) -> None:
        self.index = SlotIndex(capacity)
        self.rows = torch.zeros(capacity, dim)
        self.version = torch.full((capacity,), -1, dtype=torch.int64)
        self.stamp = torch.full((capacity,), -1, dtype=torch.int64)
        self.freq = torch.zeros(capacity, dtype=torch.float64)
        self.last_used = torch.zeros(capacity, dtype=torch.int64)

    def clear(self) -> None:
        self.index.clear()
        self.version.fill_(-1)
        self.stamp.fill_(-1)
        self.freq.zero_()
        self.last_used.zero_()


class ServerRowCache:
    """Per-table read caches of server rows (capacity ``config.rows`` per table, at most the table's rows).

    Example::

        cache = ServerRowCache([ServerTableSpec("user", 10_000, 16)], CacheConfig(rows=500, store="ps"), 1)
        rows, token = cache.fetch(client, {"user": torch.tensor([3, 9])}, need=(0,), max_age=0, min_version=0)
    """

    def __init__(self, specs: Sequence[ServerTableSpec], config: CacheConfig, num_servers: int) -> None:
        if config.store != "ps":
            raise ValueError(f"the cache in front of the parameter servers needs cache.store 'ps', got "
                             f"{config.store!r} (memory/mmap stores hold trained rows on the worker)")
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        self.policy = config.policy
        self.prefetch_enabled = config.prefetch
        self.num_servers = num_servers
        self.dims = {s.name: s.dim for s in specs}
        self._slots = {s.name: _TableSlots(min(config.rows, s.num_rows), s.dim) for s in specs}
        self.stats = RowCacheStats()
        self._client: PSClient | None = None
        self._pending: _Prefetch | None = None
        self._clock = 0

    def capacity(self, table: str) -> int:
        """Rows table ``table`` can hold."""
        return self._slots[table].index.capacity

    def fetch(self, client: PSClient, ids: Mapping[str, Tensor], need: Token, max_age: int,
              min_version: int | None) -> tuple[dict[str, Tensor], Token | None]:
        """Rows ``[len(ids[t]), dim]`` of unique ``ids`` as the step must read them, and the servers' token if asked.

        ``need``: the version per server the step reads; ``max_age``: how many versions older a
        served cached row may be (0 in sync); ``min_version``: what a pull of the rest waits for
        (sync: ``need``; gba: None). Returns ``(rows, token)``; ``token`` is None when every row
        came from the cache (no server was asked).
        """
        self._bind(client)
        self._absorb_prefetch(client, min_version)
        self._clock += 1
        if self._clock % AGE_EVERY == 0:
            for t in self._slots.values():
                t.freq.mul_(0.5)
        need_t = torch.tensor(need, dtype=torch.int64)
        asked, stamps, plans = {}, {}, {}
        for name, t_ids in ids.items():
            flat = t_ids.reshape(-1)
            slots_of = self._slots[name]
            slots = slots_of.index.find(flat)
            present = slots >= 0
            age = need_t[flat % self.num_servers] - slots_of.version[slots.clamp_min(0)]
            usable = present & (age <= max_age)
            if bool(present.any()):
                self.stats.max_held_age = max(self.stats.max_held_age, int(age[present].max()))
            if bool(usable.any()):
                self.stats.max_served_age = max(self.stats.max_served_age, int(age[usable].max()))
            ask = ~usable
            asked[name] = flat[ask]
            stamps[name] = torch.where(present, slots_of.stamp[slots.clamp_min(0)], -1)[ask]
            plans[name] = (flat, slots, present, usable, ask)
            n, n_served, n_present = flat.numel(), int(usable.sum()), int(present.sum())
            self.stats.lookups += n
            self.stats.served += n_served
            self.stats.misses += n - n_present
            self.stats.refreshes += n_present - n_served
            self.stats.row_bytes_saved += n_served * (4 * self.dims[name] + ID_BYTES)
        token = None
        changed: dict[str, tuple[Tensor, Tensor]] = {}
        versions = stamps_now = None
        if any(a.numel() for a in asked.values()):
            reply = client.collect_rows(client.request_rows(asked, stamps, min_version=min_version))
            token, versions, stamps_now, changed = reply.versions, reply.versions, reply.stamps, reply.changed
        out = {}
        for name, (flat, slots, present, usable, ask) in plans.items():
            out[name] = self._assemble(name, flat, slots, present, usable, ask, changed.get(name), versions, stamps_now)
        return out, token

    def prefetch(self, client: PSClient, ids: Mapping[str, Tensor], min_version: int | None) -> None:
        """Post the validating pull of ``ids`` (unique per table) that the next lookup will read; returns at once."""
        if not self.prefetch_enabled:
            return
        self._bind(client)
        if self._pending is not None:  # one prefetch in flight: an older one is no longer what the next step reads
            client.abandon(self._pending.request)
            self.stats.prefetches_dropped += 1
        flat_ids, stamps = {}, {}
        for name, t_ids in ids.items():
            flat = t_ids.reshape(-1)
            slots_of = self._slots[name]
            slots = slots_of.index.find(flat)
            flat_ids[name] = flat
            stamps[name] = torch.where(slots >= 0, slots_of.stamp[slots.clamp_min(0)], -1)
        request = client.request_rows(flat_ids, stamps, min_version=min_version, prefetch=True)
        self._pending = _Prefetch(request, flat_ids, stamps)

    def clear(self) -> None:
        """Forget every cached row (a checkpoint restore moves the servers' versions back)."""
        for t in self._slots.values():
            t.clear()
        if self._pending is not None and self._client is not None:
            self._client.abandon(self._pending.request)
        self._pending = None

    # ----------------------------------------------------------------- internals
    def _bind(self, client: PSClient) -> None:
        if client is not self._client:  # a new phase's client: the old one's prefetch is gone with it
            self._pending = None
            if self._client is not None:
                self.clear()
            self._client = client

    def _absorb_prefetch(self, client: PSClient, min_version: int | None) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        want = -1 if min_version is None else min_version
        if any(v > want for v in pending.request.min_version):  # it waits for an update this lookup precedes
            client.abandon(pending.request)
            self.stats.prefetches_dropped += 1
            return
        reply = client.collect_rows(pending.request)
        for name, flat in pending.ids.items():
            server = flat % self.num_servers
            versions = torch.tensor(reply.versions, dtype=torch.int64)[server]
            stamps_now = torch.tensor(reply.stamps, dtype=torch.int64)[server]
            positions, rows = reply.changed[name]
            slots_of = self._slots[name]
            unchanged = torch.ones(flat.numel(), dtype=torch.bool)
            unchanged[positions] = False
            slots = slots_of.index.find(flat)
            still = unchanged & (slots >= 0) & (slots_of.stamp[slots.clamp_min(0)] == pending.stamps[name])
            keep = slots[still]
            slots_of.version[keep], slots_of.stamp[keep] = versions[still], stamps_now[still]
            placed = self._place(name, flat[positions], rows, versions[positions], stamps_now[positions],
                                 protect=slots[slots >= 0])
            self.stats.prefetched += int(still.sum()) + placed

    def _assemble(self, name: str, flat: Tensor, slots: Tensor, present: Tensor, usable: Tensor, ask: Tensor,
                  changed: tuple[Tensor, Tensor] | None, versions: Token | None, stamps_now: tuple[int, ...] | None
                  ) -> Tensor:
        slots_of = self._slots[name]
        out = torch.empty(flat.numel(), self.dims[name])
        out[usable] = slots_of.rows[slots[usable]]
        asked_at = ask.nonzero().squeeze(1)  # caller positions of the asked rows, in request order
        if asked_at.numel():
            positions, rows = changed
            got = torch.zeros(asked_at.numel(), dtype=torch.bool)
            got[positions] = True
            out[asked_at[positions]] = rows
            valid = asked_at[~got]  # held and unchanged since its stamp
            if bool((~present[valid]).any()):
                raise RuntimeError(f"table {name!r}: the servers did not send rows the cache does not hold")
            out[valid] = slots_of.rows[slots[valid]]
            server = flat % self.num_servers
            ver_t = torch.tensor(versions, dtype=torch.int64)[server]
            stamp_t = torch.tensor(stamps_now, dtype=torch.int64)[server]
            slots_of.version[slots[valid]], slots_of.stamp[slots[valid]] = ver_t[valid], stamp_t[valid]
            self.stats.hits += valid.numel()
            self.stats.row_bytes_saved += valid.numel() * (4 * self.dims[name] - ID_BYTES)
            self.stats.refreshed_changed += int(present[asked_at[positions]].sum())
            fresh = asked_at[positions]
            self._place(name, flat[fresh], rows, ver_t[fresh], stamp_t[fresh], protect=slots[present])
        self.stats.hits += int(usable.sum())
        used = slots_of.index.find(flat)
        used = used[used >= 0]
        slots_of.freq[used] += 1
        slots_of.last_used[used] = self._clock
        return out

    def _place(self, name: str, ids: Tensor, rows: Tensor, versions: Tensor, stamps: Tensor, protect: Tensor) -> int:
        """Write rows into the cache (overwrite held ids, insert others while room or victims allow); returns placed."""
        if ids.numel() == 0:
            return 0
        slots_of = self._slots[name]
        slots = slots_of.index.find(ids)
        held = slots >= 0
        slots_of.rows[slots[held]] = rows[held]
        slots_of.version[slots[held]], slots_of.stamp[slots[held]] = versions[held], stamps[held]
        new = (~held).nonzero().squeeze(1)
        room = slots_of.index.capacity - len(slots_of.index)
        if new.numel() > room:
            keep_out = torch.cat([protect, slots[held]])
            scores = eviction_scores(self.policy, slots_of.freq, slots_of.last_used, self._clock)
            victims = pick_victims(scores, new.numel() - room, occupied=slots_of.index.occupied(), protect=keep_out)
            if victims.numel():
                slots_of.index.erase(slots_of.index.ids_of(victims))
                slots_of.version[victims], slots_of.stamp[victims] = -1, -1
                slots_of.freq[victims], slots_of.last_used[victims] = 0.0, 0
                self.stats.evictions += victims.numel()
            room = slots_of.index.capacity - len(slots_of.index)
        new = new[:room]
        if new.numel():
            placed = slots_of.index.insert(ids[new])
            slots_of.rows[placed] = rows[new]
            slots_of.version[placed], slots_of.stamp[placed] = versions[new], stamps[new]
            slots_of.freq[placed], slots_of.last_used[placed] = 0.0, self._clock
        return int(held.sum()) + new.numel()
