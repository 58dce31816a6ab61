"""gba_engine.ps.runtime split by concern: each name lives in one module, the old imports keep working."""
import warnings

import pytest


def test_the_old_import_paths_give_the_same_objects():
    from gba_engine.ps import channel, errors, liveness, rendezvous, roles, runtime

    from gba_engine.ps.runtime import (Layout, Liveness, PSConnectionError, ServerLostError, init_runtime,
                                       join_runtime, late, read_layout)
    assert Layout is roles.Layout and runtime.layout is roles.layout
    assert Liveness is liveness.Liveness
    assert PSConnectionError is errors.PSConnectionError and ServerLostError is errors.ServerLostError
    assert late is errors.late
    assert (init_runtime, join_runtime, read_layout) == (rendezvous.init_runtime, rendezvous.join_runtime,
                                                         rendezvous.read_layout)
    assert channel.PeerChannel is runtime.PeerChannel
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        runtime.nothing


def test_link_is_one_thing_and_the_old_name_warns():
    from gba_engine.ps import runtime
    from gba_engine.ps.channel import PeerChannel
    from gba_engine.ps.link import LinkModel

    with pytest.warns(DeprecationWarning, match="PeerChannel"):
        old = runtime.Link
    assert old is PeerChannel and not hasattr(runtime.PSRuntime, "Link")
    assert "Link" not in vars(runtime)  # the name "link" is the modelled slow link's (link.py) alone
    assert LinkModel.__module__ == "gba_engine.ps.link"


def test_runtime_link_method_warns_and_gives_the_channel():
    import torch.distributed as dist

    from gba_engine.ps.roles import layout
    from gba_engine.ps.runtime import PSRuntime

    class _Group:  # the channel only holds its group
        pass

    rt = PSRuntime(rank=0, layout=layout(2, 1), ps_group=_Group(), worker_group=None, store=None,
                   store_host="127.0.0.1", store_port=0, timeout_s=5.0, heartbeat_s=0.5)
    assert rt.channel(1).peer == 1 and isinstance(rt.channel(1).group, _Group)
    with pytest.warns(DeprecationWarning, match="channel"):
        assert rt.link(1) == rt.channel(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt.channel(1)
    assert dist is not None
