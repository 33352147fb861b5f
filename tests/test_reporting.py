"""What a run leaves behind (tuneforge/reporting.py): result.json replaced whole, never written in place."""

from __future__ import annotations

import json

from tuneforge.config import TrainConfig
from tuneforge.reporting import Reporter


def test_result_json_is_replaced_whole_so_a_reader_never_sees_part_of_it(tmp_path):
    """`tuneforge runs` and a sweep read result.json while runs write it; written in place, a reader (or a kill
    during the write) met a truncated file. A reader that opened the old one reads it whole; the new one is complete."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "result.json").write_text(json.dumps({"accuracy": 0.5, "steps": 2}, indent=2))
    reporter = Reporter(TrainConfig(output_dir=str(run_dir), quiet=True))
    with open(run_dir / "result.json") as reader:  # opened before the run finishes
        reporter.finish({"accuracy": 0.75, "steps": 4})
        assert json.loads(reader.read()) == {"accuracy": 0.5, "steps": 2}
    assert json.loads((run_dir / "result.json").read_text()) == {"accuracy": 0.75, "steps": 4}
    assert sorted(p.name for p in run_dir.iterdir()) == ["result.json"]  # no temporary file left


def test_config_yaml_is_replaced_whole_too(tmp_path):
    """A run (a resume too) writes OUTPUT_DIR/config.yaml as it starts: replaced whole, as result.json, so that a kill
    then leaves the one before, which `tuneforge train OUT/config.yaml` and `tuneforge runs` read."""
    path = tmp_path / "config.yaml"
    TrainConfig(output_dir=str(tmp_path), batch_size=4).save(path)
    with open(path) as reader:
        TrainConfig(output_dir=str(tmp_path), batch_size=8).save(path)
        assert "batch_size: 4" in reader.read()
    assert "batch_size: 8" in path.read_text() and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_a_plot_that_finds_no_room_leaves_the_one_before_whole(tmp_path):
    """plot.png was saved in place: a full disk at the end of a run (a resumed one, or one run again into its folder)
    left a truncated PNG where a good plot was, and no plot at all where there was none."""
    import resource

    from conftest import run_forked
    from tuneforge.errors import NoRoomError
    from tuneforge.reporting import plot_run

    records = [{"split": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    before = b"\x89PNG\r\n\x1a\n an earlier run's plot"
    (tmp_path / "plot.png").write_bytes(before)

    def without_room() -> int:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # a plot's 30 kB: EFBIG, as ENOSPC
        try:
            plot_run(tmp_path)
        except NoRoomError as err:
            print(err)
            return 0
        return 3

    proc = run_forked(without_room, ["plot"], timeout=60)
    assert proc.returncode == 0 and "plot.png' has no room" in proc.stdout, proc.stderr
    assert (tmp_path / "plot.png").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "plot.png"]
