"""Exact resume: an interrupted run continues at the exact step and batch and ends bitwise identical
to an uninterrupted one (single process and DDP); world-size and backend changes; worker death
under torchrun elastic restarts.

Every run records, per rank and step, the example indices it trained on and its loss sum (a
Trainer subclass overriding `train_step`), so the tests compare runs step by step. The script runs in a child
forked from the test process (conftest.run_script) and forks its workers as `tuneforge train` does
(`fork_workers=True`; scripts that re-run themselves in each worker: test_launch.py), so a restart here is the
CLI's restart.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_script as run_forked_script
from conftest import save_tiny_bert, sentiment_split, tiny_run_config
from tuneforge.configure import build_config
from tuneforge.trainer import Callback, Trainer

# 96 rows; per-process batch 8 -> DDP x2: global batch 16, 6 steps per epoch, 12 steps in 2 epochs
BASE = {
    "task": "classification",
    "epochs": 2,
    "batch_size": 8,
    "save_strategy": "steps",
    "save_steps": 4,
    "logging_steps": 3,
    "quiet": True,
    "optim": {"lr": 1e-3, "warmup_steps": 3},
    "freeze_layers": 0,  # every weight trains (not a classifier's default): each has optimizer state to carry
    "freeze_embeddings": "off",
}

SCRIPT = '''
import json, os, signal, sys
from pathlib import Path

import torch

from tuneforge.configure import build_config
from tuneforge.trainer import Callback, Trainer

spec = json.loads(sys.argv[1])
DIE = spec.pop("die", None)  # {"step", "rank", "marker"}: that rank SIGKILLs itself once, before that step


class Recording(Trainer):
    def train_step(self, micro_batches):
        step, rank = self.state.step + 1, self.backend.rank
        if DIE and step == DIE["step"] and rank == DIE["rank"] and not os.path.exists(DIE["marker"]):
            Path(DIE["marker"]).write_text("died")
            os.kill(os.getpid(), signal.SIGKILL)
        loss, count = super().train_step(micro_batches)
        record = {"pid": os.getpid(), "step": step, "epoch": self.state.epoch,
                  "indices": [i for mb in micro_batches for i in mb], "loss": loss.item()}
        with open(Path(self.config.output_dir) / f"steps-rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\\n")
        return loss, count


class DumpStart(Callback):
    """The model and optimizer state the run starts (or resumes) with."""

    def on_train_begin(self, trainer):
        if not trainer.config.resume:
            return
        if trainer.backend.sharded:  # gather the shards; keyed by parameter name
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model, optimizer = get_state_dict(trainer.model, trainer.optimizer, options=full)
        else:  # the optimizer's own state, keyed by parameter position
            model, optimizer = trainer.backend.unwrap(trainer.model).state_dict(), trainer.optimizer.state_dict()
        if trainer.backend.is_main:
            torch.save({"model": model, "optimizer": optimizer}, Path(trainer.config.output_dir) / "start-state.pt")


if __name__ == "__main__":
    Recording(build_config(spec), callbacks=[DumpStart()], fork_workers=True).fit()
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_bert, cache_dir):
    d = tmp_path_factory.mktemp("resume")
    train, val = sentiment_split(d, 96, 33)
    (d / "script.py").write_text(SCRIPT)
    data = {"train_file": str(train), "validation_file": str(val), "cache_dir": cache_dir}
    return d, {**BASE, "model": tiny_bert, "data": data}


def run_script(setup, out, **spec):
    d, base = setup
    spec = {**base, "output_dir": str(out), **spec}
    # one thread per process in every run: the float reduction order (and so every bit) is the same
    return run_forked_script(d / "script.py", json.dumps(spec), env={"OMP_NUM_THREADS": "1"})


def history(out: Path, rank: int) -> list[dict]:
    """The steps that made the final model: a resume replaces the records after its checkpoint."""
    steps: list[dict] = []
    for line in (out / f"steps-rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps = [s for s in steps if s["step"] < record["step"]] + [record]
    return steps


def metrics(out: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k != "time_s"}
        for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


def weights(out: Path, folder: str = "model") -> dict[str, torch.Tensor]:
    return load_file(str(out / folder / "model.safetensors"))


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def same_steps(a: list[dict], b: list[dict]) -> bool:
    strip = lambda steps: [(s["step"], s["epoch"], s["indices"], s["loss"]) for s in steps]  # noqa: E731
    return strip(a) == strip(b)


# ---- single process, in this process ------------------------------------------------------------
class Interrupted(Exception):
    pass


class RecordingTrainer(Trainer):
    """Records each step; raises before step `stop_at` (after the checkpoint of step 4)."""

    def __init__(self, *args, stop_at=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop_at, self.steps = stop_at, []

    def train_step(self, micro_batches):
        step = self.state.step + 1
        if step == self.stop_at:
            raise Interrupted
        loss, count = super().train_step(micro_batches)
        self.steps.append(
            {"step": step, "epoch": self.state.epoch, "indices": sum(micro_batches, []), "loss": loss.item()}
        )
        return loss, count


@pytest.fixture(scope="module")
def tiny_bert_dropout(tmp_path_factory, minilm_dir):
    """Like conftest's tiny BERT, with dropout: a resume is exact only if the RNG states are restored."""
    torch.manual_seed(0)
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert-dropout"), minilm_dir, dropout=0.1)


def test_single_process_resume_is_bitwise_identical(setup, tiny_bert_dropout, tmp_path):
    _, base = setup
    # micro-batches of 8, 2 per step: 6 steps per epoch; checkpoints at 4 (mid-epoch) and 8; the
    # logging window of steps 4-6 spans the interruption; warmup + linear decay over 12 steps
    values = {**base, "model": tiny_bert_dropout, "grad_accum": 2}
    whole = RecordingTrainer(build_config({**values, "output_dir": str(tmp_path / "whole")}))
    whole.fit()

    cut = tmp_path / "cut"
    first = RecordingTrainer(build_config({**values, "output_dir": str(cut)}), stop_at=6)
    with pytest.raises(Interrupted):
        first.fit()
    assert (cut / "latest").read_text().strip() == "checkpoint-4" and [s["step"] for s in first.steps] == [
        1,
        2,
        3,
        4,
        5,
    ]
    second = RecordingTrainer(build_config({**values, "output_dir": str(cut), "resume": "latest"}))
    result = second.fit()

    assert second.steps[0]["step"] == 5  # the exact next batch, nothing before it trained again
    assert same_steps(first.steps[:4] + second.steps, whole.steps) and len(whole.steps) == 12
    assert metrics(cut) == metrics(tmp_path / "whole")  # losses per window, lr schedule, epochs, evals
    assert [r["step"] for r in metrics(cut) if r["split"] == "train"] == [3, 6, 9, 12]
    assert_bitwise_equal(weights(cut), weights(tmp_path / "whole"))
    assert result["steps"] == 12


# ---- DDP (2 processes) --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp_whole(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "whole"
    proc = run_script(setup, out, backend="ddp", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def ddp_cut(setup, tmp_path_factory):
    """A 2-process DDP run whose rank 1 is SIGKILLed before step 6 (checkpoint 4 is the last)."""
    d = tmp_path_factory.mktemp("ddp-cut")
    out = d / "run"
    proc = run_script(setup, out, backend="ddp", nproc=2, die={"step": 6, "rank": 1, "marker": str(d / "died")})
    assert proc.returncode != 0 and (d / "died").exists()
    assert (out / "latest").read_text().strip() == "checkpoint-4" and not (out / "model").exists()
    return out


def test_ddp_resume_is_bitwise_identical(setup, ddp_whole, ddp_cut, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(ddp_cut, out)
    proc = run_script(setup, out, backend="ddp", nproc=2, resume="latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert same_steps(history(out, rank), history(ddp_whole, rank)) and len(history(out, rank)) == 12
    assert metrics(out) == metrics(ddp_whole)
    assert_bitwise_equal(weights(out), weights(ddp_whole))

    from tuneforge.export import export_checkpoint  # a ddp checkpoint exports the trained model

    exported = export_checkpoint(ddp_whole / "checkpoint-12", tmp_path / "exported")
    assert_bitwise_equal(weights(exported.parent, exported.name), weights(ddp_whole))


def test_ddp_checkpoint_resumes_on_one_process_without_skipping_or_repeating(setup, ddp_cut, tmp_path):
    """2 processes x 8 -> 1 process x 8: the interrupted epoch keeps its order (built for a global
    batch of 16) from example 64 on; the rest of the run is re-planned at 8 per step."""
    out = tmp_path / "run"
    shutil.copytree(ddp_cut, out)
    proc = run_script(setup, out, backend="single", nproc=1, resume="latest")
    assert proc.returncode == 0, proc.stderr[-3000:]

    start = torch.load(out / "start-state.pt", weights_only=True)  # what the 1-process run started from
    assert_bitwise_equal(start["model"], load_file(str(out / "checkpoint-4" / "model.safetensors")))
    saved_optim = torch.load(out / "checkpoint-4" / "optimizer.pt", weights_only=True)
    for i, state in saved_optim["state"].items():
        assert torch.equal(start["optimizer"]["state"][i]["exp_avg_sq"], state["exp_avg_sq"])

    before = [s for rank in (0, 1) for s in history(out, rank) if s["step"] <= 4]  # the 2-process part
    after = [s for s in history(out, 0) if s["step"] > 4]  # the 1-process part
    assert all(len(s["indices"]) == 8 for s in before + after)
    epoch0 = [i for s in before + after if s["epoch"] == 0 for i in s["indices"]]
    epoch1 = [i for s in after if s["epoch"] == 1 for i in s["indices"]]
    assert sorted(epoch0) == list(range(96)) and sorted(epoch1) == list(range(96))
    assert [s["step"] for s in after] == list(range(5, 21))  # 4 steps finish epoch 0, 12 make epoch 1
    assert json.loads((out / "result.json").read_text())["steps"] == 20


def test_fsdp_resumes_a_ddp_checkpoint(setup, ddp_whole, ddp_cut, tmp_path):
    """Backend change: the model and optimizer state of a DDP checkpoint continue under FSDP."""
    out = tmp_path / "run"
    shutil.copytree(ddp_cut, out)
    proc = run_script(setup, out, backend="fsdp", nproc=2, resume="latest")
    assert proc.returncode == 0, proc.stderr[-3000:]

    ckpt = out / "checkpoint-4"
    start = torch.load(out / "start-state.pt", weights_only=True)  # gathered from the FSDP shards
    saved = load_file(str(ckpt / "model.safetensors"))
    assert_bitwise_equal({k: start["model"][k] for k in saved}, saved)
    # optimizer.pt is keyed by position in the param groups, FSDP's full state by parameter name
    cfg = build_config({**setup[1], "output_dir": str(tmp_path / "unused")})
    from transformers import AutoConfig, BertForSequenceClassification

    model = BertForSequenceClassification(AutoConfig.from_pretrained(ckpt))
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in Trainer(cfg).make_optimizer(model).param_groups for p in group["params"]]
    saved_optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert len(saved_optim["state"]) == len(order)
    for i, state in saved_optim["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(start["optimizer"]["state"][order[i]][key], state[key]), (order[i], key)

    fsdp_steps, ddp_steps = history(out, 0), history(ddp_whole, 0)
    assert [s["indices"] for s in fsdp_steps] == [s["indices"] for s in ddp_steps] and len(fsdp_steps) == 12
    assert fsdp_steps[4]["loss"] == pytest.approx(ddp_steps[4]["loss"], rel=1e-4)  # step 5 ran on the loaded weights

    from tuneforge.export import export_checkpoint  # the fsdp (DCP) checkpoint exports offline

    assert (out / "checkpoint-12" / "sharded" / ".metadata").exists()
    exported = export_checkpoint(out / "checkpoint-12", tmp_path / "exported")
    assert_bitwise_equal(weights(exported.parent, exported.name), weights(out))


def test_worker_death_restarts_from_the_checkpoint_and_finishes(setup, ddp_whole, tmp_path):
    """`--max-restarts 1`: rank 1 dies before step 6; torchrun restarts both workers, they resume
    from checkpoint 4 by themselves, the job exits 0 and ends where an uninterrupted run ends."""
    out = tmp_path / "run"
    proc = run_script(
        setup, out, backend="ddp", nproc=2, max_restarts=1, die={"step": 6, "rank": 1, "marker": str(tmp_path / "died")}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "died").exists()
    records = [json.loads(line) for line in (out / "steps-rank0.jsonl").read_text().splitlines()]
    restarted = [r["step"] for r in records if r["pid"] != records[0]["pid"]]
    assert restarted[0] == 5  # continued after checkpoint 4, not from the start
    for rank in (0, 1):
        assert same_steps(history(out, rank), history(ddp_whole, rank))
    assert_bitwise_equal(weights(out), weights(ddp_whole))


# ---- the LR schedule of a re-planned resume -----------------------------------------------------
@pytest.mark.parametrize("scheduler", ["linear", "cosine", "constant", "constant_with_warmup"])
def test_lr_schedule_is_remade_at_the_restored_step(scheduler, tmp_path):
    """After a batch-geometry change the schedule is re-made over the new total at the restored step
    (torch's public `last_epoch`): its learning rates from there on are bitwise those of a schedule over
    that total stepped to that step, whatever schedule the optimizer ran under before."""
    cfg = build_config(
        task="classification",
        output_dir=str(tmp_path),
        optim={"lr": 1e-3, "warmup_steps": 3, "scheduler": scheduler},
    )

    def run(optimizer, schedule, steps):
        lrs = []
        for _ in range(steps):
            optimizer.step()
            schedule.step()
            lrs.append(([g["lr"] for g in optimizer.param_groups], schedule.get_last_lr()))
        return lrs

    trainer = Trainer(cfg)

    def new_optimizer():
        return trainer.make_optimizer(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))

    planned = new_optimizer()  # a run planned over 20 steps from the start
    expected = run(planned, trainer.make_scheduler(planned, 20), 20)

    resumed = new_optimizer()  # 5 steps of a 12-step plan, then re-planned to 20 steps
    run(resumed, trainer.make_scheduler(resumed, 12), 5)
    schedule = trainer.make_scheduler(resumed, 20, start_step=5)
    at_resume = ([g["lr"] for g in resumed.param_groups], schedule.get_last_lr())
    assert at_resume == expected[4] and schedule.last_epoch == 5
    assert run(resumed, schedule, 15) == expected[5:]


class FirstStepLr(Callback):
    """The learning rate the run's first optimizer step (a resumed run's first after the checkpoint) uses."""

    def on_train_begin(self, trainer) -> None:
        self.lr = trainer.run.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize(
    ("changed", "multiplier"),
    [
        ({}, 2 / 4),  # linear over 4 steps (no warmup: int(0.06 * 4)) at step 2; the 2-step run's ended at 0
        ({"optim": {"lr": 1e-3, "warmup_steps": 10}}, 2 / 10),  # still warming up at step 2
    ],
)
def test_a_resume_with_another_schedule_trains_its_first_step_at_the_new_schedules_rate(
    changed, multiplier, tmp_path, tiny_bert, cache_dir
):
    """A resume whose schedule differs from the checkpoint's (more --max-steps, another warmup or --scheduler; the
    README: they may change) takes its first step at the new schedule's rate there, not the optimizer state's
    (the old schedule's: 0 at the end of a linear decay, so that step trained nothing)."""
    first = tiny_run_config(tmp_path, tiny_bert, cache_dir, max_steps=2, save_steps=2, optim={"lr": 1e-3})
    Trainer(first).fit()
    spy = FirstStepLr()
    more = {"max_steps": 4, "resume": "latest", "optim": {"lr": 1e-3}, **changed}
    Trainer(tiny_run_config(tmp_path, tiny_bert, cache_dir, **more), callbacks=[spy]).fit()
    assert spy.lr == pytest.approx(1e-3 * multiplier, rel=1e-6)


@pytest.mark.parametrize("word, hinted", [("epochs=3", True), ("configs/glue-mrpc.yaml", True), ("ckpt-9", False)])
def test_a_word_resume_took_from_the_command_line_is_named(tmp_path, word, hinted):
    """`train --resume epochs=3` (or `--resume CONFIG`): the flag takes the word after it; the line says so."""
    from tuneforge.checkpoint import find_checkpoint
    from tuneforge.errors import CheckpointError

    with pytest.raises(CheckpointError, match=f"checkpoint '{word}' does not exist") as refused:
        find_checkpoint(word, str(tmp_path / "run"))
    assert ("--resume takes the word after it" in str(refused.value)) == hinted
