"""tuneforge.files' strict JSON: every JSON file and line a run writes is standard JSON (no bare NaN or Infinity,
which jq, JavaScript's JSON.parse and Go refuse), an undefined metric written as null. The run is real: a
regression whose validation labels are all equal, so its pearson and spearman are undefined (nan). And a write
without room is told as such, whichever library wrote (`no_room`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from conftest import cli_main
from tuneforge.files import finite_or_null, json_text


def no_constant(token: str):
    raise ValueError(f"{token} is not standard JSON")


def strict(text: str):
    """`text` parsed as a strict reader parses it: NaN, Infinity and -Infinity refused."""
    return json.loads(text, parse_constant=no_constant)


def test_json_text_writes_nan_and_infinity_as_null():
    value = {"a": math.nan, "b": [1.5, math.inf, (-math.inf, 2)], "c": {"d": "nan", "e": None, "f": 3}}
    assert strict(json_text(value)) == {"a": None, "b": [1.5, None, [None, 2]], "c": {"d": "nan", "e": None, "f": 3}}
    assert finite_or_null(0.25) == 0.25 and finite_or_null(True) is True


def constant_label_files(folder: Path) -> tuple[Path, Path]:
    """(train.csv: 40 rows of varied scores, val.csv: 8 rows all scored 2.5): the validation's pearson is nan."""
    train, val = folder / "train.csv", folder / "val.csv"
    train.write_text("text,label\n" + "".join(f"sentence number {i} is fine,{(i * 7) % 50 / 10}\n" for i in range(40)))
    val.write_text("text,label\n" + "".join(f"validation sentence {i},2.5\n" for i in range(8)))
    return train, val


def test_a_run_with_an_undefined_metric_writes_standard_json(tmp_path, tiny_bert, cache_dir, capsys):
    train, val = constant_label_files(tmp_path)
    run = tmp_path / "run"
    flags = ["--task", "regression", "--model", tiny_bert, "--train-file", str(train), "--validation-file", str(val)]
    flags += ["--max-steps", "2", "--batch-size", "8", "--eval-strategy", "steps", "--eval-steps", "1"]
    flags += ["--save-steps", "1", "--cache-dir", cache_dir, "--output-dir", str(run), "--json", "--quiet"]
    code, out, err = cli_main(capsys, "train", *flags)
    assert code == 0, err

    printed = strict(out.strip().splitlines()[-1])
    assert printed["pearson"] is None and printed["spearman"] is None and math.isfinite(printed["loss"])
    assert strict((run / "result.json").read_text()) == printed
    evals = [r for r in map(strict, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "eval"]
    assert [(r["step"], r["pearson"]) for r in evals] == [(1, None), (2, None)]
    state = strict((run / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["last_eval"]["pearson"] is None and state["best_metric"] is None


def test_writes_without_room_say_so_whichever_library_wrote(tmp_path):
    """A file size limit fails a write as a full disk does; torch.save answers it with an opaque RuntimeError
    ('unexpected pos 576 vs 534'), and safetensors with a SafetensorError, no OSError: a checkpoint's optimizer.pt
    or model.safetensors without room was an internal error. Each is told as no room, with the errno's words."""
    import resource

    import torch
    from safetensors.torch import save_file

    from conftest import run_forked
    from tuneforge.files import no_room, torch_save

    big = {"w": torch.zeros(64 * 1024)}
    writes = {
        "torch": lambda: torch_save(big, tmp_path / "o.pt"),
        "safetensors": lambda: save_file(big, tmp_path / "m"),
    }

    def limited() -> int:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        for name, write in writes.items():
            try:
                write()
            except Exception as err:  # noqa: BLE001  (each library raises its own)
                print(name, no_room(err))
        return 0

    proc = run_forked(limited, ["limited"], timeout=60)
    assert proc.stdout.splitlines() == ["torch File too large", "safetensors File too large"], proc.stderr[-2000:]
    assert no_room(OSError(13, "Permission denied")) is None and no_room(RuntimeError("(os error 28)")) is None
