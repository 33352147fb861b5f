"""Writers never destroy what tuneforge did not write: `train --overwrite`, `export`, `predict --output`,
`download --local-dir`. A destination that would lose a user's file, or an input of the same command, is
refused with one `error:` line (exit 2) before any work, and nothing on disk changes."""

from __future__ import annotations

from pathlib import Path

from conftest import cli_flags, cli_main, write_sentiment_csv


def snapshot(root: Path) -> dict:
    """Every path under `root` with its bytes (files) and mtime: equal snapshots mean nothing changed."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def old_run(folder: Path) -> None:
    """What an earlier run of tuneforge leaves in its output dir (the names it writes)."""
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text("{}")
    (folder / "checkpoint-3").mkdir()
    (folder / "checkpoint-3" / "meta.json").write_text("{}")
    (folder / "config.yaml").write_text("task: classification\n")
    (folder / "metrics.jsonl").write_text('{"split": "eval", "step": 3}\n')
    (folder / "latest").write_text("checkpoint-3\n")
    (folder / "result.json").write_text("{}")


def test_overwrite_keeps_the_users_files_and_the_runs_own_inputs(tmp_path, tiny_bert, capsys):
    """Issue 23 #3: --overwrite emptied the whole output dir, the training file it had just read included."""
    proj = tmp_path / "proj"
    old_run(proj)
    train = write_sentiment_csv(proj / "my_reviews.csv", 24, seed=1)
    val = write_sentiment_csv(proj / "my_val.csv", 8, seed=2)
    (proj / "notes.txt").write_text("my notes")
    (proj / "drafts").mkdir()
    (proj / "drafts" / "idea.md").write_text("an idea")
    kept = {
        k: v
        for k, v in snapshot(proj).items()
        if k.split("/")[0] in ("my_reviews.csv", "my_val.csv", "notes.txt", "drafts")
    }
    args = cli_flags(train_file=train, validation_file=val, model=tiny_bert, output_dir=proj, max_steps=1)
    code, _, err = cli_main(
        capsys, "train", *args, "--batch-size", "8", "--cache-dir", str(tmp_path / "c"), "--overwrite", "--quiet"
    )
    assert code == 0, err
    after = snapshot(proj)
    assert {k: v for k, v in after.items() if k in kept} == kept  # the user's files, byte for byte and untouched
    assert not (proj / "checkpoint-3").exists()  # the old run is gone
    assert (proj / "model" / "model.safetensors").exists() and (proj / "config.yaml").exists()
