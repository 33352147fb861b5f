"""LoRA adapters (tuneforge/adapters.py): a run with --adapter lora trains the adapters and the task's head,
its checkpoints hold only those and resume bit for bit, OUTPUT_DIR/model is an adapter folder that peft
loads and that merges into a standalone model with the same outputs, every backend but tp trains it as
one process does, and predict / generate / serve take the adapter folder as they take a model folder."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    PARITY_STEPS,
    backend_train_args,
    made_once,
    run_cli,
    save_tiny_bert,
    sentiment_split,
    serving,
    train_losses,
    write_sentiment_csv,
)
from test_bad_input import assert_refused, in_process, train_args

LORA = ("--adapter", "lora", "--lora-r", "4", "--lora-alpha", "8")


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory, minilm_dir) -> str:
    """A tiny random BERT (initializer range 0.3: its features differ between texts, so a LoRA run on its
    frozen weights learns enough to compare runs step by step)."""

    def make(folder: Path) -> None:
        torch.manual_seed(0)
        save_tiny_bert(folder, minilm_dir, dropout=0.0, initializer_range=0.3)

    return str(made_once(tmp_path_factory, "lora-base", make))


@pytest.fixture(scope="module")
def parity_data(tmp_path_factory) -> tuple[Path, Path]:
    folder = made_once(tmp_path_factory, "lora-data", lambda folder: sentiment_split(folder, 96, 33))
    return folder / "train.csv", folder / "validation.csv"


def lora_run(lora_base, data, cache_dir, out: Path, *flags: str) -> Path:
    """A PARITY_STEPS-step LoRA classification run (loss logged every step, fp32), asserted to succeed."""
    args = backend_train_args(lora_base, data, cache_dir, out, *LORA, "--no-group-by-length", *flags, lr="2e-2")
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory, lora_base, parity_data, cache_dir) -> Path:
    flags = ("--batch-size", "16", "--lora-dropout", "0.1", "--save-steps", "10")
    made = made_once(
        tmp_path_factory, "lora-single", lambda f: lora_run(lora_base, parity_data, cache_dir, f / "run", *flags)
    )
    return made / "run"


def adapter_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "model" / "adapter_model.safetensors")


# ---- one process: what trains, what is saved, what is exported ---------------------------------
def test_only_the_adapters_and_the_head_train_and_are_checkpointed(single, lora_base):
    saved = load_file(single / "checkpoint-10" / "trainable.safetensors")
    assert not (single / "checkpoint-10" / "model.safetensors").exists()
    assert saved and all(".lora_A." in k or ".lora_B." in k or ".modules_to_save." in k for k in saved), list(saved)
    assert any("classifier.modules_to_save" in k for k in saved)  # the head trains whole
    assert {k.split(".")[-4] for k in saved if ".lora_" in k} == {"query", "value"}  # peft's choice for BERT
    base = load_file(Path(lora_base) / "model.safetensors")
    assert sum(v.numel() for v in saved.values()) < 0.05 * sum(v.numel() for v in base.values())
    meta = json.loads((single / "checkpoint-10" / "meta.json").read_text())
    assert meta["adapter"]["r"] == 4 and meta["adapter"]["targets"] == ["query", "value"]
    # the weights moved: B starts at zero
    b = [v for k, v in adapter_weights(single).items() if "lora_B" in k]
    assert b and all(v.abs().max() > 1e-4 for v in b)


def test_resume_of_a_lora_run_is_bitwise(single, lora_base, parity_data, cache_dir, tmp_path):
    """fp32 with LoRA dropout on: the RNG states and the adapters' optimizer state come back exactly."""
    out = lora_run(
        lora_base,
        parity_data,
        cache_dir,
        tmp_path / "resumed",
        "--batch-size",
        "16",
        "--lora-dropout",
        "0.1",
        "--resume",
        str(single / "checkpoint-10"),
    )
    whole, resumed = train_losses(single), train_losses(out)
    assert sorted(resumed) == list(range(11, PARITY_STEPS + 1))
    assert all(resumed[s] == whole[s] for s in resumed)
    a, b = adapter_weights(single), adapter_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_adapter_folder_loads_in_peft_and_merges_to_the_same_outputs(single, lora_base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = single / "model"
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json", "tuneforge.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
    batch = AutoTokenizer.from_pretrained(folder)(
        ["a wonderful film", "a dull mess"], return_tensors="pt", padding=True
    )
    base = AutoModelForSequenceClassification.from_pretrained(lora_base, num_labels=2)
    with_adapter = PeftModel.from_pretrained(base, folder).eval()

    proc = run_cli("export", "--merge", str(folder), str(tmp_path / "merged"))
    assert proc.returncode == 0, proc.stderr
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        want, got = with_adapter(**batch).logits, merged(**batch).logits
    assert (want - got).abs().max() < 1e-5  # merging adds B @ A into the base weight: fp32 rounding only
    assert (want[0] - want[1]).abs().max() > 1e-3  # the outputs depend on the text: the comparison means something


def test_a_merge_without_room_is_one_line_and_leaves_nothing(single, tmp_path):
    """export --merge onto a disk without room (here a file size limit) ended in 'internal error' (safetensors'
    SafetensorError is no OSError): one line naming the folder, and no partial folder left."""
    from conftest import cli_without_room

    out = tmp_path / "merged"
    line = cli_without_room(["export", "--merge", str(single / "model"), str(out)], 1 << 16)
    assert line == f"error: the model folder {str(out)!r} has no room (File too large); free space there", line
    assert list(tmp_path.iterdir()) == []


def test_predict_and_serve_take_the_adapter_folder(single, tmp_path):
    import httpx

    texts = write_sentiment_csv(tmp_path / "in.csv", 6, seed=5)
    assert run_cli("export", "--merge", str(single / "model"), str(tmp_path / "merged")).returncode == 0
    for name, model in (("adapter", single / "model"), ("merged", tmp_path / "merged")):
        proc = run_cli("predict", str(model), "--input", str(texts), "--output", str(tmp_path / f"{name}.jsonl"))
        assert proc.returncode == 0, proc.stderr
    rows = [[json.loads(x) for x in (tmp_path / f"{n}.jsonl").read_text().splitlines()] for n in ("adapter", "merged")]
    assert len(rows[0]) == 6
    for a, m in zip(*rows):
        assert a["label"] == m["label"] and abs(a["score"] - m["score"]) < 1e-5
    with serving(str(single / "model")) as url:
        answer = httpx.post(f"{url}/predict", json={"texts": ["a wonderful film"]}, timeout=60).json()
    assert answer["predictions"][0]["label"] in ("pos", "neg")


def test_qlora_keeps_a_head_that_ends_in_a_bias_in_full_precision_and_trains_it(tiny_bert, tmp_path, cache_dir):
    """transformers keeps the module of a model's last *parameter* out of 4-bit: BERT's classifier ends in a bias,
    so its head was quantized and the run failed at its first step (an AssertionError deep in bitsandbytes). The
    head trains whole, so it stays in full precision; the run trains, and its adapter folder predicts."""
    from tuneforge.configure import build_config
    from tuneforge.tasks import get_task

    pytest.importorskip("bitsandbytes")
    train, val = sentiment_split(tmp_path, 32, 8)
    out = tmp_path / "q"
    flags = [
        "--adapter",
        "lora",
        "--quantize",
        "4bit",
        "--max-steps",
        "2",
        "--batch-size",
        "8",
        "--eval-strategy",
        "no",
    ]
    files = ["--train-file", str(train), "--validation-file", str(val), "--model", tiny_bert]
    proc = run_cli("train", *files, *flags, "--output-dir", str(out), "--cache-dir", cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    texts = write_sentiment_csv(tmp_path / "in.csv", 4, seed=5)
    proc = run_cli("predict", str(out / "model"), "--input", str(texts), "--output", str(tmp_path / "p.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 4
    kept = {}  # the heads of other tasks that end in a bias too
    for task, name in (("classification", "classifier"), ("ner", "classifier"), ("qa", "qa_outputs")):
        config = build_config({"task": task, "model": tiny_bert, "adapter": "lora", "quantize": "4bit"})
        kept[task] = get_task(config).unquantized_modules()
        assert name in kept[task], (task, kept[task])


def test_a_minilm_classifier_learns_with_lora(minilm_dir, tmp_path, cache_dir):
    """The bundled MiniLM with adapters on query/value and a trained head: the run log says how much trains."""
    train, val = sentiment_split(tmp_path, 96, 32)
    files = ["--train-file", str(train), "--validation-file", str(val), "--model", minilm_dir, "--cache-dir", cache_dir]
    run = ["--output-dir", str(tmp_path / "out"), "--adapter", "lora", "--lr", "2e-3", "--epochs", "3", "--json"]
    proc = run_cli("train", *files, *run, "--precision", "fp32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["accuracy"] >= 0.9
    log = proc.stdout + proc.stderr
    assert "training 0.15M of 22.9M parameters (0.65%): LoRA r=16 alpha=32 on query, value" in log
    assert "the head (classifier) trains whole" in log


def test_a_causal_lm_gets_lora_on_gpt2_conv1d_and_generates(tiny_gpt2, tmp_path, cache_dir):
    """GPT-2's fused c_attn (a Conv1D) takes adapters; its tied output layer stays fixed; generate reads the folder."""
    text = tmp_path / "train.txt"
    text.write_text("\n".join(f"the cat sat on the mat number {i} and looked around" for i in range(60)))
    out = tmp_path / "clm"
    flags = ["--train-file", str(text), "--model", tiny_gpt2, "--output-dir", str(out), "--cache-dir", cache_dir]
    proc = run_cli("train", *flags, *LORA, "--max-steps", "4", "--block-size", "32", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = adapter_weights(out)
    assert weights and all("c_attn.lora_" in k for k in weights), list(weights)
    proc = run_cli("generate", str(out / "model"), "--prompt", "the cat", "--max-new-tokens", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()


def test_lora_on_gpt2_conv1d_is_set_up_transposed_without_a_peft_warning(tiny_gpt2):
    """GPT-2's Conv1D layers hold their weights transposed: LoraConfig's fan_in_fan_out, as peft asks for GPT-2. Left
    False, peft set it itself with a UserWarning on stderr, --quiet or not."""
    import warnings

    from transformers import AutoModelForCausalLM

    from tuneforge.adapters import add_lora
    from tuneforge.configure import build_config

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    config = build_config(task="clm", model=tiny_gpt2, adapter="lora")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapter = add_lora(model, config, tiny_gpt2, log=lambda line: None)
    assert adapter.peft_model.peft_config["default"].fan_in_fan_out is True


def test_a_t5_question_answering_head_trains_whole_and_is_saved(tiny_t5, tmp_path):
    """T5's QA model holds its encoder and decoder itself (no `transformer` child, so its base_model is the model):
    its qa_outputs, new and random, was left frozen and out of the adapter folder, a fresh random head at each
    load. It trains whole and is saved, as peft's QUESTION_ANS task type saves qa_outputs."""
    from transformers import AutoModelForQuestionAnswering

    from tuneforge.adapters import add_lora
    from tuneforge.configure import build_config

    model = AutoModelForQuestionAnswering.from_pretrained(tiny_t5)
    config = build_config(task="qa", model=tiny_t5, adapter="lora")
    adapter = add_lora(model, config, tiny_t5, log=lambda line: None)
    head = [p for name, p in model.named_parameters() if "qa_outputs" in name and "original_module" not in name]
    assert head and all(p.requires_grad for p in head)
    adapter.peft_model.save_pretrained(tmp_path)
    assert any("qa_outputs" in key for key in load_file(tmp_path / "adapter_model.safetensors"))


def test_an_adapter_on_embeddings_grown_for_the_tokenizer_merges_into_its_base(tiny_gpt2, tmp_path):
    """A tokenizer with tokens past the model's embeddings: training grows them (resize_token_embeddings) and peft
    saves the grown layers with the adapter. Loading merged the adapter into the base at its config.json's size, so
    predict, generate, serve and export --merge refused the base it was trained on ("its weights' shapes differ").
    The base is grown first, as peft's docs do before PeftModel.from_pretrained."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tuneforge.adapters import add_lora, load_merged, write_adapter_folder
    from tuneforge.configure import build_config

    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|bot|>"]})
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    model.resize_token_embeddings(len(tokenizer))
    config = build_config(task="clm", model=tiny_gpt2, adapter="lora")
    adapter = add_lora(model, config, tiny_gpt2, log=lambda line: None)
    torch.manual_seed(0)
    with torch.no_grad():  # as if trained: the adapters and the new tokens' rows away from their start
        for name, p in model.named_parameters():
            if "lora_B" in name or name.endswith("wte.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    folder = write_adapter_folder(adapter, tmp_path / "model", None, model.config, tokenizer, {})
    ids = torch.tensor([[len(tokenizer) - 1, 5, len(tokenizer) - 2, 7]])
    want = model.eval()(ids).logits
    got = load_merged(AutoModelForCausalLM, folder).eval()(ids).logits
    assert (want - got).abs().max() < 1e-5


# ---- every backend -----------------------------------------------------------------------------
PARALLEL = {
    "ddp": ("--backend", "ddp", "--nproc", "2", "--batch-size", "8"),
    "fsdp": ("--backend", "fsdp", "--nproc", "2", "--batch-size", "8", "--save-steps", "10"),
    "zero1": ("--backend", "deepspeed", "--nproc", "2", "--zero-stage", "1", "--batch-size", "8"),
    "zero2": ("--backend", "deepspeed", "--nproc", "2", "--zero-stage", "2", "--batch-size", "4", "--grad-accum", "2"),
    "zero3": ("--backend", "deepspeed", "--nproc", "2", "--zero-stage", "3", "--batch-size", "8", "--save-steps", "10"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, lora_base, parity_data, cache_dir) -> Path:
    """One process, no LoRA dropout: the run every backend is compared with."""
    flags = ("--batch-size", "16", "--lora-dropout", "0")
    made = made_once(
        tmp_path_factory, "lora-reference", lambda f: lora_run(lora_base, parity_data, cache_dir, f / "run", *flags)
    )
    return made / "run"


def peft_logits(folder: Path) -> torch.Tensor:
    """The logits of an adapter folder loaded as a peft user loads one: AutoPeftModel, which imports the model
    class its adapter_config.json names and loads the base it names."""
    from peft import AutoPeftModel
    from transformers import AutoTokenizer

    texts = ["a wonderful film", "a dull mess"]
    batch = AutoTokenizer.from_pretrained(folder)(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        return AutoPeftModel.from_pretrained(folder).eval()(**batch).logits


@pytest.mark.parametrize("backend", sorted(PARALLEL))
def test_every_backend_trains_lora_as_one_process(backend, reference, lora_base, parity_data, cache_dir, tmp_path):
    out = lora_run(lora_base, parity_data, cache_dir, tmp_path / backend, "--lora-dropout", "0", *PARALLEL[backend])
    whole, other = train_losses(reference), train_losses(out)
    assert sorted(other) == list(range(1, PARITY_STEPS + 1))
    assert max(whole.values()) - min(whole.values()) > 0.01  # the model learns: the comparison means something
    assert max(abs(whole[s] - other[s]) for s in whole) < 1e-4
    a, b = adapter_weights(reference), adapter_weights(out)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    want, got = (peft_logits(run / "model") for run in (reference, out))  # the class adapter_config.json names
    assert (want - got).abs().max() < 1e-4
    if "--save-steps" in PARALLEL[backend]:  # a sharded checkpoint of the adapters alone resumes exactly
        resumed = lora_run(
            lora_base,
            parity_data,
            cache_dir,
            tmp_path / f"{backend}-resumed",
            "--lora-dropout",
            "0",
            *PARALLEL[backend],
            "--resume",
            str(out / "checkpoint-10"),
        )
        again = train_losses(resumed)
        assert max(abs(again[s] - other[s]) for s in again) < 1e-6


# ---- bad input: one line, exit 2, nothing written ------------------------------------------------
@pytest.fixture
def files(tmp_path):
    return write_sentiment_csv(tmp_path / "train.csv", 24, seed=1), write_sentiment_csv(tmp_path / "val.csv", 8, seed=2)


def test_targets_that_match_no_layer_list_the_linear_layers(capfd, tmp_path, tiny_bert, files):
    proc = in_process(
        capfd, *train_args(tmp_path, tiny_bert, *files, "--adapter", "lora", "--lora-targets", "q_proj,value")
    )
    assert_refused(proc, tmp_path, "--lora-targets q_proj matches no linear layer", "query, value", "all-linear")


def test_a_new_adapter_on_an_adapter_folder_is_one_line(capfd, tmp_path, single, files):
    """--model a LoRA run's OUTPUT_DIR/model with --adapter lora trained the new adapter on the merged model, and its
    folder could not be used: predict and export --merge failed to load its base (an adapter folder), and peft's
    adapter_config.json named the first base, without the first adapter (other outputs, without a word)."""
    proc = in_process(capfd, *train_args(tmp_path, str(single / "model"), *files, "--adapter", "lora"))
    assert_refused(proc, tmp_path, "is an adapter folder", "tuneforge export --merge")


def test_lora_rank_must_be_positive(capfd, tmp_path, tiny_bert, files):
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, "--adapter", "lora", "--lora-r", "0"))
    assert_refused(proc, tmp_path, "lora_r", "greater than 0")


def test_tensor_parallel_refuses_adapters_naming_the_backends_that_take_them(capfd, tmp_path, tiny_bert, files):
    extra = ("--adapter", "lora", "--backend", "tp", "--nproc", "2")
    assert_refused(
        in_process(capfd, *train_args(tmp_path, tiny_bert, *files, *extra)), tmp_path, "'tp'", "--backend fsdp"
    )


def test_freezing_flags_do_not_combine_with_an_adapter(capfd, tmp_path, tiny_bert, files):
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, "--adapter", "lora", "--freeze-layers", "2"))
    assert_refused(proc, tmp_path, "--freeze-layers 2", "--adapter lora", "drop them")


def test_lora_settings_given_without_an_adapter_are_refused_but_a_config_files_are_kept(
    capfd, tmp_path, tiny_bert, files
):
    """--lora-r 8 without --adapter lora trained a full fine-tune without a word (the rank did nothing); given on
    the command line, a flag or key=value override, it is one line. A saved LoRA run's config.yaml re-runs with
    --adapter none: its lora keys are the file's, not given now."""
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, "--lora-r", "8", "--lora-targets", "query"))
    assert_refused(proc, tmp_path, "--lora-r, --lora-targets", "--adapter none", "add --adapter lora or drop them")
    given = train_args(tmp_path, tiny_bert, *files, "--adapter", "none", positional=["lora_alpha=64"])
    assert_refused(in_process(capfd, *given), tmp_path, "lora_alpha=64 ", "--adapter none")
    saved = tmp_path / "saved.yaml"
    saved.write_text("adapter: lora\nlora_r: 8\nlora_alpha: 64\n")
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, "--adapter", "none", positional=[saved]))
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "out" / "model" / "adapter_config.json").exists()


def test_merging_into_another_base_is_refused(capfd, single, tmp_path, minilm_dir):
    other = save_tiny_bert(
        tmp_path / "other", minilm_dir, dropout=0.0, initializer_range=0.3
    )  # same shapes, new weights
    proc = in_process(capfd, "export", "--merge", str(single / "model"), str(tmp_path / "out"), "--base", other)
    assert proc.returncode == 2, proc.stderr
    assert "trained on other base weights" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["rank", "none", "base"])
def test_a_resume_with_another_adapter_or_base_is_one_line(
    case, capfd, single, lora_base, parity_data, cache_dir, tmp_path, minilm_dir
):
    """Each failed with "TypeError: unhashable type: 'dict'" (an internal error) instead of saying why."""
    flags, said = {
        "rank": (
            [*LORA[:3], "8"],
            "lora r=4 alpha=8 targets=query,value heads=classifier but this run has adapter lora r=8 alpha=32",
        ),
        "none": (
            [],
            "trained with adapter lora r=4 alpha=8 targets=query,value heads=classifier but this run has no adapter",
        ),
        "base": (LORA, "holds adapters trained on other base weights than this run's --model"),
    }[case]
    # "base": the same shapes, other weights
    model = save_tiny_bert(tmp_path / "other", minilm_dir, initializer_range=0.3) if case == "base" else lora_base
    args = backend_train_args(
        model, parity_data, cache_dir, tmp_path / "out", *flags, "--no-group-by-length", lr="2e-2"
    )
    proc = in_process(capfd, *args, "--batch-size", "16", "--resume", single / "checkpoint-10")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert said in proc.stderr, proc.stderr


def test_a_resume_with_another_adapter_under_launched_workers_is_one_line(
    single, lora_base, parity_data, cache_dir, tmp_path
):
    """The check runs in each worker: under --nproc 2 it was the line twice, torch's traceback and exit 1."""
    run = tmp_path / "run"
    shutil.copytree(single, run)
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    args = backend_train_args(lora_base, parity_data, cache_dir, run, *LORA[:3], "8", "--no-group-by-length", lr="2e-2")
    proc = run_cli(*args, "--batch-size", "8", "--backend", "ddp", "--nproc", "2", "--resume", timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and "this run has adapter lora r=8" in proc.stderr
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before  # nothing lost


def test_an_fsdp_adapter_checkpoint_resumed_on_single_advises_what_works(
    capfd, lora_base, parity_data, cache_dir, tmp_path
):
    """The refusal advised "`tuneforge export` it", which refuses an adapter run's checkpoint."""
    args = backend_train_args(lora_base, parity_data, cache_dir, tmp_path / "run", *LORA, lr="2e-2")
    written = run_cli(*args, "--backend", "fsdp", "--max-steps", "1", "--save-steps", "1")
    assert written.returncode == 0, written.stderr[-3000:]
    proc = in_process(capfd, *args, "--max-steps", "2", "--resume")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "resume with --backend fsdp (an adapter run's checkpoint holds the adapters" in proc.stderr
    assert "`tuneforge export --merge OUTPUT_DIR/model OUT`" in proc.stderr


def test_merge_needs_an_adapter_folder(capfd, tmp_path, tiny_bert):
    proc = in_process(capfd, "export", "--merge", tiny_bert, str(tmp_path / "out"))
    assert proc.returncode == 2 and "is not an adapter folder" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def merge_case(case: str, single: Path, tmp_path: Path, tiny_gpt2: str) -> tuple[list[str], tuple[str, ...]]:
    """(export --merge arguments, needles) of one merge onto a wrong or missing base."""
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(single / "model", adapter)
    out = str(tmp_path / "merged")
    if case == "base folder deleted":
        info = json.loads((adapter / "tuneforge.json").read_text())
        gone = str(tmp_path / "deleted-base")
        info["adapter"].update(base_model=gone, base_model_path=gone, base_model_path_from_adapter=gone)
        (adapter / "tuneforge.json").write_text(json.dumps(info))
        return [str(adapter), out], ("deleted-base", "is not there", "--merge --base DIR")
    if case == "base of another architecture":
        said = ("trained on a model of the bert family", "is of the gpt2 family")  # no 'a' before a family's name
        return [str(adapter), out, "--base", tiny_gpt2], said
    if case == "base of other sizes":  # transformers' size-mismatch RuntimeError: was an internal error
        from transformers import BertModel

        from conftest import tiny_bert_config

        BertModel(tiny_bert_config(intermediate_size=48)).save_pretrained(tmp_path / "wider")
        return [str(adapter), out, "--base", str(tmp_path / "wider")], ("wider", "shapes differ", "trained on")
    if case == "adapter without config.json":  # transformers' ValueError: was an internal error
        (adapter / "config.json").unlink()
        return [str(adapter), out], ("config.json cannot be read",)
    if case == "base that is a file":
        (tmp_path / "base.txt").write_text("x")
        return [str(adapter), out, "--base", str(tmp_path / "base.txt")], ("base.txt",)
    if case == "into the adapter folder":
        return [str(adapter), str(adapter), "--overwrite"], ("is the adapter folder",)
    if case == "into the base folder":
        base = tmp_path / "base"
        shutil.copytree(json.loads((adapter / "tuneforge.json").read_text())["adapter"]["base_model"], base)
        return [str(adapter), str(base), "--overwrite", "--base", str(base)], ("is the base model",)
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "base folder deleted",
        "base of another architecture",
        "base of other sizes",
        "adapter without config.json",
        "base that is a file",
        "into the adapter folder",
        "into the base folder",
    ],
)
def test_merge_onto_a_wrong_or_missing_base_is_one_line(single, tmp_path, tiny_gpt2, capsys, case):
    from test_bad_input_writers import refused

    args, needles = merge_case(case, single, tmp_path, tiny_gpt2)
    capsys.readouterr()  # what writing the case's folders printed (transformers' bars, where still on) is not the CLI's
    refused(capsys, (tmp_path,), "export", "--merge", *args, needles=needles)


# ---- a base named by a relative path: the adapter folder read from elsewhere ---------------------
@pytest.fixture(scope="module")
def relative_base_run(tmp_path_factory, lora_base, parity_data, cache_dir) -> Path:
    """A project folder (base/, data/, work/) whose LoRA run was trained from work/ with `--model ../base`: the
    adapter folder work/runs/x/model records its base as the user typed it."""

    def make(project: Path) -> None:
        shutil.copytree(lora_base, project / "base")
        shutil.copytree(parity_data[0].parent, project / "data")
        (project / "work").mkdir()
        data = (Path("../data/train.csv"), Path("../data/validation.csv"))
        args = backend_train_args("../base", data, cache_dir, Path("runs/x"), *LORA, "--max-steps", "2")
        proc = run_cli(*args, cwd=project / "work")
        assert proc.returncode == 0, proc.stderr[-4000:]

    return made_once(tmp_path_factory, "relative-base", make)


def predict_from(folder: Path, model: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    texts = write_sentiment_csv(tmp_path / "in.csv", 4, seed=5)
    return run_cli("predict", str(model), "--input", str(texts), "--output", str(tmp_path / "out.jsonl"), cwd=folder)


def test_an_adapter_whose_base_was_given_relative_loads_from_another_folder(relative_base_run, tmp_path):
    """From the project folder `../base` names no folder: predict failed on a hub id check of '../base'."""
    proc = predict_from(relative_base_run, relative_base_run / "work/runs/x/model", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 4


def test_an_adapter_finds_its_base_after_the_whole_project_moved(relative_base_run, tmp_path):
    """Copied elsewhere with its base (another machine's path): the base beside it, where it was."""
    project = tmp_path / "moved"
    shutil.copytree(relative_base_run, project)
    info = json.loads((project / "work/runs/x/model/tuneforge.json").read_text())["adapter"]
    shutil.move(info["base_model_path"], tmp_path / "gone")  # the recorded folder no longer there
    try:
        proc = predict_from(tmp_path, project / "work/runs/x/model", tmp_path)
    finally:
        shutil.move(tmp_path / "gone", info["base_model_path"])
    assert proc.returncode == 0, proc.stderr


def test_an_adapter_whose_base_folder_moved_away_says_where_it_was(relative_base_run, tmp_path, capsys):
    from test_bad_input_writers import refused

    adapter = tmp_path / "adapter"
    shutil.copytree(relative_base_run / "work/runs/x/model", adapter)  # the base no longer beside it
    info = json.loads((adapter / "tuneforge.json").read_text())["adapter"]
    shutil.move(info["base_model_path"], tmp_path / "gone")
    try:
        needles = ("'../base'", info["base_model_path"], "is not there", "--merge --base DIR")
        refused(capsys, (adapter,), "export", "--merge", str(adapter), str(tmp_path / "m"), needles=needles)
    finally:
        shutil.move(tmp_path / "gone", info["base_model_path"])
