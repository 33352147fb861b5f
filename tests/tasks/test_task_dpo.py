"""DPO (`--task dpo`) and QLoRA (`--quantize 4bit`): hh-rlhf dialogues split at their last shared assistant turn,
TRL's tokens, the loss against the DPO formula worked by hand, the reference as the model with its adapters off
(no copy), per-pair normalisation under accumulation and ddp, exact resume with a frozen reference, a 4-bit base
that trains, exports and merges, and every bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import caches_built, quiet_task, read_jsonl, run_cli, train_losses
from test_bad_input import assert_refused, in_process

SUBJECTS = ["the cat", "a dog", "my bird", "the fox"]
GOOD = ["on the mat", "in the house", "by the tree"]
BAD = ["blue sky", "no idea", "whatever"]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a>\n{% endif %}"
)


def pairs(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [
        {
            "prompt": f"where is {rng.choice(SUBJECTS)}? ",
            "chosen": f"it is {rng.choice(GOOD)}",
            "rejected": rng.choice(BAD) * rng.randint(1, 3),  # lengths differ: per-pair, not per-token, weights
        }
        for _ in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("dpo-data")
    return write_jsonl(folder / "train.jsonl", pairs(64, seed=1)), write_jsonl(folder / "valid.jsonl", pairs(12, 2))


def dpo_args(model: str, data: tuple[Path, Path], cache_dir: str, out: Path, *flags: str) -> list[str]:
    train, valid = data
    args = ["train", "--task", "dpo", "--model", model, "--train-file", str(train), "--validation-file", str(valid)]
    args += ["--block-size", "64", "--cache-dir", cache_dir, "--output-dir", str(out), "--lr", "5e-3"]
    return [*args, "--precision", "fp32", "--logging-steps", "1", "--no-group-by-length", "--quiet", *flags]


def dpo_run(*args: str) -> Path:
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Path(args[args.index("--output-dir") + 1])


# ---- pairs -----------------------------------------------------------------------------------------
def test_hh_rlhf_dialogues_split_after_their_last_shared_assistant_turn():
    from tuneforge.data.preference import to_pair

    shared = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: where is the cat?\n\nAssistant:"
    # both replies start with " I": the split is still at the turn, so each completion is a whole reply
    pair = to_pair({"chosen": shared + " I think on the mat", "rejected": shared + " I know nothing"}, "row 1")
    assert pair == {"prompt": shared, "chosen": " I think on the mat", "rejected": " I know nothing"}
    user = {"role": "user", "content": "where?"}
    pair = to_pair(
        {
            "chosen": [user, {"role": "assistant", "content": "here"}],
            "rejected": [user, {"role": "assistant", "content": "no"}],
        },
        "row 1",
    )
    assert pair["prompt"] == [user] and pair["chosen"] == [{"role": "assistant", "content": "here"}]
    # a plain-text completion of a conversational prompt is one assistant message
    assert to_pair({"prompt": [user], "chosen": "here", "rejected": "no"}, "row 1")["rejected"] == [
        {"role": "assistant", "content": "no"}
    ]


def test_a_null_prompt_is_no_prompt_so_hh_rlhf_rows_mix_with_prompted_ones():
    """A dataset of hh-rlhf rows and prompt/chosen/rejected rows (concatenated, or read from a jsonl holding both)
    gives the hh-rlhf rows `prompt: None`: they split as rows without the field do."""
    from datasets import Dataset

    from tuneforge.data.preference import given_splits, to_pair

    shared = "\n\nHuman: where is the cat?\n\nAssistant:"
    hh = {"chosen": shared + " on the mat", "rejected": shared + " no idea"}
    assert to_pair({"prompt": None, **hh}, "row 1") == to_pair(hh, "row 1")
    mixed = Dataset.from_list([{"prompt": "where? ", "chosen": "here", "rejected": "there"}, hh])
    raw = given_splits({"train": mixed}, drop_identical=False)["train"]
    assert json.loads(raw["prompt"][1]) == shared and json.loads(raw["chosen"][1]) == " on the mat"


def test_the_shared_hh_rlhf_files_read(shared_data):
    from tuneforge.data.preference import ASSISTANT_TURN, read_pairs
    from tuneforge.errors import DataError

    harmless = read_pairs(shared_data / "hh-rlhf" / "harmless-base" / "test.jsonl.gz")
    assert len(harmless) == 2312 and all(p["prompt"].endswith(ASSISTANT_TURN) for p in harmless)
    assert all(p["chosen"] != p["rejected"] for p in harmless)
    helpful = shared_data / "hh-rlhf" / "helpful-base" / "test.jsonl.gz"
    with pytest.raises(DataError, match=r"row 722 of .* identical.*\(2 such row.*--drop-identical-pairs"):
        read_pairs(helpful)
    said = []
    assert len(read_pairs(helpful, drop_identical=True, log=said.append)) == 2352 and "2 pair(s)" in said[0]


def test_pairs_are_tokenized_as_trl_does_with_the_loss_on_completions_only(tiny_llama, cache_dir, tmp_path):
    from tuneforge.data.preference import encode_pair

    task = quiet_task("dpo", tiny_llama, cache_dir=cache_dir)
    tokenizer = task.load_tokenizer()
    pair = {"prompt": "where is the cat? ", "chosen": "on the mat", "rejected": "no idea at all"}
    prompt, chosen, rejected = encode_pair(tokenizer, pair)
    # TRL: the prompt alone and prompt + completion + eos tokenized whole; the completion starts where they part
    assert prompt + chosen == tokenizer("where is the cat? on the mat" + tokenizer.eos_token)["input_ids"]
    assert chosen[-1] == rejected[-1] == tokenizer.eos_token_id
    rows = {"prompt_ids": [prompt, prompt[:2]], "chosen_ids": [chosen, chosen[:1]], "rejected_ids": [rejected, [5]]}
    batch = task.collate(rows, tokenizer)
    assert batch["input_ids"].shape[0] == 4  # chosen rows first, then rejected
    labels, ids = batch["labels"], batch["input_ids"]
    assert ids[0, : len(prompt) + len(chosen)].tolist() == prompt + chosen
    assert (labels[0, : len(prompt)] == -100).all() and labels[
        0, len(prompt) : len(prompt) + len(chosen)
    ].tolist() == chosen
    assert labels[2, len(prompt) : len(prompt) + len(rejected)].tolist() == rejected
    assert (labels[1, 3:] == -100).all() and batch["attention_mask"][1].sum() == 3  # padding: no loss, no attention
    # conversations: the chat template with the generation prompt, the completion after it
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    tokenizer.chat_template = TEMPLATE
    user = [{"role": "user", "content": "where?"}]
    prompt, chosen, _ = encode_pair(
        tokenizer,
        {
            "prompt": user,
            "chosen": [{"role": "assistant", "content": "here"}],
            "rejected": [{"role": "assistant", "content": "no"}],
        },
    )
    assert tokenizer.decode(prompt) == "u>\nwhere?\na>\n" and tokenizer.decode(chosen) == "here\n"


def completion_logps(model, batch) -> torch.Tensor:
    """Per row, the completion's log-probability summed token by token (the plain definition)."""
    with torch.no_grad():
        logprobs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.log_softmax(-1)
    out = []
    for r in range(batch["input_ids"].shape[0]):
        total = 0.0
        for t in range(1, batch["input_ids"].shape[1]):
            if batch["labels"][r, t] != -100:
                total += logprobs[r, t - 1, batch["labels"][r, t]].item()
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


@pytest.fixture
def task_and_batch(tiny_llama, data, cache_dir):
    train, _ = data
    task = quiet_task("dpo", tiny_llama, cache_dir=cache_dir, train_file=str(train), validation_file=str(train))
    tokenizer = task.load_tokenizer()
    feats = task.tokenize(task.load_raw(), tokenizer)["train"]
    return task, task.collate(feats[:6], tokenizer)


def test_the_loss_and_rewards_are_the_dpo_formula_against_a_frozen_reference(task_and_batch):
    task, batch = task_and_batch
    model = task.load_model(task.load_tokenizer()).eval()
    original = completion_logps(model, batch)
    task.set_up_reference(model, adapter=None)  # the frozen copy: the model as training finds it
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    moved = completion_logps(model, batch)
    with torch.no_grad():
        outputs = task.forward(model, batch)
        loss_sum, pairs = task.compute_loss(outputs, batch)
    beta, n = task.options.dpo_beta, 6
    margin = beta * ((moved[:n] - original[:n]) - (moved[n:] - original[n:]))
    assert pairs.item() == n
    assert loss_sum.item() == pytest.approx(-F.logsigmoid(margin).sum().item(), abs=1e-5)
    assert (outputs.ref_logps.double() - original).abs().max() < 1e-4
    chosen, rejected = outputs.rewards(beta)
    assert (chosen.double() - beta * (moved[:n] - original[:n])).abs().max() < 1e-5
    assert abs(loss_sum.item() - n * math.log(2)) > 1e-3  # the model moved: the check means something


def test_neither_the_model_nor_its_reference_builds_a_key_value_cache(task_and_batch):
    task, batch = task_and_batch
    model = task.load_model(task.load_tokenizer()).train()
    task.set_up_reference(model, adapter=None)
    policy, reference = caches_built(model), caches_built(task.reference_model)
    task.forward(model, batch)
    assert policy == [False] and reference == [False]


def test_with_lora_the_reference_is_the_model_with_its_adapters_off(task_and_batch, tiny_llama):
    from transformers import AutoModelForCausalLM

    from tuneforge import adapters
    from tuneforge.configure import build_config

    task, batch = task_and_batch
    model = task.load_model(task.load_tokenizer()).eval()
    adapter = adapters.add_lora(model, build_config(adapter="lora", lora_dropout=0.0), tiny_llama, log=lambda m: None)
    task.set_up_reference(model, adapter)
    assert task.reference_model is None  # no second copy of the weights
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn_like(p))  # B starts at zero: now the adapters change the outputs
        outputs = task.forward(model, batch)
    base = completion_logps(AutoModelForCausalLM.from_pretrained(tiny_llama).eval(), batch)
    assert (outputs.ref_logps.double() - base).abs().max() < 1e-4
    assert (outputs.logps.double() - base).abs().max() > 1e-2
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)  # switched back on


# ---- training through the CLI ------------------------------------------------------------------------
def test_the_loss_is_normalised_per_pair_under_accumulation_and_ddp(tiny_llama, data, cache_dir, tmp_path):
    common = ("--max-steps", "4", "--eval-strategy", "no", "--adapter", "lora", "--lora-dropout", "0")
    one = dpo_run(*dpo_args(tiny_llama, data, cache_dir, tmp_path / "one", *common, "--batch-size", "8"))
    acc = dpo_run(
        *dpo_args(tiny_llama, data, cache_dir, tmp_path / "acc", *common, "--batch-size", "4", "--grad-accum", "2")
    )
    ddp = dpo_run(
        *dpo_args(
            tiny_llama,
            data,
            cache_dir,
            tmp_path / "ddp",
            *common,
            "--batch-size",
            "4",
            "--backend",
            "ddp",
            "--nproc",
            "2",
        )
    )
    whole = train_losses(one)
    assert whole[1] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as its reference
    assert whole[1] - whole[4] > 0.02  # it learns: the comparison means something
    for other in (acc, ddp):
        losses = train_losses(other)
        assert max(abs(whole[s] - losses[s]) for s in whole) < 1e-5
        a, b = (
            load_file(one / "model" / "adapter_model.safetensors"),
            load_file(other / "model" / "adapter_model.safetensors"),
        )
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_full_dpo_learns_the_preference_and_resumes_exactly(tiny_llama, data, cache_dir, tmp_path):
    """No adapter: the reference is a frozen copy of the model as loaded, so a resumed run (whose model comes
    from the checkpoint) still compares with the original weights."""
    common = ("--max-steps", "4", "--batch-size", "8", "--eval-strategy", "steps", "--eval-steps", "4")
    full = dpo_run(*dpo_args(tiny_llama, data, cache_dir, tmp_path / "full", *common, "--save-steps", "2"))
    resumed = dpo_run(
        *dpo_args(tiny_llama, data, cache_dir, tmp_path / "resumed", *common, "--resume", str(full / "checkpoint-2"))
    )
    a, b = train_losses(full), train_losses(resumed)
    assert sorted(b) == [3, 4] and all(a[s] == b[s] for s in b)
    wa, wb = load_file(full / "model" / "model.safetensors"), load_file(resumed / "model" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    final = json.loads((full / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["split"] == "eval" and final["num_pairs"] == 12
    assert final["reward_accuracy"] > 0.9 and final["reward_margin"] > 0.1
    assert final["chosen_reward"] - final["rejected_reward"] == pytest.approx(final["reward_margin"], abs=1e-9)
    assert_eval_matches_the_final_evaluation(full, data)


def assert_eval_matches_the_final_evaluation(run: Path, data: tuple[Path, Path]) -> None:
    """`tuneforge eval` of a DPO run's export compares it with the model that run trained from (its reference), as
    the run's own last evaluation did: the same metrics, not rewards of 0 against itself."""
    final = [r for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "eval"][-1]
    proc = run_cli("eval", str(run / "model"), "--validation-file", str(data[1]), "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = json.loads(proc.stdout.splitlines()[-1])
    for name in ("loss", "reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward"):
        assert again[name] == pytest.approx(final[name], abs=1e-5), name


def test_eval_of_a_lora_export_compares_it_with_its_base(tiny_llama, data, cache_dir, tmp_path):
    flags = ("--max-steps", "3", "--batch-size", "16", "--adapter", "lora", "--lr", "2e-2")
    run = dpo_run(*dpo_args(tiny_llama, data, cache_dir, tmp_path / "lora", *flags))
    assert [r for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "eval"][-1]["reward_margin"] > 0.01
    assert_eval_matches_the_final_evaluation(run, data)


def test_qlora_trains_on_a_4bit_base_resumes_exactly_and_merges(tiny_llama, data, cache_dir, tmp_path):
    common = ("--max-steps", "4", "--batch-size", "8", "--eval-strategy", "no", "--adapter", "lora")
    args = dpo_args(tiny_llama, data, cache_dir, tmp_path / "q", *common, "--quantize", "4bit", "--save-steps", "2")
    proc = run_cli(*[a for a in args if a != "--quiet"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "on the 4-bit NF4 base (QLoRA)" in proc.stdout + proc.stderr
    run = tmp_path / "q"
    losses = train_losses(run)
    assert losses[1] - losses[4] > 0.02
    resumed = dpo_run(
        *dpo_args(
            tiny_llama,
            data,
            cache_dir,
            tmp_path / "r",
            *common,
            "--quantize",
            "4bit",
            "--resume",
            str(run / "checkpoint-2"),
        )
    )
    again = train_losses(resumed)
    assert all(again[s] == losses[s] for s in again)
    assert "quantization_config" not in json.loads((run / "model" / "config.json").read_text())
    merged = run_cli("export", "--merge", str(run / "model"), str(tmp_path / "merged"))  # into the full-precision base
    assert merged.returncode == 0, merged.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32


# ---- bad input: one line, exit 2, nothing written ------------------------------------------------------
USER, REPLY = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}


def bad_args(tmp_path: Path, model: str, train: Path, *extra: str) -> list[str]:
    return dpo_args(model, (train, train), str(tmp_path / "cache"), tmp_path / "out", "--max-steps", "1", *extra)


@pytest.mark.parametrize(
    "row, needles",
    [
        ({"prompt": "hi", "chosen": "yes"}, ("row 3 of", "has no `rejected`", "`chosen` and `rejected`")),
        ({"prompt": "hi", "rejected": "no"}, ("row 3 of", "has no `chosen`")),
        ({"prompt": "hi", "chosen": "same", "rejected": "same"}, ("row 3 of", "identical", "--drop-identical-pairs")),
        ({"chosen": "Human: a", "rejected": "Human: b"}, ("row 3 of", "share no dialogue", "give `prompt`")),
        (  # a completion is the reply to the prompt: the template's generation prompt comes before it
            {"prompt": [USER], "chosen": [{"role": "user", "content": "yes"}], "rejected": [REPLY]},
            ("row 3 of", "`chosen` starts with a user message", "the assistant's reply"),
        ),
        (  # dialogues that part at a user turn: no shared prompt that both replies answer
            {"chosen": [USER, REPLY, {"role": "user", "content": "a"}], "rejected": [USER, REPLY, REPLY]},
            ("row 3 of", "`chosen` starts with a user message", "give `prompt`"),
        ),
    ],
)
def test_bad_pairs_are_refused(capfd, tmp_path, tiny_llama, row, needles):
    train = write_jsonl(tmp_path / "train.jsonl", [*pairs(2), row])
    assert_refused(in_process(capfd, *bad_args(tmp_path, tiny_llama, train)), tmp_path, *needles)


def test_prompts_longer_than_the_block_are_dropped_and_counted(tiny_llama, cache_dir, tmp_path):
    long = {"prompt": "where is the cat " * 40, "chosen": "here", "rejected": "there"}
    long_answer = {"prompt": "where? ", "chosen": "here " * 40, "rejected": "there"}
    train = write_jsonl(tmp_path / "train.jsonl", [*pairs(3), long, long_answer])
    task = quiet_task(
        "dpo", tiny_llama, cache_dir=cache_dir, train_file=str(train), validation_file=str(train), block_size=32
    )
    said = []
    feats = task.tokenize(task.load_raw(), task.load_tokenizer(), log=said.append)["train"]
    assert len(feats) == 4 and max(feats["length"]) <= 32
    assert (
        "train: 1 of 5 pairs dropped (their prompt alone holds block_size 32 tokens or more), 1 of 5 pairs longer than "
        "block_size 32 tokens cut to their first 32 (their completions truncated) (raise --block-size to keep them "
        "whole)"
    ) in said


def test_quantize_needs_an_adapter_and_a_backend_that_holds_whole_models(capfd, tmp_path, tiny_llama):
    train = write_jsonl(tmp_path / "train.jsonl", pairs(4))
    proc = in_process(capfd, *bad_args(tmp_path, tiny_llama, train, "--quantize", "4bit"))
    assert_refused(proc, tmp_path, "--quantize 4bit", "add --adapter lora")
    proc = in_process(
        capfd, *bad_args(tmp_path, tiny_llama, train, "--quantize", "4bit", "--adapter", "lora", "--backend", "fsdp")
    )
    assert_refused(proc, tmp_path, "'fsdp'", "--backend ddp")


def test_quantize_where_bitsandbytes_cannot_run_is_one_line(tmp_path, tiny_llama):
    """A bitsandbytes that fails to import (as on a machine it does not support) is shadowed in for the run."""
    shadow = tmp_path / "shadow" / "bitsandbytes"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no native library for this machine')\n")
    train = write_jsonl(tmp_path / "train.jsonl", pairs(4))
    proc = run_cli(
        *bad_args(tmp_path, tiny_llama, train, "--quantize", "4bit", "--adapter", "lora"),
        env={"PYTHONPATH": str(shadow.parent)},
    )
    assert_refused(
        proc, tmp_path, "--quantize 4bit needs bitsandbytes", "cannot run here (no native library", "drop --quantize"
    )


def test_a_chat_template_whose_code_fails_on_a_pair_names_the_row(tiny_llama, cache_dir, tmp_path):
    from tuneforge.errors import ConfigError

    template = tmp_path / "fails.jinja"  # TEMPLATE, failing (in Python, not by Jinja's raise) on one message
    template.write_text("{% for m in messages if m['content'] == 'boom' %}{{ 1 / 0 }}{% endfor %}" + TEMPLATE)
    good = {"prompt": [USER], "chosen": [REPLY], "rejected": [{"role": "assistant", "content": "yes"}]}
    train = write_jsonl(
        tmp_path / "train.jsonl", [good, good, {**good, "prompt": [{"role": "user", "content": "boom"}]}]
    )
    task = quiet_task(
        "dpo",
        tiny_llama,
        cache_dir=cache_dir,
        train_file=str(train),
        validation_file=str(train),
        chat_template=str(template),
    )
    with pytest.raises(ConfigError, match="fails.jinja' fails on row 3 of .*train.jsonl': division by zero"):
        task.tokenize(task.load_raw(), task.load_tokenizer(), log=lambda _: None)


@pytest.fixture
def bert_lm(tmp_path, minilm_dir) -> str:
    """A tiny random BERT with its masked-LM head (the head a causal LM of the BERT family loads)."""
    from transformers import BertForMaskedLM

    from conftest import save_tiny_bert

    torch.manual_seed(0)
    return save_tiny_bert(tmp_path / "bert-lm", minilm_dir, BertForMaskedLM, dropout=0.0)


@pytest.mark.parametrize("base", ["bert_lm", "tiny_llama"])
def test_the_recorded_reference_of_an_untrained_export_scores_as_the_export(base, request, data, cache_dir, tmp_path):
    """An export evaluated outside training is compared with the recorded reference, loaded as training loaded its
    base: an encoder's causal LM attends one way (is_decoder), so an export equal to its base has rewards of 0 and
    a loss of log 2 a pair. The reference of a BERT base was loaded with its own config, attending both ways."""
    base = request.getfixturevalue(base)
    train, _ = data
    task = quiet_task("dpo", base, cache_dir=cache_dir, validation_file=str(train))
    tokenizer = task.load_tokenizer()
    export = tmp_path / "export"
    task.load_model(tokenizer).save_pretrained(export)
    tokenizer.save_pretrained(export)
    (export / "tuneforge.json").write_text(json.dumps({**task.export_info(), "reference_model": base}))
    evaluated = quiet_task("dpo", str(export), cache_dir=cache_dir, validation_file=str(train))
    batch = evaluated.collate(evaluated.tokenize(evaluated.load_raw(), tokenizer)["validation"][:6], tokenizer)
    model = evaluated.load_model(tokenizer).eval()
    with torch.no_grad():
        outputs = evaluated.forward(model, batch)
        loss_sum, pairs = evaluated.compute_loss(outputs, batch)
    assert (outputs.logps - outputs.ref_logps).abs().max() < 1e-5
    assert loss_sum.item() == pytest.approx(pairs.item() * math.log(2), abs=1e-5)
