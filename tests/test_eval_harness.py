"""lm-evaluation-harness in-process (tuneforge/harness/): `tuneforge eval MODEL --harness TASKS` on the harness's own
piqa and gsm8k tasks with their data from ../shared/data, PIQA's accuracy checked against the model's own
log-likelihoods of the two solutions; an adapter folder; `--harness-after-train` after a tiny run; bad input.

The tiny random Llama of conftest has a context of 64 tokens, and PIQA's solutions run longer in its 320-token
vocabulary, so PIQA runs on the same tiny Llama with a context of 512 (`long_llama`).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import (
    cli_flags,
    cli_main,
    last_json,
    made_once,
    parallel_pairs,
    run_cli,
    train_command,
)

PIQA_ROWS = 12
PIQA_PROMPT = "Question: {goal}\nAnswer:"  # lm_eval/tasks/piqa/piqa.yaml's doc_to_text; the choices follow a space


def piqa_rows(shared_data: Path, n: int) -> list[dict]:
    folder = shared_data / "piqa"
    lines = (folder / "valid.jsonl").read_text(encoding="utf-8").splitlines()[:n]
    labels = (folder / "valid-labels.lst").read_text().split()[:n]
    return [{**json.loads(line), "label": int(label)} for line, label in zip(lines, labels)]


@torch.no_grad()
def direct_piqa_scores(model, tokenizer, rows: list[dict]) -> dict[str, float]:
    """acc and acc_norm from the model's summed log-probabilities of each solution's tokens after the prompt, one
    forward pass per (prompt, solution); acc_norm divides by the solution's length in characters."""
    right = right_norm = 0
    for row in rows:
        context = PIQA_PROMPT.format(goal=row["goal"])
        scores = []
        for solution in (row["sol1"], row["sol2"]):
            prompt_ids = tokenizer(context)["input_ids"]
            ids = tokenizer(context + " " + solution)["input_ids"]
            logp = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
            scores.append(sum(logp[i - 1, ids[i]].item() for i in range(len(prompt_ids), len(ids))))
        lengths = [len(row["sol1"]), len(row["sol2"])]
        right += int(max(range(2), key=lambda i: scores[i]) == row["label"])
        right_norm += int(max(range(2), key=lambda i: scores[i] / lengths[i]) == row["label"])
    return {"acc": right / len(rows), "acc_norm": right_norm / len(rows)}


def strict_json(path: Path) -> dict:
    def refuse(name: str):
        raise ValueError(f"{path} holds {name}, which is not JSON")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)


def harness_eval(model: str, out: Path, *tasks: str, **flags) -> list[str]:
    return ["eval", model, "--harness", ",".join(tasks), *cli_flags(output_dir=out, **flags)]


# ---- scores ----------------------------------------------------------------------------------------
def test_piqa_accuracy_equals_the_models_own_log_likelihoods(long_llama, shared_data, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    data = f"piqa={shared_data / 'piqa'}"
    code, stdout, err = cli_main(
        capsys, *harness_eval(long_llama, out, "piqa", harness_data=data, harness_limit=PIQA_ROWS)
    )
    assert code == 0, err

    results = strict_json(out / "results.json")
    scores = results["results"]["piqa"]
    assert results["n-samples"]["piqa"]["effective"] == PIQA_ROWS
    model = AutoModelForCausalLM.from_pretrained(long_llama).eval()
    direct = direct_piqa_scores(model, AutoTokenizer.from_pretrained(long_llama), piqa_rows(shared_data, PIQA_ROWS))
    assert direct["acc"] != 0.5  # labels read the wrong way round would give 1 - acc: this check would see it
    assert scores["acc,none"] == pytest.approx(direct["acc"])
    assert scores["acc_norm,none"] == pytest.approx(direct["acc_norm"])
    # the harness's own task: its prompt, metrics and version; the data from the local files
    config = results["configs"]["piqa"]
    assert config["doc_to_text"] == PIQA_PROMPT.replace("{goal}", "{{goal}}") and results["versions"]["piqa"] == 1.0
    assert config["custom_dataset"] == f"local files: {shared_data / 'piqa'}"
    table = (out / "results.md").read_text()
    assert table.startswith("|Tasks|Version|") and "|piqa |" in table and f"{scores['acc,none']:.4f}" in table
    assert table.strip() in stdout  # the table printed as written


def test_gsm8k_from_local_files_generates_and_scores(tiny_llama, shared_data, tmp_path, capsys):
    out = tmp_path / "run"
    args = harness_eval(
        tiny_llama, out, f"gsm8k={shared_data / 'gsm8k'}", harness_limit=2, harness_max_gen_toks=3, json=True
    )
    code, stdout, err = cli_main(capsys, *args)
    assert code == 0, err
    results = strict_json(out / "results.json")
    assert results["n-samples"]["gsm8k"]["effective"] == 2
    assert results["n-shot"]["gsm8k"] == 5  # the task's own few-shot examples, from the local train split
    assert results["config"]["gen_kwargs"] == {"max_gen_toks": 3}
    assert set(results["results"]["gsm8k"]) >= {"exact_match,strict-match", "exact_match,flexible-extract"}
    assert last_json(stdout)["results"] == results["results"]


def test_the_destination_may_be_an_earlier_harness_run_which_is_replaced(tiny_llama, shared_data, tmp_path, capsys):
    out = tmp_path / "run"
    args = harness_eval(tiny_llama, out, f"gsm8k={shared_data / 'gsm8k'}", harness_limit=1, harness_max_gen_toks=2)
    assert cli_main(capsys, *args)[0] == 0
    again = [*args, "--harness-fewshot", "0"]
    assert cli_main(capsys, *again)[0] == 0
    assert strict_json(out / "results.json")["n-shot"]["gsm8k"] == 0
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]


# ---- adapters and after training ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_run_with_harness(tmp_path_factory, long_llama, shared_data, cache_dir) -> Path:
    """A 3-step LoRA clm run of the long tiny Llama with the harness's piqa (6 local rows) after training."""

    def make(folder: Path) -> None:
        text = folder / "text.txt"
        text.write_text("".join(f"{en} {de}\n" for en, de in parallel_pairs(40, seed=3)), encoding="utf-8")
        flags = dict(task="clm", block_size=16, max_steps=3, lr="5e-2", batch_size=4, eval_strategy="no")
        flags |= dict(adapter="lora", lora_r=4, cache_dir=cache_dir, output_dir=folder / "run", quiet=True, json=True)
        harness = ["harness_after_train.tasks=piqa", f"harness_after_train.data.piqa={shared_data / 'piqa'}"]
        proc = run_cli(*train_command((text, text), long_llama, **flags), *harness, "harness_after_train.limit=6")
        assert proc.returncode == 0, proc.stderr[-3000:]
        (folder / "result.json").write_text(json.dumps(last_json(proc.stdout)))

    return made_once(tmp_path_factory, "harness-lora-run", make)


def test_harness_after_train_scores_the_exported_adapter_folder(lora_run_with_harness, long_llama, shared_data):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tuneforge.adapters import load_merged

    run = lora_run_with_harness / "run"
    result = json.loads((lora_run_with_harness / "result.json").read_text())
    assert result["harness_dir"] == str(run / "harness")
    assert sorted(p.name for p in (run / "harness").iterdir()) == ["results.json", "results.md"]
    scores = strict_json(run / "harness" / "results.json")["results"]["piqa"]
    assert result["harness"]["piqa"]["acc,none"] == scores["acc,none"]
    written = strict_json(run / "result.json")  # the scores are the run's metrics, the filter `none` unsaid
    assert (
        written["harness/piqa/acc"] == scores["acc,none"]
        and written["harness/piqa/acc_norm"] == scores["acc_norm,none"]
    )
    assert (run / "model" / "adapter_config.json").is_file()  # the export is an adapter folder

    merged = load_merged(AutoModelForCausalLM, run / "model").eval()
    direct = direct_piqa_scores(merged, AutoTokenizer.from_pretrained(long_llama), piqa_rows(shared_data, 6))
    assert scores["acc,none"] == pytest.approx(direct["acc"])
    assert scores["acc_norm,none"] == pytest.approx(direct["acc_norm"])


def test_the_harness_model_of_an_adapter_folder_is_its_base_with_the_adapter_merged(lora_run_with_harness, long_llama):
    from transformers import AutoModelForCausalLM

    from tuneforge.adapters import load_merged
    from tuneforge.harness.evaluate import load_lm

    lm = load_lm(str(lora_run_with_harness / "run" / "model"), batch_size=2)
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        harness = lm.model(input_ids=ids).logits
        merged = load_merged(AutoModelForCausalLM, lora_run_with_harness / "run" / "model").eval()(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(long_llama).eval()(input_ids=ids).logits
    assert torch.allclose(harness, merged, atol=1e-5)
    assert (harness - base).abs().max() > 1e-3  # the adapter trained: it is in the scores


def clm_run_command(tiny_llama, run) -> list[str]:
    """`tuneforge train` of one causal LM step into `run` (its text beside it)."""
    text = run.parent / "text.txt"
    text.write_text("".join(f"{en}\n" for en, _ in parallel_pairs(20)), encoding="utf-8")
    return train_command((text, text), tiny_llama, task="clm", block_size=16, max_steps=1, output_dir=run, quiet=True)


def gsm8k_after_train(shared_data) -> list[str]:
    """The flags that score gsm8k's first row, two tokens generated, after training."""
    harness = f"--harness-after-train=gsm8k={shared_data / 'gsm8k'}"
    return [harness, "harness_after_train.limit=1", "harness_after_train.max_gen_toks=2"]


def test_harness_scores_after_training_are_metrics_of_the_runs_result(tiny_llama, shared_data, tmp_path, capsys):
    """--harness-after-train's scores join result.json as metrics `harness/TASK/METRIC/FILTER` (the harness's
    `exact_match,strict-match`), on the `final:` line and in `tuneforge runs`; a sweep can read them there."""
    run = tmp_path / "run"
    base = clm_run_command(tiny_llama, run)
    code, stdout, err = cli_main(capsys, *base, *gsm8k_after_train(shared_data))
    assert code == 0, err
    scores = strict_json(run / "harness" / "results.json")["results"]["gsm8k"]
    result = strict_json(run / "result.json")
    assert {k: v for k, v in result.items() if k.startswith("harness/")} == {
        "harness/gsm8k/exact_match/strict-match": scores["exact_match,strict-match"],
        "harness/gsm8k/exact_match/flexible-extract": scores["exact_match,flexible-extract"],
    }
    assert result["loss"] > 0 and result["harness"]["gsm8k"] == scores  # the run's own metrics and the harness's
    final = next(line for line in stdout.splitlines() if line.startswith("final: "))
    assert f"harness/gsm8k/exact_match/strict-match {scores['exact_match,strict-match']:.4f}" in final
    code, stdout, err = cli_main(capsys, "runs", str(run), "--plot", str(tmp_path / "runs.png"), "--json")
    assert code == 0, err
    assert last_json(stdout)["runs"][0]["metrics"]["harness/gsm8k/exact_match/flexible-extract"] == pytest.approx(
        scores["exact_match,flexible-extract"]
    )


def test_the_run_metrics_of_harness_scores():
    from tuneforge.harness.after_train import run_metrics

    scores = {
        "gsm8k": {
            "alias": "gsm8k",
            "sample_len": 3,
            "exact_match,strict-match": 0.5,
            "exact_match_stderr,strict-match": 0.1,
        },
        "piqa": {"acc,none": 1, "acc_stderr,none": "N/A", "acc_norm,none": None, "odd,none": "N/A", "flag,none": True},
    }
    assert run_metrics(scores) == {
        "harness/gsm8k/exact_match/strict-match": 0.5,
        "harness/piqa/acc": 1.0,
        "harness/piqa/acc_norm": None,  # undefined (a nan the harness computed): null, as a run writes any
    }


def test_a_harness_metric_cannot_pick_the_best_model(tiny_llama, tmp_path, capsys):
    """metric_for_best picks among the run's evaluations; the harness scores only the exported model, after them."""
    text = tmp_path / "text.txt"
    text.write_text("a b c\n", encoding="utf-8")
    base = train_command((text, text), tiny_llama, task="clm", max_steps=1, output_dir=tmp_path / "run")
    code, _, err = cli_main(capsys, *base, "--metric-for-best", "harness/gsm8k/exact_match/strict-match")
    assert code == 2 and err.startswith(
        "error: bad value for 'metric_for_best': names a score of lm-evaluation-harness"
    )
    assert "tuneforge sweep --metric harness/gsm8k/exact_match/strict-match" in err and not (tmp_path / "run").exists()


def test_the_harness_records_no_git_commit_of_the_working_directory(
    tiny_llama, shared_data, tmp_path, capfd, monkeypatch
):
    """lm-eval records the git commit of the working directory (`git describe` there: 'fatal: not a git repository'
    on stderr outside one) and of its parent: the user's repository, not the harness's code. Neither is looked up."""
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    commit = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"]
    subprocess.run(commit, cwd=repo, check=True)
    (tmp_path / "elsewhere").mkdir()
    for where in (tmp_path / "elsewhere", repo / "sub"):
        monkeypatch.chdir(where)
        args = harness_eval(
            tiny_llama, where / "h", f"gsm8k={shared_data / 'gsm8k'}", harness_limit=1, harness_max_gen_toks=2
        )
        code, _, err = cli_main(capfd, *args)
        assert code == 0, err
        assert "fatal" not in err
        results = strict_json(where / "h" / "results.json")
        assert results["git_hash"] is None and results["upper_git_hash"] is None


def test_overwrite_clears_the_replaced_runs_harness_scores(tiny_llama, shared_data, tmp_path, capsys):
    """--overwrite clears OUTPUT_DIR/harness's results with the rest of the run it replaces, so no scores of a model
    that is gone stay beside the new one; the user's files there stay."""
    run = tmp_path / "run"
    base = clm_run_command(tiny_llama, run)
    code, _, err = cli_main(capsys, *base, *gsm8k_after_train(shared_data))
    assert code == 0, err
    assert (run / "harness" / "results.json").is_file()
    (run / "harness" / "notes.txt").write_text("mine")
    code, _, err = cli_main(capsys, *base, "--overwrite")
    assert code == 0, err
    assert [p.name for p in (run / "harness").iterdir()] == ["notes.txt"] and (run / "model").is_dir()


def test_harness_after_train_flag_takes_task_names_with_local_data(tmp_path):
    from tuneforge.configure import config_from_sources
    from tuneforge.errors import ConfigError

    flags = {"harness_after_train": "piqa=../shared/data/piqa,gsm8k", "task": "clm", "output_dir": str(tmp_path)}
    config = config_from_sources(None, [], flags)
    assert config.harness_after_train.tasks == ["piqa", "gsm8k"]
    assert config.harness_after_train.data == {"piqa": "../shared/data/piqa"}
    config.save(tmp_path / "config.yaml")  # the run's config.yaml reads back the same
    again = config_from_sources(str(tmp_path / "config.yaml"), [], {})
    assert again.harness_after_train == config.harness_after_train
    dotted = ["harness_after_train.tasks=piqa", "harness_after_train.limit=20", "harness_after_train.fewshot=0"]
    settings = config_from_sources(None, dotted, {"task": "clm"}).harness_after_train
    assert (settings.tasks, settings.limit, settings.fewshot, settings.data) == (["piqa"], 20, 0, None)
    with pytest.raises(ConfigError, match="unknown key 'limt'; allowed: tasks, data, limit"):
        config_from_sources(None, ["harness_after_train.limt=20", "harness_after_train.tasks=piqa"], {})


def test_harness_after_train_task_names_keep_the_other_settings_of_earlier_layers(tmp_path):
    """The flag (or `harness_after_train: piqa` in YAML) names the tasks; limit and the rest, given as the help says
    (dotted overrides, a YAML mapping), stay."""
    from tuneforge.configure import config_from_sources

    limited = ["harness_after_train.limit=2", "harness_after_train.max_gen_toks=3"]
    settings = config_from_sources(None, limited, {"task": "clm", "harness_after_train": "piqa=/d/piqa"})
    assert settings.harness_after_train.model_dump(exclude_defaults=True) == {
        "tasks": ["piqa"],
        "data": {"piqa": "/d/piqa"},
        "limit": 2,
        "max_gen_toks": 3,
    }
    mapping = tmp_path / "mapping.yaml"
    mapping.write_text("task: clm\nharness_after_train: {tasks: piqa, limit: 5, fewshot: 0}\n")
    for overrides, flags in (([], {"harness_after_train": "gsm8k"}), (["harness_after_train=gsm8k"], {})):
        settings = config_from_sources(str(mapping), overrides, flags).harness_after_train
        assert (settings.tasks, settings.limit, settings.fewshot) == (["gsm8k"], 5, 0)
    names = tmp_path / "names.yaml"
    names.write_text("task: clm\nharness_after_train: piqa\n")
    settings = config_from_sources(str(names), ["harness_after_train.limit=2"], {}).harness_after_train
    assert (settings.tasks, settings.limit) == (["piqa"], 2)
    assert config_from_sources(str(names), ["harness_after_train=null"], {}).harness_after_train is None


# ---- bad input: one error line, exit 2, nothing written ----------------------------------------------
def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def refused(capsys, *args: str) -> str:
    code, _, err = cli_main(capsys, *args)
    assert code == 2, err
    return error_line(err)


def test_an_unknown_task_is_named_with_the_close_ones(tiny_llama, tmp_path, capsys):
    line = refused(capsys, *harness_eval(tiny_llama, tmp_path / "out", "piqaa", "gsm8k"))
    assert "'piqaa'" in line and "piqa" in line.split("close:")[1] and "gsm8k" not in line
    assert not (tmp_path / "out").exists()


def test_a_task_name_that_is_a_path_reads_no_folder_outside_the_harness(tiny_llama, tmp_path, capsys):
    """`--harness PATH` (for --harness-data, say) is an unknown task: the folder is not read as the harness's own
    task folders are, so a YAML there naming a task after the path does not run."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "task.yaml").write_text(f"task: {folder}\ndataset_path: nowhere\noutput_type: loglikelihood\n")
    line = refused(capsys, *harness_eval(tiny_llama, tmp_path / "out", str(folder)))
    assert f"unknown lm-evaluation-harness task '{folder}'" in line


@pytest.mark.parametrize(
    "flags, says",
    [
        (dict(harness_data="piqa"), "'piqa' is not TASK=PATH"),
        (dict(harness_data="gsm8k=/tmp"), "--harness-data names 'gsm8k', which --harness does not run"),
        (dict(harness_limit=0), "--harness-limit"),
        (dict(harness_batch_size=-1), "--harness-batch-size"),
        (dict(harness_fewshot=10**6), "--harness-fewshot"),
    ],
)
def test_bad_harness_flags_are_one_line(tiny_llama, tmp_path, capsys, flags, says):
    assert says in refused(capsys, *harness_eval(tiny_llama, tmp_path / "out", "piqa", **flags))
    assert not (tmp_path / "out").exists()


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


ROW = {"goal": "Open a jar.", "sol1": "Twist the lid.", "sol2": "Paint the lid."}


@pytest.mark.parametrize(
    "layout, says",
    [
        ("missing", "does not exist"),
        ("no split files", "holds no train/validation/test data files"),
        ("no labels", "the rows lack 'label'"),
        ("labels short", "has 1 labels for 2 rows"),
        ("only train", "scores its 'validation' split"),
        ("not json", "cannot be read"),
        ("empty split", "has no rows"),
    ],
)
def test_bad_local_data_is_one_line_before_the_model_loads(tiny_llama, tmp_path, capsys, layout, says):
    folder = tmp_path / "piqa"
    if layout == "no split files":
        write_rows(folder / "rows.jsonl", [ROW])
    elif layout in ("no labels", "labels short"):
        write_rows(folder / "valid.jsonl", [ROW, ROW])
        if layout == "labels short":
            (folder / "valid-labels.lst").write_text("0\n")
    elif layout == "only train":
        write_rows(folder / "train.jsonl", [{**ROW, "label": 0}])
    elif layout == "not json":
        write_rows(folder / "valid.jsonl", [ROW]).write_text("{not json\n")
    elif layout == "empty split":
        write_rows(folder / "valid.jsonl", [])
    line = refused(capsys, *harness_eval(tiny_llama, tmp_path / "out", f"piqa={folder}"))
    assert says in line and "--harness-data piqa=" in line
    assert not (tmp_path / "out").exists()


def test_a_single_file_is_the_split_the_task_scores(long_llama, tmp_path, capsys):
    rows = write_rows(tmp_path / "two.jsonl", [{**ROW, "label": 0}, {**ROW, "label": 1}])
    code, _, err = cli_main(capsys, *harness_eval(long_llama, tmp_path / "out", f"piqa={rows}"))
    assert code == 0, err
    results = strict_json(tmp_path / "out" / "results.json")
    assert results["n-samples"]["piqa"]["effective"] == 2
    assert results["results"]["piqa"]["acc,none"] == 0.5  # the same pair with both labels: one is right


@pytest.mark.parametrize(
    "task, shots, says",
    [
        ("gsm8k", [], "task takes its 5 few-shot examples from its 'train' split"),
        ("piqa", ["--harness-fewshot", "2"], "task takes its 2 few-shot examples from its 'train' split"),
    ],
)
def test_few_shot_examples_are_never_drawn_from_the_split_being_scored(
    long_llama, shared_data, tmp_path, capsys, task, shots, says
):
    """Local data without the split a task takes its few-shot examples from (gsm8k's test file alone, PIQA's
    validation split alone) would have the harness draw them from the scored rows, a row's own answer among them
    (gsm8k's); one line instead, and 0-shot runs."""
    scored = {"gsm8k": shared_data / "gsm8k" / "test.jsonl", "piqa": shared_data / "piqa"}[task]
    args = harness_eval(long_llama, tmp_path / "out", f"{task}={scored}", harness_limit=1, harness_max_gen_toks=2)
    line = refused(capsys, *args, *shots)
    assert says in line and "--harness-fewshot 0" in line
    assert not (tmp_path / "out").exists()
    code, _, err = cli_main(capsys, *args, "--harness-fewshot", "0")
    assert code == 0, err


def test_a_few_shot_split_with_fewer_rows_than_a_prompt_takes_is_one_line(long_llama, shared_data, tmp_path, capsys):
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    for split, rows in (("train", 2), ("test", 3)):
        lines = (shared_data / "gsm8k" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()[:rows]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = harness_eval(long_llama, tmp_path / "out", f"gsm8k={folder}", harness_max_gen_toks=2)
    line = refused(capsys, *args)
    assert "its 'train' split has 2 rows, too few for 5 few-shot examples a prompt (the harness draws 5)" in line
    assert not (tmp_path / "out").exists()
    code, _, err = cli_main(capsys, *args, "--harness-fewshot", "2")
    assert code == 0, err
    # PIQA names no test split, and the harness then draws one example more, to leave out a row's own
    piqa = tmp_path / "piqa"
    write_rows(piqa / "train.jsonl", [{**ROW, "label": 0}] * 2)
    write_rows(piqa / "valid.jsonl", [{**ROW, "label": 1}])
    line = refused(capsys, *harness_eval(long_llama, tmp_path / "out", f"piqa={piqa}", harness_fewshot=2))
    assert "its 'train' split has 2 rows, too few for 2 few-shot examples a prompt (the harness draws 3)" in line


def test_a_save_to_disk_folder_whose_splits_are_named_like_a_files_are_read(long_llama, tmp_path, capsys):
    """A datasets.save_to_disk folder's 'valid' split is the validation split, as a valid.jsonl file is."""
    import datasets

    rows = datasets.Dataset.from_list([{**ROW, "label": 0}, {**ROW, "label": 1}])
    datasets.DatasetDict({"train": rows, "valid": rows}).save_to_disk(str(tmp_path / "saved"))
    code, _, err = cli_main(capsys, *harness_eval(long_llama, tmp_path / "out", f"piqa={tmp_path / 'saved'}"))
    assert code == 0, err
    assert strict_json(tmp_path / "out" / "results.json")["n-samples"]["piqa"]["effective"] == 2


def test_a_field_a_template_reads_only_where_another_is_not_defined_is_not_required(
    long_llama, shared_data, tmp_path, capsys
):
    """gsm8k_llama's target is `answer.split(...) if answer is defined else target`: GSM8K's rows, with an answer and
    no target, are what it reads (three of the shared rows per split: the task's few-shot examples come from train)."""
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    for split in ("train", "test"):
        with open(shared_data / "gsm8k" / f"{split}.jsonl", encoding="utf-8") as rows:
            (folder / f"{split}.jsonl").write_text("".join(next(rows) for _ in range(3)), encoding="utf-8")
    args = harness_eval(long_llama, tmp_path / "out", f"gsm8k_llama={folder}", harness_limit=1, harness_max_gen_toks=2)
    code, _, err = cli_main(capsys, *args)
    assert code == 0, err
    assert strict_json(tmp_path / "out" / "results.json")["n-samples"]["gsm8k_llama"]["effective"] == 1


def test_json_files_are_read_as_datasets_reads_them(long_llama, tmp_path, capsys):
    """A .json file of JSON lines (as many hub data sets ship them) and a .jsonl file holding one JSON array are
    rows, as `datasets`' json reader takes them, whatever the suffix."""
    write_rows(tmp_path / "lines" / "validation.json", [{**ROW, "label": 0}, {**ROW, "label": 1}])
    array = tmp_path / "array" / "valid.jsonl"
    array.parent.mkdir()
    array.write_text(json.dumps([{**ROW, "label": 1}] * 3), encoding="utf-8")
    for folder, rows in ((tmp_path / "lines", 2), (array.parent, 3)):
        code, _, err = cli_main(capsys, *harness_eval(long_llama, tmp_path / f"out-{folder.name}", f"piqa={folder}"))
        assert code == 0, err
        assert strict_json(tmp_path / f"out-{folder.name}" / "results.json")["n-samples"]["piqa"]["effective"] == rows


def test_csv_text_that_pandas_would_read_as_missing_stays_text(long_llama, tmp_path, capsys):
    """A solution written "None" or "NA" is text in a .csv split (as tuneforge's own tables read it), not a missing
    value that leaves the rows unable to make a table."""
    folder = tmp_path / "piqa"
    folder.mkdir()
    (folder / "valid.csv").write_text("goal,sol1,sol2,label\nOpen a jar.,Twist the lid.,None,0\nWait.,NA,Go.,1\n")
    code, _, err = cli_main(capsys, *harness_eval(long_llama, tmp_path / "out", f"piqa={folder}"))
    assert code == 0, err
    assert strict_json(tmp_path / "out" / "results.json")["n-samples"]["piqa"]["effective"] == 2


def test_a_destination_holding_other_files_is_refused_and_left_alone(tiny_llama, shared_data, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    line = refused(capsys, *harness_eval(tiny_llama, out, f"gsm8k={shared_data / 'gsm8k'}", harness_limit=1))
    assert "holds files a harness run does not write (notes.txt)" in line
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "is a file" in refused(capsys, *harness_eval(tiny_llama, a_file, f"gsm8k={shared_data / 'gsm8k'}"))


@pytest.mark.parametrize("name, mine", [("results.json", '{"my": "scores"}\n'), ("results.md", "my notes\n")])
def test_a_users_file_named_like_the_results_is_refused_and_left_alone(
    tiny_llama, shared_data, tmp_path, capsys, name, mine
):
    """Only an earlier harness run's results.json (the harness's results) or results.md (its table) is replaced."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / name).write_text(mine)
    line = refused(capsys, *harness_eval(tiny_llama, out, f"gsm8k={shared_data / 'gsm8k'}", harness_limit=1))
    assert f"holds a {name} that a harness run did not write" in line
    assert sorted(p.name for p in out.iterdir()) == [name] and (out / name).read_text() == mine


def test_the_task_data_from_the_hub_unreachable_is_one_line_with_the_way_out(tiny_llama, tmp_path, capsys):
    line = refused(capsys, *harness_eval(tiny_llama, tmp_path / "out", "arc_easy"))  # the tests run offline
    assert "harness task 'arc_easy': could not load its data from the Hugging Face hub" in line
    assert "--harness-data arc_easy=PATH" in line


def test_a_model_that_scores_no_text_is_refused(tiny_bert, shared_data, tmp_path, capsys):
    line = refused(capsys, *harness_eval(tiny_bert, tmp_path / "out", f"gsm8k={shared_data / 'gsm8k'}"))
    assert "lm-evaluation-harness needs a causal LM or a sequence-to-sequence model" in line


def test_a_generation_length_that_fills_the_context_is_refused(tiny_llama, shared_data, tmp_path, capsys):
    line = refused(capsys, *harness_eval(tiny_llama, tmp_path / "out", f"gsm8k={shared_data / 'gsm8k'}"))
    assert "up to 256 tokens" in line and "context of 64 tokens" in line


def test_the_generation_room_is_each_tasks_own_length(tiny_llama, long_llama, shared_data, tmp_path, capsys):
    """A task's own max_gen_toks is the length it generates: agieval_math's 32 fits a 64-token context (not the
    harness's default 256), gsm8k_llama's 1024 does not fit 512 (a line naming that length before any request,
    and before training for --harness-after-train; not the harness's failed check of its first request)."""
    math_rows = write_rows(tmp_path / "math" / "test.jsonl", [{"query": "Q: 1+1?\nA:", "answer": "2"}])
    args = harness_eval(tiny_llama, tmp_path / "math-out", f"agieval_math={math_rows}")
    code, _, err = cli_main(capsys, *args)
    assert code == 0, err
    rows = [{**json.loads(line), "target": "2"} for line in (shared_data / "gsm8k" / "test.jsonl").open()][:1]
    line = refused(
        capsys, *harness_eval(long_llama, tmp_path / "out", f"gsm8k_llama={write_rows(tmp_path / 'test.jsonl', rows)}")
    )
    assert "gsm8k_llama would generate up to 1024 tokens (its own max_gen_toks)" in line
    assert "context of 512 tokens" in line and "--harness-max-gen-toks N with N below 512" in line


@pytest.mark.parametrize(
    "args, says",
    [
        (["--harness-limit", "3"], "--harness-limit needs --harness TASKS"),
        (["--harness", "piqa", "--validation-file", "x.csv"], "--validation-file set up evaluation of a config's"),
        (["--harness", ""], "needs at least one harness task name"),
        (["--harness", "piqa,piqa"], "names piqa twice"),
    ],
)
def test_harness_mode_flags_do_not_mix_with_task_evaluation(tiny_llama, tmp_path, capsys, args, says):
    assert says in refused(capsys, "eval", tiny_llama, *args, "--output-dir", str(tmp_path / "out"))


def test_a_model_folder_that_is_not_there_is_said_before_any_task_data_is_fetched(tmp_path, capsys):
    """piqa without --harness-data would go to the hub (and wait out its timeouts offline) before the model was
    looked at: the missing folder is the line, at once."""
    line = refused(capsys, "eval", str(tmp_path / "no-such-model"), "--harness", "piqa")
    assert "no-such-model" in line and "does not exist" in line and "harness task" not in line


def test_harness_after_train_is_checked_before_training(tiny_llama, shared_data, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("".join(f"{en}\n" for en, _ in parallel_pairs(20)), encoding="utf-8")
    run = tmp_path / "run"
    base = train_command((text, text), tiny_llama, task="clm", block_size=16, max_steps=1, output_dir=run)
    line = refused(capsys, *base, "--harness-after-train", "piqaa")
    assert "'piqaa' (close: piqa" in line
    assert not (run / "model").exists()
    (run / "harness").mkdir(parents=True)
    (run / "harness" / "keep.txt").write_text("mine")
    line = refused(capsys, *base, "--harness-after-train", f"gsm8k={shared_data / 'gsm8k'}")
    assert "holds files a harness run does not write (keep.txt)" in line
    assert not (run / "model").exists() and (run / "harness" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "harness, says",
    [
        (
            ["--harness-after-train", "arc_easy"],
            "without the hub, pass local files: --harness-after-train arc_easy=PATH",
        ),
        (["--harness-after-train=gsm8k={gsm8k}"], "pass harness_after_train.max_gen_toks=N with N below 64"),
    ],
)
def test_harness_after_train_is_refused_before_training_where_it_would_fail_after(
    tiny_llama, shared_data, tmp_path, capsys, harness, says
):
    """Task data the run cannot have (the hub, offline) and a generation length that fills the model's context are
    known before training: one line then, naming the train run's own spelling of the way out."""
    text = tmp_path / "text.txt"
    text.write_text("".join(f"{en}\n" for en, _ in parallel_pairs(20)), encoding="utf-8")
    run = tmp_path / "run"
    base = train_command((text, text), tiny_llama, task="clm", block_size=16, max_steps=1, output_dir=run)
    line = refused(capsys, *base, *(a.format(gsm8k=shared_data / "gsm8k") for a in harness))
    assert says in line and "training finished" not in line
    assert not (run / "model").exists()


def test_harness_after_training_a_classifier_is_refused_before_training(tiny_bert, sentiment_files, tmp_path, capsys):
    run = tmp_path / "run"
    args = train_command(sentiment_files, tiny_bert, max_steps=1, output_dir=run)
    line = refused(capsys, *args, "--harness-after-train", "piqa")
    assert "trains a model that scores no text" in line and not (run / "model").exists()


def test_results_json_is_strict_json_where_the_harness_has_nan(tmp_path):
    import numpy as np

    from tuneforge.harness.evaluate import json_safe

    safe = json_safe({"results": {"t": {"acc": np.float64(0.5), "acc_stderr": float("nan"), "n": np.int64(3)}}})
    assert safe == {"results": {"t": {"acc": 0.5, "acc_stderr": None, "n": 3}}}
    assert not math.isnan(json.loads(json.dumps(safe))["results"]["t"]["acc"])


def harness_results(acc: float, stderr) -> dict:
    """A harness results dict of one task (its shape as the harness returns it), scored `acc` +- `stderr`."""
    task = {"alias": "piqa", "acc,none": acc, "acc_stderr,none": stderr}
    return {"results": {"piqa": task}, "configs": {"piqa": {}}, "versions": {"piqa": 1.0}, "n-shot": {"piqa": 0}}


def test_the_results_and_their_table_are_replaced_as_a_pair(tmp_path):
    """results.json was written, then results.md: a table that could not be made, or a stop between the two, left
    the new scores beside the earlier run's table (or none). Both are made before either is replaced."""
    from tuneforge.harness.evaluate import write_results

    out = tmp_path / "harness"
    write_results(harness_results(0.25, 0.01), out)
    before = {p.name: p.read_text() for p in out.iterdir()}
    assert "|piqa |" in before["results.md"] and "0.25" in before["results.md"]
    with pytest.raises(TypeError):  # the harness's make_table formats a stderr as a number
        write_results(harness_results(0.75, None), out)
    assert {p.name: p.read_text() for p in out.iterdir()} == before
