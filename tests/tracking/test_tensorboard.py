"""TensorBoard (tuneforge/tracking/tensorboard.py), on the job of tracked.offline_job (killed after a checkpoint,
resumed, continued): its event files show each step once, with metrics.jsonl's values (as float32, TensorBoard's),
read through TensorBoard's own reader (which applies the resume's purge of the killed attempt's later events).
"""

from __future__ import annotations

import numpy as np
import pytest
from tracked import expected_histories, offline_job, run_ids_in_checkpoint


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_bert, cache_dir):
    return offline_job(tmp_path_factory, tiny_bert, cache_dir)


def test_a_resumed_job_shows_each_step_once(job):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = job / "run" / "tensorboard"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 3  # one an attempt
    assert run_ids_in_checkpoint(job / "run", 2)["tensorboard"] == "tensorboard"
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    expected = expected_histories(job / "run")
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for key, points in expected.items():
        shown = [(e.step, e.value) for e in events.Scalars(key)]
        assert shown == [(step, float(np.float32(value))) for step, value in points], key
