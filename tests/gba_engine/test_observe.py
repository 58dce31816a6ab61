"""Observer: GBA events share the job-samples x-axis that DeepSpeed and train_rec log on (wandb drops lower steps)."""
from gba_engine.observe import Observer
from gba_engine.protocol import MODE_IS_GBA_EVENT, SWITCH_SECONDS_EVENT, samples_per_s_event, staleness_event


class _Monitor:
    enabled = True

    def __init__(self):
        self.events = []

    def write_events(self, events):
        self.events += events


def test_events_use_job_samples_and_only_the_first_worker_writes():
    mon = _Monitor()
    obs = Observer(rank=0, monitor=mon, mode="sync", global_batch=512)
    for version in (1, 2, 3):
        obs.on_step(samples=128, seconds=0.01, version=version)
    obs.on_switch(step=3, src="sync", dst="gba", seconds=0.05, nbytes=2_000_000, reason="slow workers [3]")
    out = obs.summary([{"staleness": {"0": 5, "1": 2}, "received": 7, "counted": 7, "dropped": 0, "decayed": 0,
                        "version": 2}], rates={0: 900.0, 3: 200.0})
    assert {x for _, _, x in mon.events} == {3 * 512}  # DeepSpeed's global samples after 3 updates
    names = {n for n, _, _ in mon.events}
    assert {MODE_IS_GBA_EVENT, SWITCH_SECONDS_EVENT, staleness_event(1), samples_per_s_event(3)} <= names
    assert out["mode"] == "gba" and out["steps_per_mode"] == {"sync": 3} and out["staleness_histogram"] == {0: 5, 1: 2}
    quiet = _Monitor()
    Observer(rank=1, monitor=quiet, mode="sync", global_batch=512).on_switch(1, "sync", "gba", 0.1, 1)
    assert quiet.events == []
