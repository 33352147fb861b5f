"""`tuneforge prepare`: a config's data tokenized once into memory-mapped shards that its runs read (one process
and two ranks) without tokenizing again and with the same result; a changed file prepared anew; a prepared folder
named as a source, refused when another tokenizer, truncation or packing made it; compressed sources, and a
truncated one refused."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import read_jsonl, write_sentiment_csv
from test_bad_input import in_process
from test_data_mixture import mixture_config, sources, write_texts  # noqa: F401 (the fixture)


def final_eval(run: Path) -> dict:
    return {k: v for k, v in read_jsonl(run / "metrics.jsonl")[-1].items() if k != "time_s"}


def test_prepared_data_is_read_by_the_run_and_gives_the_same_run(capfd, tmp_path, tiny_gpt2, sources):  # noqa: F811
    cache = tmp_path / "cache"
    config = mixture_config(tmp_path, tiny_gpt2, str(cache), sources, max_steps=6)
    plain = in_process(capfd, "train", config, "--output-dir", tmp_path / "plain", "--cache-dir", tmp_path / "other")
    assert plain.returncode == 0, plain.stderr[-2000:]
    prepared = in_process(capfd, "prepare", config, "--num-workers", "2", "--json")
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    result = json.loads(prepared.stdout.strip().splitlines()[-1])
    assert result["sources"] == {"web": 108, "books": 43, "code": 14} and result["validation_rows"] == 19
    folders = sorted((cache / "prepared").iterdir())
    assert len(folders) == 3 and all((f / "meta.json").is_file() and (f / "train").is_dir() for f in folders)
    # the tokenization cache it copied from is gone (the data is on disk once); the plain run's, elsewhere, is not
    assert "removed the tokenization cache of these features" in prepared.stderr
    assert not list(cache.glob("*.arrow")) and list((tmp_path / "other").glob("*.arrow"))
    before = sorted(p.name for p in cache.iterdir())
    run = in_process(capfd, "train", config)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr.count("reading prepared data") == 3 and "tokeniz" not in run.stderr.replace(
        "nothing tokenized", ""
    )
    assert sorted(p.name for p in cache.iterdir()) == before  # nothing new in the cache
    assert final_eval(tmp_path / "run") == final_eval(tmp_path / "plain")
    # two ranks read the same shards
    ddp = in_process(capfd, "train", config, "--output-dir", tmp_path / "ddp", "--backend", "ddp", "--nproc", "2")
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    assert "tokeniz" not in ddp.stderr.replace("nothing tokenized", "")


def test_a_changed_source_is_prepared_again_not_read_stale(capfd, tmp_path, tiny_gpt2, sources):  # noqa: F811
    config = mixture_config(tmp_path, tiny_gpt2, str(tmp_path / "cache"), sources, max_steps=2)
    assert in_process(capfd, "prepare", config).returncode == 0
    web = Path(sources[0]["path"])
    web.write_text(web.read_text().replace("dog", "cow"))
    run = in_process(capfd, "train", config)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "data source 'web': tokenize train" in run.stderr
    assert "data source 'books': reading prepared data" in run.stderr


def test_a_prepared_folder_is_a_source_of_its_tokenizer_only(capfd, tmp_path, tiny_gpt2, sources):  # noqa: F811
    config = mixture_config(tmp_path, tiny_gpt2, str(tmp_path / "cache"), sources, max_steps=2)
    assert in_process(capfd, "prepare", config).returncode == 0
    # the web source's folder: the one whose training split has 108 rows
    folder = next(
        f
        for f in (tmp_path / "cache" / "prepared").iterdir()
        if json.loads((f / "meta.json").read_text())["rows"]["train"] == 108
    )
    shards = tmp_path / "web-shards"
    shutil.copytree(folder, shards)
    named = [{"path": str(shards), "weight": 1}, {**sources[1], "weight": 1}]
    ok = in_process(capfd, "train", mixture_config(tmp_path, tiny_gpt2, str(tmp_path / "cache"), named, max_steps=2))
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert f"data source 'web-shards': reading prepared data {shards}" in ok.stderr
    # the same model with one more token in its tokenizer: the shards' ids are no longer its ids
    from transformers import AutoTokenizer

    other_model = tmp_path / "other-model"
    shutil.copytree(tiny_gpt2, other_model)
    tokenizer = AutoTokenizer.from_pretrained(other_model)
    tokenizer.add_tokens(["<added>"])
    tokenizer.save_pretrained(other_model)
    other = mixture_config(tmp_path, str(other_model), str(tmp_path / "cache2"), named, max_steps=2)
    refused = in_process(capfd, "train", other, "--overwrite")
    assert refused.returncode == 2
    lines = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(f"error: data source 'web-shards': '{shards}' was prepared with ")
    assert "another tokenizer" in lines[0]


def test_gzip_sources_train_and_a_truncated_one_is_one_line(capfd, tmp_path, tiny_gpt2, sources):  # noqa: F811
    web = Path(sources[0]["path"])
    packed = web.with_name("web.jsonl.gz")
    packed.write_bytes(gzip.compress(web.read_bytes()))
    sources[0] = {**sources[0], "path": str(packed)}
    config = mixture_config(tmp_path, tiny_gpt2, str(tmp_path / "cache"), sources, max_steps=2)
    ok = in_process(capfd, "train", config)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "  web: 108 rows" in ok.stderr
    packed.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    refused = in_process(capfd, "train", config, "--overwrite")
    assert refused.returncode == 2
    lines = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1
    assert lines[0].startswith(f"error: data source 'web': file '{packed}' is not a whole gzip file")


def test_a_plain_training_file_is_prepared_too(capfd, tmp_path, tiny_gpt2, sources):  # noqa: F811
    args = ["--task", "clm", "--model", tiny_gpt2, "--train-file", sources[0]["path"], "--no-packing"]
    args += ["--cache-dir", tmp_path / "cache", "--max-steps", "2", "--max-length", "32", "--precision", "fp32"]
    assert in_process(capfd, "prepare", *args).returncode == 0
    run = in_process(capfd, "train", *args, "--output-dir", tmp_path / "run")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "reading prepared data" in run.stderr and "tokenize train" not in run.stderr


def test_packed_sources_are_prepared_as_full_blocks_of_each_source(capfd, tmp_path, tiny_gpt2, sources):  # noqa: F811
    """Packing (clm, sft) on prepared data: each source's texts cut into blocks of its own (a block never holds two
    sources' tokens), the blocks prepared once, the run on them the run on the raw files."""
    from tuneforge.data.prepared import read_prepared

    cache = tmp_path / "cache"
    held_out = write_texts(tmp_path / "held-out.jsonl", 12, (3, 8), 9)  # one file, so one cache key, for each source
    sources = [{**source, "validation_file": str(held_out)} for source in sources]
    config = mixture_config(tmp_path, tiny_gpt2, str(cache), sources, max_steps=4, packing=True, block_size=16)
    plain = in_process(capfd, "train", config, "--output-dir", tmp_path / "plain", "--cache-dir", tmp_path / "other")
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert in_process(capfd, "prepare", config, "--num-workers", "2").returncode == 0
    assert not list(cache.glob("*.arrow"))  # the blocks and the unpacked features they were cut from: removed
    blocks = []
    for folder in (cache / "prepared").iterdir():
        lengths = read_prepared(folder, log=lambda line: None).lengths["train"]
        assert (lengths[:-1] == 16).all() and 0 < lengths[-1] <= 16  # full blocks; a source's last may be short
        blocks.append(len(lengths))
    run = in_process(capfd, "train", config)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr.count("reading prepared data") == 3 and "blocks of 16" not in run.stderr
    assert f"data mixture: 3 sources, {sum(blocks)} examples per epoch" in run.stderr
    assert final_eval(tmp_path / "run") == final_eval(tmp_path / "plain")


def web_folder(capfd, tmp_path, tiny_gpt2, sources) -> Path:  # noqa: F811
    """The web source (108 training rows) prepared, copied out of the cache as shared storage would hold it."""
    config = mixture_config(tmp_path, tiny_gpt2, str(tmp_path / "cache"), sources)
    assert in_process(capfd, "prepare", config).returncode == 0
    folder = next(
        f
        for f in (tmp_path / "cache" / "prepared").iterdir()
        if json.loads((f / "meta.json").read_text())["rows"]["train"] == 108
    )
    return Path(shutil.copytree(folder, tmp_path / "web-shards"))


@pytest.mark.parametrize(
    ("values", "needle"),
    [({"max_length": 8}, "max_length 32, this run has 8"), ({"packing": True}, "packing False, this run has True")],
    ids=["max_length", "packing"],
)
def test_a_prepared_folder_of_other_truncation_or_packing_is_refused(
    capfd,
    tmp_path,
    tiny_gpt2,
    sources,  # noqa: F811
    values,
    needle,
):
    shards = web_folder(capfd, tmp_path, tiny_gpt2, sources)
    named = [{"path": str(shards), "weight": 1}, {**sources[1], "weight": 1}]
    config = mixture_config(tmp_path, tiny_gpt2, str(tmp_path / "cache2"), named, max_steps=2)
    run = yaml.safe_load(config.read_text())
    for key, value in values.items():
        (run["data"] if key == "max_length" else run)[key] = value
    config.write_text(yaml.safe_dump(run))
    refused = in_process(capfd, "train", config)
    assert refused.returncode == 2
    lines = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(f"error: data source 'web-shards': '{shards}' was prepared with ")
    assert needle in lines[0] and not (tmp_path / "run" / "model").exists()


def test_a_prepared_classification_folder_is_a_source_evaluated_on_its_validation_file(capfd, tmp_path, tiny_bert):
    """A classifier's prepared folder named as a source: it trains (it was read as a training file: 'is a folder'),
    it is evaluated on the validation file the source names (not the rows held out when it was prepared), and with
    a source of other labels, whose ids it was not encoded with, it is refused in one line."""
    train, validation = write_sentiment_csv(tmp_path / "a.csv", 60, 1), write_sentiment_csv(tmp_path / "v.csv", 7, 2)
    other = tmp_path / "b.csv"
    other.write_text(write_sentiment_csv(tmp_path / "b.csv", 30, 3).read_text().replace(",neg", ",neutral"))
    values = {"task": "classification", "model": tiny_bert, "output_dir": str(tmp_path / "run"), "max_steps": 2}
    values["data"] = {"cache_dir": str(tmp_path / "cache"), "max_length": 32}

    def config(*given) -> Path:
        path = tmp_path / "mix.yaml"
        path.write_text(yaml.safe_dump({**values, "data": {**values["data"], "sources": list(given)}}))
        return path

    assert in_process(capfd, "prepare", config({"path": str(train)})).returncode == 0
    shards = shutil.copytree(next((tmp_path / "cache" / "prepared").iterdir()), tmp_path / "a-shards")
    named = {"path": str(shards), "weight": 1, "validation_file": str(validation)}
    ok = in_process(capfd, "train", config(named, {"path": str(train), "weight": 1, "name": "raw"}))
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "data source 'a-shards': tokenize validation: tokenizing 7 examples" in ok.stderr
    refused = in_process(capfd, "train", config(named, {"path": str(other), "weight": 1}), "--overwrite")
    assert refused.returncode == 2
    lines = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(f"error: data source 'a-shards': '{shards}' was prepared with the ")
    assert "['neg', 'neutral', 'pos']" in lines[0]


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--lora-r", "8"], "--lora-r sets up LoRA adapters, and this run has none (--adapter none)"),
        (["lora_alpha=64"], "lora_alpha=64 sets up LoRA adapters"),
        (["--experiment-name", "mrpc"], "--experiment-name is the experiment or project"),
    ],
)
def test_prepare_refuses_the_settings_train_would_refuse_as_doing_nothing(capfd, tmp_path, flags, needle):
    """prepare takes train's command line: one that train refuses in one line (a LoRA or tracker setting that would
    do nothing) was prepared for without a word, and the run it was for then refused."""
    train = write_sentiment_csv(tmp_path / "train.csv", 8)
    proc = in_process(capfd, "prepare", "--task", "classification", "--train-file", train, *flags)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines


def test_prepared_data_without_room_is_one_line_and_leaves_no_folder(capfd, tmp_path, tiny_bert):
    """Writing the prepared shards failed for want of room (a full disk, a quota; here a file size limit, with the
    tokenization cache written by a run before): 'internal error' (pyarrow's OSError was not caught); one line
    naming the folder, and nothing of it left in the cache."""
    from conftest import cli_without_room

    cache = tmp_path / "cache"
    data = [
        "--task",
        "classification",
        "--model",
        tiny_bert,
        "--train-file",
        write_sentiment_csv(tmp_path / "a.csv", 60),
    ]
    run = in_process(capfd, "train", *data, "--cache-dir", cache, "--max-steps", "1", "--output-dir", tmp_path / "run")
    assert run.returncode == 0, run.stderr[-2000:]
    line = cli_without_room([str(a) for a in ("prepare", *data, "--cache-dir", cache)], 2000)
    assert line.startswith(f"error: the prepared data folder {str(cache / 'prepared')!r}"[:-1] + "/"), line
    assert line.endswith(" has no room (File too large); free space there or choose another --cache-dir"), line
    assert list((cache / "prepared").iterdir()) == []
