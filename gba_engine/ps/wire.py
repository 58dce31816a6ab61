"""The parameter-server wire format: one fixed-size int64 header, then at most two payloads.

A message is sent with gloo point-to-point over the peer's :class:`~.channel.PeerChannel` (the
PS process group, or a restarted worker's pair group):

1. ``header``: int64[HEADER_LEN] (fields below);
2. ``ints``:   int64[n_ints]    when n_ints > 0  (per-table id counts, then the ids);
3. ``floats``: float32[n_floats] when n_floats > 0 (dense shard, then the rows, flattened).

Every request is 1 to 3 transfers whatever the number of ids or tables. The receiver
learns the sizes from the header, so nothing is parsed element by element.

A sender posts all its ``isend``s *before* ringing the receiver's doorbell (a TCPStore
queue, see runtime.py), so a receiver only ever posts a ``recv`` for data that is already
on its way. That ordering is what makes the gloo waits safe: a gloo recv that times out
closes every pair of the group (measured on torch 2.13: "Application timeout caused
pair closure"), so deadlines live on the store, never on a gloo recv.

Example::

    h = Header(kind=Kind.PULL, seq=3, src=0, schema=schema_id(10, specs), n_ints=5)
    out = send_message(h, ints=ids_payload, floats=None, channel=rt.channel(2))
    ... ring the doorbell ...
    h2, ints, floats = recv_message(rt.channel(0), src=0)    # on rank 2
"""
from __future__ import annotations

import dataclasses
import enum
import zlib
from typing import Sequence

import torch
from torch import Tensor

from .sharding import ServerTableSpec

MAGIC = 0x6762615F7073  # "gba_ps": a header from anything else is a protocol error, not garbage data
HEADER_LEN = 12
MAX_ELEMENTS = 1 << 34  # refuses absurd sizes from a corrupted header before allocating


class ProtocolError(RuntimeError):
    """A message broke the PS protocol (bad magic, kind, sizes, sequence or schema)."""


class Kind(enum.IntEnum):
    """Message kinds."""

    PULL = 1  # dense shard and/or rows; may ask to wait for a minimum version
    PUSH = 2  # gradient shard + unique ids + row gradients + token + sample count
    PUT = 3  # overwrite dense shard and/or rows (initialisation, cache write-back)
    BYE = 4  # the worker stops talking to this server
    REPLY = 5  # answer to a PULL


FLAG_DENSE = 1  # PULL: include the dense shard / PUT: the floats start with a dense shard
FLAG_FINISHED = 2  # REPLY: the server reached its final version and accepts no more gradients
FLAG_STALLED = 4  # REPLY: every live worker waits for a version no push can produce
FLAG_VALIDATE = 8  # PULL: the ids are followed by the row stamps the worker holds (-1: none); the REPLY sends only
#                    the rows changed since, after an ints mask of which ones (the worker-side row cache's pull)
FLAG_PREFETCH = 16  # PULL: asked ahead of need (a prefetch); a server waiting on it alone has not stalled


@dataclasses.dataclass(frozen=True)
class Header:
    """Fixed-size message header (field order is the wire order after MAGIC)."""

    kind: Kind
    seq: int
    src: int
    schema: int
    version: int = 0  # PUSH: the token; REPLY: the server's version
    min_version: int = -1  # PULL: answer once version >= this (-1: now)
    num_samples: int = 0  # PUSH: samples in the local batch
    flags: int = 0
    n_ints: int = 0
    n_floats: int = 0
    stamp: int = 0  # REPLY: the server's row clock (bumped by every update or overwrite of rows)

    def to_tensor(self) -> Tensor:
        """The header as int64[HEADER_LEN]."""
        return torch.tensor(
            [MAGIC, int(self.kind), self.seq, self.src, self.schema, self.version, self.min_version,
             self.num_samples, self.flags, self.n_ints, self.n_floats, self.stamp],
            dtype=torch.int64,
        )

    @classmethod
    def from_tensor(cls, t: Tensor) -> "Header":
        """Parse and validate a received header."""
        if t.shape != (HEADER_LEN,) or t.dtype != torch.int64:
            raise ProtocolError(f"header must be int64[{HEADER_LEN}], got {t.dtype}{list(t.shape)}")
        v = t.tolist()
        if v[0] != MAGIC:
            raise ProtocolError(f"bad magic {v[0]:#x}: not a GBA parameter-server message")
        try:
            kind = Kind(v[1])
        except ValueError:
            raise ProtocolError(f"unknown message kind {v[1]}") from None
        n_ints, n_floats = v[9], v[10]
        if not (0 <= n_ints < MAX_ELEMENTS and 0 <= n_floats < MAX_ELEMENTS):
            raise ProtocolError(f"payload sizes out of range: ints={n_ints} floats={n_floats}")
        return cls(kind=kind, seq=v[2], src=v[3], schema=v[4], version=v[5], min_version=v[6],
                   num_samples=v[7], flags=v[8], n_ints=n_ints, n_floats=n_floats, stamp=v[11])


def schema_id(dense_numel: int, specs: Sequence[ServerTableSpec]) -> int:
    """A 32-bit fingerprint of the parameter layout; client and server must agree on it."""
    text = repr((dense_numel, [(s.name, s.num_rows, s.dim) for s in specs]))
    return zlib.crc32(text.encode())


def pack_ints(id_blocks: Sequence[Tensor]) -> Tensor:
    """``[count_0, ..., count_{T-1}, ids of table 0, ..., ids of table T-1]`` as one int64 tensor."""
    counts = torch.tensor([b.numel() for b in id_blocks], dtype=torch.int64)
    return torch.cat([counts] + [b.reshape(-1).to(torch.int64) for b in id_blocks])


def unpack_ints(ints: Tensor, num_tables: int) -> list[Tensor]:
    """Inverse of :func:`pack_ints` (views into ``ints``)."""
    if ints.numel() < num_tables:
        raise ProtocolError(f"id payload of {ints.numel()} elements cannot hold {num_tables} table counts")
    counts = ints[:num_tables].tolist()
    if any(c < 0 for c in counts) or sum(counts) != ints.numel() - num_tables:
        raise ProtocolError(f"id counts {counts} do not match the payload size {ints.numel() - num_tables}")
    return list(torch.split(ints[num_tables:], counts))


MASK_BITS = 32  # bits of a changed-row mask per int64 word (stays clear of the sign bit)


def pack_mask(mask: Tensor) -> Tensor:
    """A bool vector as int64 words of MASK_BITS bits (bit i of word w is element ``w * MASK_BITS + i``).

    Example::

        unpack_mask(pack_mask(torch.tensor([True, False, True])), 3).tolist()     # [True, False, True]
    """
    n = mask.numel()
    padded = torch.zeros(-(-n // MASK_BITS) * MASK_BITS, dtype=torch.int64)
    padded[:n] = mask.reshape(-1).to(torch.int64)
    weights = torch.ones(MASK_BITS, dtype=torch.int64) << torch.arange(MASK_BITS, dtype=torch.int64)
    return (padded.view(-1, MASK_BITS) * weights).sum(dim=1)


def unpack_mask(words: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_mask`: the first ``n`` bits as a bool vector."""
    if words.numel() != -(-n // MASK_BITS):
        raise ProtocolError(f"a mask of {n} rows needs {-(-n // MASK_BITS)} words, got {words.numel()}")
    bits = (words.reshape(-1, 1) >> torch.arange(MASK_BITS, dtype=torch.int64)) & 1
    return bits.reshape(-1)[:n].to(torch.bool)


def pack_floats(dense: Tensor | None, row_blocks: Sequence[Tensor]) -> Tensor:
    """Dense shard (optional) then each table's rows, flattened into one float32 tensor."""
    parts = ([dense.reshape(-1)] if dense is not None else []) + [r.reshape(-1) for r in row_blocks]
    return torch.cat([p.to(torch.float32) for p in parts]) if parts else torch.empty(0, dtype=torch.float32)


def unpack_floats(floats: Tensor, dense_numel: int, counts: Sequence[int], dims: Sequence[int]) -> tuple[Tensor, list[Tensor]]:
    """Inverse of :func:`pack_floats`: (dense shard, [rows of table t as [count_t, dim_t]])."""
    sizes = [dense_numel] + [c * d for c, d in zip(counts, dims)]
    if sum(sizes) != floats.numel():
        raise ProtocolError(f"float payload has {floats.numel()} elements, the header implies {sum(sizes)}")
    parts = torch.split(floats, sizes)
    return parts[0], [p.view(c, d) for p, c, d in zip(parts[1:], counts, dims)]


@dataclasses.dataclass
class Outgoing:
    """The works of one sent message and the tensors they read (kept alive until waited)."""

    works: list
    tensors: list[Tensor]

    def done(self) -> bool:
        """Whether every transfer has completed (the receiver has taken the data); never blocks."""
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        """Wait for the transfers; only call once the receiver has been told to receive."""
        for w in self.works:
            w.wait()
        self.works = []
        self.tensors = []


def send_message(header: Header, ints: Tensor | None, floats: Tensor | None, channel) -> Outgoing:
    """Post the ``isend``s of one message (header, then non-empty payloads); returns at once."""
    if (ints is None and header.n_ints) or (ints is not None and ints.numel() != header.n_ints):
        raise ProtocolError(f"header says {header.n_ints} ints, payload has {None if ints is None else ints.numel()}")
    if (floats is None and header.n_floats) or (floats is not None and floats.numel() != header.n_floats):
        got = None if floats is None else floats.numel()
        raise ProtocolError(f"header says {header.n_floats} floats, payload has {got}")
    tensors = [header.to_tensor()]
    if header.n_ints:
        tensors.append(ints.contiguous())
    if header.n_floats:
        tensors.append(floats.contiguous())
    works = [channel.send(t) for t in tensors]
    return Outgoing(works=works, tensors=tensors)


def recv_message(channel, src: int) -> tuple[Header, Tensor, Tensor]:
    """Receive one announced message from rank ``src`` over its ``channel``: (header, ints, floats); empty payloads are empty."""
    raw = torch.empty(HEADER_LEN, dtype=torch.int64)
    channel.recv(raw)
    header = Header.from_tensor(raw)
    if header.src != src:
        raise ProtocolError(f"message from rank {src} claims to come from rank {header.src}")
    ints = torch.empty(header.n_ints, dtype=torch.int64)
    floats = torch.empty(header.n_floats, dtype=torch.float32)
    if header.n_ints:
        channel.recv(ints)
    if header.n_floats:
        channel.recv(floats)
    return header, ints, floats
