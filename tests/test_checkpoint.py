"""Checkpoint contents, retention, refusal of bad checkpoints, and `tuneforge export`.

One small single-process run (tiny BERT, 96 sentiment rows) is trained once per module; each
test works on its own copy of that run folder.
"""

import json
import random
import shutil

import numpy as np
import pytest
import torch
import yaml

from conftest import cli_flags, read_jsonl, run_cli, save_tiny_bert, sentiment_split, train_command
from tuneforge import checkpoint
from tuneforge.configure import build_config
from tuneforge.progress import Progress
from tuneforge.trainer import Trainer

EPOCHS, BATCH = 2, 16  # 96 rows -> 6 steps per epoch, 12 steps


def run_config(out, files, model, cache_dir, **overrides):
    train, val = files
    values = dict(
        task="classification",
        model=model,
        output_dir=str(out),
        epochs=EPOCHS,
        batch_size=BATCH,
        quiet=True,
        optim={"lr": 1e-3},
        data={"train_file": str(train), "validation_file": str(val), "cache_dir": cache_dir},
    )
    values.update(overrides)
    return build_config(values)


def cli_args(out, files, model, cache_dir):
    """The same run as `run_config` on the command line, saving a checkpoint every 6 steps."""
    run = cli_flags(epochs=EPOCHS, batch_size=BATCH, lr="1e-3", output_dir=out, cache_dir=cache_dir, quiet=True)
    return train_command(files, model, save_strategy="steps", save_steps=6) + run


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return sentiment_split(tmp_path_factory.mktemp("data"), 96, 33)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, files, tiny_bert, cache_dir):
    """A finished run with checkpoints every 2 steps; the best (by a metric that never improves) is step 2,
    and with load_best_model_at_end the run's final model is that of step 2."""
    out = tmp_path_factory.mktemp("run") / "run"
    cfg = run_config(
        out,
        files,
        tiny_bert,
        cache_dir,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best="num_examples",
        early_stopping_patience=50,
        load_best_model_at_end=True,
    )
    result = Trainer(cfg).fit()
    return out, cfg, result


@pytest.fixture
def run_copy(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    return out


def test_checkpoint_holds_everything_and_loads_weights_only(trained):
    out, cfg, result = trained
    ckpt = out / "checkpoint-12"
    assert (out / "latest").read_text().strip() == "checkpoint-12"
    for name in (
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rank0.pt",
        "trainer_state.json",
        "meta.json",
        "config.yaml",
        "config.json",
        "tokenizer_config.json",
        "tuneforge.json",
        "manifest.json",
    ):
        assert (ckpt / name).is_file(), name
    # every non-weights file loads with weights_only=True (no pickle code execution)
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert optim["state"] and len(optim["param_groups"]) == 2
    sched = torch.load(ckpt / "scheduler.pt", weights_only=True)
    assert sched["last_epoch"] == 12
    rank = torch.load(ckpt / "rank0.pt", weights_only=True)
    assert set(rank) >= {"python", "numpy", "torch", "log_window"}

    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert (
        state["step"] == 12 and state["epoch"] == 1 and state["consumed"] == 96 and state["order_global_batch"] == BATCH
    )
    assert state["best_step"] == 2 and state["best_metric"] == 33 and state["bad_evals"] == 5
    assert (
        state["best_eval"]["num_examples"] == 33 and state["metrics_records"] == 7
    )  # 6 evals + the last step's train log
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["labels"] == ["neg", "pos"] and meta["backend"] == "single" and meta["step_examples"] == BATCH
    assert build_config(yaml.safe_load((ckpt / "config.yaml").read_text())) == cfg  # the resolved config
    assert checkpoint.verify(ckpt) is None
    assert result["steps"] == 12


def test_rng_state_round_trips_through_weights_only_file(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    random.gauss(0, 1), np.random.normal()  # leave a cached gaussian in both states
    torch.save(checkpoint.rank_state(Progress(log_loss=1.5, log_count=4.0)), tmp_path / "rank0.pt")
    expected = (random.random(), random.gauss(0, 1), np.random.normal(), torch.rand(3))
    checkpoint.set_rng_state(torch.load(tmp_path / "rank0.pt", weights_only=True))
    again = (random.random(), random.gauss(0, 1), np.random.normal(), torch.rand(3))
    assert expected[:3] == again[:3] and torch.equal(expected[3], again[3])


def test_retention_keeps_last_k_plus_best(trained):
    out = trained[0]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-12", "checkpoint-2"]
    assert not list(out.glob(".tmp-*"))


def test_resume_keeps_the_best_model_of_before_the_interruption(trained, run_copy):
    out, cfg, result = trained
    shutil.rmtree(run_copy / "checkpoint-12")
    (run_copy / "latest").write_text("checkpoint-10\n")
    resumed = Trainer(cfg.model_copy(update={"output_dir": str(run_copy), "resume": "latest"})).fit()
    assert resumed["best_step"] == 2 and resumed["num_examples"] == 33 and resumed["steps"] == 12
    from safetensors.torch import load_file

    best = load_file(str(out / "checkpoint-2" / "model.safetensors"))
    final = load_file(str(run_copy / "model" / "model.safetensors"))
    assert best.keys() == final.keys() and all(torch.equal(best[k], final[k]) for k in best)


def test_save_strategy_epoch_and_no(tmp_path, files, tiny_bert, cache_dir):
    by_epoch = tmp_path / "epoch"
    Trainer(run_config(by_epoch, files, tiny_bert, cache_dir, save_strategy="epoch")).fit()
    assert sorted(p.name for p in by_epoch.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-6"]
    assert json.loads((by_epoch / "checkpoint-6" / "trainer_state.json").read_text())["epoch"] == 1
    never = tmp_path / "no"
    Trainer(run_config(never, files, tiny_bert, cache_dir, epochs=1, save_strategy="no")).fit()
    assert not list(never.glob("checkpoint-*")) and not (never / "latest").exists()


@pytest.mark.parametrize(
    ("cadence", "saved"),
    [
        (dict(save_strategy="steps", save_steps=2), ["checkpoint-2", "checkpoint-3"]),
        (dict(save_strategy="epoch"), ["checkpoint-3"]),  # --max-steps ends the first epoch (6 steps) at 3
    ],
)
def test_the_last_step_is_saved_where_the_cadence_does_not_save_it(
    cadence, saved, tmp_path, files, tiny_bert, cache_dir
):
    """transformers' Trainer saves a run's end (save_strategy steps, and epoch at an epoch cut short); here
    --max-steps 3 with --save-steps 2 left checkpoint-2 as the latest, and an epoch cut by --max-steps no checkpoint
    at all, so a run continued with --resume and more steps could not start from where it ended."""
    out = tmp_path / "run"
    Trainer(run_config(out, files, tiny_bert, cache_dir, max_steps=3, eval_strategy="no", **cadence)).fit()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == saved
    assert (out / "latest").read_text().strip() == "checkpoint-3"


def test_a_run_stopped_after_its_last_checkpoint_resumes_to_the_uninterrupted_records(
    tmp_path, files, tiny_bert, cache_dir
):
    """Stopped after the last step's checkpoint (in the final evaluation, or the export of the model, the largest
    write): the resumed run logged that evaluation as of epoch 0 where the uninterrupted run logged epoch 1."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    cfg = run_config(whole, files, tiny_bert, cache_dir, epochs=1, batch_size=48, save_strategy="steps", save_steps=2)
    Trainer(cfg).fit()
    shutil.copytree(whole, stopped)
    shutil.rmtree(stopped / "model")
    (stopped / "result.json").unlink()
    Trainer(cfg.model_copy(update={"output_dir": str(stopped), "resume": "latest"})).fit()

    def records(out):
        return [{k: v for k, v in row.items() if k != "time_s"} for row in read_jsonl(out / "metrics.jsonl")]

    assert records(stopped) == records(whole)
    assert records(whole)[-1]["split"] == "eval" and records(whole)[-1]["epoch"] == 1


# ---- bad checkpoints: one clear line, exit 2 ---------------------------------------------------
def _flip_bytes(path):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "corrupt": (lambda c: _flip_bytes(c / "model.safetensors"), "is corrupt: the content of model.safetensors changed"),
    "truncated": (lambda c: _truncate(c / "optimizer.pt"), "is truncated: optimizer.pt has"),
    "missing-file": (lambda c: (c / "scheduler.pt").unlink(), "is incomplete: scheduler.pt is missing"),
    "unfinished-write": (lambda c: (c / "manifest.json").unlink(), "no manifest.json"),
}


def tuneforge(capsys, *args):
    """`tuneforge ARGS` through the CLI entry point, in this process: (exit code, last stderr line)."""
    from tuneforge.cli import main

    capsys.readouterr()
    code = main(list(args))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, (err.strip().splitlines() or [""])[-1]


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_checkpoint_is_refused(kind, run_copy, files, tiny_bert, cache_dir, capsys):
    damage, expected = DAMAGE[kind]
    ckpt = run_copy / "checkpoint-12"
    damage(ckpt)
    code, line = tuneforge(capsys, *cli_args(run_copy, files, tiny_bert, cache_dir), "--resume", str(ckpt))
    assert code == 2 and line.startswith("error: ") and expected in line, line


def test_bad_checkpoint_exits_2_from_a_fresh_process(run_copy, files, tiny_bert, cache_dir):
    (run_copy / "checkpoint-12" / "trainer_state.json").write_text("{}")  # edited after the write
    proc = run_cli(*cli_args(run_copy, files, tiny_bert, cache_dir), "--resume", fresh=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "is truncated: trainer_state.json has 2 bytes" in line


def test_missing_checkpoint_is_refused(tmp_path, files, tiny_bert, cache_dir, capsys):
    out = tmp_path / "fresh"
    code, line = tuneforge(
        capsys, *cli_args(out, files, tiny_bert, cache_dir), "--resume", str(tmp_path / "checkpoint-7")
    )
    assert code == 2 and "checkpoint-7' does not exist" in line
    out.mkdir()
    (out / ".tmp-checkpoint-6-123-456").mkdir()  # only a crashed write
    code, line = tuneforge(capsys, *cli_args(out, files, tiny_bert, cache_dir), "--resume")
    assert code == 2 and "no complete checkpoint in" in line and "starts again with --overwrite" in line


def test_resuming_in_a_folder_that_is_not_there_says_to_name_its_new_place(
    run_copy, files, tiny_bert, cache_dir, capsys
):
    """A run folder moved (mv runs/x runs/y) and its config re-run with --resume: the line said to train with
    --save-steps first, though the run had saved checkpoints."""
    run_copy.rename(run_copy.parent / "renamed")
    code, line = tuneforge(capsys, *cli_args(run_copy, files, tiny_bert, cache_dir), "--resume")
    assert code == 2 and f"output dir {str(run_copy)!r} does not exist" in line, line
    assert "pass its new place with --output-dir" in line and "--save-steps" not in line
    assert not run_copy.exists()


@pytest.mark.parametrize(
    "pointer",
    [b"checkpoint-12\0\xff", b"\xff\xfe not text", b"x" * 300, b"../elsewhere/checkpoint-2\n", b"checkpoint-\n"],
)
def test_a_damaged_latest_pointer_falls_back_to_the_newest_complete_checkpoint(run_copy, tmp_path, pointer):
    (tmp_path / "elsewhere").mkdir()
    shutil.copytree(run_copy / "checkpoint-2", tmp_path / "elsewhere" / "checkpoint-2")  # another run's
    (run_copy / "latest").write_bytes(pointer)
    assert checkpoint.find_checkpoint("latest", str(run_copy)) == run_copy / "checkpoint-12"


def test_a_folder_named_latest_is_refused_on_resume(run_copy, files, tiny_bert, cache_dir, capsys):
    (run_copy / "latest").unlink()
    (run_copy / "latest").mkdir()  # the user's: a save would replace it
    (run_copy / "latest" / "notes.txt").write_text("mine")
    code, line = tuneforge(capsys, *cli_args(run_copy, files, tiny_bert, cache_dir), "--resume")
    assert code == 2 and "holds 'latest', which is not the file a run writes there" in line, line
    assert (run_copy / "latest" / "notes.txt").read_text() == "mine"


def test_resuming_into_the_folder_of_another_run_needs_overwrite(
    run_copy, files, tiny_bert, cache_dir, tmp_path, capsys
):
    other = tmp_path / "other"  # another run's folder, and a file of the user's
    (other / "checkpoint-4").mkdir(parents=True)
    (other / "metrics.jsonl").write_text('{"split": "train", "step": 1, "epoch": 0, "loss": 9.5}\n')
    (other / "notes.txt").write_text("mine")
    flags = [*cli_args(other, files, tiny_bert, cache_dir), "--resume", str(run_copy / "checkpoint-10")]
    code, line = tuneforge(capsys, *flags)
    assert code == 2 and f"output dir {str(other)!r} already holds a run" in line, line
    assert (other / "checkpoint-4").is_dir() and "9.5" in (other / "metrics.jsonl").read_text()
    code, line = tuneforge(capsys, *flags, "--overwrite")
    assert code == 0, line
    assert not (other / "checkpoint-4").exists() and (other / "notes.txt").read_text() == "mine"
    steps = [json.loads(ln)["step"] for ln in (other / "metrics.jsonl").read_text().splitlines()]
    assert steps and min(steps) > 10, steps  # the resumed steps' records, none of the replaced run's


@pytest.mark.parametrize(
    "change, named",
    [
        (["--seed", "7"], "seed is 42 in its config.yaml, 7 here"),
        (["--no-group-by-length"], "data.group_by_length is true in its config.yaml, false here"),
        (["--max-train-samples", "80"], "data.max_train_samples is null in its config.yaml, 80 here"),
    ],
)
def test_a_resume_mid_epoch_onto_another_order_is_refused(change, named, run_copy, files, tiny_bert, cache_dir, capsys):
    """checkpoint-10 stopped at example 64 of epoch 1: another order of that epoch would train some of its examples
    twice and others never. The line names the setting that differs (a list of likely ones missed others that
    order an epoch: sft's --no-packing, clm's --block-size)."""
    flags = [*cli_args(run_copy, files, tiny_bert, cache_dir), "--resume", str(run_copy / "checkpoint-10"), *change]
    code, line = tuneforge(capsys, *flags)
    assert code == 2 and "stopped in the middle of epoch 1 (example 64 of 96)" in line, line
    assert f"otherwise ({named})" in line, line
    assert sorted(p.name for p in run_copy.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-12", "checkpoint-2"]
    assert (run_copy / "latest").read_text().strip() == "checkpoint-12"


def test_a_resume_with_other_data_or_task_settings_names_them(run_copy, files, tiny_bert, cache_dir, capsys):
    """Settings that may change at an epoch's end (the loss's, the data's) were taken without a word: the resumed run
    says which differ from the checkpoint's config.yaml."""
    from tuneforge.cli import main

    flags = [arg for arg in cli_args(run_copy, files, tiny_bert, cache_dir) if arg != "--quiet"]
    capsys.readouterr()
    assert main([*flags, "--resume", str(run_copy / "checkpoint-12"), "--max-length", "64"]) == 0
    err = capsys.readouterr().err
    said = "note: the resumed run trains on with settings other than its checkpoint's: data.max_length is "
    assert f"{said}128 in its config.yaml, 64 here\n" in err, err


@pytest.mark.parametrize("change", [["--lr", "5e-4"], ["--weight-decay", "0.5"], ["optim.betas=[0.8,0.9]"]])
def test_a_resume_with_other_optimizer_settings_is_refused(change, run_copy, files, tiny_bert, cache_dir, capsys):
    """The optimizer state restored from the checkpoint holds them, so the resumed run would train with the old ones
    while its config.yaml said otherwise."""
    before = (run_copy / "config.yaml").read_text()
    flags = [*cli_args(run_copy, files, tiny_bert, cache_dir), "--resume", str(run_copy / "checkpoint-10"), *change]
    code, line = tuneforge(capsys, *flags)
    assert code == 2 and "in the checkpoint's config.yaml but" in line, line
    assert (run_copy / "config.yaml").read_text() == before


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, minilm_dir):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert-48"), minilm_dir, hidden_size=48)


def test_incompatible_checkpoints_are_refused(run_copy, files, tiny_bert, other_model, cache_dir, tmp_path, capsys):
    ckpt = str(run_copy / "checkpoint-12")
    flags = cli_args(run_copy, files, tiny_bert, cache_dir)

    def refused(*args):
        code, line = tuneforge(capsys, *args, "--resume", ckpt)
        assert code == 2, line
        return line

    # another model
    line = refused(*[other_model if a == tiny_bert else a for a in flags])
    assert "does not match this run: hidden_size is 32 in the checkpoint but 48 here" in line
    # another label set
    three = tmp_path / "three.csv"
    three.write_text(files[0].read_text() + '"so so, neither good nor bad",neutral\n')
    line = refused(*[str(three) if a == str(files[0]) else a for a in flags])
    assert line.startswith(f"error: --train-file changed since {ckpt} was written (content fingerprint)")
    line = refused(*[str(three) if a == str(files[0]) else a for a in flags], "--allow-changed-data")
    assert "labels is ['neg', 'pos'] in the checkpoint but ['neg', 'neutral', 'pos'] here" in line
    # another task (regression on the same rows with numeric labels)
    numeric = tmp_path / "numeric.csv"
    numeric.write_text(files[0].read_text().replace(",pos\n", ",1\n").replace(",neg\n", ",0\n"))
    numeric_val = tmp_path / "numeric_val.csv"
    numeric_val.write_text(files[1].read_text().replace(",pos\n", ",1\n").replace(",neg\n", ",0\n"))
    swapped = {str(files[0]): str(numeric), str(files[1]): str(numeric_val)}
    line = refused(*[swapped.get(a, a) for a in flags], "--task", "regression", "--allow-changed-data")
    assert "task is 'classification' in the checkpoint but 'regression' here" in line
    # other weights trained (the run kept the classifier's embeddings and bottom layer fixed)
    line = refused(*flags, "--freeze-layers", "0", "--freeze-embeddings", "off")
    assert line.endswith(
        "trained 20 weight tensors but this run trains 41: resume with the --freeze-layers and "
        "--freeze-embeddings it was saved with (its config.yaml has them)"
    ), line


# ---- export ------------------------------------------------------------------------------------
def logits_of(model_dir, texts):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(**tok(texts, padding=True, return_tensors="pt")).logits


# ---- a disk without room --------------------------------------------------------------------------------
def test_a_checkpoint_without_room_stops_the_run_and_the_one_before_resumes(files, tiny_bert, cache_dir, tmp_path):
    """A checkpoint's write failed for want of room (a full disk, a quota; here a file size limit that starts once
    the first checkpoint is written): 'internal error', and its half-written folder left taking the room; now one
    line naming it and how to go on, no temporary left, checkpoint-1 whole and named by `latest`, and --resume
    continues the run once there is room."""
    import resource

    from conftest import run_forked
    from tuneforge import Callback
    from tuneforge.errors import NoRoomError

    out = tmp_path / "run"
    cfg = run_config(out, files, tiny_bert, cache_dir, max_steps=2, save_steps=1, eval_strategy="no")

    class DiskFullAfterFirstSave(Callback):
        def on_save(self, trainer, path) -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))

    def fit() -> int:
        try:
            Trainer(cfg, callbacks=[DiskFullAfterFirstSave()]).fit()
        except NoRoomError as err:
            print(err)
            return 2
        return 0

    proc = run_forked(fit, ["fit"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout.strip() == (
        f"the checkpoint {str(out / 'checkpoint-2')!r} has no room (File too large); free space there, then "
        "continue the run from checkpoint-1 with --resume latest (it stopped at step 2)"
    )
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "config.yaml", "latest", "metrics.jsonl"]
    assert checkpoint.verify(out / "checkpoint-1") is None and (out / "latest").read_text() == "checkpoint-1\n"
    assert Trainer(cfg.model_copy(update={"resume": "latest"})).fit()["steps"] == 2


def test_a_model_folder_without_room_keeps_the_earlier_one_and_says_how_to_write_it(
    run_copy, files, tiny_bert, cache_dir, capsys
):
    """The end of training's export (OUTPUT_DIR/model) failed for want of room: 'internal error'; now one line
    naming the folder and the checkpoint to resume, the earlier model folder whole, and the resume writes it."""
    from conftest import cli_without_room

    before = {p.name: p.read_bytes() for p in (run_copy / "model").iterdir()}
    args = [*cli_args(run_copy, files, tiny_bert, cache_dir), "--resume"]
    line = cli_without_room(args, 1 << 20)
    assert line == (
        f"error: the model folder {str(run_copy / 'model')!r} has no room (File too large); free space there, then "
        "continue the run from checkpoint-12 with --resume latest (it stopped at step 12)"
    )
    assert {p.name: p.read_bytes() for p in (run_copy / "model").iterdir()} == before
    assert not [p for p in run_copy.iterdir() if p.name.startswith(".tmp-")]
    code, line = tuneforge(capsys, *args)
    assert code == 0, line


def test_export_cli_writes_hf_folder_with_the_trained_logits(trained, tmp_path, capsys):
    out = trained[0]
    target = tmp_path / "exported"
    # the run's final model is its best, step 2 (load_best_model_at_end)
    code, line = tuneforge(capsys, "export", str(out / "checkpoint-2"), str(target))
    assert code == 0, line
    assert (target / "model.safetensors").exists() and (target / "tuneforge.json").exists()
    texts = ["a wonderful, moving film", "boring, slow and far too long"]
    assert torch.equal(logits_of(target, texts), logits_of(out / "model", texts))
    assert not torch.equal(logits_of(target, texts), logits_of(out / "checkpoint-12", texts))
    code, line = tuneforge(capsys, "export", str(out / "checkpoint-12"), str(target))
    assert code == 2 and "--overwrite" in line
    code, line = tuneforge(capsys, "export", str(out / "checkpoint-4"), str(tmp_path / "x"))  # removed by retention
    assert code == 2 and "does not exist" in line


def test_export_of_a_model_with_tied_weights(tiny_gpt2, tmp_path, cache_dir):
    """GPT-2's lm_head is its embedding matrix, stored once in model.safetensors (the run's model folder too, as
    save_pretrained writes it); the export restores the tie."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from conftest import parallel_pairs
    from tuneforge.export import export_checkpoint

    text = tmp_path / "train.txt"
    text.write_text("".join(f"{en} {de}\n" for en, de in parallel_pairs(40, seed=1)))
    out = tmp_path / "run"
    Trainer(
        build_config(
            task="clm",
            model=tiny_gpt2,
            output_dir=str(out),
            max_steps=2,
            batch_size=4,
            quiet=True,
            save_strategy="steps",
            save_steps=2,
            eval_strategy="no",
            data={"train_file": str(text), "validation_file": str(text), "block_size": 16, "cache_dir": cache_dir},
        )
    ).fit()
    exported = export_checkpoint(out / "checkpoint-2", tmp_path / "exported")
    ids = torch.tensor([[5, 17, 42, 8, 99, 3]])
    with torch.no_grad():
        got, want = (
            AutoModelForCausalLM.from_pretrained(p).eval()(input_ids=ids).logits for p in (exported, out / "model")
        )
    assert torch.equal(got, want)
    for folder in (exported, out / "model"):
        with safe_open(folder / "model.safetensors", "pt") as weights:
            names = set(weights.keys())
        assert "transformer.wte.weight" in names and "lm_head.weight" not in names, folder


def test_atomic_replace_keeps_the_old_content_when_a_write_fails(tmp_path):
    from tuneforge.files import replacing, write_text

    target = tmp_path / "latest"
    write_text(target, "checkpoint-2\n")
    with pytest.raises(RuntimeError), replacing(target) as tmp:
        tmp.write_text("checkpoint-")
        raise RuntimeError("killed half-way")
    assert target.read_text() == "checkpoint-2\n" and [p.name for p in tmp_path.iterdir()] == ["latest"]
    folder = tmp_path / "model"  # a folder is replaced whole
    folder.mkdir()
    (folder / "old.bin").write_text("1")
    with replacing(folder) as tmp:
        tmp.mkdir()
        (tmp / "new.bin").write_text("2")
    assert [p.name for p in folder.iterdir()] == ["new.bin"] and sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "model",
    ]
