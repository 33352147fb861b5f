"""NER, multiple choice and extractive QA side by side with transformers.Trainer (issue 12): whole processes
timed, runs alternated (the machine is noisy). Same model (the bundled MiniLM), same data, same machine.

(a) transformers.Trainer as the example recipe does it: run_ner.py (benchmarks/hf_trainer_ner.py),
    run_swag.py (benchmarks/hf_trainer_swag.py) or run_qa.py (benchmarks/hf_trainer_qa.py), their READMEs'
    settings, fp32, one evaluation after training (the READMEs' --do_eval)
(b) `tuneforge train --task ner` / `--task multiple-choice --data-format codah` / `--task qa` with
    tuneforge's defaults
(f) the same defaults with `--precision fp32` forced: how (b) runs on a CPU without native bf16
    (where `auto` picks fp32 and (f) is (b)); (a) is fp32 on every machine

Data. ner: CoNLL-2003 (../shared/data/conll2003), trained on the first 2,500 of its 14,041 training
sentences (`--ner-train-samples`: a full epoch does not fit a 2-core machine; the peer's three
epochs take some 5-8 minutes on a subset that size), evaluated on the whole valid.txt
(3,250 sentences), scored on the whole test.txt (3,453). mc: CODAH, the authors' cross-validation
fold 0 (../shared/data/codah/cv_split/fold_0) whole: train 1,665 rows, dev 556, test 555. qa: SQuAD
v1.1 (../shared/data/squad), trained on the first 600 questions (`--qa-train-samples`; both sides
count questions, each with all its context windows) of train-v1.1-subset-du2017.json (11,877 questions
of 44 whole training articles; a 2-core machine runs the peer's recipe at about 4 s a step of 12
windows padded to 384 tokens, so 600 questions already take it some 7 minutes). SQuAD v1.1 has no
public test split, so the official dev-v1.1.json (10,570 questions, in its published order) gives
two disjoint parts: validation, its first 400 questions (of the Super_Bowl_50 article), and test, the
next 800 (the other 410 of Super_Bowl_50, Warsaw, Normans, the start of Nikola_Tesla). The harness
writes them once per invocation as SQuAD JSON into a temporary folder, beside a copy of the training
file: train-v1.1-subset-du2017.json, dev-validation.json and test.json, given to both sides as
--data-dir (tuneforge finds train* and dev* there; test.json goes to `tuneforge eval
--validation-file`); the split is recorded in the result file (meta.qa_split). The metric:
seqeval's entity-level micro F1 (ner), accuracy (mc), the official SQuAD v1.1 script's exact match
and token F1, x100 (qa: F1 decides; each side computes them with its own code).

Timing. The end-to-end figure (wall_s) is the training process: start-up, reading and tokenizing,
training, the evaluations (tuneforge's defaults: after each epoch; the peers: once, after training),
saving the model. The test score is taken apart: tuneforge's in a
second process, `tuneforge eval OUT/model --validation-file TEST` (test_wall_s); the peer's in its
own process after the model is saved (its test_s, by its own perf_counter), which is taken off its
process time (process_s) to give its wall_s. tuneforge gets a fresh, empty --cache-dir per run, so
its tokenization is paid every time, as the peer's is.

    python benchmarks/tasks_vs_hf_trainer.py --task ner --seeds 1 2 3
    python benchmarks/tasks_vs_hf_trainer.py --task mc --seeds 1 2 3
    python benchmarks/tasks_vs_hf_trainer.py --task qa --seeds 1 2 3
Writes benchmarks/results/tasks_vs_hf_trainer-TASK[-ONLY]-seeds-S[-...].json (one file per task) and
prints a markdown table per task.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import machine_meta

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared/data"
NER_TRAIN_SAMPLES = 2500
QA_TRAIN_SAMPLES = 600
QA_VALIDATION_QUESTIONS, QA_TEST_QUESTIONS = 400, 800  # the dev file's first questions, then the next ones
QA_FILES = {"train": "train-v1.1-subset-du2017.json", "validation": "dev-validation.json", "test": "test.json"}

TASKS = {
    "ner": {
        "title": "NER, CoNLL-2003",
        "peer": ("transformers.Trainer (run_ner.py recipe)", "hf_trainer_ner.py"),
        "tuneforge": ["--task", "ner"],
        "data_dir": SHARED / "conll2003",
        "test_file": "test.txt",
        "metric": "f1",
        "dev_metrics": ["f1", "precision", "recall", "accuracy"],
    },
    "mc": {
        "title": "multiple choice, CODAH fold 0",
        "peer": ("transformers.Trainer (run_swag.py recipe)", "hf_trainer_swag.py"),
        "tuneforge": ["--task", "multiple-choice", "--data-format", "codah"],
        "data_dir": SHARED / "codah/cv_split/fold_0",
        "test_file": "test.tsv",
        "metric": "accuracy",
        "dev_metrics": ["accuracy"],
    },
    "qa": {
        "title": "extractive QA, SQuAD v1.1",
        "peer": ("transformers.Trainer (run_qa.py recipe)", "hf_trainer_qa.py"),
        "tuneforge": ["--task", "qa"],
        "data_dir": SHARED / "squad",  # the source; both sides read the split that write_qa_split makes of it
        "test_file": QA_FILES["test"],
        "metric": "f1",
        "dev_metrics": ["exact_match", "f1"],
        "test_metrics": ["exact_match", "f1"],  # default: [metric]
        "digits": 2,  # the table's decimals (default 4)
    },
}
LABELS = {"f1": "F1", "accuracy": "accuracy", "exact_match": "EM"}


def write_qa_split(source: Path, folder: Path) -> dict:
    """The qa data in `folder`: a copy of the training file, and the official dev file's questions, in its order,
    cut into a validation part (the first QA_VALIDATION_QUESTIONS) and a test part (the next QA_TEST_QUESTIONS),
    each as SQuAD JSON holding only its questions' paragraphs; returns what went where."""
    shutil.copyfile(source / QA_FILES["train"], folder / QA_FILES["train"])
    dev = json.loads((source / "dev-v1.1.json").read_text(encoding="utf-8"))
    questions = [
        (article["title"], paragraph["context"], qa)
        for article in dev["data"]
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    ]
    meta = {"source": str(source), "train": QA_FILES["train"]}
    cuts = {"validation": (0, QA_VALIDATION_QUESTIONS)}
    cuts["test"] = (QA_VALIDATION_QUESTIONS, QA_VALIDATION_QUESTIONS + QA_TEST_QUESTIONS)
    for split, (lo, hi) in cuts.items():
        articles: dict[str, dict[str, list]] = {}  # title -> context -> its questions, in file order
        for title, context, qa in questions[lo:hi]:
            articles.setdefault(title, {}).setdefault(context, []).append(qa)
        data = [
            {"title": title, "paragraphs": [{"context": c, "qas": qas} for c, qas in paragraphs.items()]}
            for title, paragraphs in articles.items()
        ]
        doc = {"data": data, "version": dev.get("version", "1.1")}
        (folder / QA_FILES[split]).write_text(json.dumps(doc), encoding="utf-8")
        meta[split] = {"file": QA_FILES[split], "articles": list(articles), "questions": hi - lo}
    return meta


def data_dir(task, args) -> str:
    return str({"ner": args.ner_data_dir, "mc": args.mc_data_dir, "qa": args.qa_split_dir}[task])


def train_samples(task, args):
    return {"ner": args.ner_train_samples, "mc": args.mc_train_samples, "qa": args.qa_train_samples}[task]


def run(cmd):
    """(wall seconds, the JSON of the last stdout line) of one whole process."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


def run_peer(cmd, spec):
    wall, out = run(cmd)
    res = {"wall_s": round(wall - out.get("test_s", 0.0), 1), "process_s": round(wall, 1)}
    res.update({k: out[k] for k in spec["dev_metrics"]})
    res.update({f"test_{k}": out.get(f"test_{k}") for k in spec.get("test_metrics", [spec["metric"]])})
    res["test_s"] = out.get("test_s")
    return res


def run_tuneforge(train_cmd, eval_cmd, spec):
    cache = tempfile.mkdtemp(prefix="bench-tf-cache-")  # cold tokenization every run, as the peer's
    try:
        wall, out = run(train_cmd + ["--cache-dir", cache])
        res = {"wall_s": round(wall, 1)}
        res.update({k: out[k] for k in spec["dev_metrics"]})
        if eval_cmd:
            test_wall, test = run(eval_cmd + ["--cache-dir", cache])
            res.update({f"test_{k}": test[k] for k in spec.get("test_metrics", [spec["metric"]])})
            res["test_wall_s"] = round(test_wall, 1)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return res


def variants(task, args):
    """{key: (name, commands)}: the peer's command, or tuneforge's train and test-eval commands (--seed SEED
    goes at the end of the peer's and the train command)."""
    spec = TASKS[task]
    folder, samples = data_dir(task, args), train_samples(task, args)
    test_file = str(Path(folder) / spec["test_file"]) if not args.no_test else None

    peer_name, peer_script = spec["peer"]
    peer = [sys.executable, str(HERE / peer_script), "--data-dir", folder, "--output-dir", f"/tmp/bench-hf-{task}"]
    if samples:
        peer += ["--max-train-samples", str(samples)]
    if args.max_eval_samples:
        peer += ["--max-eval-samples", str(args.max_eval_samples)]
    if args.max_test_samples:
        peer += ["--max-test-samples", str(args.max_test_samples)]
    if args.no_test:
        peer += ["--test-file", ""]

    exe = str(Path(sys.executable).parent / "tuneforge")
    tf = [exe, "train", *spec["tuneforge"], "--data-dir", folder, "--overwrite", "--json", "--quiet"]
    if samples:
        tf += ["--max-train-samples", str(samples)]
    if args.max_eval_samples:
        tf += ["--max-eval-samples", str(args.max_eval_samples)]

    def tuneforge(out, extra=()):
        train = tf + ["--output-dir", out, *extra]
        evaluate = None
        if test_file:
            evaluate = [exe, "eval", f"{out}/model", *spec["tuneforge"], "--validation-file", test_file]
            evaluate += ["--output-dir", f"{out}-test", "--json", "--quiet", *extra]
            if args.max_test_samples:
                evaluate += ["--max-eval-samples", str(args.max_test_samples)]
        return train, evaluate

    return {
        "a": (peer_name, [peer]),
        "b": ("tuneforge defaults", tuneforge(f"/tmp/bench-tf-{task}-default")),
        "f": ("tuneforge defaults, fp32 forced", tuneforge(f"/tmp/bench-tf-{task}-fp32", ["--precision", "fp32"])),
    }


def run_variant(key, cmds, seed, spec):
    """One run of a variant: the peer's process, or tuneforge's train process and then its test eval."""
    if key == "a":
        return run_peer(cmds[0] + ["--seed", str(seed)], spec)
    train, evaluate = cmds
    return run_tuneforge(train + ["--seed", str(seed)], evaluate, spec)


def command(key, cmds) -> str:
    """The commands of a variant as run (the first takes --seed SEED; tuneforge's a fresh --cache-dir each run),
    joined by ' ; '."""
    cache = " --cache-dir EMPTY_TMP_DIR" if key != "a" else ""
    return " ; ".join(" ".join(c) + (" --seed SEED" if i == 0 else "") + cache for i, c in enumerate(cmds) if c)


def mean(runs, key, digits):
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(sum(values) / len(values), digits) if values else None


def bench(task, args):
    spec = TASKS[task]
    table = variants(task, args)
    results = {k: [] for k in args.only}
    for r in range(args.rounds):
        order = args.only if r % 2 == 0 else args.only[::-1]
        for seed in args.seeds:
            for key in order:
                res = {"seed": seed, **run_variant(key, table[key][1], seed, spec)}
                results[key].append(res)
                print(f"{task} round {r + 1} seed {seed} ({key}) {table[key][0]}: {res}", file=sys.stderr, flush=True)
    tests = spec.get("test_metrics", [spec["metric"]])
    summary = {}
    for key, runs in results.items():
        summary[key] = {
            "name": table[key][0],
            "runs": runs,
            "wall_s": mean(runs, "wall_s", 1),
            **{k: mean(runs, k, 4) for k in spec["dev_metrics"]},
            **{f"test_{k}": mean(runs, f"test_{k}", 4) for k in tests},
            **{k: mean(runs, k, 1) for k in ("process_s", "test_s", "test_wall_s") if k in runs[0]},
            "command": command(key, table[key][1]),
        }
    samples = train_samples(task, args)
    extra = {"qa_split": args.qa_split} if task == "qa" else {}
    meta = machine_meta(
        task=task,
        seeds=args.seeds,
        rounds=args.rounds,
        data_dir=str(args.qa_data_dir) if task == "qa" else data_dir(task, args),
        max_train_samples=samples,
        max_eval_samples=args.max_eval_samples,
        max_test_samples=args.max_test_samples,
        timing="wall_s: the training process (test scoring taken apart: test_s in the peer, test_wall_s a process)",
        **extra,
    )
    name = f"tasks_vs_hf_trainer-{task}"
    if args.only != "ab":
        name += f"-{args.only}"
    name += f"-seeds-{'-'.join(map(str, args.seeds))}"
    if args.rounds != 1:
        name += f"-rounds-{args.rounds}"
    if (
        (task == "ner" and samples != NER_TRAIN_SAMPLES)
        or (task == "mc" and samples)
        or (task == "qa" and samples != QA_TRAIN_SAMPLES)
    ):
        name += f"-train-{samples}"
    if args.max_eval_samples or args.max_test_samples:
        name += f"-eval-{args.max_eval_samples or 'all'}-test-{args.max_test_samples or 'all'}"
    out = Path(args.results_dir) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary}, indent=2))

    base = summary.get("a", {}).get("wall_s")
    shown = tests  # the table's dev and test columns: the task's test metrics ([metric] unless it says)

    def fmt(value) -> str:
        return f"{value:.{spec.get('digits', 4)}f}"

    def cols(prefix) -> str:
        return " | ".join(f"{prefix} {LABELS[k]}" for k in shown)

    print(f"\n{spec['title']}: seeds {args.seeds}, means over {args.rounds} round(s); results in {out}")
    print(f"| variant | wall s | speed-up vs (a) | {cols('dev')} | {cols('test')} |")
    print(f"|---|---|---|{'---|' * 2 * len(shown)}")
    for key, s in summary.items():
        speed = f"{base / s['wall_s']:.2f}x" if base else "-"
        dev = " | ".join(fmt(s[k]) for k in shown)
        test = " | ".join(fmt(s[f"test_{k}"]) if s[f"test_{k}"] is not None else "-" for k in shown)
        print(f"| ({key}) {s['name']} | {s['wall_s']} | {speed} | {dev} | {test} |")
    if len(shown) > 1:
        print(f"\nPer seed: wall s, dev {' / '.join(LABELS[k] for k in shown)} / test the same")
    print(f"\n| seed | {' | '.join(f'({k})' for k in summary)} |\n|---|{'---|' * len(summary)}")
    for i, seed in enumerate(args.seeds * args.rounds):
        cells = []
        for s in summary.values():
            x = s["runs"][i]
            dev = " / ".join(fmt(x[k]) for k in shown)
            test = "".join(f" / {fmt(x[f'test_{k}'])}" for k in shown if x.get(f"test_{k}") is not None)
            cells.append(f"{x['wall_s']} s, {dev}{test}")
        print(f"| {seed} | {' | '.join(cells)} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", nargs="+", choices=sorted(TASKS), required=True, help="ner, mc and/or qa")
    ap.add_argument("--only", default="ab", help="which variants to run, e.g. 'abf'")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1], help="each variant runs once per seed and round")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ner-data-dir", default=str(TASKS["ner"]["data_dir"]))
    ap.add_argument("--mc-data-dir", default=str(TASKS["mc"]["data_dir"]))
    ap.add_argument(
        "--qa-data-dir", default=str(TASKS["qa"]["data_dir"]), help="qa: train-v1.1-subset-du2017.json, dev-v1.1.json"
    )
    ap.add_argument(
        "--ner-train-samples", type=int, default=NER_TRAIN_SAMPLES, help="ner: the first N training sentences"
    )
    ap.add_argument("--mc-train-samples", type=int, default=None, help="mc: the first N training rows (default: all)")
    ap.add_argument("--qa-train-samples", type=int, default=QA_TRAIN_SAMPLES, help="qa: the first N training questions")
    ap.add_argument("--max-eval-samples", type=int, default=None, help="smoke runs: the first N validation examples")
    ap.add_argument("--max-test-samples", type=int, default=None, help="smoke runs: the first N test examples")
    ap.add_argument("--no-test", action="store_true", help="skip the test-split scores")
    ap.add_argument("--results-dir", default=str(HERE / "results"))
    args = ap.parse_args()
    if set(args.only) - {"a", "b", "f"}:
        raise SystemExit(f"--only takes letters of a, b, f; got {args.only!r}")
    args.qa_split_dir = tempfile.mkdtemp(prefix="bench-qa-split-") if "qa" in args.task else None
    try:
        if args.qa_split_dir:  # once per invocation: every run of both sides reads these files
            args.qa_split = write_qa_split(Path(args.qa_data_dir), Path(args.qa_split_dir))
        for task in args.task:
            bench(task, args)
    finally:
        if args.qa_split_dir:
            shutil.rmtree(args.qa_split_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
