"""deepspeed backend: ZeRO 1/2/3 (with CPU offload) on 2 CPU processes with gloo, through the CLI.

Parity with one process (losses per step and final weights), the derived DeepSpeed config and a
user JSON merged into it (or refused when it contradicts tuneforge's config), DeepSpeed-format
checkpoints with an exact resume, and the offline export of such a checkpoint.

2-process DeepSpeed start-up is slow, so every run is made once per module and shared:
    single        one process, batch 16
    zero1         2 x 8
    zero2         2 x 4 x grad-accum 2, optimizer offload, a checkpoint every 5 steps
    zero3         2 x 8, a user JSON ("auto" batch size; every parameter partitioned)
    zero3-offload 2 x 8, optimizer and parameter offload, the same JSON
"""

from __future__ import annotations

import csv
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import PARITY_STEPS as STEPS
from conftest import (
    backend_train_args,
    max_weight_diff,
    parity_loss_gap,
    run_cli,
    sentiment_split,
    train_losses,
    train_ok,
)

# "auto" takes tuneforge's value; threshold 0 partitions even the small tensors, so the final
# weights really are gathered from ZeRO-3 shards
USER_JSON = {
    "train_micro_batch_size_per_gpu": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 100000},
}

RUNS = {
    "single": ("--batch-size", "16"),
    "zero1": ("--backend", "deepspeed", "--nproc", "2", "--zero-stage", "1", "--batch-size", "8"),
    "zero2": (
        "--backend",
        "deepspeed",
        "--nproc",
        "2",
        "--zero-stage",
        "2",
        "--batch-size",
        "4",
        "--grad-accum",
        "2",
        "--offload",
        "optimizer",
        "--save-strategy",
        "steps",
        "--save-steps",
        "5",
    ),
    "zero3": (
        "--backend",
        "deepspeed",
        "--nproc",
        "2",
        "--zero-stage",
        "3",
        "--batch-size",
        "8",
        "--deepspeed-config",
        "{json}",
    ),
    "zero3-offload": (
        "--backend",
        "deepspeed",
        "--nproc",
        "2",
        "--zero-stage",
        "3",
        "--batch-size",
        "8",
        "--offload",
        "both",
        "--deepspeed-config",
        "{json}",
    ),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """96 training rows (6 global batches of 16), 33 evaluation rows, the user JSON."""
    d = tmp_path_factory.mktemp("deepspeed-data")
    (d / "ds.json").write_text(json.dumps(USER_JSON))
    train, val = sentiment_split(d, 96, 33)
    return {"train": train, "val": val, "json": d / "ds.json"}


@pytest.fixture(scope="module")
def train_args(tiny_bert, data, cache_dir):
    """(out, *flags) -> the CLI arguments of a 20-step run of tiny_bert."""

    # No length grouping: the epoch order is then the same for every global batch size, so a
    # 2 x 4 x 2 step sees exactly the examples of the single run's step of 16. A clip norm inside
    # the range of the gradient norms (0.03-0.3 here) clips some steps and not others: Adam hides
    # a constant gradient scale (e.g. an extra 1/grad_accum), this makes it change the losses.
    def args(out, *extra: str) -> list[str]:
        return backend_train_args(
            tiny_bert,
            (data["train"], data["val"]),
            cache_dir,
            out,
            "--no-group-by-length",
            *extra,
            lr="5e-3",
            max_grad_norm="0.1",
        )

    return args


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data, train_args):
    """run name -> output dir; each run is made the first time a test asks for it."""
    root = tmp_path_factory.mktemp("deepspeed-runs")
    done = {}

    def get(name: str):
        if name not in done:
            extra = [a.replace("{json}", str(data["json"])) for a in RUNS[name]]
            train_ok(*train_args(root / name, *extra))
            done[name] = root / name
        return done[name]

    return get


def weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "model" / "model.safetensors")


@pytest.mark.parametrize("run", ["zero1", "zero2", "zero3", "zero3-offload"])
def test_zero_matches_one_process(runs, run):
    assert parity_loss_gap(runs("single"), runs(run), learns_by=0.02) < 1e-4
    a, b = weights(runs("single")), weights(runs(run))
    assert a.keys() == b.keys()
    for k in a:  # full shapes and trained values: never ZeRO-3's empty placeholders
        assert b[k].shape == a[k].shape and b[k].dtype == torch.float32, k
        assert (a[k] - b[k]).abs().max().item() < 1e-4, k


def test_derived_config_with_user_json_merged(runs):
    resolved = json.loads((runs("zero3") / "deepspeed_config.json").read_text())
    assert resolved["train_micro_batch_size_per_gpu"] == 8  # "auto" took tuneforge's value
    assert resolved["train_batch_size"] == 16 and resolved["gradient_accumulation_steps"] == 1
    assert resolved["gradient_clipping"] == 0.1 and resolved["bf16"] == {"enabled": False}
    zero = resolved["zero_optimization"]
    assert (
        zero["stage"] == 3 and zero["stage3_param_persistence_threshold"] == 0 and zero["reduce_bucket_size"] == 100000
    )
    assert zero["offload_optimizer"] == {"device": "none"} and zero["offload_param"] == {"device": "none"}
    offload = json.loads((runs("zero3-offload") / "deepspeed_config.json").read_text())["zero_optimization"]
    assert offload["offload_optimizer"] == {"device": "cpu"} and offload["offload_param"] == {"device": "cpu"}
    accum = json.loads((runs("zero2") / "deepspeed_config.json").read_text())
    assert (
        accum["train_micro_batch_size_per_gpu"],
        accum["gradient_accumulation_steps"],
        accum["train_batch_size"],
    ) == (4, 2, 16)


def test_zero3_offload_export_predicts_like_one_process(runs, data):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = [row["text"] for row in csv.DictReader(data["val"].open())][:8]
    logits = []
    for run in ("single", "zero3-offload"):
        folder = runs(run) / "model"
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        with torch.no_grad():
            logits.append(model(**tok(texts, padding=True, return_tensors="pt")).logits)
    assert logits[0].argmax(-1).tolist() == logits[1].argmax(-1).tolist()
    assert len(set(logits[0].argmax(-1).tolist())) == 2  # it predicts both labels, not a constant
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=0)


def test_resume_from_deepspeed_checkpoint_is_exact(runs, train_args, tmp_path):
    full = runs("zero2")
    ckpt = full / "checkpoint-5"
    shards = sorted(p.name for p in (ckpt / "deepspeed").iterdir())
    assert (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt" in shards and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in shards
    )
    resumed = tmp_path / "resumed"
    train_ok(*train_args(resumed, *RUNS["zero2"], "--resume", str(ckpt)))
    before, after = train_losses(full), train_losses(resumed)
    assert sorted(after) == list(range(6, STEPS + 1))
    assert all(after[s] == before[s] for s in after), (before, after)
    a, b = weights(full), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_export_deepspeed_checkpoint_offline(runs, tmp_path):
    full = runs("zero2")
    out = tmp_path / "exported"
    proc = run_cli("export", str(full / f"checkpoint-{STEPS}"), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max_weight_diff(full / "model", out) == 0.0


@pytest.mark.parametrize(
    "user_json, extra, needles",
    [
        (
            {"train_micro_batch_size_per_gpu": 4},
            (),
            [
                "deepspeed config train_micro_batch_size_per_gpu=4 conflicts with batch_size=8",
                "remove it from the JSON or change --batch-size",
            ],
        ),
        (
            {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}},
            ("--zero-stage", "3"),
            ["deepspeed config bf16.enabled=true conflicts with precision=fp32", "--precision"],
        ),
        ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, (), ["sets 'optimizer'", "--lr"]),
        (None, ("--zero-stage", "2", "--offload", "params"), ["offload=params", "ZeRO stage 3", "--zero-stage 3"]),
    ],
)
def test_bad_deepspeed_settings_are_refused(tmp_path, tiny_bert, data, user_json, extra, needles):
    args = [
        "train",
        "--train-file",
        str(data["train"]),
        "--model",
        tiny_bert,
        "--backend",
        "deepspeed",
        "--nproc",
        "2",
        "--batch-size",
        "8",
        "--precision",
        "fp32",
        "--output-dir",
        str(tmp_path / "out"),
        *extra,
    ]
    if user_json is not None:
        (tmp_path / "ds.json").write_text(json.dumps(user_json))
        args += ["--deepspeed-config", str(tmp_path / "ds.json")]
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "out").exists()  # refused before any worker started
