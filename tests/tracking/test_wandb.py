"""Weights & Biases (tuneforge/tracking/wandb.py) in offline mode, on the job of tracked.offline_job: killed after a
checkpoint, resumed, then continued. W&B resumes offline into a new folder with the same run id (`wandb sync` uploads
them as one run); the folders together hold metrics.jsonl's values at their steps, each step once. The killed
attempt's folder holds what W&B had written of it (its buffer: often nothing), the resume sends the rest; the
continued attempt's folder holds only the new steps, the earlier folders being read for the steps they have. Also the
config, tags, exit code and model artifact. Read back from the .wandb files with wandb's own protobuf
(tracked.wandb_records).
"""

from __future__ import annotations

import json

import pytest
import yaml
from tracked import (
    expected_histories,
    flattened,
    offline_job,
    run_ids_in_checkpoint,
    wandb_folders,
    wandb_history,
    wandb_records,
)

pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install 'tuneforge[wandb]')")


def histories(folders) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value)]} of the rows of offline run folders, in order."""
    found: dict[str, list[tuple[int, float]]] = {}
    for folder in folders:
        for step, row in wandb_history(folder):
            for key, value in row.items():
                found.setdefault(key, []).append((step, value))
    return found


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_bert, cache_dir):
    return offline_job(tmp_path_factory, tiny_bert, cache_dir)


def test_a_resumed_job_is_one_wandb_run_with_each_step_once(job):
    folders = wandb_folders(job / "wandb-dir")
    assert len(folders) == 3  # killed, resumed, continued
    run_id = run_ids_in_checkpoint(job / "run", 2)["wandb"]
    assert run_ids_in_checkpoint(job / "run", 4)["wandb"] == run_ids_in_checkpoint(job / "run", 6)["wandb"] == run_id
    assert {f.name.rsplit("-", 1)[1] for f in folders} == {run_id}
    assert histories(folders) == expected_histories(job / "run")
    assert [step for step, _ in wandb_history(folders[2])] == [5, 6]  # the earlier folders had steps 1-4


def test_the_runs_config_tags_end_and_model(job):
    resumed = wandb_folders(job / "wandb-dir")[1]
    records = list(wandb_records(next(resumed.glob("run-*.wandb"))))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {item.key: json.loads(item.value_json) for item in run.config.update if item.key != "_wandb"}
    flags = json.loads((job / "flags.json").read_text())
    assert config["resume"] == "latest" and config["max_steps"] is None and config["task"] == "classification"
    assert config["data.train_file"] == flags[flags.index("--train-file") + 1]
    # numbers and booleans as such (W&B sorts and filters them as numbers), as transformers' WandbCallback sends them
    assert config["batch_size"] == 8 and config["optim.lr"] == 8e-5 and config["quiet"] is True
    assert config["report_to"] == ["wandb", "trackio", "tensorboard"]
    continued = flattened(yaml.safe_load((job / "run" / "config.yaml").read_text()))  # the continued attempt's
    assert config == {**continued, "max_steps": None}
    assert {"task=classification", "backend=single", "world_size=1"} <= set(run.tags)
    assert run.project == "tuneforge" and run.display_name == "run"
    (end,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    (artifact,) = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert end.exit_code == 0 and artifact.type == "model" and artifact.name == f"model-{run.run_id}"
    files = sorted(entry.path for entry in artifact.manifest.contents)
    assert files == sorted(p.name for p in (job / "run" / "model").iterdir())
