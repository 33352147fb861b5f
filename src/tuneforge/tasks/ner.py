"""Token classification (named entities): CoNLL files, jsonl with tokens and tags, the hub's conll2003.

Tags are read as IOB1 or IOB2 and trained as IOB2 (data/conll.py). Each word's tag is predicted at
its first sub-token; the other sub-tokens are left out of the loss (-100), as in transformers'
run_ner.py. The loss is summed over those first sub-tokens and normalised by their count across
accumulation and ranks. Evaluation is entity-level precision/recall/F1 with `seqeval` (overall and
per type) over whole sentences, every sentence once across ranks: words cut off by --max-length
count as predicted O, so a truncated entity is a miss, not left out (so do words the tokenizer drops, such as a
zero-width space: the words after one are scored against their own tags). The log says per split how many sentences
were cut to --max-length (data/tokenize.py's `report_cuts`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np
import regex
import torch
import torch.nn.functional as F

from tuneforge.adapters import load_pretrained_model
from tuneforge.artifacts import check_vocabulary_fits, from_pretrained, inference_device, load_tokenizer
from tuneforge.data.conll import (
    check_lengths,
    check_tagged_file,
    entities,
    entity_type,
    find_split_files,
    iob_label_set,
    is_conll,
    read_tagged,
    to_iob2,
)
from tuneforge.data.tokenize import Cut, check_room_for_text, encode_within, report_cuts
from tuneforge.errors import ConfigError, DataError
from tuneforge.options import TaskOptions
from tuneforge.tasks.base import (
    MetricStream,
    ServingPrecision,
    Task,
    architecture_ends,
    empty_check,
    open_predictor_folder,
    predict_max_length,
    set_dropout,
    set_pad_token,
)
from tuneforge.tasks.length_runs import length_batches

if TYPE_CHECKING:
    import datasets

IGNORE = -100
# raw text -> words as CoNLL splits them: runs of letters/digits, punctuation, and each Chinese character alone (Chinese
# NER data tags each; BERT's tokenizer splits each off). `regex`'s \w holds combining marks (an NFD accent, a Devanagari
# vowel sign, a variation selector), which `re`'s leaves out: each mark would be a word of its own
WORD = regex.compile(r"\p{Han}\p{M}*|[^\W\p{Han}]+|[^\w\s]\p{M}*")


def text_words(text: str) -> list[tuple[str, int, int]]:
    """(word, start, end) of each word of a raw text, as NER predicts on them (WORD)."""
    return [(m.group(), m.start(), m.end()) for m in WORD.finditer(text)]


def word_tokenizer(path: str):
    """The model's tokenizer, set up for words given one by one: fast (it maps sub-tokens to words), and with
    byte-level BPE a space before each word, as the words had in running text; a pad token for its batches."""
    tokenizer = load_tokenizer(path)
    if not tokenizer.is_fast:
        raise ConfigError(
            f"model {path!r} has a slow (Python) tokenizer; NER needs a fast one to map sub-tokens to words: "
            "save a tokenizer.json with the model (AutoTokenizer.from_pretrained(..., use_fast=True))"
        )
    if getattr(tokenizer, "add_prefix_space", None) is False:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, add_prefix_space=True)
    set_pad_token(tokenizer, path)
    return tokenizer


def entity_metrics(gold: list[list[str]], pred: list[list[str]]) -> dict[str, float]:
    """seqeval's entity-level scores (conlleval rules): micro precision/recall/F1, F1 per type, word accuracy."""
    from seqeval.metrics import accuracy_score, classification_report

    with warnings.catch_warnings():  # no entity in gold or predictions: numpy's notes of seqeval's empty averages
        warnings.simplefilter("ignore", RuntimeWarning)
        report = classification_report(gold, pred, output_dict=True, zero_division=0)
    micro = report.get("micro avg", {"precision": 0.0, "recall": 0.0, "f1-score": 0.0})
    out = {"precision": float(micro["precision"]), "recall": float(micro["recall"]), "f1": float(micro["f1-score"])}
    out["accuracy"] = float(accuracy_score(gold, pred)) if gold else float("nan")
    for kind, scores in sorted(report.items()):
        if kind not in ("micro avg", "macro avg", "weighted avg"):
            out[f"f1_{kind}"] = float(scores["f1-score"])
    return out


class EntityStream(MetricStream):
    """Per sentence: the gold tags of every word and the predicted tag of each word the model saw (O for the others:
    words cut off by --max-length, and words the tokenizer drops, such as a zero-width space)."""

    def __init__(self, task: TokenClassificationTask) -> None:
        self.task = task
        self.gold: list[list[int]] = []
        self.pred: list[list[int]] = []
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.float64)
        self.outside = task.label_names.index("O")

    def update(self, outputs, batch, valid) -> None:
        labels = batch["labels"]
        picked = outputs.logits.argmax(-1)
        for row in torch.nonzero(valid).flatten().tolist():
            gold = list(batch["word_tags"][row])
            pred = [self.outside] * len(gold)
            # (features prepared before tagged_words was kept: the labelled words are the first ones)
            words = batch["tagged_words"][row] if batch.get("tagged_words") is not None else range(len(gold))
            for word, tag in zip(words, picked[row][labels[row] != IGNORE].tolist()):
                pred[word] = tag
            self.gold.append(gold)
            self.pred.append(pred)
        loss, n = self.task.compute_loss(outputs, batch, row_mask=valid)
        self.loss_sum += loss.detach().double().cpu()
        self.count += n.detach().double().cpu()

    def compute(self, backend) -> dict[str, float]:
        gathered = backend.gather_objects((self.gold, self.pred))
        names = self.task.label_names
        gold = [[names[i] for i in s] for g in gathered for s in g[0]]
        pred = [[names[i] for i in s] for g in gathered for s in g[1]]
        return self.with_loss(backend, entity_metrics(gold, pred), len(gold))


class NEROptions(TaskOptions):
    """ner has no settings of its own; it sets its own schedule. A tag per word learns slower than a label per
    sentence: on CoNLL-2003 (2,500 sentences, seeds 1-3) the classifiers' 2 epochs at 8e-5 stayed 0.03 entity
    F1 below run_ner.py's recipe (benchmarks/README.md, NER)."""

    run_defaults = {"epochs": 3, "optim.lr": 1.5e-4}


class TokenClassificationTask(Task):
    model_kind = "a token-classification model"
    pads_with_tokenizer = True
    model_classes = "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"
    best_metric = "f1"
    greater_is_better = True
    Options = NEROptions

    def __init__(self, config) -> None:
        super().__init__(config)
        self.converted = 0  # IOB1 entity starts brought to IOB2 in the data read (said once it passes its checks)
        data = config.data
        if data.text_columns and len(data.text_columns) != 1:
            raise ConfigError(f"--task ner takes one --text-column (the tokens), got {len(data.text_columns)}")
        self.tokens_column = data.text_columns[0] if data.text_columns else "tokens"
        self.tags_column = data.label_column or "tags"
        self.label_names = None
        self.check_local_files(check_tagged_file, find_split_files)

    # ---- model -------------------------------------------------------------------------
    def load_tokenizer(self):
        from transformers import AutoConfig

        path = self.model_path()
        tokenizer = word_tokenizer(path)
        self.check_max_length(tokenizer, from_pretrained(AutoConfig, path, "the model config"))
        return tokenizer

    def load_model(self, tokenizer):
        from transformers import AutoConfig, AutoModelForTokenClassification

        path = self.model_path()
        model_config = from_pretrained(
            AutoConfig,
            path,
            "the model config",
            num_labels=len(self.label_names),
            id2label=dict(enumerate(self.label_names)),
            label2id={n: i for i, n in enumerate(self.label_names)},
        )
        set_dropout(model_config, self.config.dropout)
        self.check_max_length(tokenizer, model_config)
        return load_pretrained_model(
            AutoModelForTokenClassification,
            path,
            self.model_kind,
            config=model_config,
            new_head=self.log,
            **self.pretrained_kwargs(),
        )

    # ---- raw data ----------------------------------------------------------------------
    def load_raw(self) -> datasets.DatasetDict:
        import datasets

        splits = self.read_local_splits(find_split_files, self._read)
        if splits is None:
            return self._from_hub()
        splits = self._check(splits)  # before a hold-out, so errors name the file's own lines and rows
        return datasets.DatasetDict(self.hold_out_if_needed(splits, "sentence"))

    def _read(self, path) -> datasets.Dataset:
        return read_tagged(path, self.tokens_column, self.tags_column)

    def prepare_raw(self, splits: dict) -> datasets.DatasetDict:
        import datasets

        self.files = {}
        raw = {}
        for split, ds in splits.items():
            if ds is None:
                continue
            ds = ds.rename_columns({self.tokens_column: "tokens", self.tags_column: "tags"})
            names = getattr(getattr(ds.features["tags"], "feature", None), "names", None)  # the hub's ClassLabel ids
            named = names and all(0 <= t < len(names) for row in ds["tags"] for t in row)  # (-1: no tag, refused)
            tags = [[names[t] if named else str(t) for t in row] for row in ds["tags"]]
            lines = ds["line"] if "line" in ds.column_names else list(range(1, len(ds) + 1))
            raw[split] = datasets.Dataset.from_dict({"tokens": ds["tokens"], "tags": tags, "line": lines})
        return datasets.DatasetDict(self._check(raw))

    def _from_hub(self) -> datasets.DatasetDict:
        import datasets

        from tuneforge.data.sources import from_hub

        hub = from_hub("conll2003", None, "pass --data-dir with the CoNLL-2003 files (train.txt, valid.txt)")
        names = hub["train"].features["ner_tags"].feature.names
        raw = {}
        for split in ("train", "validation"):
            ds = hub[split]
            raw[split] = datasets.Dataset.from_dict(
                {
                    "tokens": ds["tokens"],
                    "tags": [[names[i] for i in tags] for tags in ds["ner_tags"]],
                    "line": list(range(1, len(ds) + 1)),
                }
            )
        return datasets.DatasetDict(self._check(raw))

    def _check(self, raw: dict) -> dict:
        """Lengths and tags checked, tags brought to IOB2 (encode_labels says so when they were IOB1)."""
        out, converted = {}, 0
        for split, ds in raw.items():
            empty_check(ds, split)
            place = self._place(split)
            check_lengths(ds, place)
            fixed = []
            for tags, line in zip(ds["tags"], ds["line"]):
                try:
                    iob2 = to_iob2(tags)
                except ValueError as err:
                    raise DataError(
                        f"{place(line)}: tag {err.args[0]!r} is not IOB; NER tags are O, B-TYPE or I-TYPE (e.g. B-PER)"
                    ) from None
                converted += sum(a != b for a, b in zip(tags, iob2))
                fixed.append(iob2)
            out[split] = ds.remove_columns("tags").add_column("tags", fixed)
        self.converted = converted
        return out

    def _place(self, split: str):
        """line -> where a sentence of `split` is, for errors: 'FILE, sentence at line N' (CoNLL) or '..., row N'."""
        path = self.files.get(split)
        if path and is_conll(path):
            return lambda line: f"{path}, sentence at line {line}"
        where = path or f"the {split} data"
        return lambda line: f"{where}, row {line}"

    # ---- labels ------------------------------------------------------------------------
    def label_set(self, raw) -> list[str]:
        if self.label_names is not None:
            return list(self.label_names)
        return iob_label_set(raw["train"]["tags"] if "train" in raw else next(iter(raw.values()))["tags"])

    def use_labels(self, names) -> None:
        self.label_names = list(names)

    def adopt_model_labels(self, model_config=None) -> None:
        if not (model_config or self.config.model):
            return
        from transformers import AutoConfig

        mc = model_config or from_pretrained(AutoConfig, self.config.model, "the model config")
        names = [mc.id2label[i] for i in sorted(mc.id2label)] if getattr(mc, "id2label", None) else []
        try:
            if names and all(n == "O" or entity_type(n) for n in names):
                self.label_names = names
        except ValueError:
            return  # not a tagger's label set: train one

    def encode_labels(self, raw) -> datasets.DatasetDict:
        import datasets

        index = {n: i for i, n in enumerate(self.label_names)}
        out = {}
        for split, ds in raw.items():
            place = self._place(split)
            ids = []
            for tags, line in zip(ds["tags"], ds["line"]):
                missing = next((t for t in tags if t not in index), None)
                if missing is not None:
                    raise DataError(
                        f"{place(line)}: tag {missing!r} is not in the label set seen in "
                        f"training [{', '.join(self.label_names)}]; fix the tag or add sentences with it to the "
                        "training data"
                    )
                ids.append([index[t] for t in tags])
            out[split] = ds.remove_columns("tags").add_column("tag_ids", ids)
        if self.converted:  # said once the data has passed its checks: an error stays one line
            self.log(f"tags read as IOB1: {self.converted} entity starts tagged I- are trained as B- (IOB2)")
        return datasets.DatasetDict(out)

    # ---- features ----------------------------------------------------------------------
    def tokenize(self, raw, tokenizer, log=print):
        import datasets

        max_length = self.config.data.max_length
        raw = {split: self.select_examples(split, ds) for split, ds in raw.items()}

        def fn(batch):
            enc, cut = encode_within(tokenizer, {"text": batch["tokens"], "is_split_into_words": True}, max_length)
            labels, tagged_words = [], []
            for i, tag_ids in enumerate(batch["tag_ids"]):
                row, words, previous = [], [], None
                for word in enc.word_ids(i):
                    first = word is not None and word != previous
                    row.append(tag_ids[word] if first else IGNORE)
                    words += [word] if first else []
                    previous = word
                labels.append(row)
                tagged_words.append(words)
            enc["labels"] = labels
            enc["word_tags"] = batch["tag_ids"]
            enc["tagged_words"] = tagged_words  # the word of each label: a word without a token has none
            enc["length"] = [len(x) for x in enc["input_ids"]]
            enc["sentence_cut"] = cut  # counted in the log line, then dropped
            return enc

        settings = {
            "task": "ner",
            "max_length": max_length,
            "labels": self.label_names,
            "first_subtoken": True,
            "tagged_words": True,
            "cut_flags": True,
        }
        cols = ["tokens", "tag_ids"]
        limit = max_length or tokenizer.model_max_length
        cuts = [Cut("sentence_cut", "sentences", "max_length", limit, "--max-length")]
        return datasets.DatasetDict(
            {
                split: report_cuts(split, self.tokenize_split(split, ds, cols, fn, tokenizer, settings, log), cuts, log)
                for split, ds in raw.items()
            }
        )

    def collate(self, rows, tokenizer):
        labels = rows.pop("labels", None)
        word_tags = rows.pop("word_tags", None)
        tagged_words = rows.pop("tagged_words", None)
        rows.pop("length", None)
        # padded on the right whatever the tokenizer's side: each row's labels start at its first token
        batch = dict(tokenizer.pad(rows, return_tensors="pt", padding_side="right"))
        if labels is not None:
            width = batch["input_ids"].shape[1]
            padded = torch.full((len(labels), width), IGNORE, dtype=torch.long)
            for i, row in enumerate(labels):
                padded[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            batch["labels"] = padded
        if word_tags is not None:
            batch["word_tags"], batch["tagged_words"] = word_tags, tagged_words
        return batch

    # ---- loss and metrics --------------------------------------------------------------
    def compute_loss(self, outputs, batch, row_mask=None):
        logits, labels = outputs.logits, batch["labels"]
        per = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="none")
        counted = labels != IGNORE
        if row_mask is not None:  # padded duplicate rows (evaluation) add neither loss nor words
            counted = counted & row_mask[:, None]
            per = per * counted.flatten()
        return per.sum(), counted.sum().float()

    def count(self, batch) -> torch.Tensor:
        return (batch["labels"] != IGNORE).sum().float()

    def metric_stream(self):
        return EntityStream(self)

    def export_info(self) -> dict:
        return {**super().export_info(), "tag_scheme": "IOB2"}

    @staticmethod
    def claims_folder(model_dir: str) -> bool:
        return architecture_ends(model_dir, "ForTokenClassification")  # a hub model's folder: run as its head says

    @staticmethod
    def make_predictor(model_dir: str, **kwargs):
        return EntityPredictor(model_dir, **kwargs)


WINDOW_OVERLAP = 0.25  # of a window's tokens, the part the next window of a long text reads again


def word_windows(sizes: list[int], room: int, overlap: int) -> list[tuple[int, int]]:
    """(first word, end word) of each window over words of `sizes` tokens: as many whole words as `room` tokens
    hold (a longer word alone), each window after the first taking back the last words of the one before that fit
    in `overlap` tokens (always moving on by a word at least)."""
    out: list[tuple[int, int]] = []
    first = 0
    while first < len(sizes):
        end, used = first, 0
        while end < len(sizes) and (end == first or used + sizes[end] <= room):
            used, end = used + sizes[end], end + 1
        out.append((first, end))
        if end == len(sizes):
            break
        back, first_next = 0, end
        while first_next - 1 > first and back + sizes[first_next - 1] <= overlap:
            first_next -= 1
            back += sizes[first_next]
        first = first_next
    return out


class EntityPredictor:
    """`EntityPredictor("runs/ner/model").predict(["Peter lives in Berlin."])` -> per text, its entities:
    {"entity": type, "text", "start", "end" (character offsets), "score" (mean of its words' tag
    probabilities)}. Words are split as CoNLL splits them (a combining mark stays in its word, a Chinese character is a
    word of its own); each word's tag is read at its first sub-token (a word with none, such as a zero-width space, is
    in no entity). A text of more tokens than max_length is tagged in overlapping windows of whole words, so every word
    has its tag, read in the window where it has the most words around it."""

    regression = False
    accepts = ("texts",)  # what `tuneforge serve` takes for it
    task = "ner"

    def __init__(self, model_dir: str, device: str | None = None, max_length: int | None = None) -> None:
        from transformers import AutoModelForTokenClassification

        folder = open_predictor_folder(model_dir, max_length)
        self.max_length = predict_max_length(max_length, folder.info.get("max_length"), 512, folder.config)
        self.tokenizer = word_tokenizer(model_dir)
        check_room_for_text(self.max_length, self.tokenizer)
        check_vocabulary_fits(self.tokenizer, folder.config, model_dir)
        self.model = load_pretrained_model(AutoModelForTokenClassification, model_dir, "a token-classification model")
        self.model.eval()
        self.device = inference_device(device)
        self.model.to(self.device)
        self.precision = ServingPrecision(self.model, self.device)
        self.labels = [self.model.config.id2label[i] for i in sorted(self.model.config.id2label)]
        if not all(t == "O" or (len(t) > 2 and t[:2] in ("B-", "I-")) for t in self.labels):  # a hub model's head
            raise ConfigError(
                f"model {model_dir!r}: its labels are not IOB tags (O, B-TYPE, I-TYPE): {', '.join(self.labels)}; "
                "NER predict reads entities from such tags"
            )

    @torch.inference_mode()
    def predict(self, texts: list[str], batch_size: int = 32) -> list[dict]:
        if any(not isinstance(t, str) for t in texts):
            raise DataError("NER predicts on plain texts (strings), one per input")
        spans = [text_words(t) for t in texts]
        windows, tokens = self._windows(spans)
        tagged: list[list[tuple]] = [[] for _ in windows]  # per window: (word index, tag, score) of its tagged words
        for run in length_batches(tokens, batch_size, on_cpu=self.device.type == "cpu"):
            for r, words in zip(run, self._tag([windows[r] for r in run], spans)):
                tagged[r] = words
        # a word in two windows takes its tag from the one where it has more words on its shorter side (the
        # "max context" rule of transformers' QA windows): its neighbours then inform its tag as in a whole text
        best: list[dict[int, tuple]] = [{} for _ in texts]
        for (i, first, end), words in zip(windows, tagged):
            for w, tag, score in words:
                context = min(w - first, end - 1 - w)
                if w not in best[i] or context > best[i][w][0]:
                    best[i][w] = (context, tag, score)
        results = []
        for text, words, chosen in zip(texts, spans, best):
            order = sorted(chosen)
            tags, scores = [chosen[w][1] for w in order], [chosen[w][2] for w in order]
            results.append({"entities": self._entities(text, [words[w] for w in order], tags, scores)})
        return results

    def _windows(self, spans: list[list[tuple]]) -> tuple[list[tuple[int, int, int]], list[int]]:
        """Each text's words cut into windows whose tokens fit max_length, so that every word is tagged (a text
        longer than a sentence: a page), each window after the first starting WINDOW_OVERLAP of the room back in
        the one before (as transformers' TokenClassificationPipeline's `stride`), so that no word is tagged at a
        window's edge without the words around it: ([(text, first word, end word)], the tokens of each window)."""
        words = [w for text in spans for w, _, _ in text]
        room = max(1, self.max_length - self.tokenizer.num_special_tokens_to_add())
        # each word's tokens, up to one more than a window holds (a longer word is a window of its own)
        enc = self.tokenizer(words, add_special_tokens=False, truncation=True, max_length=room + 1) if words else None
        counts = [len(ids) for ids in enc["input_ids"]] if enc else []
        windows, tokens, offset = [], [], 0
        for i, text in enumerate(spans):
            sizes, offset = counts[offset : offset + len(text)], offset + len(text)
            for first, end in word_windows(sizes, room, int(room * WINDOW_OVERLAP)):
                windows.append((i, first, end))
                tokens.append(sum(sizes[first:end]))
        return windows, tokens

    def _tag(self, windows: list[tuple[int, int, int]], spans: list[list[tuple]]) -> list[list[tuple]]:
        """Per window, (word index in its text, tag, score) of each of its words that has a token: a word the
        tokenizer drops (a zero-width space, a control character) has none, and must not take the next word's."""
        enc = self.tokenizer(
            [[w for w, _, _ in spans[i][first:end]] for i, first, end in windows],
            is_split_into_words=True,
            truncation=True,  # a single word longer than max_length: its first tokens, enough for its tag
            max_length=self.max_length,
            padding=True,
            return_tensors="pt",
        )
        with self.precision.autocast():
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
        probs = logits.float().softmax(-1).cpu()
        out = []
        for j, (_, first, _) in enumerate(windows):
            words, previous = [], None
            for pos, word in enumerate(enc.word_ids(j)):
                if word is not None and word != previous:
                    p = probs[j, pos]
                    words.append((first + word, self.labels[int(p.argmax())], float(p.max())))
                previous = word
            out.append(words)
        return out

    @staticmethod
    def _entities(text, words, tags, scores) -> list[dict]:
        out = []
        for kind, first, end in entities(tags):
            begin, stop = words[first][1], words[end - 1][2]
            out.append(
                {
                    "entity": kind,
                    "text": text[begin:stop],
                    "start": begin,
                    "end": stop,
                    "score": float(np.mean(scores[first:end])),
                }
            )
        return out
