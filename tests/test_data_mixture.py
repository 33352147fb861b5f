"""Training on a mixture of sources (`data.sources`): each source read in its own format, the plan in the log,
evaluation per source, exact resume after a real SIGKILL (across an epoch's end, and onto two ranks), the refusal
to resume onto a changed source (and --allow-changed-data), and every bad mixture as one error line naming the
source."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from conftest import read_jsonl
from conftest import run_script as run_forked_script
from test_bad_input import in_process
from test_resume import SCRIPT, history, same_steps

WORDS = "the cat dog sat on mat ran far away house tree river".split()


def write_texts(path: Path, n: int, words: tuple[int, int], seed: int) -> Path:
    """`n` jsonl rows {"text": ...} of `words` (min, max) words each, starting with the file's stem."""
    rng = random.Random(seed)
    rows = [f"{path.stem} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(n)]
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return path


@pytest.fixture
def sources(tmp_path) -> list[dict]:
    """Three clm sources of different lengths and sizes, weighted 0.5 / 0.3 / 0.2."""
    specs = [("web", 120, (3, 8), 0.5), ("books", 48, (10, 20), 0.3), ("code", 16, (2, 4), 0.2)]
    return [
        {"path": str(write_texts(tmp_path / f"{name}.jsonl", n, words, seed)), "weight": weight}
        for seed, (name, n, words, weight) in enumerate(specs)
    ]


def mixture_config(tmp_path, model: str, cache_dir: str, sources: list[dict], **values) -> Path:
    config = {
        "task": "clm",
        "model": model,
        "output_dir": str(tmp_path / "run"),
        "batch_size": 8,
        "epochs": 1,
        "logging_steps": 1,
        "precision": "fp32",
        "packing": False,
        "data": {"cache_dir": cache_dir, "max_length": 32, "sources": sources},
        **values,
    }
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_mixture_trains_logs_its_plan_and_evaluates_each_source(capfd, tmp_path, tiny_gpt2, cache_dir, sources):
    proc = in_process(capfd, "train", mixture_config(tmp_path, tiny_gpt2, cache_dir, sources))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 184 rows, 10% of each held out for validation (rounded up): 108 + 43 + 14 train; the epoch as long as all
    log = proc.stderr
    assert "data mixture: 3 sources, 165 examples per epoch" in log
    assert "  web: 108 rows, 82 per epoch (49.7% of it" in log
    assert "  code: 14 rows, 33 per epoch (20.0% of it; each row 2.36x per epoch)" in log
    assert "data source 'books': no --validation-file: holding out 10%" in log
    final = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]
    assert final["split"] == "eval"
    assert {f"{name}/loss" for name in ("web", "books", "code")} <= set(final)
    # the run's loss is over the sources' validation rows together: between the lowest and the highest source's
    per_source = [final[f"{name}/loss"] for name in ("web", "books", "code")]
    assert min(per_source) <= final["loss"] <= max(per_source)


def test_sft_sources_in_their_own_formats_train_together(capfd, tmp_path, tiny_llama, cache_dir):
    rng = random.Random(0)
    chats = [
        {"messages": [{"role": "user", "content": f"where is the {w}"}, {"role": "assistant", "content": "here"}]}
        for w in (rng.choice(WORDS) for _ in range(24))
    ]
    alpaca = [{"instruction": f"name a {w}", "input": "", "output": w} for w in (rng.choice(WORDS) for _ in range(24))]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    (tmp_path / "alpaca.json").write_text(json.dumps(alpaca))
    sources = [
        {"path": str(tmp_path / "chats.jsonl"), "epochs": 1, "options": {"chat_format": "messages"}},
        {"path": str(tmp_path / "alpaca.json"), "epochs": 2, "options": {"chat_format": "alpaca"}},
    ]
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'][0] }}>\n{{ m['content'] }}\n{% endfor %}")
    config = mixture_config(
        tmp_path, tiny_llama, cache_dir, sources, task="sft", block_size=64, chat_template=str(template)
    )
    proc = in_process(capfd, "train", config, "--max-steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 24 rows each, 3 held out: each chat once, each Alpaca row twice an epoch
    assert "data mixture: 2 sources, 63 examples per epoch" in proc.stderr
    assert "  chats: 21 rows, 21 per epoch (33.3% of it; each row 1x per epoch)" in proc.stderr
    assert "  alpaca: 21 rows, 42 per epoch (66.7% of it; each row 2x per epoch)" in proc.stderr


# ---- exact resume --------------------------------------------------------------------------------------------------
def resume_spec(tmp_path, model: str, cache_dir: str, sources: list[dict]) -> dict:
    return {
        "task": "clm",
        "model": model,
        "epochs": 2,
        "batch_size": 8,
        "save_strategy": "steps",
        "save_steps": 8,
        "logging_steps": 2,
        "quiet": True,
        "precision": "fp32",
        "packing": False,
        "optim": {"lr": 1e-3},
        "data": {"cache_dir": cache_dir, "max_length": 32, "sources": sources},
    }


def run_spec(tmp_path: Path, out: Path, spec: dict, **more):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    full = {**spec, "output_dir": str(out), **more}
    proc = run_forked_script(script, json.dumps(full), env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode in (0, -9), proc.stderr[-3000:]
    return proc


def test_a_killed_mixture_run_resumes_bit_for_bit_across_the_epochs_end(tmp_path, tiny_gpt2, cache_dir, sources):
    # 165 examples per epoch, global batch 8: 21 steps an epoch; killed at step 26, it resumes from step 16's
    # checkpoint and re-runs the end of epoch 1 and the start of epoch 2
    spec = resume_spec(tmp_path, tiny_gpt2, cache_dir, sources)
    run_spec(tmp_path, tmp_path / "whole", spec)
    marker = tmp_path / "died"
    killed = run_spec(tmp_path, tmp_path / "cut", spec, die={"step": 26, "rank": 0, "marker": str(marker)})
    assert killed.returncode == -9 and marker.exists()
    run_spec(tmp_path, tmp_path / "cut", spec, resume="latest")
    whole, cut = history(tmp_path / "whole", 0), history(tmp_path / "cut", 0)
    assert len(whole) == 42 and same_steps(whole, cut)
    assert {s["epoch"] for s in cut} == {0, 1}


def test_a_mixture_checkpoint_resumes_on_two_ranks_with_the_same_examples(tmp_path, tiny_gpt2, cache_dir, sources):
    spec = resume_spec(tmp_path, tiny_gpt2, cache_dir, sources)
    run_spec(tmp_path, tmp_path / "one", spec, max_steps=12)
    run_spec(tmp_path, tmp_path / "cut", spec, max_steps=8)
    run_spec(tmp_path, tmp_path / "cut", spec, max_steps=12, resume="latest", nproc=2, batch_size=4, backend="ddp")
    one = history(tmp_path / "one", 0)
    two = [history(tmp_path / "cut", r) for r in (0, 1)]
    after = {s["step"]: sorted(s["indices"]) for s in one if s["step"] > 8}
    rank1 = {s["step"]: s["indices"] for s in two[1]}
    resumed = {s["step"]: sorted(s["indices"] + rank1[s["step"]]) for s in two[0] if s["step"] > 8}
    assert after == resumed and len(after) == 4


# ---- changed data --------------------------------------------------------------------------------------------------
def test_a_source_that_changed_since_the_checkpoint_is_refused_unless_allowed(
    capfd, tmp_path, tiny_gpt2, cache_dir, sources
):
    config = mixture_config(tmp_path, tiny_gpt2, cache_dir, sources, save_strategy="steps", save_steps=4, max_steps=4)
    first = in_process(capfd, "train", config, "--quiet")
    assert first.returncode == 0, first.stderr[-2000:]
    books = Path(sources[1]["path"])
    books.write_text(books.read_text().replace("cat", "cow"))  # same size: only the content tells
    refused = in_process(capfd, "train", config, "--resume", "latest", "--max-steps", "6", "--quiet")
    assert refused.returncode == 2
    lines = [x for x in refused.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: data source 'books' changed since ")
    assert "--allow-changed-data" in lines[0]
    allowed = in_process(capfd, "train", config, "--resume", "latest", "--max-steps", "8", "--allow-changed-data")
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "warning: data source 'books' changed since" in allowed.stderr
    # the checkpoint of the rest of the run holds the data as it is now: a later resume is not refused
    again = in_process(capfd, "train", config, "--resume", "latest", "--max-steps", "10", "--quiet")
    assert again.returncode == 0, again.stderr[-2000:]


# ---- bad mixtures --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, needles",
    [
        ({1: {"weight": 0}}, ["data source 'books.jsonl'", "weight", "greater than 0"]),
        ({1: {"weight": None, "epochs": 2}}, ["data source 'books' mixes weight and epochs"]),
        ({2: {"weight": None}}, ["data source 'code' has no weight while others do"]),
        ({0: {"path": "missing.jsonl"}}, ["data source 'missing'", "does not exist"]),
        ({0: {"empty": True}}, ["data source 'web'", "no examples"]),
        ({1: {"options": {"packing": "sometimes"}}}, ["data source 'books'", "packing"]),
        ({1: {"name": "web"}}, ["two data sources are named 'web'"]),
    ],
)
def test_bad_mixtures_are_one_error_line_naming_the_source(
    capfd, tmp_path, tiny_gpt2, cache_dir, sources, change, needles
):
    for i, values in change.items():
        if values.pop("empty", False):
            Path(sources[i]["path"]).write_text("")
        sources[i] = {k: v for k, v in {**sources[i], **values}.items() if v is not None}
    config = mixture_config(tmp_path, tiny_gpt2, str(tmp_path / "cache"), sources)
    proc = in_process(capfd, "train", config)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip() and not x.startswith("data source")]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0]
    assert not (tmp_path / "run" / "model").exists()


def test_max_eval_samples_takes_each_sources_share_of_the_validation_rows(tmp_path, tiny_gpt2, cache_dir, sources):
    """The run's evaluation on the sources together, cut to N examples, holds rows of each source (their shares of
    the 12 + 5 + 2 held-out rows): it was the first N of them laid end to end, the first source's alone, so the run's
    loss was web/loss and the best checkpoint was chosen on one source."""
    from tuneforge.configure import build_config
    from tuneforge.tasks import get_task
    from tuneforge.training_data import load_mixture

    config = build_config(yaml.safe_load(mixture_config(tmp_path, tiny_gpt2, cache_dir, sources).read_text()))
    config.data.max_eval_samples = 10
    task = get_task(config)
    task.log = lambda line: None
    tokenizer = task.load_tokenizer()
    data = load_mixture(task, config, tokenizer, log=lambda line: None)
    firsts = [tokenizer.decode(ids).split()[0] for ids in data.evals["input_ids"]]
    assert len(firsts) == 10 and {name: firsts.count(name) for name in set(firsts)} == {"web": 5, "books": 3, "code": 2}
    assert {name: len(part) for name, part in data.eval_parts.items()} == {"web": 10, "books": 5, "code": 2}


def test_a_source_without_a_name_is_named_after_its_file_whatever_the_file_is_called():
    """The name made of a file's stem is one the name rule takes: '_web.jsonl' was refused as a bad 'name' the
    config never gave ("got '_web'")."""
    from tuneforge.configure import build_config

    paths = ["data/_web.jsonl", "über.jsonl", "-.jsonl", "books.v2.jsonl"]
    config = build_config(task="clm", data={"sources": [{"path": p, "weight": 1} for p in paths]})
    assert [s.name for s in config.data.sources] == ["web", "ber", "source", "books"]


def test_sources_with_a_train_file_are_refused(capfd, tmp_path, tiny_gpt2, cache_dir, sources):
    config = mixture_config(tmp_path, tiny_gpt2, cache_dir, sources)
    proc = in_process(capfd, "train", config, "--train-file", sources[0]["path"])
    assert proc.returncode == 2
    assert "data.sources replaces --train-file" in proc.stderr
