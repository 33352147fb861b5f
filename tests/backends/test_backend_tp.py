"""tp backend: plans for GPT-2 and Llama on a 2-D mesh, bad input refused before launch.

Parity, sharded checkpoints, resume, resharding and export are in test_backend_conformance.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, cli_main, save_tiny_bert


@pytest.fixture(scope="module")
def tiny_distilbert(tmp_path_factory, minilm_dir) -> str:
    """An architecture without a tp plan."""
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertModel

    out = tmp_path_factory.mktemp("tiny-distilbert")
    DistilBertModel(
        DistilBertConfig(dim=32, n_layers=1, n_heads=4, hidden_dim=64, max_position_embeddings=128)
    ).save_pretrained(out)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def odd_mlp_bert(tmp_path_factory, minilm_dir) -> str:
    """tiny_bert with an MLP of 37 units: 2 ranks cannot split it evenly."""
    return save_tiny_bert(tmp_path_factory.mktemp("odd-mlp-bert"), minilm_dir, intermediate_size=37)


@pytest.mark.parametrize("case", ["world", "heads", "mlp", "architecture"])
def test_tp_bad_input_is_one_line_before_launch(case, request, tmp_path, backend_runs, capfd):
    model, flags, message = {
        "world": (
            "tiny_bert",
            ["--nproc", "2", "--tp-size", "3"],
            "error: --tp-size 3 does not divide the world size 2 (all processes); use a tp size among [1, 2]",
        ),
        "heads": (
            "tiny_bert",
            ["--nproc", "8", "--tp-size", "8"],
            "error: --tp-size 8 does not divide the model's 4 attention heads; use a tp size among [1, 2, 4]",
        ),
        # the row-wise down-projection takes equal shards: a worker failed in its first forward with
        # "a and b must have same reduction dim"
        "mlp": (
            "odd_mlp_bert",
            ["--nproc", "2"],
            "error: --tp-size 2 does not divide the model's 37 MLP units (intermediate size); use a tp size among [1]",
        ),
        "architecture": (
            "tiny_distilbert",
            ["--nproc", "2"],
            "error: backend 'tp' has no tensor-parallel plan for model type 'distilbert'",
        ),
    }[case]
    model = request.getfixturevalue(model)
    code, _, err = cli_main(capfd, *backend_runs.args("clip", tmp_path / "run", "--backend", "tp", *flags, model=model))
    assert code == 2
    # refused in the launching process (this one): one line, no worker started (no launcher output)
    assert err.strip().startswith(message) and len(err.strip().splitlines()) == 1


def test_tp_eval_takes_the_tp_size(tmp_path, tiny_llama, capfd):
    """`eval --backend tp` runs on that backend, so it takes its options: --tp-size was an unrecognized argument, and
    a model whose heads the world size does not divide (2 key/value heads, --nproc 4) could not be evaluated."""
    args = ["eval", tiny_llama, "--task", "clm", "--backend", "tp", "--nproc", "2", "--tp-size", "3"]
    code, _, err = cli_main(capfd, *args, "--output-dir", str(tmp_path / "eval"))
    assert code == 2
    assert err.strip() == (
        "error: --tp-size 3 does not divide the world size 2 (all processes); use a tp size among [1, 2]"
    )


def test_the_best_model_snapshot_does_not_follow_the_training(tiny_llama):
    """load_best_model_at_end keeps full_state_dict's weights while training goes on: the replicated (plain)
    parameters (embeddings, norms, head) were the live CPU tensors, so OUTPUT_DIR/model held the best step's
    split weights with the last step's replicated ones (a model no step had, worse than the best)."""
    from transformers import AutoModelForCausalLM

    from tuneforge import launch
    from tuneforge.backends.tp import BACKEND
    from tuneforge.configure import build_config

    backend = BACKEND(build_config(backend="tp", precision="fp32"), launch.dist_env())  # a world of one
    backend.setup()
    try:
        model, optimizer = backend.wrap(
            AutoModelForCausalLM.from_pretrained(tiny_llama), lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
        )
        best = backend.full_state_dict(model)
        kept = {name: weight.clone() for name, weight in best.items()}
        ids = torch.arange(12).reshape(2, 6)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        assert not torch.equal(kept["model.norm.weight"], model.model.norm.weight.detach())  # a replicated weight moved
        assert [name for name in kept if not torch.equal(best[name], kept[name])] == []
    finally:
        backend.teardown()


WORKER = '''
"""4 processes: a ("dp", "tp") = 2 x 2 mesh. Each causal LM: loss, gradients, grad norm, one
AdamW step, the gathered weights and a DCP save/load round trip, all against one process; and
that sharding keeps frozen weights frozen."""
import copy
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tuneforge import launch
from tuneforge.backends.tp import BACKEND
from tuneforge.configure import build_config
from tuneforge.freezing import freeze_bottom

backend = BACKEND(build_config(backend="tp", tp_size=2, precision="fp32"), launch.dist_env())
backend.setup()
assert (backend.tp_size, backend.dp_size) == (2, 2)


def make_optimizer(model):
    # eps 1e-3, not 1e-8: Adam's step is g / (|g| + eps), so where a gradient is near 1e-8 (some biases here)
    # the rounding of a sharded reduction (gradients agree to 1e-6) moved the stepped weight by up to 2e-4 on
    # an AMX CPU; with eps 1e-3 that step is bounded by lr * 1e-6 / 1e-3 = 1e-5, and the check keeps its meaning
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


for folder in sys.argv[2:]:
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    kind = reference.config.model_type
    model = copy.deepcopy(reference)
    ids = torch.randint(0, reference.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    ref_loss = reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)

    model, optimizer = backend.wrap(model, make_optimizer)
    mine = ids.chunk(backend.dp_size)[backend.dp_rank]  # ranks of one tp group share the batch
    with backend.micro_step(model, sync=True):  # the sync seam: the "dp" replicas average their gradients at its end
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
    assert abs(sum(backend.gather_objects(loss.item())) / 2 - ref_loss.item()) < 1e-5, kind
    norm = backend.clip_grad_norm(model, 1e9)
    assert abs(norm.item() - ref_norm.item()) < 1e-4 * ref_norm.item(), (kind, norm.item(), ref_norm.item())
    split = 0
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        split += hasattr(p, "full_tensor")
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert torch.allclose(grad, ref.grad, atol=1e-6, rtol=1e-4), (kind, name)
    assert split >= 12, (kind, split)  # q/k/v/out (or fused qkv) and MLP matrices of both layers
    optimizer.step()
    make_optimizer(reference).step()
    full = backend.full_state_dict(model)
    if backend.is_main:
        expected = reference.state_dict()
        assert full.keys() == expected.keys()
        assert max((full[k] - expected[k]).abs().max().item() for k in full) < 1e-4, kind  # one AdamW step

    ckpt = Path(sys.argv[1]) / kind
    if backend.is_main:
        ckpt.mkdir(parents=True)
    backend.barrier()
    backend.save(ckpt, model, optimizer)
    fresh, fresh_optimizer = backend.wrap(AutoModelForCausalLM.from_pretrained(folder), make_optimizer)
    backend.load(ckpt, fresh, fresh_optimizer)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(local(p), local(q)), kind
        assert torch.equal(local(optimizer.state[p]["exp_avg_sq"]), local(fresh_optimizer.state[q]["exp_avg_sq"])), kind

    frozen = AutoModelForCausalLM.from_pretrained(folder)
    freeze_bottom(frozen, 1)  # --freeze-layers 1: sharding keeps a frozen weight frozen
    wanted = {name: p.requires_grad for name, p in frozen.named_parameters()}
    assert 0 < sum(wanted.values()) < len(wanted), kind
    frozen, _ = backend.wrap(frozen, make_optimizer)
    assert {name: p.requires_grad for name, p in frozen.named_parameters()} == wanted, kind
    print(f"ok {kind}", flush=True)
backend.teardown()
'''


def test_tp_parallelizes_gpt2_and_llama_on_a_2d_mesh(tmp_path, tiny_gpt2, tiny_llama):
    """GPT-2 (fused qkv in Conv1D) and Llama (grouped-query attention), tp 2 x dp 2."""
    script = tmp_path / "tp_worker.py"
    script.write_text(WORKER)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=4",
            str(script),
            str(tmp_path / "ckpt"),
            tiny_gpt2,
            tiny_llama,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("ok gpt2") == 4 and proc.stdout.count("ok llama") == 4
