"""Chat SFT (`--task sft`): the loss mask token by token on a known conversation, Alpaca rows, packing that
gives each token the loss it has alone, training with LoRA through the CLI, and every bad input."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import cli_command, max_weight_diff, quiet_task, run_cli, train_losses
from test_bad_input import assert_refused, in_process

# a compact template (the tiny test tokenizer spells ChatML's markers in many byte-level pieces): a role
# marker line, the content, and a newline that ends the turn
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a>\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "the cat"},
    {"role": "assistant", "content": "sat on the mat"},
    {"role": "user", "content": "and the dog"},
    {"role": "assistant", "content": "ran away"},
]


@pytest.fixture
def template(tmp_path) -> Path:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


def chats(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my bird", "the fox"]
    places = ["on the mat", "in the house", "by the tree", "near the river"]
    return [
        {
            "messages": [
                {"role": "user", "content": f"where is {rng.choice(subjects)}"},
                {"role": "assistant", "content": f"it is {rng.choice(places)}"},
            ]
        }
        for _ in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_task(model: str, template: Path, cache_dir: str, **data):
    return quiet_task("sft", model, chat_template=str(template), cache_dir=cache_dir, **data)


# ---- the mask ------------------------------------------------------------------------------------
def test_the_loss_mask_covers_each_assistant_reply_and_its_end_of_turn_only(tiny_llama, template, cache_dir):
    from tuneforge.data.chat import IGNORE, encode_conversation

    tokenizer = sft_task(tiny_llama, template, cache_dir).load_tokenizer()
    ids, labels = encode_conversation(tokenizer, CONVERSATION)
    assert len(ids) == len(labels)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    # token by token: the marked tokens, read in order, are the two replies with their end-of-turn markup
    marked = [t for t, y in zip(ids, labels) if y != IGNORE]
    assert all(y in (IGNORE, t) for t, y in zip(ids, labels))
    assert tokenizer.decode(marked) == "sat on the mat\nran away\n"
    # and every token outside them (system, user, the template's markup) is unmarked
    runs, current = [], []
    for t, y in zip(ids, labels):
        if y != IGNORE:
            current.append(t)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    assert runs == ["sat on the mat\n", "ran away\n"]


def test_alpaca_rows_become_a_user_and_an_assistant_turn(tmp_path):
    from tuneforge.data.chat import read_conversations

    path = tmp_path / "alpaca.json"
    path.write_text(
        json.dumps(
            [{"instruction": "add", "input": "2 and 3", "output": "5"}, {"instruction": "hi", "output": "hello"}]
        )
    )
    assert read_conversations(path) == [
        [{"role": "user", "content": "add\n\n2 and 3"}, {"role": "assistant", "content": "5"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    ]


def test_sharegpt_prompt_completion_and_text_parts_read_as_the_same_conversations(tmp_path):
    """The row forms TRL and the hub's chat datasets use: ShareGPT's `conversations` (from/value), TRL's `prompt` +
    `completion` (message lists, or two texts), and OpenAI's text parts as a content; each file reads as the
    messages it stands for (they were refused: 'neither `messages` nor ...')."""
    from tuneforge.data.chat import read_conversations

    want = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello"},
    ]
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    forms = {
        "sharegpt": {"conversations": [{"from": speakers[m["role"]], "value": m["content"]} for m in want]},
        "prompt-completion": {"prompt": want[:2], "completion": want[2:]},
        "parts": {"messages": [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in want]},
    }
    forms["parts"]["messages"][1]["content"] = [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]
    for name, row in forms.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", [row, row])
        assert read_conversations(path) == [want, want], name
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"prompt": "add 2 and 3", "completion": "5"}])
    assert read_conversations(texts) == [
        [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "5"}]
    ]


@pytest.mark.parametrize(
    "rows, needles",
    [
        (
            [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bard", "value": "hello"}]}],
            ("row 1 of", "message 2: unknown speaker 'bard'", "human"),
        ),
        (
            [{"prompt": "hi", "completion": [{"role": "assistant", "content": "x"}]}],
            ("row 1 of", "both texts or both lists"),
        ),
        (
            [
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                        {"role": "assistant", "content": "a cat"},
                    ]
                }
            ],
            ("row 1 of", "message 1: a content part of kind 'image_url'", "text is what trains here"),
        ),
        (  # it was written into the prompt as Python writes a list: "add\n\n['2', '3']"
            [{"instruction": "add", "input": ["2", "3"], "output": "5"}],
            ("row 1 of", "`input` is a list", "give it as text"),
        ),
    ],
)
def test_rows_of_the_other_forms_that_cannot_train_are_one_line(tmp_path, rows, needles):
    from tuneforge.data.chat import read_conversations
    from tuneforge.errors import DataError

    with pytest.raises(DataError) as caught:
        read_conversations(write_jsonl(tmp_path / "rows.jsonl", rows))
    assert all(n in str(caught.value) for n in needles), str(caught.value)


def test_the_shared_lima_and_alpaca_seed_files_read(shared_data):
    from tuneforge.data.chat import read_conversations

    lima = read_conversations(shared_data / "lima" / "lima.json")
    assert len(lima) == 1029 and all(c[-1]["role"] == "assistant" for c in lima)


# ---- packing -------------------------------------------------------------------------------------
def test_a_packed_block_gives_each_token_the_loss_it_has_alone(tiny_llama, template, cache_dir, tmp_path):
    """Three conversations in one block: per-token losses equal those of each conversation run alone."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    short = [("the cat", "on the mat"), ("a dog", "by the tree"), ("the fox", "in the house")]
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in short]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    task = sft_task(tiny_llama, template, cache_dir, train_file=str(train), validation_file=str(train), block_size=64)
    tokenizer = task.load_tokenizer()
    feats = task.tokenize(task.load_raw(), tokenizer)["train"]
    assert len(feats) == 1 and len(feats[0]["segments"]) == 3  # one block, three conversations
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()

    def token_losses(batch) -> torch.Tensor:
        with torch.no_grad():
            logits = model(**task.model_inputs(batch)).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), batch["labels"][:, 1:], ignore_index=-100, reduction="none")[0]

    packed = token_losses(task.collate(feats[:1], tokenizer))
    alone, start = [], 0
    for length in feats[0]["segments"]:
        one = {k: [v[0][start : start + length]] for k, v in feats[:1].items() if k in ("input_ids", "labels")}
        losses = token_losses(task.collate({**one, "segments": [[length]]}, tokenizer))
        alone.append(torch.cat([losses, torch.zeros(1)]))  # the conversation's last token predicts nothing of its own
        start += length
    alone = torch.cat(alone)[:-1]
    assert packed.shape == alone.shape
    assert (packed - alone).abs().max() < 1e-5
    assert packed.abs().sum() > 0  # there are assistant targets
    # without the mask the later conversations would see the earlier ones: the losses differ
    batch = task.collate(feats[:1], tokenizer)
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"]).logits[:, :-1]
    leaky = F.cross_entropy(leaky.transpose(1, 2), batch["labels"][:, 1:], ignore_index=-100, reduction="none")[0]
    assert (leaky - alone).abs().max() > 1e-4


# ---- sliding-window attention -------------------------------------------------------------------
WINDOWED = {  # tiny_llama's sizes with a window of 4 tokens, shorter than every conversation
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=4)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(sliding_window=4, head_dim=8, attn_implementation="eager")),
    "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(sliding_window=4, head_dim=8)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),  # no window at all
}
SHORT = [("the cat", "on the mat"), ("a dog", "by the tree"), ("the fox", "in the house"), ("my bird", "up high")]


def tiny_windowed(family: str, vocab_size: int):
    """A random causal LM of `family` with tiny_llama's sizes (seed 0), built in memory."""
    import transformers

    model_class, config_class, changes = WINDOWED[family]
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64, **heads)
    config = getattr(transformers, config_class)(vocab_size=vocab_size, **sizes, **changes)
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).eval()


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "no-packing"])
@pytest.mark.parametrize("family", list(WINDOWED))
def test_each_conversation_gets_the_logits_it_has_alone_under_a_sliding_window(
    tiny_llama, template, cache_dir, tmp_path, family, packing
):
    """A batch's logits, token by token, equal each conversation run alone with no mask (as inference runs it),
    where the model's sliding window is shorter than the conversations: a 4-D mask would lift the window."""
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in SHORT]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    data = dict(train_file=str(train), validation_file=str(train), block_size=40, packing=packing)
    task = sft_task(tiny_llama, template, cache_dir, **data)
    tokenizer = task.load_tokenizer()
    feats = task.tokenize(task.load_raw(), tokenizer)["train"]
    model = tiny_windowed(family, len(tokenizer))
    assert_each_conversation_as_alone(task, model, feats, tokenizer)


def assert_each_conversation_as_alone(task, model, feats, tokenizer) -> None:
    """The logits of the task's batch of `feats`, conversation by conversation, equal the model's on it alone."""
    batch = task.collate(feats[:], tokenizer)
    with torch.no_grad():
        logits = task.forward(model, batch).logits
        for r, (ids, lengths) in enumerate(zip(feats["input_ids"], feats["segments"])):
            start = 0
            for length in lengths:
                alone = model(input_ids=torch.tensor([ids[start : start + length]])).logits[0]
                assert (logits[r, start : start + length] - alone).abs().max() < 1e-5, (r, start)
                start += length


def test_a_family_that_builds_its_mask_without_position_ids_is_refused_packed(
    tiny_llama, template, cache_dir, tmp_path
):
    """OPT's mask ignores the position ids: its packed conversations would see each other, so the first packed
    batch is refused in one line; one conversation per row (a 2-D padding mask) trains it."""
    from transformers import OPTConfig, OPTForCausalLM

    from tuneforge.errors import ConfigError

    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in SHORT]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    sizes = dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32)
    for packing in (True, False):
        data = dict(train_file=str(train), validation_file=str(train), block_size=40, packing=packing)
        task = sft_task(tiny_llama, template, cache_dir, **data)
        tokenizer = task.load_tokenizer()
        feats = task.tokenize(task.load_raw(), tokenizer)["train"]
        torch.manual_seed(0)
        model = OPTForCausalLM(OPTConfig(vocab_size=len(tokenizer), max_position_embeddings=64, **sizes)).eval()
        if packing:
            with pytest.raises(ConfigError, match="the opt model does not keep conversations packed .* --no-packing"):
                task.forward(model, task.collate(feats[:], tokenizer))
            assert model.training is False  # the probe left the model as it found it
        else:
            assert_each_conversation_as_alone(task, model, feats, tokenizer)


# ---- training through the CLI ----------------------------------------------------------------------
def test_sft_with_lora_trains_evaluates_on_assistant_tokens_and_exports(tiny_llama, template, cache_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", chats(48, seed=1))
    valid = write_jsonl(tmp_path / "valid.jsonl", chats(8, seed=2))
    out = tmp_path / "run"
    args = [
        "train",
        "--task",
        "sft",
        "--model",
        tiny_llama,
        "--train-file",
        str(train),
        "--validation-file",
        str(valid),
    ]
    args += ["--chat-template", str(template), "--block-size", "64", "--output-dir", str(out), "--cache-dir", cache_dir]
    proc = run_cli(*args, "--adapter", "lora", "--lr", "5e-3", "--epochs", "3", "--batch-size", "4", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert evals[-1]["loss"] < evals[0]["loss"]  # it learns the replies
    assert result["perplexity"] == pytest.approx(torch.tensor(result["loss"]).exp().item(), rel=1e-4)
    assert "assistant tokens" in proc.stdout + proc.stderr
    assert (out / "model" / "adapter_config.json").exists()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out / "model").chat_template == TEMPLATE  # the template travels along
    # `tuneforge chat` answers each line with the template's rendering of the conversation so far
    chat = subprocess.run(
        cli_command("chat", str(out / "model"), "--max-new-tokens", "6"),
        input="where is the cat\nand the dog\n\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert chat.stdout.count("model> ") == 2 and chat.stdout.startswith("you> ")


def test_ddp_trains_packed_conversations_as_one_process_does(tiny_llama, template, cache_dir, tmp_path):
    """Packed blocks on 2 ranks: the loss is normalised by the global count of assistant tokens, so each step's
    loss and the final weights equal one process's."""
    train = write_jsonl(tmp_path / "train.jsonl", chats(48, seed=1))
    common = ["--task", "sft", "--model", tiny_llama, "--train-file", str(train), "--validation-file", str(train)]
    common += ["--chat-template", str(template), "--block-size", "64", "--cache-dir", cache_dir, "--max-steps", "4"]
    common += ["--lr", "5e-3", "--precision", "fp32", "--logging-steps", "1", "--eval-strategy", "no", "--quiet"]
    common += ["--no-group-by-length"]
    one = run_cli("train", *common, "--output-dir", str(tmp_path / "one"), "--batch-size", "8")
    two = run_cli(
        "train", *common, "--output-dir", str(tmp_path / "two"), "--batch-size", "4", "--backend", "ddp", "--nproc", "2"
    )
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    a, b = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert a.keys() == b.keys() == {1, 2, 3, 4} and max(abs(a[s] - b[s]) for s in a) < 1e-5
    assert a[1] - a[4] > 0.05  # it learns: the comparison means something
    assert max_weight_diff(tmp_path / "one" / "model", tmp_path / "two" / "model") < 1e-5


# ---- bad input: one line, exit 2, nothing written --------------------------------------------------
def sft_args(tmp_path, model: str, train: Path, *extra: str) -> list[str]:
    where = ["--output-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--max-steps", "1"]
    return [
        "train",
        "--task",
        "sft",
        "--model",
        model,
        "--train-file",
        str(train),
        "--block-size",
        "64",
        *where,
        *extra,
    ]


@pytest.mark.parametrize(
    "rows, needles",
    [
        ([{"messages": [{"role": "user", "content": "hi"}]}], ("row 3 of", "no assistant turn")),
        (
            [{"messages": [{"role": "bot", "content": "hi"}]}],
            ("row 3 of", "unknown role 'bot'", "system, user, assistant"),
        ),
        ([{"messages": []}], ("row 3 of", "empty conversation")),
        (  # the mask needs the prompt of each reply: nothing comes before a first assistant turn
            [{"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]}],
            ("row 3 of", "message 1", "starts with the assistant", "system or user turn first"),
        ),
    ],
)
def test_bad_conversations_are_refused(capfd, tmp_path, tiny_llama, template, rows, needles):
    train = write_jsonl(tmp_path / "train.jsonl", [*chats(2), *rows])
    proc = in_process(capfd, *sft_args(tmp_path, tiny_llama, train, "--chat-template", str(template)))
    assert_refused(proc, tmp_path, *needles)  # the two good rows come first


def test_no_chat_template_and_no_flag_is_refused(capfd, tmp_path, tiny_llama):
    train = write_jsonl(tmp_path / "train.jsonl", chats(4))
    proc = in_process(capfd, *sft_args(tmp_path, tiny_llama, train))
    assert_refused(proc, tmp_path, "has no chat template", "--chat-template FILE")


def test_conversations_longer_than_the_block_are_cut_and_counted(tiny_llama, template, cache_dir, tmp_path):
    long = {
        "messages": [{"role": "user", "content": "where is the cat " * 30}, {"role": "assistant", "content": "here"}]
    }
    train = write_jsonl(tmp_path / "train.jsonl", [*chats(3), long])
    task = sft_task(tiny_llama, template, cache_dir, train_file=str(train), validation_file=str(train), block_size=64)
    said = []
    task.tokenize(task.load_raw(), task.load_tokenizer(), log=said.append)
    assert (
        "train: 1 of 4 conversations longer than block_size 64 tokens cut to their first 64, 1 of them dropped (no "
        "assistant token left) (raise --block-size to keep them whole)"
    ) in said


def test_a_template_that_writes_no_assistant_token_is_named_not_the_block_size(tiny_llama, cache_dir, tmp_path):
    from tuneforge.errors import ConfigError

    prompt_only = tmp_path / "prompt-only.jinja"  # writes the user's turns only, as some inference templates do
    prompt_only.write_text("{% for m in messages if m['role'] != 'assistant' %}{{ m['content'] }}\n{% endfor %}")
    train = write_jsonl(tmp_path / "train.jsonl", chats(4))
    task = sft_task(tiny_llama, prompt_only, cache_dir, train_file=str(train), validation_file=str(train))
    with pytest.raises(ConfigError, match="prompt-only.jinja' writes no token of the assistant's turns"):
        task.tokenize(task.load_raw(), task.load_tokenizer(), log=lambda _: None)


def test_a_reply_the_template_writes_nothing_of_is_dropped_and_counted_as_such(tiny_llama, cache_dir, tmp_path):
    content_only = tmp_path / "content-only.jinja"  # an empty reply leaves nothing to learn
    content_only.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    empty = {"messages": [{"role": "user", "content": "where is the cat"}, {"role": "assistant", "content": ""}]}
    train = write_jsonl(tmp_path / "train.jsonl", [*chats(3), empty])
    task = sft_task(tiny_llama, content_only, cache_dir, train_file=str(train), validation_file=str(train))
    said = []
    task.tokenize(task.load_raw(), task.load_tokenizer(), log=said.append)
    assert any("1 conversation(s) dropped: the chat template writes no assistant token" in s for s in said), said
    assert not any("longer than block_size" in s for s in said), said


@pytest.mark.parametrize(
    "failing, message",
    [
        ("{{ raise_exception('no such row') }}", "no such row"),  # the template's own refusal
        ("{{ 1 / 0 }}", "division by zero"),  # an error in the template's code (a Python exception, not Jinja's)
    ],
)
def test_a_template_that_fails_on_a_row_names_the_row(tiny_llama, cache_dir, tmp_path, failing, message):
    from tuneforge.errors import ConfigError

    template = tmp_path / "fails.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['content'] == 'boom' %}" + failing + "{% endif %}"
        "{{ m['role'][0] }}>\n{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}a>\n{% endif %}"
    )
    boom = {"messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "bang"}]}
    train = write_jsonl(tmp_path / "train.jsonl", [*chats(2), boom])
    task = sft_task(tiny_llama, template, cache_dir, train_file=str(train), validation_file=str(train))
    with pytest.raises(ConfigError, match=f"fails.jinja' fails on row 3 of .*train.jsonl': {message}"):
        task.tokenize(task.load_raw(), task.load_tokenizer(), log=lambda _: None)


def test_a_generation_prompt_that_is_not_how_the_template_begins_a_reply_is_refused(tiny_llama, cache_dir, tmp_path):
    from tuneforge.data.chat import encode_conversation
    from tuneforge.errors import ConfigError

    # as DeepSeek-R1's and Nemotron 3's: the generation prompt opens a reasoning block that past replies do not
    # hold, so its end is not where the reply begins (the mask took "n the mat" of "sat on the mat")
    thinking = tmp_path / "thinking.jinja"
    thinking.write_text(TEMPLATE.replace("a>\n{% endif %}", "a>\n<think>\n{% endif %}"))
    tokenizer = sft_task(tiny_llama, thinking, cache_dir).load_tokenizer()
    with pytest.raises(ConfigError, match=r"generation prompt 'a>\\n<think>\\n' .* assistant's turn of message 3"):
        encode_conversation(tokenizer, CONVERSATION)


def test_a_conversation_of_thousands_of_turns_renders_only_the_turns_its_block_holds(
    tiny_llama, template, cache_dir, tmp_path, monkeypatch
):
    from tuneforge.data.chat import encode_conversation

    turns = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(1000)]
    train = write_jsonl(tmp_path / "train.jsonl", [*chats(3), {"messages": turns}])
    files, cache = dict(train_file=str(train), validation_file=str(train)), str(tmp_path / "cache")
    # a shorter block first, in the same cache: its labels, found within 32 tokens, are not reused for 64
    short = sft_task(tiny_llama, template, cache, **files, block_size=32)
    short.tokenize(short.load_raw(), short.load_tokenizer(), log=lambda _: None)
    task = sft_task(tiny_llama, template, cache, **files, block_size=64)
    tokenizer = task.load_tokenizer()
    renders = []
    render = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: renders.append(1) or render(*a, **k))
    blocks = task.tokenize({"train": task.load_raw()["train"]}, tokenizer, log=lambda _: None)["train"]
    # each reply rendered the conversation up to it twice: 1,001 renders of up to 1,000 messages (10,000: half an hour)
    assert len(renders) < 60
    monkeypatch.undo()
    alone = encode_conversation(tokenizer, turns[:40])  # its block: the same tokens and labels as its start alone
    assert (blocks[-1]["input_ids"][-64:], blocks[-1]["labels"][-64:]) == (alone[0][:64], alone[1][:64])
