"""Byte-level text data over any folder of text files, with a deterministic train/held-out split.

Files are split by a hash of their path relative to the folder, so the split does not depend
on the file order, the machine or which files were added later. Each split is the files'
bytes in path order, joined by the end-of-document token (256). Training windows are
``seq_len + 1`` tokens, cut without overlap and shuffled per epoch from the seed; global
window ``g`` of micro-batch ``m`` goes to rank ``g % world_size``, so ranks never share a
window and a resumed run continues from the micro-batch index alone.

Example::

    corpus = ByteCorpus.from_folder("/usr/lib/python3.11", glob="*.py", heldout_fraction=0.05)
    batches = corpus.train_batches(seq_len=256, micro_batch=8, rank=0, world_size=2, seed=1)
    tokens, targets = next(batches)          # [8, 256] each, int64
    for tokens, targets in corpus.eval_batches(256, 8, rank=0, world_size=2): ...
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .models.config import END_OF_DOCUMENT

logger = logging.getLogger(__name__)

BINARY_PROBE_BYTES = 8192  # a NUL byte in the first 8 KiB marks a binary file (git's heuristic)


def is_heldout(relative_path: str, heldout_fraction: float) -> bool:
    """Whether a file goes to the held-out split: the first 8 bytes of sha1(path) as a fraction of 2**64."""
    digest = hashlib.sha1(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < heldout_fraction


def _join(files: Sequence[Path]) -> Tensor:
    """The files' bytes joined by the end-of-document token, as int16 (fits 0..256)."""
    parts: List[Tensor] = []
    for f in files:
        data = f.read_bytes()
        parts.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16) if data else
                     torch.empty(0, dtype=torch.int16))
        parts.append(torch.tensor([END_OF_DOCUMENT], dtype=torch.int16))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int16)


@dataclass
class ByteCorpus:
    """The two token streams of a folder: ``train`` and ``heldout`` (int16, bytes + end-of-document)."""

    train: Tensor
    heldout: Tensor
    train_files: List[str]
    heldout_files: List[str]

    @classmethod
    def from_folder(cls, folder: str | Path, glob: str = "**/*", heldout_fraction: float = 0.05,
                    max_file_bytes: Optional[int] = None) -> "ByteCorpus":
        """Read every text file under ``folder`` that matches ``glob`` (binary files are skipped).

        Both splits get at least one file: when the hash puts all files on one side, the
        file with the smallest hash value is moved over.
        """
        root = Path(folder)
        if not root.is_dir():
            raise FileNotFoundError(f"data folder {root} does not exist or is not a folder")
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
        files, skipped = [], 0
        for path in sorted(p for p in root.glob(glob) if p.is_file()):
            if max_file_bytes is not None and path.stat().st_size > max_file_bytes:
                skipped += 1
                continue
            with path.open("rb") as fh:
                if b"\0" in fh.read(BINARY_PROBE_BYTES):
                    skipped += 1
                    continue
            files.append(path)
        if len(files) < 2:
            raise ValueError(f"{root} has {len(files)} text file(s) matching {glob!r}; need at least 2 "
                             "(one for training, one held out)")
        rel = [p.relative_to(root).as_posix() for p in files]
        held = [is_heldout(r, heldout_fraction) for r in rel]
        if all(held) or not any(held):
            # Tiny folders: move the file nearest the threshold so both splits exist.
            key = min(range(len(rel)), key=lambda i: hashlib.sha1(rel[i].encode()).digest())
            held[key] = not held[key]
        train_files = [p for p, h in zip(files, held) if not h]
        heldout_files = [p for p, h in zip(files, held) if h]
        corpus = cls(_join(train_files), _join(heldout_files), [r for r, h in zip(rel, held) if not h],
                     [r for r, h in zip(rel, held) if h])
        logger.info("corpus %s: %d train files (%d bytes), %d held-out files (%d bytes), %d skipped", root,
                    len(train_files), corpus.train.numel(), len(heldout_files), corpus.heldout.numel(), skipped)
        return corpus

    def num_train_windows(self, seq_len: int) -> int:
        """Non-overlapping training windows of ``seq_len + 1`` tokens."""
        return (self.train.numel() - 1) // seq_len

    def train_batches(self, seq_len: int, micro_batch: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                      start_micro_batch: int = 0) -> Iterator[Tuple[Tensor, Tensor]]:
        """Endless ``(tokens, targets)`` micro-batches of this rank, from micro-batch ``start_micro_batch``.

        Global window ``g = (m * world_size + rank) * micro_batch + j`` of the epoch's
        permutation feeds row ``j`` of micro-batch ``m``; epochs reshuffle with ``seed + epoch``.
        """
        windows = self.num_train_windows(seq_len)
        per_step = micro_batch * world_size
        if windows < per_step:
            raise ValueError(f"training split has {windows} windows of {seq_len + 1} tokens but one step of "
                             f"{world_size} rank(s) x {micro_batch} needs {per_step}: use more data or shorter "
                             "sequences")
        steps_per_epoch = windows // per_step  # the tail of each epoch is dropped so every step is full
        offsets = torch.arange(seq_len + 1)
        m = start_micro_batch
        epoch, perm = -1, None
        while True:
            e, within = divmod(m, steps_per_epoch)
            if e != epoch:
                epoch = e
                perm = torch.randperm(windows, generator=torch.Generator().manual_seed(seed + epoch))
            first = (within * world_size + rank) * micro_batch
            starts = perm[first:first + micro_batch] * seq_len
            rows = self.train[starts[:, None] + offsets].long()
            yield rows[:, :-1], rows[:, 1:]
            m += 1

    def eval_batches(self, seq_len: int, micro_batch: int, rank: int = 0, world_size: int = 1,
                     max_tokens: Optional[int] = None) -> Iterator[Tuple[Tensor, Tensor]]:
        """This rank's share of the held-out split: every held-out token is predicted exactly once.

        Windows start every ``seq_len`` tokens (the last may be shorter, padded with target
        ``-100``, which losses ignore); window ``i`` goes to rank ``i % world_size``, and every
        rank yields the same number of batches;
        ``max_tokens`` caps the predicted tokens over all ranks.
        """
        stream = self.heldout
        n = stream.numel() - 1
        if max_tokens is not None:
            n = min(n, max_tokens)
        all_starts = list(range(0, n, seq_len))
        per_rank = -(-len(all_starts) // world_size)
        mine = all_starts[rank::world_size]
        # Every rank runs the same number of batches (an expert-parallel forward is collective):
        # short ranks get padding windows (start -1) whose targets are all ignored.
        starts = mine + [-1] * (per_rank - len(mine))
        for i in range(0, len(starts), micro_batch):
            chunk = starts[i:i + micro_batch]
            tokens = torch.zeros(len(chunk), seq_len, dtype=torch.long)
            targets = torch.full((len(chunk), seq_len), -100, dtype=torch.long)
            for row, s in enumerate(chunk):
                if s < 0:
                    continue
                length = min(seq_len, n - s)
                tokens[row, :length] = stream[s:s + length].long()
                targets[row, :length] = stream[s + 1:s + 1 + length].long()
            yield tokens, targets
