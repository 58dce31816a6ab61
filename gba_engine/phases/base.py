"""What every phase of a worker shares: the :class:`WorkerContext` and the small :class:`Phase` interface.

A worker is always in exactly one phase: :class:`~gba_engine.phases.sync.SyncPhase`
(DeepSpeed's all-reduce; the servers hold only the server tables' rows) or
:class:`~gba_engine.phases.gba.GBAPhase` (every global batch through the parameter servers
under token control). The engine forwards its training surface to the current phase; a
:class:`~gba_engine.phases.auto.SwitchPolicy` decides when to move between them.

Example::

    ctx = WorkerContext(rt=rt, gba=gba, spec=spec, ds_engine=ds, module=net, tables=[], micro_batch=8, gas=1)
    phase = SyncPhase(ctx)
    phase.open()
    out = phase.forward(x); phase.backward(loss_fn(out, y)); phase.step()     # True at the boundary
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Mapping, Protocol

import torch

from ..claims import BatchClaims
from ..commands import ServerCommands
from ..config import GBAConfig
from ..observe import Observer
from ..ps import OptimizerSpec, PSClient, PSRuntime
from ..ps.runtime import Liveness
from ..ps.sharding import ServerTableSpec
from ..row_cache import ServerRowCache
from ..step_clock import StepClock
from ..worker_tables import WorkerTables


@dataclasses.dataclass(eq=False)
class WorkerContext:
    """One worker's state that outlives its phases (the engine owns it; phases read and advance it)."""

    rt: PSRuntime
    gba: GBAConfig
    spec: OptimizerSpec
    ds_engine: Any  # deepspeed.DeepSpeedEngine; None in a restarted worker
    module: torch.nn.Module
    tables: list[ServerTableSpec]  # ServerEmbeddingBagCollection tables: rows on the servers in every mode
    micro_batch: int
    gas: int
    version: int = 0  # global updates applied to the model
    global_steps: int = 0  # local optimizer steps of this worker
    truth: str = "workers"  # where the current parameters live: "workers" (DeepSpeed) or "servers"
    gba_phases: int = 0  # gba phases entered so far, job-wide numbering (the servers count them the same way)
    clock: StepClock = dataclasses.field(default_factory=StepClock)  # this step's own time (step_clock.py)
    claims: BatchClaims | None = None
    last_batch: int | None = None  # the batch number claim_batches last handed this worker
    pulled_rows: list = dataclasses.field(default_factory=list)  # (table, unique ids, leaf) of this step
    row_cache: ServerRowCache | None = None  # the worker's read cache of server rows (row_cache.py), if configured
    worker_tables: WorkerTables | None = None  # auto mode: every server table on this worker in sync phases
    tables_here: bool = False  # whether the tables' rows live on the workers now (worker_tables), not the servers
    ps_bytes: dict = dataclasses.field(default_factory=lambda: {"sent": 0, "received": 0})  # of closed clients
    observer: Observer = None  # type: ignore[assignment]  # set in __post_init__
    commands: ServerCommands = None  # type: ignore[assignment]
    worker_live: Liveness = None  # type: ignore[assignment]
    first_live: Liveness = None  # type: ignore[assignment]
    server_live: Liveness = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.observer is None:
            monitor = self.ds_engine.monitor if self.ds_engine is not None else None
            self.observer = Observer(self.rt.rank, monitor, "sync", self.micro_batch * self.gas * self.num_workers)
        if self.commands is None:
            self.commands = ServerCommands(self.rt)
        if self.worker_live is None:  # one tracker per engine: a worker found lost once costs no new lease
            self.worker_live = Liveness(self.rt, self.workers)
        if self.first_live is None:  # auto mode: the coordinator
            self.first_live = Liveness(self.rt, self.workers[:1])
        if self.server_live is None:  # sync phases: the servers' heartbeats (sync_faults.ServerWatch)
            self.server_live = Liveness(self.rt, self.rt.layout.servers)

    @property
    def workers(self) -> tuple[int, ...]:
        """The job's worker ranks."""
        return self.rt.layout.workers

    @property
    def num_workers(self) -> int:
        """Workers of the job (N)."""
        return len(self.rt.layout.workers)

    @property
    def is_first(self) -> bool:
        """Whether this worker coordinates the servers (sends commands, saves, decides auto switches)."""
        return self.rt.rank == self.rt.layout.workers[0]

    @property
    def job_step(self) -> int:
        """The job step this worker last trained, counted from 0: the one counter of every message and summary line.

        With :meth:`GBAEngine.claim_batches`, its batch number // workers (what the rec job's ``--straggler``
        windows count; in a gba phase the fast workers move it on); otherwise this worker's optimizer steps - 1,
        which is the user's loop index in ``for step in range(steps)``.
        """
        if self.last_batch is not None:
            return self.last_batch // self.num_workers
        return max(0, self.global_steps - 1)

    @property
    def dense_numel(self) -> int:
        """Elements of the flat dense vector (every module parameter)."""
        return sum(p.numel() for p in self.module.parameters())

    @property
    def local_samples(self) -> int:
        """Samples of one local optimizer step (micro batch x accumulation steps)."""
        return self.micro_batch * self.gas

    def take_row_grads(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The pulled rows' ids and gradients of this step, per table; forgets them (binds ``pulled_rows = []``)."""
        ids: dict[str, list] = {}
        grads: dict[str, list] = {}
        for table, unique, leaf in self.pulled_rows:
            if leaf.grad is not None:
                ids.setdefault(table, []).append(unique)
                grads.setdefault(table, []).append(leaf.grad)
        self.pulled_rows = []
        return ({t: torch.cat(v) for t, v in ids.items()}, {t: torch.cat(v) for t, v in grads.items()})


class Phase(abc.ABC):
    """One way of training a step; the engine's training surface goes to the current phase."""

    name: ClassVar[str]  # "sync" or "gba": what ``GBAEngine.mode`` reports

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.client: PSClient | None = None  # the parameter servers' client while the phase is open

    @property
    def is_open(self) -> bool:
        """Whether the phase talks to the servers now (its client is connected)."""
        return self.client is not None

    def close_client(self) -> None:
        """Say goodbye to the servers and keep the client's byte counts in the context."""
        if self.client is not None:
            self.ctx.ps_bytes["sent"] += self.client.bytes_sent
            self.ctx.ps_bytes["received"] += self.client.bytes_received
            self.client.close()
            self.client = None

    def prefetch_rows(self, ids: Mapping[str, torch.Tensor]) -> None:
        """Start pulling rows the next lookup will read (with a row cache; otherwise nothing to do)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Leave the servers (the client says goodbye); the phase may not train afterwards."""

    @abc.abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward for this phase."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """The backward of one micro-batch."""

    @abc.abstractmethod
    def step(self) -> bool:
        """One micro-batch's step; True when it ended an accumulation window (an update was made)."""

    @abc.abstractmethod
    def is_boundary(self) -> bool:
        """Whether the next :meth:`step` ends an accumulation window."""

    @abc.abstractmethod
    def fetch_rows(self, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows of unique ``ids`` per server table, as this phase's training must read them."""

    @abc.abstractmethod
    def table_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The servers' rows of ``table`` for ``ids`` as this phase sees them (evaluation, export)."""

    def refresh_for_eval(self) -> None:
        """Bring the module up to date before evaluation (nothing to do unless the servers hold the truth)."""


class PhaseHost(Protocol):
    """What a switch policy may ask of the engine: its current phase, and the two hand-overs."""

    ctx: WorkerContext
    phase: Phase

    def switch_to_gba(self, reason: str, slow: frozenset = frozenset()) -> None:
        """Hand the state to the servers and continue in a gba phase."""

    def switch_to_sync(self, reason: str) -> None:
        """Take the state back from the servers and continue in a sync phase."""
