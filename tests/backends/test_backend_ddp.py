"""ddp backend: exact evaluation over uneven rank shares, a world of one, bf16 with accumulation.

Parity, resume (under an external torchrun) and export are in test_backend_conformance.py; the
runs compared here are the shared ones of the `backend_runs` fixture (setup "clip").
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import last_json, max_weight_diff, run_cli


def test_ddp_eval_counts_each_example_once_and_equals_one_process(backend_runs, cache_dir):
    """Same weights (the single run's model) evaluated by 2 DDP processes and by one."""
    data = backend_runs.data("clip")
    args = ["eval", str(backend_runs["single"] / "model"), "--task", "classification"]
    args += ["--train-file", str(data["train"]), "--validation-file", str(data["val"]), "--cache-dir", cache_dir]
    args += ["--precision", "fp32", "--eval-batch-size", "16", "--json", "--quiet"]
    out = backend_runs.root / "eval-ddp"
    ddp = run_cli(*args, "--backend", "ddp", "--nproc", "2", "--output-dir", str(out))
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    # computed in-process at the end of the single run, same weights
    one = json.loads((backend_runs["single"] / "result.json").read_text())
    metrics = last_json(ddp.stdout)
    assert metrics["num_examples"] == one["num_examples"] == 101
    assert 0.5 < one["accuracy"] < 1.0 and 0.0 < one["f1"] < 1.0  # both classes predicted: counting matters
    assert metrics["accuracy"] == one["accuracy"] and metrics["f1"] == one["f1"]
    assert metrics["loss"] == pytest.approx(one["loss"], rel=1e-6)  # summation order differs, nothing else


def test_ddp_checkpoint_is_the_main_ranks_full_copy(backend_runs):
    """The main rank writes model.safetensors + optimizer.pt (test_backend_conformance resumes from it)."""
    ckpt = backend_runs["ddp"] / "checkpoint-10"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "optimizer.pt").exists()


def in_process_run(backend_runs, out, **overrides) -> dict:
    from tuneforge.configure import build_config
    from tuneforge.trainer import Trainer

    data = backend_runs.data("clip")
    cfg = build_config(
        {
            "task": "classification",
            "model": backend_runs.model,
            "output_dir": str(out),
            "max_steps": 3,
            "batch_size": 8,
            "precision": "fp32",
            "eval_strategy": "no",
            "quiet": True,
            "optim": {"lr": 1e-2},
            "data": {
                "train_file": str(data["train"]),
                "validation_file": str(data["val"]),
                "cache_dir": backend_runs.cache_dir,
                "max_eval_samples": 16,
            },
            **overrides,
        }
    )
    trainer = Trainer(cfg)
    result = trainer.fit()
    result["world_size"] = trainer.backend.world_size
    return result


def test_ddp_with_one_process_runs_as_world_size_one(tmp_path, backend_runs):
    """`--backend ddp` without a launch: a process group of one, identical to `single`."""
    single = in_process_run(backend_runs, tmp_path / "single")
    ddp = in_process_run(backend_runs, tmp_path / "ddp", backend="ddp")
    assert ddp["world_size"] == 1 and ddp["steps"] == 3
    assert not torch.distributed.is_initialized()  # torn down again
    assert max_weight_diff(tmp_path / "single" / "model", tmp_path / "ddp" / "model") == 0.0
    assert ddp["train_loss"] == single["train_loss"]


def test_ddp_bf16_with_gradient_checkpointing_and_accumulation(tmp_path, backend_runs):
    result = in_process_run(
        backend_runs,
        tmp_path / "bf16",
        backend="ddp",
        precision="bf16",
        gradient_checkpointing=True,
        grad_accum=2,
        batch_size=4,
    )
    assert result["steps"] == 3 and result["train_loss"] == pytest.approx(0.69, abs=0.1)
    meta = json.loads((tmp_path / "bf16" / "model" / "config.json").read_text())
    assert meta["architectures"] == ["BertForSequenceClassification"]


# One rank of the several-forwards case, in a fresh interpreter (argv: rank, store, out folder): a child forked from
# a pytest worker of the full suite hung in it (twice, at 120 s), so the ranks are started anew.
RANK_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from tuneforge.backends.ddp import DDPBackend
from tuneforge.configure import build_config


class PositionTable(torch.nn.Module):
    # token plus position embeddings, the positions a slice of a buffer saved for backward (BERT's in transformers
    # 5.17); rank_mark is read by nothing: it shows whether DDP broadcast the buffers
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tokens, self.positions = torch.nn.Embedding(10, 4), torch.nn.Embedding(8, 4)
        self.register_buffer("position_ids", torch.arange(8).unsqueeze(0), persistent=False)
        self.register_buffer("rank_mark", torch.zeros(1))

    def forward(self, ids):
        return (self.tokens(ids) + self.positions(self.position_ids[:, : ids.shape[1]])).pow(2).sum()


RANK_IDS = [[torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5]])], [torch.tensor([[6, 7, 8, 9]]), torch.tensor([[2]])]]
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if rank < 0:  # one process on every rank's rows
    one = PositionTable()
    sum(one(ids) for part in RANK_IDS for ids in part).backward()
    torch.save({"grads": {n: p.grad for n, p in one.named_parameters()}}, out + "/one.pt")
    sys.exit(0)
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
model, _ = DDPBackend(build_config({"backend": "ddp", "precision": "fp32"}), None).wrap(PositionTable())
model.module.rank_mark.fill_(rank)
sum(model(ids) for ids in RANK_IDS[rank]).backward()  # two forwards, one backward: split_by_length's step
dist.destroy_process_group()
grads = {n: p.grad for n, p in model.module.named_parameters()}
torch.save({"grads": grads, "mark": model.module.rank_mark.item()}, out + f"/rank{rank}.pt")
"""


def test_a_step_of_several_forwards_trains_a_model_that_reads_a_buffer_slice(tmp_path):
    """DDP's broadcast of the buffers before each forward (off: `forward_sync_buffers=False` on torch 2.13, which
    warns of `broadcast_buffers`) rewrote the position ids in place between the forwards,
    and with torch 2.11 (a GPU machine's image) backward failed ("modified by an inplace operation"; torch 2.13
    keeps the buffers' version counters, so here the broadcast itself is what is seen: rank 1's own mark must
    survive). Both ranks' gradients are one process's on all the rows, halved."""
    import subprocess
    import sys

    store = tmp_path / "store"
    procs = [
        subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(store), str(tmp_path)], stderr=subprocess.PIPE)
        for r in (0, 1, -1)
    ]
    try:
        errors = [proc.communicate(timeout=180)[1].decode(errors="replace") for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0, 0], "\n".join(errors)[-3000:]
    assert not any("broadcast_buffers" in e for e in errors)  # torch 2.13's deprecation warning, on every run
    saved = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [s["mark"] for s in saved] == [0, 1]
    one = torch.load(tmp_path / "one.pt")["grads"]
    for name, grad in one.items():
        assert torch.allclose(saved[0]["grads"][name], grad / 2) and torch.allclose(saved[1]["grads"][name], grad / 2)
