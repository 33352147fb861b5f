"""Instruction / chat supervised fine-tuning (`--task sft`): the causal LM trained on the assistant's
tokens only, conversations packed into blocks without attention across them.

Data: json/jsonl files of chat rows (`messages`) or Alpaca rows (`instruction`/`input`/`output`),
read and rendered by tuneforge/data/chat.py with the tokenizer's chat template (`--chat-template FILE`
where it has none). Tool calling: assistant turns with `tool_calls`, `tool` turns with results and a `tools`
column (rendered through the template's tools=) train the model's calls and replies; the tool results, like the
user's and system's turns, carry no loss. A template that does not render tools refuses such data, naming
the column. The loss is the next-token loss summed over assistant tokens (each reply and its
end-of-turn marker) and normalised by their global count, as the causal LM normalises by its target
tokens; evaluation reports that loss and its perplexity.

Length rule: a conversation longer than `block_size` tokens is cut to its first `block_size`; one
with no assistant token left after the cut is dropped, and so is one whose assistant turns the template writes
nothing of (an empty reply; for every conversation, a template that writes no assistant turn: refused). The counts
are logged per split.

Packing (default; `--no-packing`: one conversation per row): whole conversations per block
(data/chat_blocks.py). Each keeps positions 0, 1, ... (position_ids), and a packed batch carries no attention
mask: transformers finds the conversations from the restarting positions and builds each layer's mask, causal within
a conversation and closed across them, sliding windows included (Mistral, Gemma 2/3), so a packed block gives every
token the loss it has when its conversation runs alone; a padding position sees only itself. A model whose family
builds its mask without the position ids (OPT, BLOOM) is refused at the first forward (`--no-packing`
trains it, with a 2-D padding mask).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import Field

from tuneforge.config import EVAL, INPUT
from tuneforge.data import chat, chat_blocks
from tuneforge.data.mapped import is_large, rows_mapped
from tuneforge.data.text import blocks_file
from tuneforge.data.tokenize import cut_phrase
from tuneforge.errors import ConfigError, DataError, UserError
from tuneforge.tasks.clm import CausalLMOptions, CausalLMTask

if TYPE_CHECKING:
    import datasets


class ChatSFTOptions(CausalLMOptions):
    chat_format: Literal["auto", "messages", "sharegpt", "prompt-completion", "alpaca"] = Field(
        "auto",
        description="rows with `messages` ([{role, content}]), ShareGPT's `conversations` ([{from, value}]), "
        "`prompt` + `completion` (TRL's), or Alpaca rows (instruction, input, output); auto: from the first row",
        json_schema_extra=EVAL,
    )
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template file, for a tokenizer that has none (or to replace its own)",
        json_schema_extra={**EVAL, **INPUT},
    )


def chat_dataset(chats: list[tuple[list[dict], list[dict] | None]]) -> datasets.Dataset:
    """(conversation, tools) pairs as a raw split: each a JSON text (tools `null` when a row has none), with the
    row's number in its file (`row`: kept through a held-out split, for errors)."""
    import datasets

    return datasets.Dataset.from_list(list(_rows(chats)), features=chat_features())


def chat_features() -> datasets.Features:
    """chat_dataset's columns (a function: `datasets` is imported only where data is read)."""
    import datasets

    return datasets.Features(
        {"conversation": datasets.Value("string"), "tools": datasets.Value("string"), "row": datasets.Value("int64")}
    )


def chat_rows(path: str, fmt: str):
    """chat_dataset's rows of a JSON-lines file, a line at a time (`datasets.Dataset.from_generator`)."""
    yield from _rows(chat.iter_chats(path, fmt))


def _rows(chats):
    for n, (conversation, tools) in enumerate(chats, 1):
        yield {"conversation": json.dumps(conversation), "tools": json.dumps(tools), "row": n}


class ChatSFTTask(CausalLMTask):
    name = "sft"
    Options = ChatSFTOptions
    model_kind = "a chat model"
    packing_checked = False  # whether the model was seen to keep packed conversations apart (`_check_packing`)

    @property
    def pads_batches(self) -> bool:  # blocks of different lengths, and a mask between conversations
        return True

    def load_tokenizer(self):
        tokenizer = super().load_tokenizer()
        chat.set_chat_template(tokenizer, self.options.chat_template, self.model_path())
        if not tokenizer.is_fast:
            raise ConfigError(
                f"the tokenizer of {self.model_path()!r} is not a fast tokenizer; --task sft needs its character "
                "offsets to find the assistant's tokens"
            )
        return tokenizer

    # ---- raw data --------------------------------------------------------------------------
    def load_raw(self) -> datasets.DatasetDict:
        import datasets

        def read(path, _split) -> datasets.Dataset:
            fmt = self.options.chat_format
            # read a line at a time, memory-mapped, from a quarter of the size: chat rows held whole cost ~10x
            if is_large(path, share=0.25) and Path(path).suffix.lower() == ".jsonl":
                return rows_mapped(
                    path, self.config.data.cache_dir, f"chats-{fmt}", chat_rows, chat_features(), fmt=fmt
                )
            return chat_dataset(chat.read_chats(path, fmt))

        splits = self.read_given_files(
            "conversations: pass --train-file chats.jsonl (rows with `messages`, ShareGPT's `conversations`, "
            "`prompt` + `completion`, or Alpaca rows with instruction/input/output) and --validation-file",
            read,
        )
        return datasets.DatasetDict(self.hold_out_if_needed(splits, "conversation"))

    def prepare_raw(self, splits: dict) -> datasets.DatasetDict:
        import datasets

        raw = {}
        for split, ds in splits.items():
            if ds is None:
                continue
            if "messages" not in ds.column_names:
                raise DataError(f"the {split} dataset has no `messages` column (lists of {{role, content}})")
            where = f"the {split} dataset"
            tools = ds["tools"] if "tools" in ds.column_names else [None] * len(ds)
            raw[split] = chat_dataset(
                [
                    (
                        chat.to_conversation(
                            {"messages": chat.without_arrow_nulls(m)}, "messages", f"{where}, row {i + 1}", tools=True
                        ),
                        chat.to_tools(chat.without_arrow_nulls(t), f"{where}, row {i + 1}"),
                    )
                    for i, (m, t) in enumerate(zip(ds["messages"], tools))
                ]
            )
        return datasets.DatasetDict(raw)

    # ---- features --------------------------------------------------------------------------
    def tokenize(self, raw, tokenizer, log=print):
        import datasets

        block_size = self.resolve_block_size()

        # the labels are found within the block only (chat.encode_conversation's `within`)
        settings = {"task": "sft", "template": tokenizer.chat_template, "labels_within": block_size}
        out = {}
        for split, ds in raw.items():  # every split checked before any is tokenized
            self._check_tool_support(tokenizer, ds, split)
        for split, ds in raw.items():
            fn = self._encoder(tokenizer, ds, split, block_size)
            feats = self.tokenize_split(split, ds, ["conversation", "tools"], fn, tokenizer, settings, log)
            out[split] = self._fit_and_pack(split, feats, block_size, log)
        return datasets.DatasetDict(out)

    def _check_tool_support(self, tokenizer, ds, split: str) -> None:
        """ConfigError naming the row and column when a split has tool calling and the template renders no tools."""
        where = repr(self.files[split]) if self.files.get(split) else f"the {split} data"
        rows = ds["row"] if "row" in ds.column_names else range(1, len(ds) + 1)
        chats = ((n, json.loads(c), json.loads(t)) for n, c, t in zip(rows, ds["conversation"], ds["tools"]))
        chat.check_tool_support(tokenizer, chats, chat.template_name(self.config), where)

    def _encoder(self, tokenizer, ds, split: str, block_size: int):
        """The batched map function of one split; a template that raises for a row names that row."""
        template = chat.template_name(self.config)
        where = repr(self.files[split]) if self.files.get(split) else f"the {split} data"

        def fn(batch):
            ids, labels = [], []
            for text, tools in zip(batch["conversation"], batch["tools"]):
                try:
                    x, y = chat.encode_conversation(tokenizer, json.loads(text), json.loads(tools), block_size)
                except UserError:  # encode_conversation's own refusals name their fix already
                    raise
                except Exception as err:  # the template's raise_exception, or an error in its own code (1 / 0)
                    row = ds["row"][ds["conversation"].index(text)]  # the file's row; the error path only: one scan
                    raise chat.template_error(err, template, row, where) from None
                ids.append(x)
                labels.append(y)
            return {"input_ids": ids, "labels": labels}

        return fn

    def _fit_and_pack(self, split: str, feats, block_size: int, log) -> datasets.Dataset:
        """The length rule (cut to block_size; dropped when no assistant token is left), then packing: a part of
        the split at a time (data/chat_blocks.py), the blocks beside the tokenization cache."""
        fitted = chat_blocks.fit(feats, block_size)
        if fitted.unlearnable:
            log(f"{split}: {fitted.unlearnable} conversation(s) dropped: the chat template writes no assistant token")
        if fitted.cut or fitted.dropped > fitted.unlearnable:
            log(
                f"{split}: {cut_phrase(fitted.cut, len(feats), 'conversations', 'block_size', block_size)}, "
                f"{fitted.dropped - fitted.unlearnable} of them dropped (no assistant token left) (raise --block-size "
                "to keep them whole)"
            )
        if fitted.unlearnable == len(feats):
            raise ConfigError(
                f"the chat template {chat.template_name(self.config)} writes no token of the assistant's turns in any "
                f"{split} conversation, so there is nothing to learn; pass --chat-template FILE with a template that "
                "writes each message's content"
            )
        if not len(fitted.kept):
            raise DataError(
                f"the {split} data has no conversation with an assistant token within block_size {block_size}; raise "
                "--block-size"
            )
        packing = self.options.packing
        tag = f"sft-{'packed' if packing else 'rows'}{block_size}"
        blocks = chat_blocks.write_blocks(feats, fitted, block_size, packing, blocks_file(feats, tag))
        log(
            f"{split}: {len(fitted.kept)} conversations, {fitted.targets} assistant tokens, in {len(blocks)} blocks "
            f"of up to {block_size} tokens"
        )
        return blocks

    def collate(self, rows, tokenizer):
        """Right-padded blocks; position ids restart with each conversation. A batch with a packed row carries no
        attention mask: from the restarting positions transformers builds each layer's own mask, causal within a
        conversation, closed across them, sliding windows included (a 4-D mask would be used as it is, lifting
        the window); a padding position, at 0, sees only itself. A batch of one conversation per row carries the
        usual 2-D padding mask."""
        width = max(len(x) for x in rows["input_ids"])
        n = len(rows["input_ids"])
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((n, width), pad_id, dtype=torch.long)
        labels = torch.full((n, width), chat.IGNORE, dtype=torch.long)
        positions = torch.zeros((n, width), dtype=torch.long)
        real = torch.zeros((n, width), dtype=torch.long)
        for r, (x, y, lengths) in enumerate(zip(rows["input_ids"], rows["labels"], rows["segments"])):
            input_ids[r, : len(x)] = torch.tensor(x)
            labels[r, : len(y)] = torch.tensor(y)
            real[r, : len(x)] = 1
            start = 0
            for length in lengths:
                positions[r, start : start + length] = torch.arange(length)
                labels[r, start] = chat.IGNORE  # a conversation's first token is predicted from nothing of its own
                start += length
        batch = {"input_ids": input_ids, "position_ids": positions, "labels": labels}
        if all(len(lengths) <= 1 for lengths in rows["segments"]):
            batch["attention_mask"] = real
        return batch

    def model_inputs(self, batch):
        # no cache: with one, transformers reads no conversations from the position ids
        return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch} | {
            "use_cache": False
        }

    def forward(self, model, batch):
        # at the first forward of every rank alike (a sharded engine's forward is collective), not at its first
        # batch that holds a packed row, which ranks reach at different steps
        if self.options.packing and not self.packing_checked:
            self._check_packing(model, batch["input_ids"][0])
        return model(**self.model_inputs(batch))

    def _check_packing(self, model, row: torch.Tensor) -> None:
        """ConfigError where the model does not keep packed conversations apart by their position ids (its family
        builds its masks without them): a short probe of two conversations from `row`'s tokens, run once."""
        first, second = row[:6], row[:4]
        joined = torch.cat([first, second])[None]
        positions = torch.cat([torch.arange(len(first)), torch.arange(len(second))]).to(row.device)[None]
        was_training = model.training
        model.eval()  # no dropout in the comparison
        try:
            with torch.no_grad():
                alone = model(input_ids=second[None], use_cache=False).logits[0]
                packed = model(input_ids=joined, position_ids=positions, use_cache=False).logits[0, len(first) :]
                leaky = model(input_ids=joined, use_cache=False).logits[0, len(first) :]
        finally:
            model.train(was_training)
        # a tenth of what seeing the conversation before would change: rounding, not attention across them
        if (packed - alone).abs().max() > 0.1 * (leaky - alone).abs().max():
            family = getattr(getattr(model, "module", model).config, "model_type", "this")
            raise ConfigError(
                f"the {family} model does not keep conversations packed into one block apart (transformers builds "
                "its attention mask without their position ids); pass --no-packing"
            )
        self.packing_checked = True

    def export_info(self) -> dict:
        return {
            "task": self.config.task,
            "block_size": self.block_size,
            "packing": self.options.packing,
            **self.capabilities(),
        }
