"""ddp backend: exact evaluation over uneven rank shares, a world of one, bf16 with accumulation.

Parity, resume (under an external torchrun) and export are in test_backend_conformance.py; the
runs compared here are the shared ones of the `backend_runs` fixture (setup "clip").
"""

from __future__ import annotations

import json
import tempfile

import pytest
import torch

from conftest import Forked, last_json, max_weight_diff, run_cli


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


class PositionTable(torch.nn.Module):
    """Token plus position embeddings, the positions a slice of a buffer (saved for backward by the lookup), as
    BERT's embeddings are in transformers 5.17."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens, self.positions = torch.nn.Embedding(10, 4), torch.nn.Embedding(8, 4)
        self.register_buffer("position_ids", torch.arange(8).unsqueeze(0), persistent=False)
        self.register_buffer("rank_mark", torch.zeros(1))  # read by nothing: shows whether DDP broadcast buffers

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.tokens(ids) + self.positions(self.position_ids[:, : ids.shape[1]])).pow(2).sum()


RANK_IDS = [[torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5]])], [torch.tensor([[6, 7, 8, 9]]), torch.tensor([[2]])]]


def two_forwards_one_backward(backend, store: str, out: str, rank: int) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model, _ = backend.wrap(PositionTable())
        model.module.rank_mark.fill_(rank)
        sum(model(ids) for ids in RANK_IDS[rank]).backward()  # two forwards, one backward: split_by_length's step
    finally:
        dist.destroy_process_group()
    grads = {n: p.grad for n, p in model.module.named_parameters()}
    torch.save({"grads": grads, "mark": model.module.rank_mark.item()}, f"{out}/rank{rank}.pt")
    return 0


def test_a_step_of_several_forwards_trains_a_model_that_reads_a_buffer_slice():
    """DDP's broadcast of the buffers before each forward rewrote the position ids in place between the forwards,
    and with torch 2.11 (a GPU machine's image) backward failed ("modified by an inplace operation"; torch 2.13
    keeps the buffers' version counters, so here the broadcast itself is what is seen: rank 1's own mark must
    survive). Both ranks' gradients are one process's on all the rows, halved."""
    from tuneforge.backends.ddp import DDPBackend
    from tuneforge.configure import build_config

    # built here, not in the forked children: an import there can wait forever on a lock a thread held at the fork
    backend = DDPBackend(build_config({"backend": "ddp", "precision": "fp32"}), None)
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryFile() as log:
        store = f"{folder}/store"
        children = [
            Forked(lambda r=r: two_forwards_one_backward(backend, store, folder, r), log.fileno(), log.fileno())
            for r in (0, 1)
        ]
        try:
            codes = [child.wait(timeout=120) for child in children]
        finally:
            for child in children:
                child.kill()
        log.seek(0)
        assert codes == [0, 0], log.read().decode(errors="replace")[-3000:]
        saved = [torch.load(f"{folder}/rank{r}.pt") for r in (0, 1)]
    assert [s["mark"] for s in saved] == [0, 1]
    grads = [s["grads"] for s in saved]
    one = PositionTable()
    sum(one(ids) for rank in RANK_IDS for ids in rank).backward()
    for name, param in one.named_parameters():
        assert torch.allclose(grads[0][name], param.grad / 2) and torch.allclose(grads[1][name], param.grad / 2)
