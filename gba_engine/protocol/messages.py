"""Every value on the control plane, with its ``encode()`` / ``decode()``: records, phase ends, commands, acks.

A malformed value raises :class:`ControlMessageError` naming the message type and the text.

Example::

    decode_command(encode_command(Serve(m=4)))        # Serve(m=4, dense=True)
    PhaseEnd.decode("leave|12|recovered")             # Leave(target=12, reason='recovered')
"""
from __future__ import annotations

import dataclasses
import json
import pickle
from typing import Any, ClassVar, Mapping, Union


class ControlMessageError(ValueError):
    """A control-plane value that does not decode as the message it should be."""


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _fail(kind: str, raw: bytes | str, why: str) -> ControlMessageError:
    return ControlMessageError(f"malformed {kind} message {_text(raw)!r}: {why}")


# ---------------------------------------------------------------------------------------------- scalars
FLAG = "1"  # the value of a key whose presence is the message


def encode_int(value: int) -> str:
    """An integer record (a phase, a version, a batch number)."""
    return str(int(value))


def decode_int(raw: bytes | str) -> int:
    """Read :func:`encode_int`'s text."""
    try:
        return int(_text(raw))
    except ValueError:
        raise _fail("integer", raw, "not an integer") from None


def encode_float(value: float) -> str:
    """A float record, exact (``repr``)."""
    return repr(float(value))


def decode_float(raw: bytes | str) -> float:
    """Read :func:`encode_float`'s text."""
    try:
        return float(_text(raw))
    except ValueError:
        raise _fail("float", raw, "not a number") from None


def encode_stats(stats: Mapping[str, Any]) -> str:
    """A server's stats record (JSON)."""
    return json.dumps(stats)


def decode_stats(raw: bytes | str) -> dict:
    """Read :func:`encode_stats`' record."""
    try:
        out = json.loads(_text(raw))
    except json.JSONDecodeError as exc:
        raise _fail("stats", raw, str(exc)) from None
    if not isinstance(out, dict):
        raise _fail("stats", raw, "not a JSON object")
    return out


def encode_object(obj: Any) -> bytes:
    """A gather part (pickled: keep it to a few MB)."""
    return pickle.dumps(obj)


def decode_object(raw: bytes) -> Any:
    """Read :func:`encode_object`'s bytes."""
    return pickle.loads(raw)


# ---------------------------------------------------------------------------------------------- records
def _fields(kind: str, raw: bytes | str, sep: str, count: int) -> list[str]:
    parts = _text(raw).split(sep, count - 1)
    if len(parts) != count:
        raise _fail(kind, raw, f"expected {count} fields separated by {sep!r}")
    return parts


def _ints(kind: str, raw: bytes | str, *texts: str) -> list[int]:
    try:
        return [int(t) for t in texts]
    except ValueError:
        raise _fail(kind, raw, "a numeric field is not an integer") from None


@dataclasses.dataclass(frozen=True)
class StoreAddress:
    """``HOST:PORT`` of the control plane (also the content of ``gba.control_file``)."""

    host: str
    port: int

    def encode(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def decode(cls, raw: bytes | str) -> "StoreAddress":
        host, sep, port = _text(raw).strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise _fail("StoreAddress", raw, "expected HOST:PORT")
        return cls(host, int(port))


@dataclasses.dataclass(frozen=True)
class LayoutRecord:
    """The launch's world size and number of servers."""

    world_size: int
    num_servers: int

    def encode(self) -> str:
        return f"{self.world_size}|{self.num_servers}"

    @classmethod
    def decode(cls, raw: bytes | str) -> "LayoutRecord":
        return cls(*_ints("LayoutRecord", raw, *_fields("LayoutRecord", raw, "|", 2)))


@dataclasses.dataclass(frozen=True)
class DoorbellMessage:
    """Data from ``src`` (incarnation ``incarnation``) is on its way, or (``join``) a restarted worker asks in."""

    src: int
    incarnation: int
    join: bool = False

    def encode(self) -> str:
        body = f"{self.src}:{self.incarnation}"
        return f"join|{body}" if self.join else body

    @classmethod
    def decode(cls, raw: bytes | str) -> "DoorbellMessage":
        kind, _, rest = _text(raw).rpartition("|")
        if kind not in ("", "join"):
            raise _fail("DoorbellMessage", raw, f"unknown kind {kind!r}")
        src, inc = _fields("DoorbellMessage", rest, ":", 2)
        return cls(*_ints("DoorbellMessage", raw, src, inc), join=kind == "join")


@dataclasses.dataclass(frozen=True)
class AbortRecord:
    """Why the job stops: rank ``by`` found server rank ``server`` lost; ``reason`` is its error message."""

    by: int
    server: int
    reason: str

    def encode(self) -> str:
        return f"{self.by}|{self.server}|{self.reason}"

    @classmethod
    def decode(cls, raw: bytes | str) -> "AbortRecord":
        by, server, reason = _fields("AbortRecord", raw, "|", 3)
        return cls(*_ints("AbortRecord", raw, by, server), reason)


@dataclasses.dataclass(frozen=True)
class StuckRecord:
    """Worker rank ``by`` waits in a collective the servers never join; ``reason``: which, where, since when."""

    by: int
    reason: str

    def encode(self) -> str:
        return f"{self.by}|{self.reason}"

    @classmethod
    def decode(cls, raw: bytes | str) -> "StuckRecord":
        by, reason = _fields("StuckRecord", raw, "|", 2)
        return cls(*_ints("StuckRecord", raw, by), reason)


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """The first worker asks the servers to save their shards to ``path`` once at ``min_version``."""

    request_id: int
    min_version: int
    path: str

    def encode(self) -> str:
        return f"{self.request_id}|{self.min_version}|{self.path}"

    @classmethod
    def decode(cls, raw: bytes | str) -> "SaveRequest":
        req, version, path = _fields("SaveRequest", raw, "|", 3)
        return cls(*_ints("SaveRequest", raw, req, version), path)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A worker's ``count``-th local step took ``seconds`` (auto mode's straggler detection in gba)."""

    count: int
    seconds: float

    def encode(self) -> str:
        return f"{self.count}:{self.seconds!r}"

    @classmethod
    def decode(cls, raw: bytes | str) -> "StepTime":
        count, seconds = _fields("StepTime", raw, ":", 2)
        try:
            return cls(int(count), float(seconds))
        except ValueError:
            raise _fail("StepTime", raw, "expected COUNT:SECONDS") from None


# ---------------------------------------------------------------------------------------------- end of a gba phase
@dataclasses.dataclass(frozen=True)
class Leave:
    """Auto mode: every worker leaves the gba phase after ``target`` pushes of it, back to sync."""

    target: int
    reason: str

    def encode(self) -> str:
        return f"leave|{self.target}|{self.reason}"


@dataclasses.dataclass(frozen=True)
class Finished:
    """The phase's data ran out before anybody asked to leave."""

    def encode(self) -> str:
        return "finished"


@dataclasses.dataclass(frozen=True)
class Kept:
    """Auto mode: a worker is gone, so the job stays in this gba phase for good (a restarted one may join)."""

    reason: str

    def encode(self) -> str:
        return f"kept|{self.reason}"


class PhaseEnd:
    """How a gba phase ends: ``Leave``, ``Finished`` or ``Kept`` (``decode`` reads each); the first set wins."""

    @staticmethod
    def decode(raw: bytes | str) -> Union[Leave, Finished, Kept]:
        text = _text(raw)
        if text == "finished":
            return Finished()
        if text.startswith("kept|"):
            return Kept(text[len("kept|"):])
        kind, target, reason = _fields("PhaseEnd", raw, "|", 3) if text.startswith("leave|") else ("", "", "")
        if kind != "leave":
            raise _fail("PhaseEnd", raw, "expected 'finished', 'kept|REASON' or 'leave|TARGET|REASON'")
        return Leave(_ints("PhaseEnd", raw, target)[0], reason)


# ---------------------------------------------------------------------------------------------- commands
@dataclasses.dataclass(frozen=True)
class PutState:
    """Servers: receive a dense state (parameters + moments) from worker rank ``src``."""

    op: ClassVar[str] = "put_state"
    src: int


@dataclasses.dataclass(frozen=True)
class GetState:
    """Servers: send the dense state to worker rank ``src`` (acknowledged once the sends are posted)."""

    op: ClassVar[str] = "get_state"
    src: int


@dataclasses.dataclass(frozen=True)
class Serve:
    """Servers: serve one phase of ``m`` gradients per update; ``dense=False`` serves tables only (sync)."""

    op: ClassVar[str] = "serve"
    m: int
    dense: bool = True


@dataclasses.dataclass(frozen=True)
class SaveShards:
    """Servers: save the dense shard and the tables to ``path``."""

    op: ClassVar[str] = "save"
    path: str


@dataclasses.dataclass(frozen=True)
class LoadShards:
    """Servers: restore the dense shard and the tables from ``path``."""

    op: ClassVar[str] = "load"
    path: str


@dataclasses.dataclass(frozen=True)
class PutTables:
    """Servers: receive every server table's shard (rows, row optimizer state, step count) from worker rank ``src``.

    The tables were trained on the workers up to update ``version`` (a sync phase of mode auto).
    """

    op: ClassVar[str] = "put_tables"
    src: int
    version: int


@dataclasses.dataclass(frozen=True)
class GetTables:
    """Servers: send every server table's shard to worker rank ``src`` (acknowledged once the sends are posted)."""

    op: ClassVar[str] = "get_tables"
    src: int


Command = Union[PutState, GetState, Serve, SaveShards, LoadShards, PutTables, GetTables]
COMMANDS: dict[str, type] = {c.op: c for c in (PutState, GetState, Serve, SaveShards, LoadShards, PutTables,
                                               GetTables)}


def encode_command(command: Command) -> str:
    """``{"op": NAME, **fields}`` as JSON."""
    return json.dumps({"op": command.op, **dataclasses.asdict(command)})


def decode_command(raw: bytes | str) -> Command:
    """Read :func:`encode_command`'s JSON; an unknown op or field is a :class:`ControlMessageError` naming it."""
    try:
        body = json.loads(_text(raw))
        op = body.pop("op")
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
        raise _fail("Command", raw, 'expected a JSON object with an "op"') from None
    if op not in COMMANDS:
        raise _fail("Command", raw, f"unknown command {op!r} (known: {sorted(COMMANDS)})")
    try:
        return COMMANDS[op](**body)
    except TypeError as exc:
        raise _fail("Command", raw, f"bad fields for {op!r}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Ack:
    """A server's acknowledgement; a ``Serve`` phase's also carries the version and lost workers at its end."""

    version: int | None = None
    lost_workers: tuple[int, ...] = ()

    def encode(self) -> str:
        if self.version is None:
            return "{}"
        return json.dumps({"version": self.version, "lost_workers": list(self.lost_workers)})

    @classmethod
    def decode(cls, raw: bytes | str) -> "Ack":
        try:
            body = json.loads(_text(raw))
            return cls(body.get("version"), tuple(body.get("lost_workers", ())))
        except (json.JSONDecodeError, AttributeError, TypeError):
            raise _fail("Ack", raw, "expected a JSON object") from None
