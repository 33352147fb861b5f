"""Shared fixtures: real tokenizers, tiny random models, real files, a CLI runner.

Tiny models use the bundled MiniLM tokenizer (bert-base-uncased vocabulary) and no dropout, so
runs are deterministic and backends can be compared step by step.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# property tests share 2 cores with a parallel half of the suite: a slow draw is the machine's, not the strategy's
settings.register_profile("tuneforge", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("tuneforge")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# keep every test offline and fast-failing; one thread per process (2 cores, 2 workers)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny models: 2 threads per op cost more than they give


# `make test` runs the suite in two halves: the tests here marked `serial` alone, the rest spread over both cores
# by pytest-xdist. Serial: what depends on timing or on having the CPU to itself (servers with timeouts, batching
# windows and concurrent clients); a test elsewhere that needs it says so with @pytest.mark.serial. The other serve
# tests (fuzzing, tools, the page, logprobs, structured output) check answers, not timing; the crash and resume
# tests kill at marker files (the save's pause hook), not at a moment; the launch tests take free ports and wait
# minutes for a hang: they all run beside other tests, where their process starts and waits leave no core idle.
SERIAL_PATHS = (
    "serve/test_serve.py",
    "serve/test_serve_generate.py",
    "serve/test_serve_isolation.py",
    "serve/test_serve_embeddings.py",
)


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """The serial half (`-m serial`) skips the test files none of whose tests can be serial (not in SERIAL_PATHS,
    no `mark.serial` written in them): importing them (openai, mlflow, wandb, llguidance, ...) was most of its
    collection's ~15 s, each import only to deselect the file's tests."""
    here = Path(__file__).parent
    if config.getoption("markexpr") != "serial" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py" or not collection_path.is_relative_to(here):
        return None
    if collection_path.relative_to(here).as_posix().startswith(SERIAL_PATHS):
        return None
    return "mark.serial" not in collection_path.read_text(encoding="utf-8") or None


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        where = Path(item.path).relative_to(Path(__file__).parent).as_posix()
        if where.startswith(SERIAL_PATHS):
            item.add_marker(pytest.mark.serial)


def made_once(tmp_path_factory, name: str, make) -> Path:
    """A folder that `make(folder)` fills once per test session, shared by pytest-xdist's workers.

    A session or module fixture alone runs once per worker, and `make test` spreads a module's tests over both
    workers, so its run would be made twice: here the first worker to ask makes it under a file lock, the others
    wait for it and read it. A folder a failed `make` left half-written is made again by the next to ask."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "made-once"
    root.mkdir(exist_ok=True)
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def tokenized_fresh_then_cached(task, raw, tokenizer, split: str) -> list[tuple[list[str], object]]:
    """`task.tokenize` run twice on `raw`: tokenized, then read from its cache (checked by the first log line); each
    run's log lines and `split`'s features, so a test sees what a cached run says again."""
    runs = []
    for reused in (False, True):
        lines: list[str] = []
        feats = task.tokenize(raw, tokenizer, log=lines.append)[split]
        assert ("reusing" in lines[0]) is reused, lines[0]
        runs.append((lines, feats))
    return runs


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(
            f"shared data not found at {SHARED_DATA} (it sits beside the checkout in CI, not in a user's clone)"
        )
    return SHARED_DATA


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    from tuneforge.artifacts import bundled_minilm

    return bundled_minilm()


def tiny_bert_config(dropout: float | None = None, **changes):
    """The tiny BERT's config (MiniLM vocabulary, 2 layers, 32 wide, 4 heads); `dropout` sets all three dropouts."""
    from transformers import BertConfig

    sizes = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if dropout is not None:
        probs = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")
        changes = {**dict.fromkeys(probs, dropout), **changes}
    return BertConfig(**{**sizes, "max_position_embeddings": 128, **changes})


def save_tiny_bert(out: Path, minilm_dir: str, model_class=None, **config) -> str:
    """A random `model_class` (default BertModel) of `tiny_bert_config(**config)` + MiniLM tokenizer, in `out`."""
    from transformers import AutoTokenizer, BertModel

    (model_class or BertModel)(tiny_bert_config(**config)).save_pretrained(out)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(out)
    return str(out)


def save_tiny_classifier(out: Path, minilm_dir: str, labels: dict[int, str]) -> str:
    """A random tiny BERT classifier (seed 0; initializer range 0.3, so scores spread) with `labels`."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    ids = dict(num_labels=len(labels), id2label=labels, label2id={v: k for k, v in labels.items()})
    return save_tiny_bert(out, minilm_dir, BertForSequenceClassification, initializer_range=0.3, **ids)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory, minilm_dir) -> str:
    """A 2-layer, 32-wide random BERT with the real MiniLM tokenizer, saved as an HF folder."""
    import torch

    torch.manual_seed(0)
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), minilm_dir, dropout=0.0)


POSITIVE = [
    "a wonderful, moving film",
    "great acting and a clever plot",
    "i loved every minute of it",
    "a joyful and funny story",
    "brilliant direction and a superb cast",
    "warm, witty and wise",
    "the best film of the year",
    "an uplifting delight",
    "beautifully shot and deeply felt",
    "charming from start to finish",
]
NEGATIVE = [
    "a dull and tedious mess",
    "the plot makes no sense at all",
    "i wanted my money back",
    "boring, slow and far too long",
    "terrible acting and a weak script",
    "a lifeless, clumsy film",
    "the worst film of the year",
    "an ugly and tiresome bore",
    "badly written and badly shot",
    "painful from start to finish",
]


def write_sentiment_csv(path: Path, n: int, seed: int = 0) -> Path:
    """`n` rows of text,label (pos/neg) built from fixed phrases; deterministic for a seed."""
    import random

    rng = random.Random(seed)
    rows = ["text,label"]
    for i in range(n):
        pos = i % 2 == 0
        words = rng.choice(POSITIVE if pos else NEGATIVE)
        extra = " ".join(
            rng.choice(["really", "truly", "quite", "so", "very", "just"]) for _ in range(rng.randint(0, 6))
        )
        rows.append(f'"{words} {extra}",{"pos" if pos else "neg"}')
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def sentiment_files(tmp_path) -> tuple[Path, Path]:
    """(train.csv with 96 rows, validation.csv with 33 rows), labels 'pos'/'neg'."""
    return sentiment_split(tmp_path, 96, 33)


def sentiment_split(folder: Path, n_train: int, n_val: int) -> tuple[Path, Path]:
    """(folder/train.csv, folder/validation.csv) with `n_train` and `n_val` rows."""
    return (
        write_sentiment_csv(folder / "train.csv", n_train, seed=1),
        write_sentiment_csv(folder / "validation.csv", n_val, seed=2),
    )


def cli_flags(**flags) -> list[str]:
    """Keywords as CLI flags: batch_size=16 -> --batch-size 16, json=True -> --json, [a, b] repeats; None: no flag."""
    args = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            args += [a for v in value for a in (flag, str(v))]
        elif value is not None and value is not False:
            args += [flag, str(value)]
    return args


def train_command(files: tuple[Path, Path], model: str | None = None, **flags) -> list[str]:
    """`train --train-file TRAIN --validation-file VAL [--model MODEL]`, then `flags` (see cli_flags)."""
    train, val = files
    return ["train", *cli_flags(train_file=train, validation_file=val, model=model, **flags)]


@functools.cache
def gpu_here() -> bool:
    """Whether a CUDA GPU is visible. There the helpers below start fresh processes instead of forking this one: a
    forked child cannot use CUDA once this process has set it up, and on a lent H200 children forked from pytest
    workers failed at their first CUDA call ("initialization error") though `torch.cuda.is_initialized()` was
    False in the worker (something had set up the driver under torch)."""
    import torch

    return torch.cuda.is_available()


def more_ranks_than_gpus(args) -> bool:
    """Whether a command line asks for more ranks (`--nproc N`) than there are GPUs: NCCL would refuse it."""
    import torch

    asked = re.search(r"--nproc[= ](\d+)", " ".join(args))
    return asked is not None and int(asked.group(1)) > torch.cuda.device_count()


def cli_command(*args: str) -> list[str]:
    """The command line of `python -m tuneforge.cli ARGS` with this interpreter."""
    return [sys.executable, "-m", "tuneforge.cli", *args]


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 600, cwd: Path | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """Run the CLI with ARGS in a process of its own; returns a CompletedProcess. `env`: variables to set, or to
    remove (None).

    The process is forked from this one, which has imported tuneforge and its libraries already (their start-up
    costs more than a small run), unless `fresh` or `env` ask for `python -m tuneforge.cli` started anew (what a
    user starts; what reads the environment at import), or there is a GPU (see `gpu_here`)."""
    if gpu_here() and more_ranks_than_gpus(args):  # the CI's case: gloo ranks on the CPU
        env = {**(env or {}), "CUDA_VISIBLE_DEVICES": ""}
    if fresh or env is not None or gpu_here():
        return run_fresh(cli_command(*args), {"PYTHONUNBUFFERED": "1", **(env or {})}, timeout, cwd or REPO)
    return forked_cli(list(args), timeout, cwd or REPO)


def run_fresh(command: list[str], env: dict, timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    """`command` in a new process, captured; `env` set over this one's (None: removed)."""
    full_env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    return subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)


def forked_cli(args: list[str], timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    """`tuneforge.cli.main(args)` in a `Forked` child; its output is captured as a subprocess's would be."""
    from tuneforge.cli import main

    return run_forked(lambda: main(args), cli_command(*args), timeout, cwd=cwd)


def run_script(script: Path, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` as a `Forked` child (the script runs as __main__ with that argv), captured."""
    import runpy

    if gpu_here():
        return run_fresh([sys.executable, str(script), *args], env or {}, timeout, REPO)

    def run() -> int:
        sys.argv = [str(script), *args]
        runpy.run_path(str(script), run_name="__main__")
        return 0

    return run_forked(run, [sys.executable, str(script), *args], timeout, env=env)


def cli_without_room(args: list[str], limit: int, timeout: float = 120) -> str:
    """`tuneforge ARGS` in a forked child whose files cannot grow past `limit` bytes (a file size limit fails a write
    with EFBIG as a full disk does with ENOSPC; Python ignores SIGXFSZ): asserts it stopped on one error line (exit
    2, no traceback), and returns that line."""
    import resource

    from tuneforge.cli import main

    def limited() -> int:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        return main(args)

    proc = run_forked(limited, ["tuneforge", *args], timeout=timeout)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: "), line
    return line


def run_forked(target, shown_as: list[str], timeout: float, **how) -> subprocess.CompletedProcess:
    """`target()` in a `Forked` child (`how`: its cwd and env); returns what subprocess.run would, `shown_as`
    its args. Past the timeout the child is killed with the workers it started."""
    import tempfile

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = Forked(target, out.fileno(), err.fileno(), **how)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            raise subprocess.TimeoutExpired(shown_as, timeout) from None
        out.seek(0)
        err.seek(0)
        stdout, stderr = (f.read().decode("utf-8", errors="replace") for f in (out, err))
    return subprocess.CompletedProcess(shown_as, code, stdout, stderr)


class Forked:
    """`target()` (its return value the exit code) in a child forked from this test process, which has imported
    the libraries already, in a session of its own (`kill` stops it with the workers it started); stdin empty,
    stdout and stderr to the file descriptors given; `env` set (None: removed) in it. The parts of
    subprocess.Popen the tests use: pid, poll, wait, returncode, kill."""

    def __init__(self, target, stdout: int, stderr: int, cwd: Path | None = None, env: dict | None = None):
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()  # the child never collects what it inherits: a gloo group's destructor would wait forever there
        self.pid = os.fork()
        if self.pid == 0:
            self._child(target, stdout, stderr, cwd or REPO, env or {})  # never returns
        gc.unfreeze()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.wait()

    @staticmethod
    def _child(target, stdout: int, stderr: int, cwd: Path, env: dict) -> None:
        """Leaves with os._exit, never through the test process's exit handlers."""
        code = 1
        try:
            os.setsid()
            # Ctrl-C as a terminal's foreground process takes it: a test run started in the background (a CI job
            # started with &) inherits SIGINT ignored, and Python then installs no handler of its own
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(stdout, 1)
            os.dup2(stderr, 2)
            sys.stdin = open(0, closefd=False)  # noqa: SIM115
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115
            sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115
            os.chdir(cwd)
            for key, value in env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if "OMP_NUM_THREADS" in env:  # read by torch at start-up only: a forked child is told
                import torch

                torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
            code = target()
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code if isinstance(code, int) else 0)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One tokenization cache for the whole session (tests that check caching use their own)."""
    return str(tmp_path_factory.mktemp("tok-cache"))


# ---- tiny generative models (causal LM and seq2seq tasks) -----------------------------------
# Real tokenizers trained here in well under a second: a GPT-2-style byte-level BPE (`tokenizers`)
# and a T5 SentencePiece unigram model (`sentencepiece`), on a small English/German corpus whose
# sentences are built from fixed phrases (deterministic for a seed).
SUBJECTS = [
    ("a man", "ein Mann"),
    ("a woman", "eine Frau"),
    ("the dog", "der Hund"),
    ("two children", "zwei Kinder"),
    ("a girl", "ein Mädchen"),
    ("the old man", "der alte Mann"),
]
VERBS = [
    ("is riding", "fährt"),
    ("is holding", "hält"),
    ("is watching", "beobachtet"),
    ("is painting", "malt"),
    ("is carrying", "trägt"),
]
OBJECTS = [
    ("a red bike", "ein rotes Fahrrad"),
    ("a blue ball", "einen blauen Ball"),
    ("a small boat", "ein kleines Boot"),
    ("the green door", "die grüne Tür"),
    ("a big box", "eine große Kiste"),
]


def parallel_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """`n` (English, German) sentence pairs."""
    import random

    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        (se, sd), (ve, vd), (oe, od) = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)
        pairs.append((f"{se} {ve} {oe}.".capitalize(), f"{sd} {vd} {od}.".capitalize()))
    return pairs


def write_parallel(folder: Path, name: str, n: int, seed: int = 0) -> tuple[Path, Path]:
    """`folder/name.en` and `folder/name.de`, one sentence per line."""
    pairs = parallel_pairs(n, seed)
    en, de = folder / f"{name}.en", folder / f"{name}.de"
    en.write_text("".join(e + "\n" for e, _ in pairs), encoding="utf-8")
    de.write_text("".join(d + "\n" for _, d in pairs), encoding="utf-8")
    return en, de


def _corpus() -> list[str]:
    return [s for pair in parallel_pairs(400, seed=99) for s in pair]


def bpe_tokenizer(out: Path):
    """A GPT-2-style byte-level BPE tokenizer (no pad token, like GPT-2), saved to `out`."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        _corpus(), vocab_size=320, min_frequency=1, special_tokens=["<|endoftext|>"], show_progress=False
    )
    tok = GPT2TokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    tok.save_pretrained(out)
    return tok


def metaspace_tokenizer(out: Path):
    """A Llama-style SentencePiece tokenizer (BPE on a Metaspace pre-tokenizer, byte fallback, <s> prepended; its
    decoder strips the leading space of a text's first token), saved to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizerFast

    spm = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    spm.decoder = decoders.Sequence(steps)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    spm.train_from_iterator(_corpus(), trainer)
    tok = LlamaTokenizerFast(tokenizer_object=spm, bos_token="<s>", eos_token="</s>", unk_token="<unk>", legacy=False)
    tok.save_pretrained(out)
    return tok


def t5_tokenizer(out: Path):
    """A T5 tokenizer from a SentencePiece unigram model (pad 0, </s> 1, <unk> 2), saved to `out`."""
    import io

    import sentencepiece as spm
    from transformers import T5Tokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()),
        model_writer=model,
        vocab_size=120,
        hard_vocab_limit=False,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "spiece.model").write_bytes(model.getvalue())
    tok = T5Tokenizer.from_pretrained(out, extra_ids=0)
    tok.save_pretrained(out)
    return tok


def save_random(out: Path, model_class, config) -> str:
    """`model_class(config)` with its weights drawn from seed 0, saved into `out`."""
    import torch

    torch.manual_seed(0)
    model_class(config).save_pretrained(out)
    return str(out)


def save_tiny_causal_lm(out: Path, model_class, config_class, **config) -> str:
    """A random causal LM with a byte-level BPE tokenizer (its end-of-text token is bos and eos), saved into `out`."""
    tok = bpe_tokenizer(out)
    ends = dict(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    return save_random(out, model_class, config_class(vocab_size=len(tok), **config, **ends))


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> str:
    """2-layer, 32-wide random GPT-2 (context 64) with a byte-level BPE tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = dict(n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny-gpt2"), GPT2LMHeadModel, GPT2Config, **sizes)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """2-layer, 32-wide random Llama (grouped-query attention, context 64), byte-level BPE tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64, **heads)
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny-llama"), LlamaForCausalLM, LlamaConfig, **sizes)


@pytest.fixture(scope="session")
def metaspace_llama(tmp_path_factory) -> str:
    """tiny_llama's sizes with a Llama-style SentencePiece (Metaspace) tokenizer instead of byte-level BPE."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("metaspace-llama")
    tok = metaspace_tokenizer(out)
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64, **heads)
    ends = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return save_random(out, LlamaForCausalLM, LlamaConfig(vocab_size=len(tok), **sizes, **ends))


@pytest.fixture(scope="session")
def long_llama(tmp_path_factory) -> str:
    """tiny_llama (2 layers, 32 wide, byte-level BPE) with a context of 512 tokens: room for PIQA's prompts and
    solutions (lm-evaluation-harness tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(folder: Path) -> None:
        heads = dict(num_attention_heads=4, num_key_value_heads=2)
        sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=512, **heads)
        save_tiny_causal_lm(folder, LlamaForCausalLM, LlamaConfig, **sizes)

    return str(made_once(tmp_path_factory, "harness-long-llama", make))


# the serve tests' model folders (tests/serve), made once a session and only read: a tiny random Llama with a compact
# chat template, and one whose template renders tools
@pytest.fixture(scope="session")
def chat_model(tmp_path_factory, tiny_llama) -> str:
    from test_serve_generate import save_chat_model  # tests/serve, on the path with its tests

    return save_chat_model(tmp_path_factory.mktemp("serve-chat") / "model", tiny_llama)


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory, tiny_llama) -> str:
    from test_tool_calls import save_tool_model

    return save_tool_model(tmp_path_factory.mktemp("serve-tools") / "model", tiny_llama)


@pytest.fixture(scope="session")
def tiny_t5(tmp_path_factory) -> str:
    """2+2-layer, 32-wide random T5 with a real SentencePiece T5 tokenizer."""
    from transformers import T5Config, T5ForConditionalGeneration

    out = tmp_path_factory.mktemp("tiny-t5")
    tok = t5_tokenizer(out)
    sizes = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, dropout_rate=0.0)
    config = T5Config(vocab_size=len(tok), **sizes, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return save_random(out, T5ForConditionalGeneration, config)


@pytest.fixture(scope="session")
def tiny_bart(tmp_path_factory, minilm_dir) -> str:
    """2+2-layer, 32-wide random BART on the MiniLM (BERT) tokenizer: [CLS]=bos, [SEP]=eos=decoder start."""
    from transformers import AutoTokenizer, BartConfig, BartForConditionalGeneration

    out = tmp_path_factory.mktemp("tiny-bart")
    tok = AutoTokenizer.from_pretrained(minilm_dir)
    tok.save_pretrained(out)
    layers = dict(encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4)
    sizes = dict(d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128, **layers)
    no_dropout = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)
    ids.update(decoder_start_token_id=tok.sep_token_id, forced_eos_token_id=None)
    return save_random(out, BartForConditionalGeneration, BartConfig(vocab_size=len(tok), **sizes, **no_dropout, **ids))


# ---- tagged sentences (NER) -------------------------------------------------------------------
# Sentences built from fixed names, places, organisations and adjectives, tagged as CoNLL-2003 is:
# PER, LOC, ORG, MISC. Deterministic for a seed.
PEOPLE = [["John", "Smith"], ["Maria", "Garcia"], ["Zbigniew", "Brzezinski"], ["Anna"], ["Li", "Wei"], ["Omar"]]
PLACES = [["Paris"], ["Berlin"], ["New", "York"], ["Tokyo"], ["Cairo"], ["Buenos", "Aires"]]
ORGS = [["Reuters"], ["United", "Nations"], ["Siemens"], ["European", "Commission"], ["FIFA"]]
MISC = [["German"], ["British"], ["French"], ["Japanese"]]
TEMPLATES = [
    ["PER", "visited", "LOC", "on", "Monday", "."],
    ["ORG", "said", "PER", "will", "travel", "to", "LOC", "."],
    ["MISC", "officials", "met", "PER", "in", "LOC", "."],
    ["PER", "joined", "ORG", "last", "year", "."],
    ["the", "MISC", "team", "beat", "ORG", "in", "LOC", "."],
]


def tagged_sentences(n: int, seed: int = 0) -> list[tuple[list[str], list[str]]]:
    """`n` (words, IOB2 tags) sentences."""
    import random

    rng = random.Random(seed)
    pools = {"PER": PEOPLE, "LOC": PLACES, "ORG": ORGS, "MISC": MISC}
    out = []
    for _ in range(n):
        words, tags = [], []
        for slot in rng.choice(TEMPLATES):
            if slot in pools:
                name = rng.choice(pools[slot])
                words += name
                tags += [f"B-{slot}"] + [f"I-{slot}"] * (len(name) - 1)
            else:
                words.append(slot)
                tags.append("O")
        out.append((words, tags))
    return out


def iob1(tags: list[str]) -> list[str]:
    """IOB2 tags as CoNLL-2003 writes them (IOB1): B- only where an entity follows one of its own type."""
    out = []
    for i, tag in enumerate(tags):
        follows_same = i > 0 and tags[i - 1] != "O" and tags[i - 1][2:] == tag[2:]
        out.append("I-" + tag[2:] if tag.startswith("B-") and not follows_same else tag)
    return out


def write_conll(path: Path, n: int, seed: int = 0, scheme: str = "iob1") -> Path:
    """A CoNLL-2003 style file: `word POS chunk tag` lines, -DOCSTART- every 8 sentences, blank lines between."""
    lines = []
    for i, (words, tags) in enumerate(tagged_sentences(n, seed)):
        if i % 8 == 0:
            lines += ["-DOCSTART- -X- -X- O", ""]
        tags = iob1(tags) if scheme == "iob1" else tags
        lines += [f"{w} NNP I-NP {t}" for w, t in zip(words, tags)] + [""]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_conll_dir(folder: Path) -> Path:
    """`folder` made a folder of CoNLL files: train.txt (64 sentences), valid.txt (21), test.txt (10); IOB1 tags."""
    folder.mkdir()
    write_conll(folder / "train.txt", 64, seed=1)
    write_conll(folder / "valid.txt", 21, seed=2)
    write_conll(folder / "test.txt", 10, seed=3)
    return folder


@pytest.fixture
def conll_dir(tmp_path) -> Path:
    return write_conll_dir(tmp_path / "conll")


def trained_once(tmp_path_factory, name: str, write_data, command) -> tuple[Path, Path, str]:
    """(run folder, data folder, what the run printed) of a training run made once per session (made_once):
    `write_data(root)` writes its data under `root` and returns its folder, `command(data, run)` is its CLI
    command."""

    def make(root: Path) -> None:
        data = write_data(root)
        (root / "data-folder.txt").write_text(str(data))
        proc = run_cli(*command(data, root / "run"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        (root / "stdout.txt").write_text(proc.stdout)

    root = made_once(tmp_path_factory, name, make)
    return root / "run", Path((root / "data-folder.txt").read_text()), (root / "stdout.txt").read_text()


def write_review_pairs(path: Path, n: int, seed: int = 0) -> Path:
    """`n` (anchor, positive) jsonl rows: a review phrase and another of the same sentiment; deterministic."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        anchor, positive = rng.sample(rng.choice([POSITIVE, NEGATIVE]), 2)
        rows.append(json.dumps({"anchor": anchor, "positive": positive}))
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory, tiny_bert, cache_dir) -> str:
    """OUTPUT_DIR/model of a short `tuneforge train --task embedding` run of tiny_bert (4 steps on review pairs,
    Matryoshka dimensions 16 and 8 of its 32, max_length 24): a sentence encoder as tuneforge exports it, made
    once a session (predict and serve tests share it)."""

    def write(root: Path) -> Path:
        (root / "data").mkdir()
        return write_review_pairs(root / "data" / "train.jsonl", 32, seed=1).parent

    def command(data: Path, run: Path) -> list[str]:
        flags = cli_flags(max_steps=4, batch_size=8, lr="2e-3", eval_strategy="no", matryoshka_dims="16,8")
        flags += cli_flags(max_length=24, cache_dir=cache_dir, output_dir=run, json=True, quiet=True)
        return ["train", "--task", "embedding", "--model", tiny_bert, "--train-file", str(data / "train.jsonl"), *flags]

    run, _, _ = trained_once(tmp_path_factory, "tiny-encoder", write, command)
    return str(run / "model")


# ---- the task families on the sharding engines (tests/tasks) ----------------------------------
# Each task's tiny run on 2 ranks of every sharding engine against one process: 4 steps in fp32, every weight
# trained, the loss logged every step.
SHARDED_ENGINES = [
    "--backend fsdp --nproc 2 --batch-size 4",
    "--backend deepspeed --zero-stage 3 --nproc 2 --batch-size 4",
    "--backend tp --tp-size 2 --nproc 2 --batch-size 8",  # both ranks see the whole batch
]
TASK_PARITY_RUN = dict(
    max_steps=4,
    lr="3e-3",
    precision="fp32",
    logging_steps=1,
    eval_strategy="no",
    json=True,
    quiet=True,
    no_group_by_length=True,
    freeze_layers=0,
    freeze_embeddings="off",
)


# ---- helpers shared by the test files --------------------------------------------------------
def train_ok(*args: str) -> dict:
    """Run `tuneforge ARGS` in a process of its own (run_cli), assert it succeeded; its final JSON line."""
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return last_json(proc.stdout)


def tiny_run_config(folder: Path, tiny_bert: str, cache_dir: str, **values):
    """The TrainConfig of a quiet fp32 classification run of `tiny_bert` on 48 training and 8 validation rows written
    into `folder` (the run goes to folder/run), one log line a step; `values` set or replace any key."""
    from tuneforge.configure import build_config

    folder.mkdir(exist_ok=True)
    train = write_sentiment_csv(folder / "train.csv", 48, seed=1)
    val = write_sentiment_csv(folder / "val.csv", 8, seed=2)
    base = dict(
        task="classification",
        model=tiny_bert,
        output_dir=str(folder / "run"),
        batch_size=8,
        logging_steps=1,
        quiet=True,
        precision="fp32",
        data={"train_file": str(train), "validation_file": str(val), "cache_dir": cache_dir},
    )
    return build_config({**base, **values})


def cli_main(capsys, *args: str) -> tuple[int, str, str]:
    """The real CLI entry point, in this process (the subprocess start-up costs more than a tiny run)."""
    from tuneforge.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def quiet_task(task: str, model: str | None, **data):
    """The task object for `task` and `model` with these data settings; its log lines dropped."""
    from tuneforge.configure import build_config
    from tuneforge.tasks import get_task

    built = get_task(build_config(task=task, model=model, data=data))
    built.log = lambda msg: None
    return built


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, env: dict | None = None, **flags) -> tuple[subprocess.Popen, str]:
    """`tuneforge serve MODEL_DIR` (flags as cli_flags; --precision fp32 unless given, so that answers equal an fp32
    reference on every CPU) in its own process on a free port, with `env` as its whole environment if given;
    returns (the process, its URL) once /health answers. Its stderr (the access log) goes to a file, `proc.log` (a
    pipe nobody reads would fill and stop the server)."""
    import tempfile
    import time

    import httpx

    port = free_port()
    log = Path(tempfile.mkstemp(prefix="tuneforge-serve-", suffix=".log")[1])
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            cli_command("serve", model_dir, *cli_flags(port=port, **{"precision": "fp32", **flags})),
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
        )
    proc.log = log
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}: {log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("server did not come up within 120 s")
        time.sleep(0.3)


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a `start_server` process: SIGTERM (it drains), then kill if it has not ended within 20 s."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def float32_and_bf16_predictors(model_dir):
    """Two predictors of `model_dir`: as loaded (float32), and one switched to bf16 as `serve --precision bf16`
    switches it (its linear layers checked to be bf16 then)."""
    import torch

    from tuneforge.predict import load_predictor

    loaded, switched = load_predictor(model_dir), load_predictor(model_dir)
    assert switched.precision.use("bf16") == "bf16"
    assert {m.weight.dtype for m in switched.model.modules() if type(m) is torch.nn.Linear} == {torch.bfloat16}
    return loaded, switched


@contextmanager
def serving(model_dir: str, **flags):
    """`start_server`'s URL for the `with` block; the server is stopped (`stop_server`) afterwards and its log
    deleted (a test that reads the log once the server has ended uses `start_server` and `stop_server`)."""
    proc, url = start_server(model_dir, **flags)
    try:
        yield url
    finally:
        stop_server(proc)
        proc.log.unlink(missing_ok=True)


# ---- backend conformance (tests/backends) ----------------------------------------------------
# Every backend is compared with one process on the same deterministic PARITY_STEPS-step run with a
# global batch of 16. A *setup* is what the compared runs share (data, learning rate, clipping); every
# run named in BACKEND_RUNS is made once a session, the first time a test asks for it, so the one
# single-process reference of a setup serves every backend compared under it.
PARITY_STEPS = 20


@dataclass(frozen=True)
class BackendSetup:
    n_train: int
    n_val: int
    lr: str
    max_grad_norm: str
    flags: tuple[str, ...] = ()
    learns_by: float = 0.01  # the reference's loss moves by more than this: the comparison means something
    # --freeze-layers: the embeddings and this many bottom layers stay as loaded; 0 trains every weight (not
    # the classifier default, which freezes the embeddings and layer 0): the engines shard and update them all
    frozen_layers: int = 0


BACKEND_SETUPS = {
    # 320 rows (20 global batches of 16), 101 eval rows (odd: uneven rank shares). Clipping at 0.01 is
    # active (the gradient norm starts near 0.02): sharded, split and replicated gradients count too.
    "clip": BackendSetup(320, 101, "1e-2", "0.01"),
    # 96 rows (6 global batches of 16). No length grouping: the epoch order is then the same for every
    # global batch size, so a 2 x 4 x 2 step sees exactly the examples of the single run's step of 16.
    # A clip norm inside the range of the gradient norms (0.03-0.3 here) clips some steps and not
    # others: Adam hides a constant gradient scale (e.g. an extra 1/grad_accum), this makes it change
    # the losses.
    "zero": BackendSetup(96, 33, "5e-3", "0.1", ("--no-group-by-length",), learns_by=0.02),
    # "zero" with the embeddings and layer 0 frozen (--freeze-layers 1): frozen parameters on the sharding engines
    "frozen": BackendSetup(96, 33, "5e-3", "0.1", ("--no-group-by-length",), learns_by=0.02, frozen_layers=1),
}

# "auto" takes tuneforge's value; threshold 0 partitions even the small tensors, so the final
# weights really are gathered from ZeRO-3 shards
DEEPSPEED_USER_JSON = {
    "train_micro_batch_size_per_gpu": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 100000},
}

# run name -> (setup, its flags); "{json}" stands for the setup's copy of DEEPSPEED_USER_JSON. The
# single-process reference of a setup is the run named "single" in it (REFERENCE_RUN).
BACKEND_RUNS = {
    "single": ("clip", "--batch-size 16 --save-strategy steps --save-steps 10"),
    "ddp": ("clip", "--backend ddp --nproc 2 --batch-size 8 --save-strategy steps --save-steps 10"),
    "fsdp": ("clip", "--backend fsdp --nproc 2 --batch-size 8 --save-strategy steps --save-steps 10"),
    # both tensor-parallel ranks see the same batch of 16
    "tp": ("clip", "--backend tp --nproc 2 --tp-size 2 --batch-size 16 --save-strategy steps --save-steps 10"),
    "zero-single": ("zero", "--batch-size 16"),
    "zero1": ("zero", "--backend deepspeed --nproc 2 --zero-stage 1 --batch-size 8"),
    "zero2": (
        "zero",
        "--backend deepspeed --nproc 2 --zero-stage 2 --batch-size 4 --grad-accum 2 --offload optimizer"
        " --save-strategy steps --save-steps 5",
    ),
    "zero3": (
        "zero",
        "--backend deepspeed --nproc 2 --zero-stage 3 --batch-size 8 --deepspeed-config {json}"
        " --save-strategy steps --save-steps 20",
    ),
    "zero3-offload": (
        "zero",
        "--backend deepspeed --nproc 2 --zero-stage 3 --batch-size 8 --offload both --deepspeed-config {json}",
    ),
    "frozen-single": ("frozen", "--batch-size 16"),
    "zero3-frozen": ("frozen", "--backend deepspeed --nproc 2 --zero-stage 3 --batch-size 8 --deepspeed-config {json}"),
    "fsdp-frozen": ("frozen", "--backend fsdp --nproc 2 --batch-size 8"),
}
REFERENCE_RUN = {"clip": "single", "zero": "zero-single", "frozen": "frozen-single"}


def backend_train_args(
    model: str,
    data: tuple[Path, Path],
    cache_dir: str,
    out: Path,
    *extra: str,
    lr: str = "1e-2",
    precision: str = "fp32",
    max_grad_norm: str | None = None,
) -> list[str]:
    """`train` arguments for a PARITY_STEPS-step classification run: the loss logged every step, no evaluation."""
    train, val = data
    clip = ["--max-grad-norm", max_grad_norm] if max_grad_norm else []
    files = ["--train-file", str(train), "--validation-file", str(val), "--model", model, "--cache-dir", cache_dir]
    run = f"--max-steps {PARITY_STEPS} --precision {precision} --logging-steps 1 --lr {lr} --eval-strategy no"
    return ["train", *files, *run.split(), *clip, "--output-dir", str(out), "--json", "--quiet", *extra]


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss of a run, from its metrics.jsonl (a step logged twice fails: two writers)."""
    rows = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if r["split"] == "train"]
    losses = {r["step"]: r["loss"] for r in rows}
    assert len(losses) == len(rows), f"a training step was logged more than once in {run_dir}"
    return losses


def max_weight_diff(dir_a: Path, dir_b: Path) -> float:
    """The largest absolute difference between two model folders' weights (same tensor names asserted)."""
    from safetensors.torch import load_file

    a, b = load_file(Path(dir_a) / "model.safetensors"), load_file(Path(dir_b) / "model.safetensors")
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def parity_loss_gap(single_dir: Path, other_dir: Path, learns_by: float = 0.01) -> float:
    """The largest per-step training loss gap between two PARITY_STEPS-step runs.

    Asserts both logged every step once, and that the single run's loss moved by more than
    `learns_by` (the model learns: the comparison means something)."""
    single, other = train_losses(single_dir), train_losses(other_dir)
    assert sorted(single) == sorted(other) == list(range(1, PARITY_STEPS + 1))
    assert max(single.values()) - min(single.values()) > learns_by
    return max(abs(single[s] - other[s]) for s in single)


def torchrun_cmd(nproc: int, *args: str) -> tuple[list[str], dict]:
    """(command, environment) running `tuneforge ARGS` under an external torchrun with `nproc` workers."""
    from tuneforge import launch

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(launch.free_port()), "-m", "tuneforge.cli", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TUNEFORGE_LAUNCHED")}
    return cmd, env


class BackendRuns:
    """The runs shared by tests/backends (the `backend_runs` fixture), each made the first time it is asked for.

    `runs[name]` is a BACKEND_RUNS run's folder, `runs.reference(name)` the single-process run of its
    setup, `runs.stdout[name]` what the launching process printed (nothing for a run made in this
    process: one process needs no launcher, and the start-up of a fresh one costs more than the run)."""

    def __init__(self, tmp_path_factory, model: str, cache_dir: str):
        self.factory, self.model, self.cache_dir = tmp_path_factory, model, cache_dir
        self.root = made_once(tmp_path_factory, "backend-runs", lambda folder: None)  # the runs: one per session
        self.stdout = _Printed(self.root)

    def data(self, setup: str) -> dict[str, Path]:
        """{'train', 'val', 'json'}: a setup's training and evaluation CSV and its DeepSpeed user JSON."""

        def write(folder: Path) -> None:
            (folder / "ds.json").write_text(json.dumps(DEEPSPEED_USER_JSON))
            sentiment_split(folder, BACKEND_SETUPS[setup].n_train, BACKEND_SETUPS[setup].n_val)

        folder = made_once(self.factory, f"{setup}-data", write)
        return {"train": folder / "train.csv", "val": folder / "validation.csv", "json": folder / "ds.json"}

    def args(self, setup: str, out: Path, *flags: str, precision: str = "fp32", model: str | None = None) -> list[str]:
        """The CLI arguments of a PARITY_STEPS-step run of `setup` (tiny_bert unless `model`) into `out`."""
        s, data = BACKEND_SETUPS[setup], self.data(setup)
        flags = tuple(f.replace("{json}", str(data["json"])) for f in flags)
        return backend_train_args(
            model or self.model,
            (data["train"], data["val"]),
            self.cache_dir,
            out,
            *s.flags,
            "--freeze-layers",
            str(s.frozen_layers),
            *(() if s.frozen_layers else ("--freeze-embeddings", "off")),
            *flags,
            lr=s.lr,
            precision=precision,
            max_grad_norm=s.max_grad_norm,
        )

    def train(self, setup: str, name: str, *flags: str, precision: str = "fp32", torchrun: int = 0) -> Path:
        """A run of `setup` into root/name, asserted to succeed: in this process without --nproc
        (nor `torchrun`, a number of workers under an external torchrun), else launched."""
        out = self.root / name
        args = self.args(setup, out, *flags, precision=precision)
        if torchrun:  # nproc=N, an override: torchrun's parser would take --nproc for its --nproc-per-node
            args.insert(1, f"nproc={torchrun}")
            cmd, env = torchrun_cmd(torchrun, *args)
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        elif "--nproc" in flags:
            proc = run_cli(*args)
        else:
            from tuneforge import cli

            assert cli.main(args) == 0
            return out
        assert proc.returncode == 0, proc.stderr[-4000:]
        self.stdout[name] = proc.stdout
        return out

    def __getitem__(self, name: str) -> Path:
        from filelock import FileLock

        with FileLock(str(self.root / f"{name}.lock")):  # made by the first worker to ask; the others wait
            if not (self.root / name / "model").is_dir():
                shutil.rmtree(self.root / name, ignore_errors=True)  # what a failed attempt left
                setup, flags = BACKEND_RUNS[name]
                self.train(setup, name, *flags.split())
        return self.root / name

    def setup(self, name: str) -> BackendSetup:
        return BACKEND_SETUPS[BACKEND_RUNS[name][0]]

    def reference(self, name: str) -> Path:
        """The single-process run that `name` is compared with."""
        return self[REFERENCE_RUN[BACKEND_RUNS[name][0]]]

    def resume(self, source: str, name: str, *flags: str, step: int = 10, torchrun: int = 0):
        """Finish run `source` from its checkpoint-`step` into a run `name` with `flags` (+ --resume).

        Asserts the resumed run logged exactly steps step+1..PARITY_STEPS; returns (the whole run's
        losses, the resumed run's losses, the resumed run's folder)."""
        setup, ckpt = BACKEND_RUNS[source][0], self[source] / f"checkpoint-{step}"
        out = self.train(setup, name, *flags, "--resume", str(ckpt), torchrun=torchrun)
        whole, resumed = train_losses(self[source]), train_losses(out)
        assert sorted(resumed) == list(range(step + 1, PARITY_STEPS + 1))
        return whole, resumed, out


class _Printed(dict):
    """What the launching process of each run printed, kept beside the runs (the worker that reads a run may not
    be the one that made it)."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __setitem__(self, name: str, text: str) -> None:
        (self.root / f"{name}.stdout").write_text(text)

    def __getitem__(self, name: str) -> str:
        return (self.root / f"{name}.stdout").read_text()


@pytest.fixture(scope="session")
def backend_runs(tmp_path_factory, tiny_bert, cache_dir) -> BackendRuns:
    return BackendRuns(tmp_path_factory, tiny_bert, cache_dir)


REVIEWS = ["a wonderful, moving film", "a dull and tedious mess so very"]


def classify_reviews(*model_dirs: Path, texts: list[str] = REVIEWS) -> list[tuple]:
    """(the HF classifier loaded from the folder, its logits for `texts`) for each folder.

    The texts are tokenized once, by the first folder's tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    batch = AutoTokenizer.from_pretrained(model_dirs[0])(texts, return_tensors="pt", padding=True)
    predicted = []
    for folder in model_dirs:
        model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        with torch.no_grad():
            predicted.append((model, model(**batch).logits))
    return predicted


def query_weights(base_model: str, trained_dir: Path, layer: int = 0) -> tuple:
    """A layer's attention query matrix in a base BERT folder and in a classifier trained from it."""
    from safetensors.torch import load_file

    name = f"encoder.layer.{layer}.attention.self.query.weight"
    start = load_file(Path(base_model) / "model.safetensors")[name]
    return start, load_file(Path(trained_dir) / "model.safetensors")["bert." + name]


def caches_built(model) -> list[bool]:
    """Whether each later forward of `model` returned a key/value cache (a forward hook on the real model)."""
    built: list[bool] = []
    model.register_forward_hook(lambda module, args, output: built.append(getattr(output, "cache", None) is not None))
    return built


def model_spy():
    """A Callback recording the attention kernel and the dropout probabilities the model trains with."""
    import torch

    from tuneforge.trainer import Callback

    class ModelSpy(Callback):
        def on_train_begin(self, trainer):
            self.attention = trainer.model.config._attn_implementation
            self.dropouts = {m.p for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)}

    return ModelSpy()


# ---- a finished tiny run, shared by the bad-input suites ------------------------------------------
@pytest.fixture(scope="session")
def run_with_checkpoint(tmp_path_factory, tiny_bert):
    """A real 1-step run that saved OUTPUT_DIR/checkpoint-1 and OUTPUT_DIR/model."""
    from tuneforge.trainer import Trainer

    root = tmp_path_factory.mktemp("ckpt-run")
    train = write_sentiment_csv(root / "train.csv", 16, seed=1)
    Trainer(
        task="classification",
        model=tiny_bert,
        output_dir=str(root / "run"),
        max_steps=1,
        batch_size=8,
        save_strategy="steps",
        save_steps=1,
        quiet=True,
        data={"train_file": str(train), "validation_file": str(train), "cache_dir": str(root / "cache")},
    ).fit()
    assert (root / "run" / "checkpoint-1" / "trainer_state.json").exists()
    return root / "run", train
