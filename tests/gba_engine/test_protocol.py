"""The control-plane protocol: every message round-trips through its encoding; a malformed one is a clear error."""
import math

import pytest

from gba_engine import protocol as p


@pytest.mark.parametrize("message", [
    p.StoreAddress("127.0.0.1", 29500),
    p.LayoutRecord(world_size=4, num_servers=1),
    p.DoorbellMessage(src=2, incarnation=0),
    p.DoorbellMessage(src=1, incarnation=3, join=True),
    p.SaveRequest(request_id=7, min_version=12, path="/tmp/ckpt|odd/global_step12"),  # a "|" in the path survives
    p.StepTime(count=5, seconds=0.125),
    p.Ack(),
    p.Ack(version=9, lost_workers=(1, 3)),
])
def test_every_record_round_trips(message):
    encoded = message.encode()
    assert type(message).decode(encoded) == message
    assert type(message).decode(encoded.encode()) == message  # the store hands back bytes


def test_step_time_keeps_nan_and_exact_floats():
    assert math.isnan(p.StepTime.decode(p.StepTime(0, math.nan).encode()).seconds)
    assert p.StepTime.decode(p.StepTime(3, 0.1 + 0.2).encode()).seconds == 0.1 + 0.2


@pytest.mark.parametrize("end", [p.Leave(target=12, reason="recovered, ratios [1.0, 1.1]"),
                                 p.Leave(target=0, reason="a|b"), p.Finished(), p.Kept("workers [1] are gone")])
def test_phase_end_round_trips(end):
    assert p.PhaseEnd.decode(end.encode()) == end


@pytest.mark.parametrize("command", [p.PutState(src=0), p.GetState(src=1), p.Serve(m=4), p.Serve(m=2, dense=False),
                                     p.SaveShards(path="ckpt/a"), p.LoadShards(path="ckpt/b"),
                                     p.PutTables(src=0, version=7), p.GetTables(src=1)])
def test_every_command_round_trips(command):
    assert p.decode_command(p.encode_command(command)) == command


def test_commands_are_the_json_the_servers_always_read():
    assert p.encode_command(p.Serve(m=4, dense=False)) == '{"op": "serve", "m": 4, "dense": false}'
    assert sorted(p.COMMANDS) == ["get_state", "get_tables", "load", "put_state", "put_tables", "save", "serve"]
    assert p.encode_command(p.PutTables(src=0, version=7)) == '{"op": "put_tables", "src": 0, "version": 7}'


def test_scalars_and_stats_round_trip():
    assert p.decode_int(p.encode_int(42)) == 42
    assert p.decode_float(p.encode_float(1 / 3)) == 1 / 3
    stats = {"received": 3, "staleness": {"0": 2, "1": 1}, "lost_workers": [2]}
    assert p.decode_stats(p.encode_stats(stats)) == stats
    assert p.decode_object(p.encode_object({"w": [1, 2]})) == {"w": [1, 2]}


@pytest.mark.parametrize("decode, raw, match", [
    (p.decode_command, '{"op": "explode"}', "unknown command 'explode'"),
    (p.decode_command, '{"m": 4}', 'with an "op"'),
    (p.decode_command, "not json", 'with an "op"'),
    (p.decode_command, '{"op": "serve", "n": 4}', "bad fields for 'serve'"),
    (p.PhaseEnd.decode, "stay|3|x", "expected 'finished', 'kept|REASON' or 'leave|TARGET|REASON'"),
    (p.PhaseEnd.decode, "leave|soon|x", "not an integer"),
    (p.StepTime.decode, "12", "StepTime"),
    (p.SaveRequest.decode, "1|2", "SaveRequest"),
    (p.LayoutRecord.decode, "4|x", "LayoutRecord"),
    (p.DoorbellMessage.decode, "ring|1:0", "unknown kind 'ring'"),
    (p.StoreAddress.decode, "localhost", "HOST:PORT"),
    (p.decode_int, "3.5", "integer"),
    (p.decode_stats, "[1]", "not a JSON object"),
    (p.Ack.decode, "[]", "Ack"),
])
def test_malformed_messages_name_their_type_and_text(decode, raw, match):
    with pytest.raises(p.ControlMessageError, match="malformed") as info:
        decode(raw)
    assert match in str(info.value) and repr(raw) in str(info.value)


def test_keys_are_distinct_per_family_and_argument():
    keys = [p.command_key(1), p.ack_key(1, 0), p.done_key(1), p.exhausted_key(1), p.out_key(1, 0), p.end_key(1),
            p.stats_key(1), p.save_request_key(), p.save_done_key(1, 0), p.gather_key("x", 1), p.rate_key(1),
            p.step_time_key(1), p.claims_counter_key(1), p.claims_base_key(1), p.inbox_key(1), p.inbox_key(1, 2),
            p.incarnation_key(1), p.joinable_key(), p.layout_key(), p.heartbeat_key(1), p.version_key(1),
            p.closed_key(1), p.store_address_key(1), p.norm_key(1, 2, 0), p.pair_prefix(1, 2, 0)]
    assert len(set(keys)) == len(keys)
    assert p.inbox_key(3).split("/") == ["gba", "inbox", "3"]  # spelt as running jobs spell it
    assert p.pair_prefix(1, 2, 0).split("/") == ["gba", "pair", "1", "2", "0", ""]


def test_command_table_names_a_command_it_has_no_handler_for():
    from gba_engine.server_loop import CommandTable, UnknownCommandError

    seen = []
    table = CommandTable({p.Serve: lambda cmd, seq: seen.append((cmd, seq))})
    table.handler(p.Serve(m=2))(p.Serve(m=2), 5)
    assert seen == [(p.Serve(m=2), 5)]
    with pytest.raises(UnknownCommandError, match="'save'"):
        table.handler(p.SaveShards(path="x"))


def test_server_stats_merge_once_without_touching_the_totals():
    from gba_engine.server_loop import empty_stats, merged_stats

    totals = empty_stats()
    phase = {"received": 4, "counted": 3, "dropped": 1, "decayed": 0, "staleness": {0: 3, 2: 1}}
    out = merged_stats(totals, phase, lost_workers=[2], rejoined=[1], pushes={0: 2, 1: 2})
    again = merged_stats(out, phase, lost_workers=[0], pushes={0: 1})
    assert totals == empty_stats()  # a new dict: the input is not mutated
    assert again["received"] == 8 and again["dropped"] == 2 and again["staleness"] == {"0": 6, "2": 2}
    assert again["lost_workers"] == [0, 2] and again["rejoined"] == [1] and again["pushes"] == {"0": 3, "1": 2}


def _phase_on_a_store(number: int):
    """A GBAPhase whose context has only a real TCPStore (keep() touches nothing else)."""
    import datetime
    import types

    from torch.distributed import TCPStore

    from gba_engine.phases.gba import GBAPhase
    from sparse_scale.multiproc import free_port

    store = TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=10))
    phase = GBAPhase(types.SimpleNamespace(rt=types.SimpleNamespace(store=store)), kept=False)
    phase.number = number
    return phase, store


def test_keep_loses_to_a_leave_set_first_and_publishes_no_joinable_phase():
    # the CI flake: a worker kept a phase the first worker had already decided to leave, so a restarted
    # worker joined while the servers served sync's tables-only phase
    phase, store = _phase_on_a_store(3)
    store.set(p.end_key(3), p.Leave(target=5, reason="recovered").encode())
    assert phase.keep("worker 0 is gone") is False
    assert not phase.kept and not store.check([p.joinable_key()])
    assert p.PhaseEnd.decode(store.get(p.end_key(3))) == p.Leave(target=5, reason="recovered")


def test_keep_wins_an_open_phase_and_a_later_leave_or_finish_loses():
    phase, store = _phase_on_a_store(2)
    assert phase.keep("workers [1] are gone") is True
    assert phase.kept and p.decode_int(store.get(p.joinable_key())) == 2
    for late in (p.Leave(target=9, reason="recovered"), p.Finished()):  # what auto's first worker / data end try
        assert p.PhaseEnd.decode(store.compare_set(p.end_key(2), "", late.encode())) == p.Kept("workers [1] are gone")
    assert phase.keep("the first worker 0 is gone") is True  # a second keeper agrees with the first
