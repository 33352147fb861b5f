"""Gradient accumulation equals the large batch, with the default length-grouped order: for classification, and
for the tasks whose loss is over tokens, normalised by the step's target tokens (not a mean of micro-batch means)."""

import pytest

from conftest import (
    cli_flags,
    max_weight_diff,
    read_jsonl,
    run_cli,
    train_command,
    train_losses,
    write_conll_dir,
    write_parallel,
    write_sentiment_csv,
)


def _losses(tmp_path, tiny_bert, cache_dir, name, **batch):
    train = write_sentiment_csv(tmp_path / "train.csv", 80, seed=3)
    val = write_sentiment_csv(tmp_path / "val.csv", 8, seed=4)
    out = tmp_path / name
    run = cli_flags(max_steps=6, logging_steps=1, precision="fp32", lr="1e-2", eval_strategy="no", **batch)
    args = train_command((train, val), tiny_bert, output_dir=out, cache_dir=cache_dir, quiet=True)
    proc = run_cli(*args, *run)  # forked: one thread, as conftest sets OMP_NUM_THREADS
    assert proc.returncode == 0, proc.stderr
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]


def test_accumulation_equals_large_batch(tmp_path, tiny_bert, cache_dir):
    large = _losses(tmp_path, tiny_bert, cache_dir, "large", batch_size=16)
    accumulated = _losses(tmp_path, tiny_bert, cache_dir, "accum", batch_size=4, grad_accum=4)
    assert len(large) == len(accumulated) == 6
    assert max(abs(a - b) for a, b in zip(large, accumulated)) < 1e-5, (large, accumulated)
    assert len(set(round(x, 6) for x in large)) > 1  # the loss really moves: the check can fail


def _token_task_flags(task: str, folder, models: dict) -> dict:
    """The data and model flags of a tiny run of `task`, whose rows hold different numbers of target tokens."""
    if task == "ner":
        return dict(task="ner", model=models["bert"], data_dir=write_conll_dir(folder / "conll"))
    (train_en, train_de), (val_en, val_de) = write_parallel(folder, "train", 40, 1), write_parallel(folder, "val", 5, 2)
    if task == "seq2seq":
        files = dict(source_file=train_en, target_file=train_de)
        files.update(validation_source_file=val_en, validation_target_file=val_de)
        return dict(task="seq2seq", model=models["t5"], generation_max_length=4, **files)
    return dict(task="clm", model=models["gpt2"], train_file=train_en, validation_file=val_en, no_packing=True)


@pytest.mark.parametrize("task", ["ner", "seq2seq", "clm"])
def test_token_losses_accumulated_equal_the_large_batch(task, tmp_path, tiny_bert, tiny_t5, tiny_gpt2, cache_dir):
    """21 rows: the accumulated run's last step is a micro-batch of 4 rows and one of 1, whose tokens a mean of the
    micro-batches' means would weigh as much as the 4 rows' together."""
    models = dict(bert=tiny_bert, t5=tiny_t5, gpt2=tiny_gpt2)
    flags = _token_task_flags(task, tmp_path, models)
    common = dict(epochs=1, max_train_samples=21, lr="3e-3", precision="fp32", logging_steps=1, quiet=True)
    for name, batch in (("large", dict(batch_size=8)), ("accum", dict(batch_size=4, grad_accum=2))):
        args = cli_flags(output_dir=tmp_path / name, cache_dir=cache_dir, eval_strategy="no", **common, **flags)
        proc = run_cli("train", *args, *cli_flags(**batch))
        assert proc.returncode == 0, proc.stderr[-3000:]
    large, accumulated = train_losses(tmp_path / "large"), train_losses(tmp_path / "accum")
    assert large.keys() == accumulated.keys() == {1, 2, 3}
    assert max(abs(large[s] - accumulated[s]) for s in large) < 1e-5, (large, accumulated)
    assert large[1] != large[3]  # the loss moves: the check can fail
    assert max_weight_diff(tmp_path / "large" / "model", tmp_path / "accum" / "model") < 1e-5


def test_a_micro_batchs_outputs_are_let_go_after_its_backward(tmp_path, tiny_bert, cache_dir):
    """Each micro-batch's outputs (its logits, and a causal LM's key/value cache) stayed alive through the next
    micro-batch's forward and backward and through the optimizer step: the largest tensor of a step held twice."""
    import weakref

    from conftest import tiny_run_config
    from tuneforge.trainer import Trainer

    alive = []  # (when, whether the last micro-batch's logits were still held)

    class Probe(Trainer):
        last = None

        def forward_step(self, model, batch):
            if self.model.training and self.last is not None:
                alive.append(("forward", self.last() is not None))
            outputs = super().forward_step(model, batch)
            self.last = weakref.ref(outputs.logits)
            return outputs

    class AtOptimizerStep:
        def on_train_begin(self, trainer):
            trainer.optimizer.register_step_pre_hook(lambda *_: alive.append(("step", trainer.last() is not None)))

    values = dict(max_steps=2, grad_accum=2, batch_size=8, eval_strategy="no")
    Probe(tiny_run_config(tmp_path, tiny_bert, cache_dir, **values), callbacks=[AtOptimizerStep()]).fit()
    assert [when for when, _ in alive] == ["forward", "step", "forward", "forward", "step"]
    assert not any(held for _, held in alive), alive
