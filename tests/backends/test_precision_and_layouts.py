"""The parts a Backend is made of, in one process: its precision (backends/precision.py) and its checkpoint
layout (backends/layouts.py). The 2-process behaviour of both is in test_backend_conformance.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tuneforge import launch
from tuneforge.backends import available_backends, backend_class, layouts
from tuneforge.backends.precision import (
    EnginePrecision,
    NoAutocastPrecision,
    Precision,
    ShardedPrecision,
    quantized_compute_dtype,
)
from tuneforge.configure import build_config
from tuneforge.errors import CheckpointError, ConfigError

CPU = torch.device("cpu")


def single_backend(**config):
    backend = backend_class("single")(build_config(backend="single", **config), launch.dist_env())
    backend.setup()
    return backend


def small_model(frozen_first: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if frozen_first:
        model[0].requires_grad_(False)
    return model


def one_step(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    return optimizer


# ---- precision -----------------------------------------------------------------------------------------
def test_the_parts_are_not_backends():
    assert not {"precision", "layouts", "options", "base"} & set(available_backends())
    assert {"single", "ddp", "fsdp", "tp"} <= set(available_backends())


@pytest.mark.parametrize(
    "plugin, autocasts",
    [(Precision, True), (ShardedPrecision, True), (NoAutocastPrecision, False), (EnginePrecision, False)],
)
def test_autocast_is_the_precisions(plugin, autocasts):
    precision = plugin("bf16", "probe")
    precision.setup(CPU)
    assert precision.name == "bf16" and precision.scaler is None
    with precision.autocast():
        assert torch.is_autocast_enabled("cpu") is autocasts


def test_backend_delegates_precision_autocast_and_attention():
    backend = single_backend(precision="bf16")
    assert backend.precision == "bf16" == backend.precision_plugin.name
    assert backend.precision_plugin.scaler is None
    with backend.autocast():
        assert torch.is_autocast_enabled("cpu")
    assert backend.default_attention(padded=True) == "eager"  # CPU SDPA with a padding mask is slower under bf16
    assert backend.default_attention(padded=False) is None
    fp32 = single_backend(precision="fp32")
    with fp32.autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert fp32.default_attention(padded=True) is None


@pytest.mark.parametrize("requested", ["bf16", "auto", "fp32"])
def test_bf16_asked_for_on_a_cpu_without_native_bf16_is_said_to_be_slower(requested):
    """--precision bf16 on an AVX2 CPU trained in emulated bf16, slower than auto's fp32 there, without a word."""
    from tuneforge.backends.precision import cpu_has_native_bf16

    note = single_backend(precision=requested).precision_plugin.emulated_note()
    if requested == "bf16" and not cpu_has_native_bf16():
        assert note.startswith("note: this CPU has no native bf16") and "--precision auto" in note
    else:
        assert note is None


def test_fp16_refusals_are_one_line_each():
    with pytest.raises(ConfigError, match=r"^precision fp16 needs a CUDA GPU; on CPU use --precision bf16 or fp32$"):
        Precision("fp16", "single").setup(CPU)
    no_fp16 = r"^backend 'fsdp' does not support precision fp16; use --precision bf16 \(or fp32\)$"
    with pytest.raises(ConfigError, match=no_fp16):
        ShardedPrecision("fp16", "fsdp").check_requested()  # at config time, before any device
    with pytest.raises(ConfigError, match=no_fp16):
        ShardedPrecision("fp16", "fsdp").setup(CPU)
    Precision("fp16", "single").check_requested()  # the device decides: a GPU runs it


def test_the_backends_that_hold_a_4bit_base_declare_it():
    """config.py's --quantize rule (single and ddp: each rank holds the whole 4-bit model), as a capability."""
    names = ("single", "ddp", "fsdp", "tp", "deepspeed")
    holds = {name for name in names if backend_class(name).supports_quantized_base}
    assert holds == {"single", "ddp"}


def test_4bit_compute_dtype_follows_the_precision():
    assert quantized_compute_dtype("fp16") == torch.float16
    assert quantized_compute_dtype("bf16") == torch.bfloat16
    assert quantized_compute_dtype("fp32") == torch.float32
    auto = torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    assert quantized_compute_dtype("auto") == auto


# ---- checkpoint layouts ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, adapter, layout",
    [
        ("full", False, layouts.FullLayout),
        ("full", True, layouts.AdapterLayout),
        ("dcp", True, layouts.DCPLayout),
        ("deepspeed", False, layouts.DeepSpeedLayout),
    ],
)
def test_each_backend_kind_has_its_layout(kind, adapter, layout):
    chosen = layouts.layout_for(kind, adapter=adapter)
    assert type(chosen) is layout
    assert getattr(chosen, "adapter", adapter) is adapter


def test_full_layout_saves_loads_and_reads_the_weights(tmp_path):
    backend = single_backend(precision="fp32")
    assert type(backend.layout) is layouts.FullLayout
    model = small_model()
    optimizer = one_step(model)
    backend.save(tmp_path, model, optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "optimizer.pt"]
    assert layouts.has_full_weights(tmp_path) and layouts.holds_unsharded_weights(tmp_path)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    backend.load(tmp_path, fresh, fresh_optimizer)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(optimizer.state[a]["exp_avg"], fresh_optimizer.state[b]["exp_avg"])
    offline = backend_class("single").read_weights(tmp_path)  # `tuneforge export`: no process group
    assert offline.keys() == model.state_dict().keys()
    assert all(torch.equal(offline[k], v) for k, v in model.state_dict().items())


def test_adapter_layout_holds_the_weights_that_train(tmp_path):
    layout = layouts.AdapterLayout()
    backend = single_backend(precision="fp32")
    model = small_model(frozen_first=True)
    layout.save(backend, tmp_path, model, one_step(model))
    assert sorted(load_file(tmp_path / layouts.TRAINABLE_FILE)) == ["2.bias", "2.weight"]
    assert not layouts.has_full_weights(tmp_path) and layouts.holds_unsharded_weights(tmp_path)
    fresh = small_model(frozen_first=True)
    layout.load(backend, tmp_path, fresh, None)
    assert torch.equal(fresh[2].weight, model[2].weight) and torch.equal(fresh[0].weight, model[0].weight)
    other = small_model()  # trains every layer: not the run that wrote it
    with pytest.raises(CheckpointError, match="holds other trained weights than this run's adapter"):
        layout.load(backend, tmp_path, other, None)


def test_reading_a_folder_without_the_layouts_files_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match=r"\(backend 'ddp'\) holds no weights tuneforge can read"):
        layouts.read_weights("full", tmp_path, "ddp")
    with pytest.raises(CheckpointError, match=r"\(backend 'tp'\) holds no weights tuneforge can read"):
        layouts.read_weights("dcp", tmp_path, "tp")  # no sharded/.metadata: read as a full checkpoint
    with pytest.raises(CheckpointError, match=r"holds no DeepSpeed state \(deepspeed/\)"):
        layouts.DeepSpeedLayout.read_weights(Path(tmp_path), "deepspeed")


def test_a_refusal_names_deepspeed_shards_and_advises_a_way_that_works(tmp_path):
    """fsdp and tp said of a DeepSpeed checkpoint that it held "neither sharded weights ... nor model.safetensors",
    not whose it was; and every refusal advised "`tuneforge export` it", which an adapter run's checkpoint is not."""
    (tmp_path / layouts.DEEPSPEED_DIR).mkdir()
    fsdp = backend_class("fsdp")(build_config(backend="fsdp"), launch.dist_env())
    said = fsdp.layout.refusal(fsdp, tmp_path, "deepspeed")
    assert "holds DeepSpeed's ZeRO shards (deepspeed/), written by backend 'deepspeed'" in said
    assert "resume with --backend deepspeed, or `tuneforge export` it" in said
    sharded = tmp_path / "fsdp-run"
    (sharded / layouts.SHARDED_DIR).mkdir(parents=True)
    single = single_backend()
    said = single.layout.refusal(single, sharded, "fsdp", adapter=True)
    assert "resume with --backend fsdp (an adapter run's checkpoint" in said and "`tuneforge export` it" not in said
    assert "`tuneforge export --merge OUTPUT_DIR/model OUT`" in said
