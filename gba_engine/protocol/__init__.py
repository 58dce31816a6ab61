"""The control plane of a GBA job in one place: every TCPStore key, every message and its encoding.

The first server rank hosts a TCPStore (``ps/runtime.py``); all ranks, and a restarted
worker, talk through it. Every key below is built by one function here and every value is
written by an ``encode()`` and read by a ``decode()`` here, so nothing else in the job knows
how a key is spelt or a value is packed. Tensors never go through the store: they travel
over gloo point-to-point (``ps/wire.py``); the store carries doorbells, commands and
small records.

==========================  ========================  ==================  =====================================
key                         written by                read by             value: meaning
==========================  ========================  ==================  =====================================
``ps_store/<gen>``          first server (default     launched ranks      ``StoreAddress`` of the control plane
                            store of the launch)
``layout``                  first server              restarting worker   ``LayoutRecord``: world, servers
``hb/<rank>``               each rank (counter)       ``Liveness``        heartbeat; stops when the rank dies
``closed/<rank>``           each rank at close        first server        ``FLAG``: keep the store up until all
``inbox/<rank>[/<inc>]``    peers (a queue)           ``rank``            ``DoorbellMessage``: data/join coming
``incarnation/<rank>``      restarting worker         itself              restarts of worker ``rank`` (counter)
``pair/<w>/<s>/<inc>/``     gloo rendezvous           gloo                a rejoined worker's pair group
``joinable``                first worker (auto: any)  restarting worker   ``encode_int``: the gba phase kept
``version/<server>``        each server, per update   rejoining worker    ``encode_int``: model version
``norm/<p>/<v>/<server>``   each server (clipping)    the other servers   ``encode_float``: shard's sum sq.
``cmd/<seq>``               first worker              every server        a ``Command`` (seq 0, 1, ...)
``ack/<seq>/<server>``      each server               first worker        ``Ack`` of command ``seq``
``done/<rank>``             each worker at close      every server        ``FLAG``: the worker left the job
``stats/<server>``          each server               ``summary()``       ``encode_stats``: running totals
``save_req``                first worker              every server        ``SaveRequest`` during a phase
``save_done/<id>/<s>``      each server               first worker        ``FLAG``: shard of save ``id`` written
``exhausted/<phase>``       any worker                every server        ``FLAG``: the phase's batches ran out
``out/<phase>/<rank>``      each worker               every worker        ``FLAG``: no more pushes from rank
``end/<phase>``             compare_set: first wins   every worker        ``PhaseEnd``: ``Leave`` / ``Finished`` / ``Kept``
``t/<rank>``                each worker (auto, gba)   first worker        ``StepTime`` of its last local step
``rate/<rank>``             each worker               ``summary()``       ``encode_float``: local samples/s
``claims/<phase>``          workers (a counter)       workers             batches claimed in gba phase
``claims_base/<phase>``     each worker entering      rejoined worker     ``encode_int``: the phase's 1st batch
``gather/<name>/<rank>``    each live worker          each live worker    ``encode_object``: a gather's part
``abort``                   compare_set: first rank   every rank's waits  ``AbortRecord``: a server is lost, stop
                            to find a server lost
``stuck``                   compare_set: the first    every server's      ``StuckRecord``: a worker waits in a
                            worker found stuck        waits               collective the servers never join
==========================  ========================  ==================  =====================================

Every key starts with ``gba/`` (``keys._ROOT``).

Monitor events (DeepSpeed's ``monitor.write_events``, first worker) are named here too:
``gba/mode_is_gba``, ``gba/switch_seconds``, ``gba/switch_mbytes``, ``gba/dropped``,
``gba/decayed``, ``gba/samples_per_s/worker<r>``, ``gba/staleness/<tau>``.

The keys are in ``keys.py``, the values and their encodings in ``messages.py``.
A malformed value raises :class:`ControlMessageError` naming the message type and the text.

Example::

    store.set(command_key(0), Serve(m=4, dense=True).encode())
    decode_command(store.get(command_key(0)))          # Serve(m=4, dense=True)
    PhaseEnd.decode(b"leave|12|recovered")             # Leave(target=12, reason='recovered')
"""
from __future__ import annotations

from .keys import (DECAYED_EVENT, DROPPED_EVENT, MODE_IS_GBA_EVENT, SWITCH_MBYTES_EVENT, SWITCH_SECONDS_EVENT,
                   abort_key, ack_key, claims_base_key, claims_counter_key, closed_key, command_key, done_key,
                   end_key, exhausted_key, gather_key, heartbeat_key, host_key, inbox_key, incarnation_key, joinable_key,
                   layout_key, norm_key, out_key, pair_prefix, rate_key, samples_per_s_event, save_done_key,
                   save_request_key, staleness_event, stats_key, step_time_key, store_address_key, stuck_key,
                   version_key, worker_lost_key)
from .messages import (COMMANDS, FLAG, AbortRecord, Ack, Command, ControlMessageError, DoorbellMessage, Finished,
                       GetState, GetTables, Kept, LayoutRecord, Leave, LoadShards, PhaseEnd, PutState, PutTables,
                       SaveRequest, SaveShards, Serve, StepTime, StoreAddress, StuckRecord, decode_command, decode_float,
                       decode_int,
                       decode_object, decode_stats, encode_command, encode_float, encode_int, encode_object,
                       encode_stats)

__all__ = [
    "AbortRecord", "Ack", "COMMANDS", "Command", "ControlMessageError", "DECAYED_EVENT", "DROPPED_EVENT",
    "DoorbellMessage", "FLAG", "Finished", "GetState", "GetTables", "Kept", "LayoutRecord", "Leave",
    "LoadShards", "MODE_IS_GBA_EVENT", "PhaseEnd", "PutState", "PutTables", "SWITCH_MBYTES_EVENT",
    "SWITCH_SECONDS_EVENT", "SaveRequest",
    "SaveShards", "Serve", "StepTime", "StoreAddress", "StuckRecord", "abort_key", "ack_key", "claims_base_key",
    "claims_counter_key", "closed_key", "command_key", "decode_command", "decode_float", "decode_int",
    "decode_object", "decode_stats", "done_key", "encode_command", "encode_float", "encode_int", "encode_object",
    "encode_stats", "end_key", "exhausted_key", "gather_key", "heartbeat_key", "host_key", "inbox_key", "incarnation_key",
    "joinable_key", "layout_key", "norm_key", "out_key", "pair_prefix", "rate_key", "samples_per_s_event",
    "save_done_key", "save_request_key", "staleness_event", "stats_key", "step_time_key", "store_address_key",
    "stuck_key", "version_key", "worker_lost_key",
]
