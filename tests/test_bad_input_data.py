"""Every user-supplied file of `train`, in every task family, fails in one line: another encoding (UTF-16,
Latin-1) is refused the same way by every reader and a UTF-8 byte-order mark is read; a folder given where a file
is expected says so; a misspelt key names what is missing; a chat template that does not parse or raises for a row
names the template, the row and its own message. Each case: exit 2, one `error:` line, nothing on disk changed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from conftest import cli_flags
from test_bad_input_writers import refused

LATIN1 = "un film très beau"
CHAT = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]}
REJECTED = [{"role": "assistant", "content": "go away"}]
SYSTEM_CHAT = {"messages": [{"role": "system", "content": "be brief"}, *CHAT["messages"]]}
PAIR = {"prompt": "where is the cat", "chosen": "on the mat", "rejected": "it is blue"}
SQUAD_ROW = {
    "id": "1",
    "question": "who sat?",
    "context": "the cat sat.",
    "answers": {"text": ["the cat"], "answer_start": [0]},
}
SWAG_HEADER = "sent1,sent2,ending0,ending1,ending2,ending3,label"
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
GEMMA_LIKE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" + PLAIN
)


def jsonl(*rows: dict) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def write(path: Path, content: str | bytes) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


# case -> (task, model fixture, files to write {name: content; None: a folder}, flags {flag: name or value}, needles)
CASES = {
    "classification: train file is a folder": (
        "classification",
        "tiny_bert",
        {"data": None},
        {"train_file": "data"},
        ("is a folder, not a file",),
    ),
    "classification: UTF-16 csv": (
        "classification",
        "tiny_bert",
        {"t.csv": "text,label\na,pos\nb,neg\n".encode("utf-16")},
        {"train_file": "t.csv"},
        ("is UTF-16 text, not UTF-8", "re-save it as UTF-8"),
    ),
    "classification: jsonl with a BOM and a misspelt label key": (
        "classification",
        "tiny_bert",
        {"t.jsonl": "\ufeff" + jsonl({"text": "a", "lable": "pos"}, {"text": "b", "lable": "neg"})},
        {"train_file": "t.jsonl"},
        ("column 'label' not found", "columns are: text, lable"),
    ),
    "classification: json that does not parse": (
        "classification",
        "tiny_bert",
        {"t.json": '[{"text": "a", "label": "pos"},'},
        {"train_file": "t.json"},
        ("could not be parsed as json",),
    ),
    "regression: Latin-1 tsv": (
        "regression",
        "tiny_bert",
        {"t.tsv": f"text\tlabel\n{LATIN1}\t1.0\n".encode("latin-1")},
        {"train_file": "t.tsv"},
        ("not UTF-8 text", "byte 0xe8"),
    ),
    "regression: an infinite label": (
        "regression",
        "tiny_bert",
        {"t.csv": "text,label\na,1.5\nb,inf\nc,2\nd,0.5\n"},
        {"train_file": "t.csv", "validation_file": "t.csv"},
        ("regression label 'inf'", "(row 2)", "is not a finite number"),
    ),
    "glue: data dir is a file": ("glue/sst2", "tiny_bert", {"glue": "x"}, {"data_dir": "glue"}, ("glue",)),
    "glue: data dir without its files": (
        "glue/sst2",
        "tiny_bert",
        {"glue": None},
        {"data_dir": "glue"},
        ("train.tsv",),
    ),
    "glue: data dir beside a validation file": (
        "glue/sst2",
        "tiny_bert",
        {"glue": None, "v.tsv": "sentence\tlabel\na\t1\n"},
        {"data_dir": "glue", "validation_file": "v.tsv"},
        ("--data-dir reads a GLUE folder",),
    ),
    "clm: UTF-16 text": (
        "clm",
        "tiny_gpt2",
        {"t.txt": "a line\nanother\n".encode("utf-16")},
        {"train_file": "t.txt"},
        ("is UTF-16 text, not UTF-8",),
    ),
    "clm: Latin-1 text": (
        "clm",
        "tiny_gpt2",
        {"t.txt": f"{LATIN1}\n".encode("latin-1")},
        {"train_file": "t.txt"},
        ("not UTF-8 text",),
    ),
    "clm: train file is a folder": (
        "clm",
        "tiny_gpt2",
        {"texts.txt": None},
        {"train_file": "texts.txt"},
        ("is a folder, not a file",),
    ),
    "sft: Latin-1 chats": (
        "sft",
        "tiny_llama",
        {"c.jsonl": jsonl({"messages": [{"role": "user", "content": LATIN1}]}).encode("latin-1"), "t.jinja": PLAIN},
        {"train_file": "c.jsonl", "chat_template": "t.jinja"},
        ("not UTF-8 text", "byte 0xe8"),
    ),
    "sft: chats file is a folder": (
        "sft",
        "tiny_llama",
        {"chats.jsonl": None, "t.jinja": PLAIN},
        {"train_file": "chats.jsonl", "chat_template": "t.jinja"},
        ("is a folder, not a file",),
    ),
    "sft: misspelt messages key": (
        "sft",
        "tiny_llama",
        {"c.jsonl": jsonl({"message": CHAT["messages"]}), "t.jinja": PLAIN},
        {"train_file": "c.jsonl", "chat_template": "t.jinja"},
        ("none of `messages`", "it has: message"),
    ),
    "sft: a line that is not JSON": (
        "sft",
        "tiny_llama",
        {"c.jsonl": jsonl(CHAT) + "{oops\n", "t.jinja": PLAIN},
        {"train_file": "c.jsonl", "chat_template": "t.jinja"},
        ("line 2", "not valid JSON"),
    ),
    "sft: template that does not parse": (
        "sft",
        "tiny_llama",
        {"c.jsonl": jsonl(CHAT, CHAT), "t.jinja": "{% for m in messages %}{{ m['content'] }}"},
        {"train_file": "c.jsonl", "chat_template": "t.jinja"},
        ("t.jinja", "not a valid Jinja template", "line 1"),
    ),
    "sft: template that raises for a system message": (
        "sft",
        "tiny_llama",
        {"c.jsonl": jsonl(CHAT, CHAT, SYSTEM_CHAT, CHAT), "t.jinja": GEMMA_LIKE},
        {"train_file": "c.jsonl", "validation_file": "c.jsonl", "chat_template": "t.jinja"},
        ("t.jinja", "row 3 of", "c.jsonl", "System role not supported"),
    ),
    "sft: template that raises in a held-out split names the file's row": (
        "sft",
        "tiny_llama",
        {"c.jsonl": jsonl(*[CHAT] * 14, SYSTEM_CHAT, *[CHAT] * 5), "t.jinja": GEMMA_LIKE},
        {"train_file": "c.jsonl", "chat_template": "t.jinja"},  # no validation file: 10% held out, shuffled
        ("t.jinja", "row 15 of", "c.jsonl", "System role not supported"),
    ),
    **{
        f"{task}: template file that is empty": (
            task,
            "tiny_llama",
            {"c.jsonl": jsonl(CHAT, CHAT), "p.jsonl": jsonl(PAIR, PAIR), "t.jinja": " \n"},
            {"train_file": "c.jsonl" if task == "sft" else "p.jsonl", "chat_template": "t.jinja"},
            ("--chat-template", "t.jinja", "is empty"),
        )
        for task in ("sft", "dpo")
    },
    "sft: template is a folder": (
        "sft",
        "tiny_llama",
        {"c.jsonl": jsonl(CHAT, CHAT), "tpl": None},
        {"train_file": "c.jsonl", "chat_template": "tpl"},
        ("--chat-template", "is a folder, not a file"),
    ),
    "sft: template missing": (
        "sft",
        "tiny_llama",
        {"c.jsonl": jsonl(CHAT, CHAT)},
        {"train_file": "c.jsonl", "chat_template": "nope.jinja"},
        ("nope.jinja", "does not exist"),
    ),
    "dpo: misspelt chosen key": (
        "dpo",
        "tiny_llama",
        {"p.jsonl": jsonl({**{k: v for k, v in PAIR.items() if k != "chosen"}, "choosen": "x"})},
        {"train_file": "p.jsonl"},
        ("chosen",),
    ),
    "dpo: template that raises for a system message": (
        "dpo",
        "tiny_llama",
        {
            "p.jsonl": jsonl(
                *[{"prompt": CHAT["messages"][:1], "chosen": CHAT["messages"][1:], "rejected": REJECTED}] * 2,
                {
                    "prompt": SYSTEM_CHAT["messages"][:2],
                    "chosen": CHAT["messages"][1:],
                    "rejected": REJECTED,
                },
            ),
            "t.jinja": GEMMA_LIKE,
        },
        {"train_file": "p.jsonl", "validation_file": "p.jsonl", "chat_template": "t.jinja"},
        ("t.jinja", "row 3 of", "p.jsonl", "System role not supported"),
    ),
    **{
        f"{task}: template that raises after a dropped pair in a held-out split names the file's row": (
            task,
            "tiny_llama",
            {
                "p.jsonl": jsonl(
                    {**PAIR, "rejected": PAIR["chosen"]},  # identical: dropped with --drop-identical-pairs
                    *[{"prompt": CHAT["messages"][:1], "chosen": CHAT["messages"][1:], "rejected": REJECTED}] * 13,
                    {"prompt": SYSTEM_CHAT["messages"][:2], "chosen": CHAT["messages"][1:], "rejected": REJECTED},
                    *[{"prompt": CHAT["messages"][:1], "chosen": CHAT["messages"][1:], "rejected": REJECTED}] * 5,
                ),
                "t.jinja": GEMMA_LIKE,
            },
            {"train_file": "p.jsonl", "chat_template": "t.jinja", "drop_identical_pairs": True, **limit},
            ("t.jinja", "row 15 of", "p.jsonl", "System role not supported"),
        )
        for task, limit in (("dpo", {}), ("reward", {"max_length": 64}))
    },
    "dpo: corrupt gzip": (
        "dpo",
        "tiny_llama",
        {"p.jsonl.gz": b"\x1f\x8bnot really gzip"},
        {"train_file": "p.jsonl.gz"},
        ("not a readable gzip file",),
    ),
    "dpo: UTF-16 pairs": (
        "dpo",
        "tiny_llama",
        {"p.jsonl": jsonl(PAIR).encode("utf-16")},
        {"train_file": "p.jsonl"},
        ("is UTF-16 text, not UTF-8",),
    ),
    "dpo: gzip of Latin-1 text": (
        "dpo",
        "tiny_llama",
        {"p.jsonl.gz": gzip.compress(jsonl({**PAIR, "chosen": LATIN1}).encode("latin-1"))},
        {"train_file": "p.jsonl.gz"},
        ("not UTF-8 text",),
    ),
    "seq2seq: Latin-1 source file": (
        "seq2seq",
        "tiny_t5",
        {"a.en": f"{LATIN1}\n".encode("latin-1"), "a.de": "ein Film\n"},
        {"source_file": "a.en", "target_file": "a.de"},
        ("not UTF-8 text",),
    ),
    "seq2seq: source file is a folder": (
        "seq2seq",
        "tiny_t5",
        {"src": None, "a.de": "ein Film\n"},
        {"source_file": "src", "target_file": "a.de"},
        ("is a folder, not a file",),
    ),
    "seq2seq: UTF-16 target file": (
        "seq2seq",
        "tiny_t5",
        {"a.en": "a film\n", "a.de": "ein Film\n".encode("utf-16")},
        {"source_file": "a.en", "target_file": "a.de"},
        ("is UTF-16 text, not UTF-8",),
    ),
    "ner: Latin-1 CoNLL": (
        "ner",
        "tiny_bert",
        {"t.conll": "très B-PER\nbeau O\n".encode("latin-1")},
        {"train_file": "t.conll"},
        ("not UTF-8 text", "byte 0xe8"),
    ),
    "ner: CoNLL file is a folder": (
        "ner",
        "tiny_bert",
        {"t.conll": None},
        {"train_file": "t.conll"},
        ("is a folder, not a file",),
    ),
    "ner: UTF-16 CoNLL": (
        "ner",
        "tiny_bert",
        {"t.conll": "EU B-ORG\nrejects O\n".encode("utf-16")},
        {"train_file": "t.conll"},
        ("is UTF-16 text, not UTF-8",),
    ),
    "qa: Latin-1 SQuAD json": (
        "qa",
        "tiny_bert",
        {"t.json": json.dumps({"data": []}).replace("[]", f'["{LATIN1}"]').encode("latin-1")},
        {"train_file": "t.json"},
        ("not UTF-8 text",),
    ),
    "qa: SQuAD file is a folder": (
        "qa",
        "tiny_bert",
        {"t.json": None},
        {"train_file": "t.json"},
        ("is a folder, not a file",),
    ),
    "qa: answer instead of answers": (
        "qa",
        "tiny_bert",
        {"t.jsonl": jsonl(*[{**{k: v for k, v in SQUAD_ROW.items() if k != "answers"}, "answer": "the cat"}] * 3)},
        {"train_file": "t.jsonl"},
        ("answers",),
    ),
    "multiple-choice: missing ending columns": (
        "multiple-choice",
        "tiny_bert",
        {"t.csv": "sent1,sent2,label\na,b,0\n"},
        {"train_file": "t.csv"},
        ("ending",),
    ),
    "multiple-choice: UTF-16 csv": (
        "multiple-choice",
        "tiny_bert",
        {"t.csv": f"{SWAG_HEADER}\na,b,c,d,e,f,0\n".encode("utf-16")},
        {"train_file": "t.csv"},
        ("is UTF-16 text, not UTF-8",),
    ),
    # a table of another separator reads as one column, so its columns were 'not found' ('columns are: text;label')
    "classification: a ;-separated csv": (
        "classification",
        "tiny_bert",
        {"t.csv": "text;label\na;pos\nb;neg\n"},
        {"train_file": "t.csv"},
        ("reads as one column 'text;label'", "seems separated by ';'", "re-save it comma-separated"),
    ),
    "classification: a |-separated csv, its text column named": (
        "classification",
        "tiny_bert",
        {"t.csv": "text|label\na|pos\nb|neg\n"},
        {"train_file": "t.csv", "text_column": "text"},
        ("reads as one column 'text|label'", "seems separated by '|'"),
    ),
    "embedding: a tab-separated csv": (
        "embedding",
        "tiny_bert",
        {"t.csv": "anchor\tpositive\na\tb\nc\td\n"},
        {"train_file": "t.csv"},
        ("seems separated by tabs", "name it .tsv"),
    ),
    "multiple-choice: a ;-separated SWAG csv": (
        "multiple-choice",
        "tiny_bert",
        {"t.csv": SWAG_HEADER.replace(",", ";") + "\na;b;c;d;e;f;0\n"},
        {"train_file": "t.csv"},
        ("seems separated by ';'",),
    ),
    "multiple-choice: train file is a folder": (
        "multiple-choice",
        "tiny_bert",
        {"t.csv": None},
        {"train_file": "t.csv"},
        ("is a folder, not a file",),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_training_file(case, tmp_path, capsys, request):
    task, model_fixture, files, flags, needles = CASES[case]
    for name, content in files.items():
        (tmp_path / name).mkdir() if content is None else write(tmp_path / name, content)
    paths = {k: str(tmp_path / v) if k.endswith(("_file", "_dir", "template")) else v for k, v in flags.items()}
    model = request.getfixturevalue(model_fixture)
    capsys.readouterr()  # the fixture's own output, when it is first made here
    args = cli_flags(task=task, model=model, output_dir=tmp_path / "out", cache_dir=tmp_path / "cache", **paths)
    refused(capsys, (tmp_path,), "train", *args, "--max-steps", "1", "--quiet", needles=needles)
    assert not (tmp_path / "out").exists()


# ---- a UTF-8 byte-order mark is read, by every reader --------------------------------------------------
def test_every_reader_reads_a_file_with_a_byte_order_mark(tmp_path):
    from tuneforge.data import chat, conll, squad, text
    from tuneforge.data.sources import read_table

    bom = "\ufeff"
    assert list(read_table(write(tmp_path / "a.jsonl", bom + jsonl({"text": "a", "label": "pos"}))).columns) == [
        "text",
        "label",
    ]
    assert list(read_table(write(tmp_path / "a.json", bom + json.dumps([{"text": "a"}]))).columns) == ["text"]
    assert list(read_table(write(tmp_path / "a.csv", bom + "text,label\na,pos\n")).columns) == ["text", "label"]
    assert read_table(write(tmp_path / "a.txt", bom + "first\n"))["text"].tolist() == ["first"]
    assert chat.read_rows(write(tmp_path / "c.jsonl", bom + jsonl(CHAT))) == [CHAT]
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress((bom + jsonl(CHAT)).encode("utf-8")))
    assert chat.read_rows(gz) == [CHAT]
    assert conll.read_conll(write(tmp_path / "t.conll", bom + "EU B-ORG\nrejects O\n"))["tokens"][0] == [
        "EU",
        "rejects",
    ]
    assert text.read_lines(write(tmp_path / "s.en", bom + "a man\n"), keep_linebreaks=False) == ["a man"]
    doc = {
        "data": [
            {
                "paragraphs": [
                    {
                        "context": "the cat sat.",
                        "qas": [{"id": "1", "question": "who?", "answers": [{"text": "the cat", "answer_start": 0}]}],
                    }
                ]
            }
        ]
    }
    assert squad.read_squad(write(tmp_path / "q.json", bom + json.dumps(doc)))["question"] == ["who?"]


def test_a_chat_template_with_a_byte_order_mark_renders_without_it(tmp_path, tiny_llama):
    from transformers import AutoTokenizer

    from tuneforge.data.chat import set_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    set_chat_template(tokenizer, str(write(tmp_path / "t.jinja", "\ufeff" + PLAIN)), tiny_llama)
    assert tokenizer.apply_chat_template(CHAT["messages"], tokenize=False) == "user: hi there\nassistant: hello\n"


# ---- data that parses but is almost certainly a mistake --------------------------------------------------
def test_a_misspelt_label_key_in_some_rows_names_the_row_and_the_key(tmp_path, tiny_bert, capsys):
    rows = [{"text": f"good {i}", "label": "pos"} if i % 2 else {"text": f"bad {i}", "lable": "neg"} for i in range(8)]
    train = write(tmp_path / "t.jsonl", jsonl(*rows))
    args = cli_flags(model=tiny_bert, train_file=train, validation_file=train, output_dir=tmp_path / "out")
    refused(capsys, (tmp_path,), "train", *args, needles=("row 1 of", "has an empty label", "'lable': a misspelling"))


def test_a_misspelt_chosen_key_names_the_keys_the_row_has(tmp_path, tiny_llama, capsys):
    train = write(tmp_path / "p.jsonl", jsonl(PAIR, {"prompt": "p", "choosen": "a", "rejected": "b"}))
    args = cli_flags(task="dpo", model=tiny_llama, train_file=train, validation_file=train, output_dir=tmp_path / "o")
    refused(capsys, (tmp_path,), "train", *args, needles=("row 2 of", "(it has: prompt, choosen, rejected)"))


def test_qa_rows_with_answer_instead_of_answers_are_counted_in_a_warning(tmp_path, capsys):
    from tuneforge.data.squad import read_squad

    good = SQUAD_ROW
    bad = {k: v for k, v in SQUAD_ROW.items() if k != "answers"} | {"answer": "the cat"}
    ds = read_squad(write(tmp_path / "q.jsonl", jsonl(good, bad, bad)))
    assert len(ds) == 3
    err = capsys.readouterr().err
    assert err.startswith("warning: 2 of 3 rows of") and "`answer`, which is not read" in err
    read_squad(write(tmp_path / "ok.jsonl", jsonl(good, {**good, "answers": {"text": [], "answer_start": []}})))
    assert capsys.readouterr().err == ""  # an explicit unanswerable row is no mistake


def test_the_parse_check_takes_transformers_own_generation_tag():
    from tuneforge.data.chat import check_template_parses

    tagged = "{% for m in messages %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}{% endfor %}"
    check_template_parses(tagged, "tagged.jinja")  # valid for apply_chat_template: not refused


# ---- a bad row is named by its row in the file, also where 10% of the file was held out (and shuffled) ----------
def held_out_positions(rows: int, seed: int = 42) -> list[int]:
    """The 0-based rows of a `rows`-row file that the default hold-out (10%, split_seed 42) takes for validation."""
    import datasets

    return datasets.Dataset.from_dict({"i": list(range(rows))}).train_test_split(test_size=0.1, seed=seed)["test"]["i"]


def labelled_rows(n: int, bad_at: int, bad: dict) -> list[dict]:
    """`n` sentiment rows, row `bad_at` (0-based) updated with `bad`."""
    rows = [
        {"text": f"good film {i}", "label": "pos"} if i % 2 else {"text": f"bad film {i}", "label": "neg"}
        for i in range(n)
    ]
    rows[bad_at].update(bad)
    return rows


@pytest.mark.parametrize("part", ["train", "validation"])
def test_an_empty_label_is_named_by_the_file_s_own_row_also_after_the_hold_out(tmp_path, tiny_bert, capsys, part):
    held = held_out_positions(30)
    bad_at = 3 if part == "train" else held[0]
    assert (bad_at in held) == (part == "validation")
    train = write(tmp_path / "t.jsonl", jsonl(*labelled_rows(30, bad_at, {"label": None})))
    args = cli_flags(model=tiny_bert, train_file=train, output_dir=tmp_path / "out", cache_dir=tmp_path / "cache")
    line = refused(capsys, (tmp_path,), "train", *args, "--max-steps", "1", "--quiet", needles=("has an empty label",))
    assert f"row {bad_at + 1} of " in line and str(train) in line


def test_a_ragged_last_csv_row_is_named_by_its_row(tmp_path, tiny_bert, capsys):
    lines = ["text,label", *(f"film {i},{'pos' if i % 2 else 'neg'}" for i in range(20)), "a row without its label"]
    train = write(tmp_path / "t.csv", "\n".join(lines) + "\n")
    args = cli_flags(model=tiny_bert, train_file=train, output_dir=tmp_path / "out", cache_dir=tmp_path / "cache")
    refused(capsys, (tmp_path,), "train", *args, "--quiet", needles=("row 21 of the train data", "empty label"))


@pytest.mark.parametrize("part", ["train", "validation"])
def test_a_regression_label_that_is_no_number_is_named_by_the_file_s_own_row(tmp_path, tiny_bert, capsys, part):
    bad_at = 3 if part == "train" else held_out_positions(30)[0]
    rows = [f"film {i},{i / 30:.3f}" if i != bad_at else f"film {i},abc" for i in range(30)]
    train = write(tmp_path / "t.csv", "\n".join(["text,label", *rows]) + "\n")  # (jsonl: a mixed-type column)
    args = cli_flags(
        task="regression", model=tiny_bert, train_file=train, output_dir=tmp_path / "out", cache_dir=tmp_path / "c"
    )
    line = refused(capsys, (tmp_path,), "train", *args, "--quiet", needles=("'abc'", "is not a finite number"))
    assert f"(row {bad_at + 1})" in line and str(train) in line


def test_a_label_held_out_alone_is_named_by_the_file_s_own_row(tmp_path, tiny_bert, capsys):
    bad_at = held_out_positions(30)[0]  # the file's only 'meh' row: validation holds it, training never sees it
    train = write(tmp_path / "t.jsonl", jsonl(*labelled_rows(30, bad_at, {"label": "meh"})))
    args = cli_flags(model=tiny_bert, train_file=train, output_dir=tmp_path / "out", cache_dir=tmp_path / "cache")
    line = refused(capsys, (tmp_path,), "train", *args, "--quiet", needles=("'meh'", "is not in the label set"))
    assert f"(row {bad_at + 1})" in line and str(train) in line


# ---- a URL where a local file is read (datasets would fetch it; tuneforge reads local files) ---------------------
@pytest.mark.parametrize(
    "task, flag, url",
    [
        ("classification", "--train-file", "https://example.com/data/train.csv"),
        ("classification", "--validation-file", "hf://datasets/stanfordnlp/imdb/plain_text/test.parquet"),
        ("ner", "--train-file", "https://example.com/conll/train.txt"),
        ("clm", "--train-file", "s3://bucket/corpus.txt"),
        ("seq2seq", "--source-file", "https://example.com/train.en"),
    ],
)
def test_a_url_given_for_a_data_file_is_refused_as_typed(task, flag, url, tmp_path, tiny_bert, capsys):
    train = write(tmp_path / "t.csv", "text,label\na,pos\nb,neg\n")
    given = {"--train-file": str(train), "--target-file": str(write(tmp_path / "t.de", "ein Film\n")), flag: url}
    if task != "seq2seq":
        given.pop("--target-file")
    args = ["--task", task, "--model", tiny_bert, "--output-dir", str(tmp_path / "out")]
    line = refused(capsys, (tmp_path,), "train", *args, *[a for kv in given.items() for a in kv], needles=(url,))
    assert f"{flag} {url!r} is a URL" in line and "current folder" not in line


def test_a_url_given_to_predict_is_refused_as_typed(tmp_path, tiny_bert, capsys):
    url = "https://example.com/texts.jsonl"
    line = refused(capsys, (tmp_path,), "predict", tiny_bert, "--input", url, "--output", str(tmp_path / "p.jsonl"))
    assert f"--input {url!r} is a URL" in line


# ---- a data file that cannot be read (its permissions) -------------------------------------------------------
WRITE_ONLY = Path("/proc/sys/net/ipv4/route/flush")  # mode 0200: unreadable to root too


def unreadable(path: Path) -> Path:
    """A file named `path` that open() refuses: mode 000, or for root (whom modes do not stop) a link to a
    write-only kernel setting."""
    import os

    if os.geteuid() != 0:
        write(path, "text,label\n").chmod(0)
        return path
    try:
        WRITE_ONLY.open("rb").close()
    except PermissionError:
        path.symlink_to(WRITE_ONLY)
        return path
    pytest.skip(f"running as root, and {WRITE_ONLY} is readable here: no file root cannot read")


@pytest.mark.parametrize(
    "task, name", [("classification", "t.csv"), ("clm", "t.txt"), ("ner", "t.conll"), ("qa", "t.json")]
)
def test_a_data_file_without_read_permission_is_one_line(task, name, tmp_path, tiny_bert, capsys):
    train = unreadable(tmp_path / name)
    args = cli_flags(task=task, model=tiny_bert, train_file=train, output_dir=tmp_path / "out")
    # (no snapshot of tmp_path: it would read the file)
    refused(capsys, (), "train", *args, needles=(str(train), "cannot be read (Permission denied"))
    assert not (tmp_path / "out").exists()


def test_an_unreadable_file_in_a_data_dir_is_one_line(tmp_path, tiny_bert, capsys):
    folder = tmp_path / "conll"
    folder.mkdir()
    for name in ("train.txt", "valid.txt"):
        write(folder / name, "EU B-ORG\nrejects O\n\nPeter B-PER\n")
    notes = unreadable(folder / "notes.txt")
    args = cli_flags(task="ner", model=tiny_bert, data_dir=folder, output_dir=tmp_path / "out")
    refused(capsys, (), "train", *args, needles=(str(notes), "cannot be read (Permission denied"))
    assert not (tmp_path / "out").exists()


def test_every_reader_refuses_an_unreadable_file_in_one_line(tmp_path):
    """The readers' own check (a --data-dir's files are read by `eval` without the run's up-front checks)."""
    from tuneforge.data import conll, squad, text
    from tuneforge.data.sources import read_table
    from tuneforge.errors import DataError

    for read, name in ((read_table, "t.csv"), (text.read_lines, "t.txt"), (conll.read_conll, "t.conll")):
        with pytest.raises(DataError, match=r"cannot be read \(Permission denied\)"):
            read(unreadable(tmp_path / name))
    with pytest.raises(DataError, match=r"cannot be read \(Permission denied\)"):
        squad.read_squad(unreadable(tmp_path / "q.json"))


@pytest.mark.parametrize("key", ["path", "validation_file"])
def test_a_url_given_for_a_mixture_source_names_the_sources_key(key, tmp_path, tiny_bert, capsys):
    """A source's URL was 'data source 'books': --train-file '...' is a URL': no such flag was given."""
    url = "https://example.com/books.jsonl"
    web = str(write(tmp_path / "web.jsonl", jsonl({"text": "a b c"}, {"text": "d e f"})))
    sources = [{"path": web}, {"name": "books", "path": web, key: url}]
    config = write(tmp_path / "mix.yaml", json.dumps({"task": "clm", "data": {"sources": sources}}))
    args = ["--model", tiny_bert, "--output-dir", str(tmp_path / "out")]
    line = refused(capsys, (tmp_path,), "train", str(config), *args, needles=(url,))
    assert f"data source 'books': {key} {url!r} is a URL" in line and "--" not in line.partition("is a URL")[0]
