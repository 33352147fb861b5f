"""`tuneforge runs`: real run folders of tiny trainings compared (table, JSON, plot), and every bad input refused."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import cli_main, last_json, made_once, sentiment_split, write_conll_dir, write_sentiment_csv

STEPS = 4  # each compared run: 4 steps of 8 rows, the loss logged each step, evaluated every 2 steps


def write_scores_csv(path: Path, n: int) -> Path:
    """The sentiment rows with a numeric label (pos 1.0, neg 0.0): a regression run's data."""
    rows = write_sentiment_csv(path, n, seed=3).read_text(encoding="utf-8").splitlines()
    scored = [rows[0]] + [r.replace(",pos", ",1.0").replace(",neg", ",0.0") for r in rows[1:]]
    path.write_text("\n".join(scored) + "\n", encoding="utf-8")
    return path


def make_runs(root: Path, model: str) -> None:
    """root/sweep/{lr-1e-3,lr-3e-3} (learning rate and seed differ), root/regression and root/ner (other tasks): each
    a real tiny training, in this process."""
    from tuneforge import cli

    (root / "data").mkdir()
    data = sentiment_split(root / "data", 32, 9)
    scores = write_scores_csv(root / "data" / "scores.csv", 16)
    common = ["--model", model, "--batch-size", "8", "--logging-steps", "1", "--quiet", "--max-length", "32"]
    common += ["--cache-dir", str(root / "cache")]
    evals = ["--eval-strategy", "steps", "--eval-steps", "2"]
    files = ["--train-file", str(data[0]), "--validation-file", str(data[1])]
    runs = {
        "sweep/lr-1e-3": [*files, *evals, "--max-steps", str(STEPS), "--lr", "1e-3", "--seed", "1"],
        "sweep/lr-3e-3": [*files, *evals, "--max-steps", str(STEPS), "--lr", "3e-3", "--seed", "2"],
        "regression": ["--task", "regression", "--train-file", str(scores), "--validation-file", str(scores), *evals]
        + ["--max-steps", "2"],
        "ner": ["--task", "ner", "--data-dir", str(write_conll_dir(root / "data" / "conll")), *evals]
        + ["--max-steps", str(STEPS)],
    }
    for name, flags in runs.items():
        assert cli.main(["train", *common, *flags, "--output-dir", str(root / name)]) == 0, name


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_bert) -> Path:
    return made_once(tmp_path_factory, "runs-compare", lambda root: make_runs(root, tiny_bert))


def compared(capsys, *args) -> tuple[dict, str]:
    """(the --json comparison, the printed table) of `tuneforge runs ARGS`, asserted to succeed."""
    code, out, err = cli_main(capsys, "runs", *map(str, args), "--json")
    assert code == 0, err
    return last_json(out), out


def refused(capsys, *args) -> str:
    """The one error line of a `tuneforge runs ARGS` that must fail with exit 2."""
    code, out, err = cli_main(capsys, "runs", *map(str, args))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    return lines[0]


def result_of(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())


def copy_run(run: Path, to: Path, result: bool = True) -> Path:
    """A run folder's files the comparison reads (its config, records and, unless not `result`, its result)."""
    to.mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", *(("result.json",) if result else ())):
        shutil.copy(run / name, to / name)
    return to


# ---- the comparison ------------------------------------------------------------------------------
def test_the_table_shows_the_keys_that_differ_and_each_run_s_metrics(capsys, runs, tmp_path):
    a, b = runs / "sweep" / "lr-1e-3", runs / "sweep" / "lr-3e-3"
    made, out = compared(capsys, a, b, "--plot", tmp_path / "cmp.png")
    assert set(made["differing_keys"]) == {"seed", "optim.lr"}  # output_dir, the run's folder, is not compared
    header = next(line for line in out.splitlines() if line.lstrip().startswith("run "))
    assert "optim.lr" in header and "seed" in header and "batch_size" not in header and "output_dir" not in header
    assert f"{made['equal_keys']} config keys equal in all of them are left out" in out
    assert made["equal_keys"] > 40
    rows = {row["name"]: row for row in made["runs"]}
    assert list(rows) == ["lr-1e-3", "lr-3e-3"]
    assert rows["lr-1e-3"]["config"] == {"seed": 1, "optim.lr": 0.001}
    assert rows["lr-3e-3"]["config"] == {"seed": 2, "optim.lr": 0.003}
    for run, row in zip((a, b), made["runs"]):
        result = result_of(run)
        timings = ("wall_s", "data_wait_s")  # as the run's own `final:` line, no timing is a metric
        assert row["metrics"] == {k: v for k, v in result.items() if isinstance(v, float) and k not in timings}
        assert row["metrics"].keys() >= {"accuracy", "f1", "loss", "train_loss"} and "data_wait_s" in result
        assert row["status"] == "finished" and row["steps"] == result["steps"] == STEPS
        assert row["steps_per_s"] == pytest.approx(STEPS / result["wall_s"])
        evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "eval"]
        best = max(evals, key=lambda r: r["accuracy"])  # classification's first metric; higher is better
        assert row["best"] == {
            "metric": "accuracy",
            "value": best["accuracy"],
            "step": best["step"],
            "greater_is_better": True,
            "chosen_by": "run",
        }
        assert result["metric_for_best"] == "accuracy"
    assert "best eval of every run: by accuracy, higher is better" in out
    assert made["plot"] == str(tmp_path / "cmp.png")


def test_the_plot_overlays_the_runs_and_is_a_real_png(capsys, runs, tmp_path):
    import matplotlib.colors
    import matplotlib.image

    from tuneforge.runs import DPI, PANEL_INCHES

    out = tmp_path / "plots" / "cmp.png"  # its folder is made
    compared(capsys, runs / "sweep", "--plot", out)
    image = matplotlib.image.imread(out)
    # 4 panels: the training loss, eval accuracy, f1 and loss: 3 in a row, 2 rows
    assert image.shape[:2] == (round(2 * PANEL_INCHES[1] * DPI), round(3 * PANEL_INCHES[0] * DPI))
    pixels = (image[..., :3] * 255).round().astype(int).reshape(-1, 3)
    for color in ("C0", "C1"):  # each run's line is drawn in its own colour
        rgb = np.array(matplotlib.colors.to_rgb(color)) * 255
        assert (np.abs(pixels - rgb).max(axis=1) <= 2).sum() > 200, color


def test_an_existing_plot_is_replaced_only_with_overwrite_and_only_if_tuneforge_wrote_it(
    capsys, runs, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    made, _ = compared(capsys, runs / "sweep")  # by default into the current folder
    out = tmp_path / "runs-comparison.png"
    assert made["plot"] == "runs-comparison.png" and out.stat().st_size > 10_000
    before = out.read_bytes()
    assert "exists; pass --overwrite" in refused(capsys, runs / "sweep")
    assert out.read_bytes() == before
    compared(capsys, runs / "sweep", "--overwrite")
    # a run's own plot.png, and a file of the user's: never replaced
    for theirs in (runs / "sweep" / "lr-1e-3" / "plot.png", None):
        mine = tmp_path / "mine.png"
        shutil.copy(theirs, mine) if theirs else mine.write_bytes(b"\x89PNG not really")
        kept = mine.read_bytes()
        assert "not a comparison plot tuneforge wrote" in refused(capsys, runs / "sweep", "--plot", mine, "--overwrite")
        assert mine.read_bytes() == kept
        mine.unlink()


@pytest.mark.parametrize(
    "plot, says",
    [("cmp.jpg", "give a name ending in .png"), ("folder.png/", "is not a plain file"), ("file/cmp.png", "is a file")],
)
def test_a_bad_plot_path_is_refused_before_any_run_is_read(capsys, tmp_path, plot, says):
    (tmp_path / "folder.png").mkdir()
    (tmp_path / "file").write_text("mine")
    # the runs named do not exist: the plot's path is checked first
    assert says in refused(capsys, tmp_path / "no-such-run", "--plot", tmp_path / plot)


def test_a_folder_of_runs_expands_to_the_runs_one_level_down(capsys, runs, tmp_path):
    swept, _ = compared(capsys, runs / "sweep", "--plot", tmp_path / "a.png")
    assert [r["name"] for r in swept["runs"]] == ["lr-1e-3", "lr-3e-3"]
    # each run once, also where it is named as well as its folder
    named, _ = compared(
        capsys, runs / "sweep" / "lr-1e-3", runs / "sweep" / "lr-3e-3", runs / "sweep", "--plot", tmp_path / "b.png"
    )
    assert swept["runs"] == named["runs"]
    # the made runs' folder holds data/ (not a run), sweep/ (its runs two levels down: not taken) and two runs
    top, _ = compared(capsys, runs, "--plot", tmp_path / "c.png")
    assert [r["name"] for r in top["runs"]] == ["ner", "regression"]


def test_runs_of_the_same_name_are_told_apart_by_their_parent(capsys, runs, tmp_path):
    one = copy_run(runs / "sweep" / "lr-1e-3", tmp_path / "first" / "run")
    two = copy_run(runs / "sweep" / "lr-3e-3", tmp_path / "second" / "run")
    made, out = compared(capsys, one, two, "--plot", tmp_path / "cmp.png")
    assert [r["name"] for r in made["runs"]] == ["first/run", "second/run"]


def test_runs_of_different_tasks_show_each_task_s_metrics(capsys, runs, tmp_path):
    made, out = compared(capsys, runs / "sweep" / "lr-1e-3", runs / "regression", "--plot", tmp_path / "cmp.png")
    assert {"task", "optim.lr", "data.train_file"} <= set(made["differing_keys"])
    classify, regress = made["runs"]
    assert regress["metrics"] == {
        k: v for k, v in result_of(runs / "regression").items() if isinstance(v, float) and not k.endswith("_s")
    }
    assert "pearson" in regress["metrics"] and "accuracy" not in regress["metrics"]
    assert regress["best"]["metric"] == "pearson" and regress["best"]["greater_is_better"]
    assert classify["best"]["metric"] == "accuracy"
    row = next(line for line in out.splitlines() if line.lstrip().startswith("regression "))
    header = next(line for line in out.splitlines() if line.lstrip().startswith("run "))
    assert "accuracy" in header and "pearson" in header
    assert row.split()[header.split().index("accuracy")] == "-"  # a metric the run does not compute
    assert "best eval of lr-1e-3: by accuracy" in out and "best eval of regression: by pearson" in out


def test_an_undefined_metric_written_as_null_is_a_metric_without_a_value(capsys, runs, tmp_path):
    """A run writes an undefined metric (a correlation of constant predictions) as null: the table shows it as nan,
    the JSON as null, and an unfinished run whose first evaluation logs it null is still ranked by it."""
    run = copy_run(runs / "regression", tmp_path / "done")
    (run / "result.json").write_text(json.dumps({**result_of(run), "pearson": None}))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    first_eval = next(i for i, line in enumerate(lines) if json.loads(line)["split"] == "eval")
    lines[first_eval] = json.dumps({**json.loads(lines[first_eval]), "pearson": None})
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    made, out = compared(capsys, run, "--plot", tmp_path / "cmp.png")
    assert made["runs"][0]["metrics"]["pearson"] is None
    header = next(line for line in out.splitlines() if line.lstrip().startswith("run "))
    row = next(line for line in out.splitlines() if line.lstrip().startswith("done "))
    assert row.split()[header.split().index("pearson")] == "nan"

    (run / "result.json").unlink()  # unfinished: the best by the first metric logged, null or not
    made, out = compared(capsys, run, "--plot", tmp_path / "cmp.png", "--overwrite")
    best = made["runs"][0]["best"]
    assert (best["metric"], best["chosen_by"], best["value"]) == ("pearson", "default", None)  # not spearman
    assert "- (no pearson)" in out


def test_a_run_s_best_is_by_the_metric_the_run_chose_its_best_model_by(capsys, runs, tmp_path):
    # NER logs precision before f1, and picks its best model by f1: the run records that choice in result.json
    run = runs / "ner"
    result = result_of(run)
    assert result["metric_for_best"] == "f1" and result["greater_is_better"] is True
    made, out = compared(capsys, run, "--plot", tmp_path / "cmp.png")
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "eval"]
    assert list(evals[0])[3] == "precision"  # split, step, epoch, then the metrics: f1 is not the first
    best = max(evals, key=lambda r: r["f1"])
    assert made["runs"][0]["best"] == {
        "metric": "f1",
        "value": best["f1"],
        "step": best["step"],
        "greater_is_better": True,
        "chosen_by": "run",
    }
    assert "best eval of every run: by f1, higher is better (the metric the run chose its best model by)" in out
    assert "metric_for_best" not in made["runs"][0]["metrics"]  # a recorded choice is no metric


def test_a_run_folder_that_records_no_choice_falls_back_to_the_first_metric_logged(capsys, runs, tmp_path):
    run = copy_run(runs / "ner", tmp_path / "old")  # as an earlier version left it: no choice in result.json
    result = {k: v for k, v in result_of(run).items() if k not in ("metric_for_best", "greater_is_better")}
    (run / "result.json").write_text(json.dumps(result))
    made, out = compared(capsys, run, "--plot", tmp_path / "cmp.png")
    assert made["runs"][0]["best"]["metric"] == "precision" and made["runs"][0]["best"]["chosen_by"] == "default"
    assert "by precision, higher is better (no metric_for_best set or recorded" in out


def test_a_run_stopped_before_its_first_evaluation_has_no_best(capsys, runs, tmp_path):
    run = copy_run(runs / "sweep" / "lr-1e-3", tmp_path / "stopped", result=False)
    records = (run / "metrics.jsonl").read_text().splitlines()
    train = [line for line in records if json.loads(line)["split"] == "train"]
    (run / "metrics.jsonl").write_text("\n".join(train[:2]) + "\n")
    made, out = compared(capsys, run, runs / "sweep" / "lr-3e-3", "--plot", tmp_path / "cmp.png")
    stopped = made["runs"][0]
    assert stopped["status"] == "running-or-interrupted" and stopped["metrics"] == {}
    assert stopped["best"]["value"] is None and stopped["best"]["step"] is None
    assert stopped["steps"] == 2 and stopped["steps_per_s"] == pytest.approx(2 / json.loads(train[1])["time_s"])
    assert "- (no loss)" in out


def test_metric_for_best_in_a_run_s_config_chooses_its_best(capsys, runs, tmp_path):
    run = copy_run(runs / "sweep" / "lr-1e-3", tmp_path / "run")
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("metric_for_best: null", "metric_for_best: loss"))
    made, out = compared(capsys, run, "--plot", tmp_path / "cmp.png")
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "eval"]
    assert made["runs"][0]["best"]["value"] == min(r["loss"] for r in evals)
    assert made["runs"][0]["best"]["chosen_by"] == "metric_for_best"
    assert "by loss, lower is better (its metric_for_best)" in out


def test_an_unfinished_run_is_shown_from_its_records(capsys, runs, tmp_path):
    run = copy_run(runs / "sweep" / "lr-1e-3", tmp_path / "running", result=False)
    records = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(records) + '\n{"split": "train", "st')  # a line being written now
    made, out = compared(capsys, run, "--plot", tmp_path / "cmp.png")
    row = made["runs"][0]
    last = json.loads(records[-1])
    assert row["status"] == "running-or-interrupted" and row["metrics"] == {}
    assert row["steps"] == last["step"] and row["wall_s"] == last["time_s"]
    assert row["best"]["value"] is not None
    assert "running-or-interrupted" in out


def test_an_empty_metrics_file_is_a_run_that_logged_nothing(capsys, runs, tmp_path):
    run = copy_run(runs / "sweep" / "lr-1e-3", tmp_path / "run")
    (run / "metrics.jsonl").write_text("")
    made, _ = compared(capsys, run, runs / "sweep" / "lr-3e-3", "--plot", tmp_path / "cmp.png")
    assert made["runs"][0]["best"]["value"] is None and made["runs"][0]["status"] == "finished"
    assert (tmp_path / "cmp.png").exists()


# ---- bad input: one line, exit 2, no plot ----------------------------------------------------------
BAD_FILES = {
    # name: (file, content, what the line says)
    "a corrupt metrics line": ("metrics.jsonl", None, "metrics.jsonl' line 2 is not a JSON record"),
    "a metrics line that is no record": ("metrics.jsonl", "[1, 2]\n", "line 1 is not a metrics record"),
    "a record without a step": ("metrics.jsonl", '{"split": "train", "loss": 1.0}\n', "line 1 is not a metrics"),
    "a binary metrics file": ("metrics.jsonl", b"\x00\xff\xfe\x89PNG\r\n" * 40, "metrics.jsonl' is not a text file"),
    "a corrupt result": ("result.json", '{"accuracy": 0.5,', "result.json' is not valid JSON"),
    "a result that is no object": ("result.json", "[0.5]", "result.json' is not a run's result"),
    "a corrupt config": ("config.yaml", "task: [classification\nseed: 1\n", "config.yaml' is not valid YAML"),
    "a config that is no mapping": ("config.yaml", "just words\n", "config.yaml' is not a run's config"),
    "a binary config": ("config.yaml", bytes(range(256)), "config.yaml' is not a text file"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_corrupt_run_file_is_one_line_naming_it(capsys, runs, tmp_path, case):
    name, content, says = BAD_FILES[case]
    run = copy_run(runs / "sweep" / "lr-1e-3", tmp_path / "run")
    if content is None:  # the second record cut short, the rest intact
        lines = (run / name).read_text().splitlines()
        content = "\n".join([lines[0], lines[1][:20], *lines[2:]]) + "\n"
    (run / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    line = refused(capsys, runs / "sweep" / "lr-3e-3", run, "--plot", tmp_path / "cmp.png")
    assert says in line and str(run / name) in line
    assert not (tmp_path / "cmp.png").exists()


def test_a_folder_that_is_no_run_is_refused(capsys, runs, tmp_path):
    plot = ["--plot", tmp_path / "cmp.png"]
    assert "does not exist" in refused(capsys, tmp_path / "missing", *plot)
    (tmp_path / "file").write_text("x")
    assert "is a file, not a run folder" in refused(capsys, tmp_path / "file", *plot)
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert "is not a run folder (no config.yaml and metrics.jsonl) and holds none" in refused(
        capsys, tmp_path / "empty", *plot
    )
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(runs / "sweep" / "lr-1e-3" / "config.yaml", half)
    assert "holds config.yaml but no metrics.jsonl" in refused(capsys, runs / "sweep", half, *plot)
    assert not (tmp_path / "cmp.png").exists()


def test_the_command_builds_its_own_arguments_and_needs_a_folder():
    from tuneforge.cli import build_parser, main

    sub = build_parser("runs")._subparsers._group_actions[0].choices
    assert {a.dest for a in sub["runs"]._actions} >= {"dirs", "plot", "overwrite", "print_json"}
    assert not [a for a in sub["train"]._actions if a.dest != "help"]
    assert main(["runs"]) == 2
