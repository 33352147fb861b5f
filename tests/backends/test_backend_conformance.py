"""Backend conformance: every backend trains, resumes and exports like one process.

The same tests, parametrised over the backends (ddp, fsdp, tp, deepspeed ZeRO 1/2/3 and ZeRO-3 with
offload), against one single-process reference run per setup (conftest.BACKEND_SETUPS). Every run
is made once a session by the `backend_runs` fixture and shared with the per-backend files
(test_backend_<name>.py), which hold what only one backend has.
"""

from __future__ import annotations

import csv

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    BACKEND_RUNS,
    REVIEWS,
    classify_reviews,
    cli_main,
    last_json,
    max_weight_diff,
    parity_loss_gap,
    query_weights,
    run_cli,
)
from conftest import PARITY_STEPS as STEPS

PARALLEL = ["ddp", "fsdp", "tp", "zero1", "zero2", "zero3", "zero3-offload"]
# --freeze-layers 1 runs; not in the prediction test: their tiny model learns too little to predict both labels
FROZEN = ["zero3-frozen", "fsdp-frozen"]


@pytest.mark.parametrize("run", PARALLEL + FROZEN)
def test_per_step_losses_match_one_process(backend_runs, run):
    gap = parity_loss_gap(backend_runs.reference(run), backend_runs[run], learns_by=backend_runs.setup(run).learns_by)
    assert gap < 1e-4


@pytest.mark.parametrize("run", PARALLEL + FROZEN)
def test_final_weights_match_one_process(backend_runs, run, tiny_bert):
    single, other = backend_runs.reference(run) / "model", backend_runs[run] / "model"
    assert max_weight_diff(single, other) < 1e-4
    a, b = load_file(single / "model.safetensors"), load_file(other / "model.safetensors")
    for k in a:  # full shapes (not per-rank ones) and fp32: never ZeRO-3's empty placeholders
        assert b[k].shape == a[k].shape and b[k].dtype == torch.float32, k
    start, trained = query_weights(tiny_bert, other, layer=backend_runs.setup(run).frozen_layers)  # lowest trained
    assert trained.shape == start.shape  # gathered to the full (not per-rank) shape
    assert (trained - start).abs().max() > 1e-3  # the sharded weights were trained and gathered
    # the launching parent prints the result once; the workers print nothing
    assert sum(line.startswith("{") for line in backend_runs.stdout[run].splitlines()) == 1
    assert last_json(backend_runs.stdout[run])["steps"] == STEPS


@pytest.mark.parametrize("run", ["frozen-single", *FROZEN])
def test_frozen_layers_stay_as_loaded(backend_runs, run, tiny_bert):
    """--freeze-layers 1: the embeddings and layer 0 come out bit for bit as loaded, layer 1 trained."""
    assert backend_runs.setup(run).frozen_layers == 1
    start, trained = (
        load_file(f"{tiny_bert}/model.safetensors"),
        load_file(backend_runs[run] / "model/model.safetensors"),
    )
    frozen = [k for k in start if k.startswith(("embeddings.", "encoder.layer.0."))]
    assert len(frozen) > 10
    for k in frozen:
        assert torch.equal(trained["bert." + k], start[k]), k
    first, last = query_weights(tiny_bert, backend_runs[run] / "model", layer=1)
    assert (last - first).abs().max() > 1e-3


@pytest.mark.parametrize("run", PARALLEL)
def test_model_folder_predicts_like_one_process(backend_runs, run):
    val = backend_runs.data(BACKEND_RUNS[run][0])["val"]
    texts = REVIEWS + [row["text"] for row in csv.DictReader(val.open())][:8]
    (single_model, single), (model, other) = classify_reviews(
        backend_runs.reference(run) / "model", backend_runs[run] / "model", texts=texts
    )
    for m in (single_model, model):
        assert m.config.architectures == ["BertForSequenceClassification"]
        assert m.config.num_attention_heads == 4  # per-rank head counts never reach the export
    assert other.argmax(-1).tolist() == single.argmax(-1).tolist()
    assert len(set(single.argmax(-1).tolist())) == 2  # it predicts both labels, not a constant
    torch.testing.assert_close(other, single, atol=1e-4, rtol=0)


# run -> (the checkpoint step it resumes from, its flags, the largest loss and weight gap allowed,
# the workers of an external torchrun that starts it: 0 for `--nproc`)
RESUMES = {
    # started by torchrun itself (with nproc=2 in the config): tuneforge uses that environment and
    # launches nothing more (a nested launch would make each worker a parent: two results printed,
    # two writers of metrics.jsonl)
    "ddp": (10, ("--backend", "ddp", "--batch-size", "8"), 1e-6, 2),
    "fsdp": (10, ("--backend", "fsdp", "--nproc", "2", "--batch-size", "8"), 0.0, 0),
    "tp": (10, ("--backend", "tp", "--nproc", "2", "--batch-size", "16"), 0.0, 0),
    "zero2": (5, tuple(BACKEND_RUNS["zero2"][1].split()), 0.0, 0),
}


@pytest.mark.parametrize("run", list(RESUMES))
def test_resume_continues_with_identical_losses(backend_runs, run):
    """Every rank loads the checkpoint and finishes the run as if never stopped."""
    step, flags, tolerance, torchrun = RESUMES[run]
    whole, resumed, out = backend_runs.resume(run, f"{run}-resumed", *flags, step=step, torchrun=torchrun)
    assert sum(line.startswith("{") for line in backend_runs.stdout[f"{run}-resumed"].splitlines()) == 1
    if tolerance:
        assert max(abs(resumed[s] - whole[s]) for s in resumed) < tolerance
        assert max_weight_diff(backend_runs[run] / "model", out / "model") < tolerance
    else:
        assert all(resumed[s] == whole[s] for s in resumed), (whole, resumed)
        assert max_weight_diff(backend_runs[run] / "model", out / "model") == 0.0
        a, b = (load_file(folder / "model" / "model.safetensors") for folder in (backend_runs[run], out))
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("run", ["fsdp", "tp"])
def test_sharded_checkpoint_holds_one_shard_per_rank(backend_runs, run):
    ckpt = backend_runs[run] / "checkpoint-10"
    assert sorted(p.name for p in (ckpt / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (ckpt / "sharded" / ".metadata").exists()
    assert not (ckpt / "model.safetensors").exists()  # no full copy gathered at save time


# run -> flags of a world of one that resumes its checkpoint-10
ON_ONE = {
    # DCP reshards the 2 ranks' shards, here with 2 accumulated micro-batches of 8
    "fsdp": ("--backend", "fsdp", "--batch-size", "8", "--grad-accum", "2"),
    # the 2 ranks' halves of each split matrix are joined again
    "tp": ("--backend", "tp", "--batch-size", "16"),
}


@pytest.mark.parametrize("run", list(ON_ONE))
def test_sharded_checkpoint_reshards_onto_one_process(backend_runs, run):
    whole, resumed, out = backend_runs.resume(run, f"{run}-on-one", *ON_ONE[run])
    assert max(abs(resumed[s] - whole[s]) for s in resumed) < 1e-4
    assert max_weight_diff(backend_runs[run] / "model", out / "model") < 1e-4


@pytest.mark.parametrize("backend", ["fsdp", "tp"])
def test_resumes_from_a_single_process_checkpoint(backend_runs, backend):
    """model.safetensors + optimizer.pt (single/ddp layout, fused AdamW) load into sharded/split parameters."""
    flags = ("--backend", backend, "--batch-size", "16")
    whole, resumed, out = backend_runs.resume("single", f"single-to-{backend}", *flags)
    assert max(abs(resumed[s] - whole[s]) for s in resumed) < 1e-4
    assert max_weight_diff(backend_runs["single"] / "model", out / "model") < 1e-4


# run -> (its checkpoint's step, the flags of a run that cannot resume it, what the one line says)
UNREADABLE = {
    "fsdp": (10, "--backend ddp --nproc 2", ["written by backend 'fsdp'", "'ddp' cannot", "--backend fsdp"]),
    "zero2": (5, "--backend deepspeed --nproc 2 --zero-stage 3", ["stage 1 or 2", "has stage 3", "stage 2"]),
    "zero3": (20, "--backend deepspeed --nproc 2 --zero-stage 2", ["stage 3,", "has stage 2", "stage 3"]),
    "zero3-on-fsdp": (20, "--backend fsdp --nproc 2", ["DeepSpeed's ZeRO shards", "backend 'fsdp' cannot read"]),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_a_checkpoint_the_backend_cannot_resume_is_one_line_before_launch(backend_runs, case, capfd, tmp_path):
    """Another backend's files, or DeepSpeed's ZeRO-3 files on stage 1/2 (and back): refused in the launching
    process, not by each worker (whose lines came with the launcher's traceback, and ZeRO's as an IndexError)."""
    run = case.removesuffix("-on-fsdp")
    step, flags, needles = UNREADABLE[case]
    ckpt = backend_runs[run] / f"checkpoint-{step}"
    args = backend_runs.args(BACKEND_RUNS[run][0], tmp_path / "out", *flags.split(), "--batch-size", "8")
    args += ["--resume", str(ckpt)]
    code, _, err = cli_main(capfd, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert all(needle in lines[0] for needle in needles), lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("run", ["single", "ddp", "fsdp", "tp", "zero2", "zero3"])
def test_export_checkpoint_offline(backend_runs, run, tmp_path, capsys):
    """`tuneforge export` of the last checkpoint: exactly the model folder the run wrote."""
    args = ("export", str(backend_runs[run] / f"checkpoint-{STEPS}"), str(tmp_path / "exported"))
    if "deepspeed" in BACKEND_RUNS[run][1]:  # DeepSpeed is only ever imported by child processes here (slow)
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        code, _, err = cli_main(capsys, *args)
        assert code == 0, err
    assert max_weight_diff(backend_runs[run] / "model", tmp_path / "exported") == 0.0


@pytest.mark.parametrize(
    "backend, distributed, sharded",
    [("single", False, False), ("ddp", True, False), ("fsdp", True, True), ("tp", True, True)],
)
def test_backend_reports_itself_usable_here(backend, distributed, sharded):
    import importlib

    cls = importlib.import_module(f"tuneforge.backends.{backend}").BACKEND
    assert cls.usable() == "usable"
    assert cls.distributed is distributed and cls.sharded is sharded
