"""The ground floor of model folders (tuneforge.artifacts): the device choice, the one position-limit rule, the
declared capabilities and their architecture fallback, and that no other module keeps its own copy of these."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import BertConfig, EncoderDecoderConfig, GPT2Config, LlamaConfig, T5Config

from conftest import quiet_task
from tuneforge.artifacts import (
    FAMILY_CAUSAL,
    FAMILY_SEQ2SEQ,
    capability_info,
    context_length,
    from_pretrained,
    generation_family,
    inference_device,
    write_model_info,
)
from tuneforge.errors import ConfigError
from tuneforge.tasks.base import predict_max_length

SRC = Path(__file__).resolve().parents[1] / "src" / "tuneforge"
HOME = SRC / "artifacts.py"


# ---- the inference device ---------------------------------------------------------------------
def availability(monkeypatch, cuda: bool, mps: bool) -> None:
    """This machine as one with(out) cuda and mps: torch's own availability answers, not the function under test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)


ORDER = [(True, True, "cuda"), (False, True, "mps"), (True, False, "cuda"), (False, False, "cpu")]


@pytest.mark.parametrize(("cuda", "mps", "chosen"), ORDER)
def test_the_device_is_cuda_then_mps_then_cpu(monkeypatch, cuda, mps, chosen):
    availability(monkeypatch, cuda, mps)
    assert inference_device() == torch.device(chosen)
    assert inference_device("cpu") == torch.device("cpu")  # the user's device always wins


def test_this_machine_runs_on_cpu_unless_it_has_an_accelerator():
    has_mps = torch.backends.mps.is_available()
    expected = "cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu"
    assert inference_device().type == expected


def test_a_generator_runs_where_inference_device_says(tiny_gpt2):
    from tuneforge.generate import Generator

    assert Generator(tiny_gpt2).device.type == inference_device().type


# ---- the one position-limit rule ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "limit"),
    [
        (BertConfig(max_position_embeddings=256), 256),
        (GPT2Config(n_positions=64), 64),  # GPT-2 names it n_positions
        (LlamaConfig(max_position_embeddings=4096), 4096),
        (T5Config(), None),  # relative positions: no fixed limit
        (SimpleNamespace(n_ctx=48), 48),
        (SimpleNamespace(max_position_embeddings=0, seq_length=32), 32),  # 0 is no limit of its own
        (None, None),
    ],
    ids=["bert", "gpt2", "llama", "t5", "n_ctx", "seq_length", "none"],
)
def test_context_length_of_each_architecture(config, limit):
    assert context_length(config) == limit


def test_predict_max_length_follows_the_one_rule():
    """GPT-2's n_positions bounds a predictor too (it once read max_position_embeddings only)."""
    assert predict_max_length(None, 128, 512, SimpleNamespace(n_positions=64)) == 64
    assert predict_max_length(None, 128, 512, T5Config()) == 128
    with pytest.raises(ConfigError, match="above the model's limit of 64 positions"):
        predict_max_length(100, None, 512, SimpleNamespace(n_positions=64))


# ---- capabilities, declared or from the architecture -------------------------------------------
def arch_config(kind, architectures, **values):
    return kind(architectures=architectures, **values)


@pytest.mark.parametrize(
    ("config", "family"),
    [
        (arch_config(GPT2Config, ["GPT2LMHeadModel"]), FAMILY_CAUSAL),
        (arch_config(LlamaConfig, ["LlamaForCausalLM"]), FAMILY_CAUSAL),
        (arch_config(T5Config, ["T5ForConditionalGeneration"]), FAMILY_SEQ2SEQ),
        (
            EncoderDecoderConfig.from_encoder_decoder_configs(
                BertConfig(), BertConfig(), architectures=["EncoderDecoderModel"]
            ),
            FAMILY_SEQ2SEQ,
        ),
        (arch_config(BertConfig, ["BertForSequenceClassification"]), None),
        (arch_config(BertConfig, ["BertForMaskedLM"]), None),
        (arch_config(BertConfig, ["BertModel"]), None),
        (arch_config(GPT2Config, None), None),
    ],
    ids=["gpt2", "llama", "t5", "encoder-decoder", "classifier", "masked-lm", "bare", "no-architecture"],
)
@pytest.mark.parametrize("info", [{}, {"task": "sft"}, {"task": "clm"}], ids=["hub", "old-sft", "old-clm"])
def test_a_folder_without_capabilities_falls_back_on_its_architecture(config, family, info):
    assert generation_family(config, info) == family


def test_declared_capabilities_win_over_the_architecture():
    gpt2 = arch_config(GPT2Config, ["GPT2LMHeadModel"])
    assert generation_family(gpt2, {"task": "clm", **capability_info(False, None)}) is None
    assert generation_family(gpt2, {"task": "anything", **capability_info(True, FAMILY_SEQ2SEQ)}) == FAMILY_SEQ2SEQ
    with pytest.raises(ConfigError, match="unknown family 'causal-ish'"):
        generation_family(gpt2, {"generates": True, "family": "causal-ish"})


@pytest.mark.parametrize(
    ("task", "family"),
    [("clm", FAMILY_CAUSAL), ("sft", FAMILY_CAUSAL), ("dpo", FAMILY_CAUSAL), ("seq2seq", FAMILY_SEQ2SEQ)]
    + [(t, None) for t in ("classification", "ner", "qa", "multiple-choice")],
)
def test_each_task_records_what_its_models_produce(task, family):
    info = quiet_task(task, None).export_info()
    assert info["task"] == task
    assert info["generates"] is (family is not None) and info["family"] == family


def copy_with_info(src: str, dest: Path, info: dict) -> str:
    shutil.copytree(src, dest)
    (dest / "tuneforge.json").unlink(missing_ok=True)
    write_model_info(dest, info)
    return str(dest)


def test_serve_chooses_by_capability_not_by_task_name(tiny_gpt2, tiny_t5, tmp_path):
    """An old clm export (no capability keys), a model of a task serve has never heard of that declares it
    generates, and a causal LM declared not to generate."""
    from tuneforge.generate import Generator
    from tuneforge.predict import load_servable

    old = load_servable(copy_with_info(tiny_gpt2, tmp_path / "old", {"task": "clm", "block_size": 64}))
    assert isinstance(old, Generator) and old.family == FAMILY_CAUSAL
    declared = {"task": "translate-v9", **capability_info(True, FAMILY_SEQ2SEQ)}
    new = load_servable(copy_with_info(tiny_t5, tmp_path / "new", declared))
    assert isinstance(new, Generator) and new.family == FAMILY_SEQ2SEQ
    silent = copy_with_info(tiny_gpt2, tmp_path / "silent", {"task": "scorer", **capability_info(False, None)})
    with pytest.raises(ConfigError, match="not a text-generation model"):
        Generator(silent)


def test_an_adapter_folder_model_is_not_loaded_bare(tmp_path):
    """Its model is the base with the adapter merged (adapters.load_pretrained_model); its config loads plainly."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    BertConfig(num_hidden_layers=1).save_pretrained(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "x"}))
    assert from_pretrained(AutoConfig, str(tmp_path), "the model config").num_hidden_layers == 1
    with pytest.raises(TypeError, match="load_pretrained_model"):
        from_pretrained(AutoModelForSequenceClassification, str(tmp_path), "the model")


# ---- no other module keeps its own copy ---------------------------------------------------------
OWNED = {
    "check_model_path",
    "load_tokenizer",
    "context_length",
    "from_pretrained",
    "inference_device",
    "bundled_minilm",
    "read_model_info",
    "write_model_info",
}
OWNED_CONSTANTS = {"WEIGHT_SUFFIXES", "CHECKPOINT_MARKERS", "TOKENIZER_FILES", "TOKENIZER_SUFFIXES"}
POSITION_KEYS = {"max_position_embeddings", "n_positions"}


def parsed() -> list[tuple[str, ast.Module]]:
    return [
        (p.relative_to(SRC).as_posix(), ast.parse(p.read_text(encoding="utf-8")))
        for p in sorted(SRC.rglob("*.py"))
        if p != HOME
    ]


def test_no_module_but_artifacts_defines_the_model_folder_functions():
    """Module level only: a Task's `load_tokenizer` method is the task's, built on artifacts'."""
    defined = [
        f"{name}:{node.lineno} {node.name}"
        for name, tree in parsed()
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in OWNED
    ]
    defined += [
        f"{name}:{node.lineno} {target.id}"
        for name, tree in parsed()
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name) and target.id in OWNED_CONSTANTS
    ]
    assert defined == [], f"defined outside artifacts.py: {defined}"


def test_no_module_but_artifacts_reads_a_position_limit():
    """getattr(config, "n_positions") or config.max_position_embeddings: context_length is the one rule."""
    reads = [
        f"{name}:{node.lineno}"
        for name, tree in parsed()
        for node in ast.walk(tree)
        if (isinstance(node, ast.Attribute) and node.attr in POSITION_KEYS)
        or (isinstance(node, ast.Constant) and node.value in POSITION_KEYS)
    ]
    assert reads == [], f"a position limit read outside artifacts.py (use context_length): {reads}"


def test_nothing_imports_the_model_folder_functions_from_a_task_module():
    tests = Path(__file__).resolve().parent
    trees = parsed() + [(p.name, ast.parse(p.read_text(encoding="utf-8"))) for p in sorted(tests.rglob("*.py"))]
    wrong = [
        f"{name}:{node.lineno} {alias.name}"
        for name, tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tuneforge.tasks")
        for alias in node.names
        if alias.name in OWNED | OWNED_CONSTANTS
    ]
    assert wrong == [], f"import these from tuneforge.artifacts: {wrong}"


def test_artifacts_stays_the_ground_floor():
    """artifacts.py imports no tuneforge module but errors and paths: everything that reads a folder may use it."""
    tree = ast.parse(HOME.read_text(encoding="utf-8"))
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tuneforge")
    }
    imported |= {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name.startswith("tuneforge")
    }
    assert imported <= {"tuneforge.errors", "tuneforge.paths"}, imported


SAVE_IN_A_FRESH_INTERPRETER = """
import sys, torch
from transformers import BertModel
from tuneforge.artifacts import save_pretrained
import accelerate.utils.other as other
asks = other.is_deepspeed_available
model = BertModel.from_pretrained(sys.argv[1])
save_pretrained(model, sys.argv[2])
again = BertModel.from_pretrained(sys.argv[2])
same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
print("deepspeed" in sys.modules, other.is_deepspeed_available is asks, same)
"""


def test_saving_a_model_folder_does_not_import_deepspeed(tiny_bert, tmp_path):
    """transformers' save_pretrained would import DeepSpeed (seconds) to check for a DeepSpeedEngine: tuneforge's
    save_pretrained writes the same folder in a fresh interpreter without importing it, and leaves accelerate's
    check as it found it."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed: nothing would import it")
    code = [sys.executable, "-c", SAVE_IN_A_FRESH_INTERPRETER, tiny_bert, str(tmp_path / "saved")]
    done = subprocess.run(code, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "True"]
    assert (tmp_path / "saved" / "model.safetensors").is_file()
