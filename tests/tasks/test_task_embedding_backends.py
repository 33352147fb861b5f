"""Sentence embeddings (`--task embedding`) on the backends that train a classifier: LoRA on a bare encoder (no head,
so only the adapters train; the merged weights embed as the adapter folder does, in SentenceTransformer too), and
fsdp and DeepSpeed on a 2-process gloo group logging the losses of one process at the same global batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_task_embedding import rows, write_jsonl

from conftest import max_weight_diff, run_cli, train_losses


def embedding_args(tiny_bert: str, cache_dir: str, train: Path, out: Path, *extra: str) -> list[str]:
    """A 4-step fp32 embedding run on `train` (every weight trainable), the loss logged every step."""
    args = ["train", "--task", "embedding", "--model", tiny_bert, "--train-file", str(train)]
    args += ["--validation-file", str(train), "--max-steps", "4", "--precision", "fp32", "--logging-steps", "1"]
    args += ["--lr", "3e-3", "--eval-strategy", "no", "--freeze-layers", "0", "--freeze-embeddings", "off"]
    args += ["--cache-dir", cache_dir, "--max-eval-samples", "16", "--output-dir", str(out), "--json", "--quiet"]
    return [*args, *extra]


# ---- LoRA on a bare encoder ---------------------------------------------------------------------------------
def test_lora_trains_an_encoder_and_its_merged_weights_embed_alike(tiny_bert, cache_dir, tmp_path):
    """`--adapter lora` on a sentence encoder (a bare BertModel: no head) trains the adapters alone; OUTPUT_DIR/model
    is the adapter merged into its base, a folder SentenceTransformer loads with tuneforge's embeddings."""
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer

    from tuneforge.tasks.sentence_encoder import SentenceEncoder

    train = write_jsonl(tmp_path / "train.jsonl", rows(32, seed=6))
    args = embedding_args(tiny_bert, cache_dir, train, tmp_path / "lora", "--batch-size", "8", "--adapter", "lora")
    run = run_cli(*args, "--lr", "1e-1")
    assert run.returncode == 0, run.stderr[-4000:]
    losses = train_losses(tmp_path / "lora")
    assert losses[1] - losses[4] > 0.01  # the adapters learn
    folder = tmp_path / "lora" / "model"
    assert not (folder / "adapter_config.json").exists() and (folder / "modules.json").exists()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # the staging folder is gone
    assert max_weight_diff(Path(tiny_bert), folder) > 1e-4  # the adapter moved the weights it sits on
    base, merged = load_file(Path(tiny_bert) / "model.safetensors"), load_file(folder / "model.safetensors")
    moved = {name for name in merged if not torch.equal(merged[name], base[name])}
    assert moved and all(".query." in n or ".value." in n for n in moved)  # peft's BERT targets alone, no head
    texts = [r["anchor"] for r in rows(5, seed=9)] + ["a much longer text about a fox that sits by the river " * 3]
    ours = SentenceEncoder(folder, device="cpu").encode(texts)
    theirs = SentenceTransformer(str(folder), device="cpu").encode(texts)  # its own modules normalise
    assert np.abs(ours - theirs).max() < 1e-5
    untrained = SentenceEncoder(tiny_bert, device="cpu").encode(texts)
    assert np.abs(ours - untrained).max() > 1e-4


# ---- fsdp and DeepSpeed: 2 ranks at batch B log the losses of 1 process at batch 2B ------------------------------
@pytest.fixture(scope="module")
def single_run(tmp_path_factory, tiny_bert, cache_dir) -> tuple[Path, Path]:
    """(training file, the one-process run at --batch-size 8)."""
    root = tmp_path_factory.mktemp("embedding-backends")
    train = write_jsonl(root / "train.jsonl", rows(40, seed=6))
    from tuneforge import cli

    assert cli.main(embedding_args(tiny_bert, cache_dir, train, root / "single", "--batch-size", "8")) == 0
    return train, root / "single"


@pytest.mark.parametrize(
    "flags",
    [
        ("--backend", "fsdp"),
        ("--backend", "deepspeed", "--zero-stage", "2"),
        ("--backend", "deepspeed", "--zero-stage", "3"),
        ("--backend", "fsdp", "--grad-cache-chunk", "3"),
    ],
    ids=["fsdp", "zero2", "zero3", "fsdp-grad-cache"],
)
def test_a_sharding_backend_trains_an_encoder_as_one_process(single_run, tiny_bert, cache_dir, tmp_path, flags):
    """In-batch negatives gathered across the 2 ranks: the per-step losses and the exported weights of one process on
    the double batch (within the tolerance the classifier's backend tests use, 1e-4). With GradCache too (each rank's
    batch 3 and 1 rows at a time, the chunks run again in the backward under fsdp's hooks)."""
    train, single = single_run
    out = tmp_path / "two"
    run = run_cli(*embedding_args(tiny_bert, cache_dir, train, out, "--batch-size", "4", "--nproc", "2", *flags))
    assert run.returncode == 0, run.stderr[-4000:]
    whole, split = train_losses(single), train_losses(out)
    assert sorted(whole) == sorted(split) == [1, 2, 3, 4]
    assert max_weight_diff(tiny_bert, single / "model") > 1e-3  # it trains: the comparison means something
    assert max(abs(whole[s] - split[s]) for s in whole) < 1e-4
    assert max_weight_diff(single / "model", out / "model") < 1e-4
    assert (out / "model" / "modules.json").exists()  # the sentence-transformers folder, from sharded weights too


def test_ddp_with_grad_cache_and_accumulation_trains_as_one_process(single_run, tiny_bert, cache_dir, tmp_path):
    """GradCache under ddp with 2 accumulated micro-batches: the first one's chunks run again in the backward under
    no_sync, the last one's synchronise each: the losses and weights of one process at the double micro-batch."""
    train, _ = single_run
    args = lambda out, *extra: embedding_args(tiny_bert, cache_dir, train, out, "--grad-accum", "2", *extra)  # noqa: E731
    one = run_cli(*args(tmp_path / "one", "--batch-size", "4"))
    two = run_cli(
        *args(tmp_path / "two", "--batch-size", "2", "--backend", "ddp", "--nproc", "2", "--grad-cache-chunk", "1")
    )
    assert one.returncode == 0 and two.returncode == 0, (one.stderr + two.stderr)[-4000:]
    whole, split = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert max_weight_diff(Path(tiny_bert), tmp_path / "one" / "model") > 1e-3  # trained: a comparison that counts
    assert max(abs(whole[s] - split[s]) for s in whole) < 1e-4
    assert max_weight_diff(tmp_path / "one" / "model", tmp_path / "two" / "model") < 1e-4
