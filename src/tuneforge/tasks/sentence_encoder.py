"""A trained sentence encoder at work: `SentenceEncoder` (a model folder -> L2-normalised, mean-pooled embeddings of
texts, tokenized as the folder's sentence-transformers config says: its default prompt, do_lower_case,
max_seq_length), `EmbeddingPredictor` (what `tuneforge predict` and `serve`'s POST /v1/embeddings run: texts or token
ids, whole or cut to their first dimensions) and `sentence_transformers_files` (the folder format that makes an
exported encoder load in `sentence_transformers.SentenceTransformer`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tuneforge.adapters import load_pretrained_model
from tuneforge.artifacts import (
    check_vocabulary_fits,
    inference_device,
    load_tokenizer,
    sentence_transformers_layout,
)
from tuneforge.errors import ConfigError, DataError
from tuneforge.tasks.base import ServingPrecision, open_predictor_folder, predict_max_length, set_pad_token
from tuneforge.tasks.embedding_ops import cut, embed
from tuneforge.tasks.length_runs import length_batches


def sentence_transformers_files(size: int, max_seq_length: int) -> dict[str, str]:
    """sentence-transformers' folder format for a mean-pooled, normalised encoder of width `size` whose HF weights
    and tokenizer sit in the folder's root: modules.json (Transformer, Pooling, Normalize), the Pooling config,
    sentence_bert_config.json and config_sentence_transformers.json (module names as every version since 2.x
    reads them)."""
    import transformers

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    pooling = {
        "word_embedding_dimension": size,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    }
    model = {
        "__version__": {"transformers": transformers.__version__, "pytorch": torch.__version__},
        "model_type": "SentenceTransformer",
        "prompts": {},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    }
    files = {
        "modules.json": modules,
        "1_Pooling/config.json": pooling,
        "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": False},
        "config_sentence_transformers.json": model,
    }
    return {name: json.dumps(value, indent=2) + "\n" for name, value in files.items()}


def tokenizer_limit(tokenizer) -> int | None:
    """The tokenizer's model_max_length where its folder sets one (transformers' stand-in for none is ~1e30): what
    sentence-transformers cuts texts at when its own config names no max_seq_length."""
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 1_000_000 else None


class SentenceEncoder:
    """`SentenceEncoder("runs/x/model").encode(["a text", ...])`: one L2-normalised, mean-pooled embedding per text
    (float32, shape (texts, size)), as training computed them; `dims` keeps the first dims (renormalised)."""

    def __init__(self, model_dir: str | Path, device: str | None = None, max_length: int | None = None) -> None:
        from transformers import AutoModel

        folder = open_predictor_folder(model_dir, max_length)
        model_dir, self.info, config = folder.path, folder.info, folder.config
        self.tokenizer = load_tokenizer(model_dir)
        check_vocabulary_fits(self.tokenizer, config, model_dir)
        set_pad_token(self.tokenizer, model_dir)
        layout = sentence_transformers_layout(model_dir)  # its texts prompted, lowercased and cut as it says
        folder_length = layout.max_seq_length if layout else None
        self.lowercase, self.prompt = (layout.lowercase, layout.prompt) if layout else (False, "")
        trained = self.info.get("max_length") or folder_length or tokenizer_limit(self.tokenizer)
        self.max_length = predict_max_length(max_length, trained, 512, config)
        from tuneforge.data.tokenize import check_room_for_text  # (datasets loads with it: not at every import)

        check_room_for_text(self.max_length, self.tokenizer)
        self.size = getattr(config, "hidden_size", None)
        self.model = load_pretrained_model(AutoModel, model_dir, "a sentence encoder").eval()
        self.device = inference_device(device)
        self.model.to(self.device)
        self.precision = ServingPrecision(self.model, self.device)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids as the folder's sentence-transformers config has it tokenized: after its default
        prompt, lowercased where it says do_lower_case, cut at max_length."""
        return self.tokenize_within(texts)[0]

    def tokenize_within(self, texts: Sequence[str]) -> tuple[list[list[int]], list[bool]]:
        """`tokenize`, and which texts were cut at max_length."""
        from tuneforge.data.tokenize import encode_within  # (datasets loads with it: not at every import)

        texts = [self.prompt + t for t in texts]
        texts = [t.lower() for t in texts] if self.lowercase else texts
        if not texts:
            return [], []
        enc, was_cut = encode_within(self.tokenizer, {"text": texts}, self.max_length)
        return enc["input_ids"], was_cut

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], batch_size: int = 64, dims: int | None = None) -> np.ndarray:
        return self.encode_ids(self.tokenize(texts), batch_size, dims)

    @torch.inference_mode()
    def encode_ids(self, ids: Sequence[Sequence[int]], batch_size: int = 64, dims: int | None = None) -> np.ndarray:
        """`encode` of texts already tokenized: each one's token ids as the tokenizer gives them (its special tokens
        included, at most max_length)."""
        if dims is not None and (dims < 1 or (self.size and dims > self.size)):
            raise ConfigError(f"dims {dims} is outside the embedding's 1 to {self.size} dimensions")
        if not ids:
            return np.zeros((0, dims or self.size or 0), dtype=np.float32)
        runs = length_batches([len(x) for x in ids], batch_size, on_cpu=self.device.type == "cpu")
        parts = []
        for idx in runs:
            batch = self.tokenizer.pad({"input_ids": [list(ids[i]) for i in idx]}, return_tensors="pt")
            with self.precision.autocast():
                pooled = embed(self.model, batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device))
            parts.append(cut(pooled, dims).cpu().numpy())
        out = np.empty((len(ids), parts[0].shape[1]), dtype=np.float32)
        out[np.concatenate(runs)] = np.concatenate(parts)
        return out


# ---- prediction and serving ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Embedded:
    """One input's embedding as `tuneforge serve` answers it: the L2-normalised float32 vector, and the number of
    tokens the model read (its special tokens included, after truncation at max_length)."""

    vector: np.ndarray
    tokens: int


class EmbeddingPredictor:
    """What `tuneforge predict` and `serve` run for a sentence encoder (`make_predictor`): SentenceEncoder's vectors
    of texts, or of token-id lists as the model's tokenizer gives them (special tokens included). `encode` -> a
    matrix, `predict` -> per input {"embedding": [...]}, `embed` -> per input an `Embedded` (serve's batches);
    `dimensions` keeps the first N dimensions, renormalised (what a Matryoshka-trained model, `matryoshka_dims`,
    is made for). `embedding_size` is the capability predict and serve read: this model answers with vectors (a
    .npy matrix, POST /v1/embeddings), not through /predict (`accepts` is empty)."""

    accepts: tuple[str, ...] = ()
    regression = False
    labels: list[str] = []
    task = "embedding"

    def __init__(self, model_dir: str | Path, device: str | None = None, max_length: int | None = None) -> None:
        self.model_dir = str(model_dir)
        self.encoder = SentenceEncoder(model_dir, device=device, max_length=max_length)
        self.max_length = self.encoder.max_length
        self.embedding_size = int(self.encoder.size or self.encoder.encode(["a"]).shape[1])
        self.matryoshka_dims = [int(d) for d in self.encoder.info.get("matryoshka_dims") or []]
        self.vocab_size = int(self.encoder.model.get_input_embeddings().num_embeddings)
        self.precision = self.encoder.precision
        self.last_cut = None  # its CutCount of the last inputs embedded (`tuneforge predict` says it)

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is not None and not 1 <= dimensions <= self.embedding_size:
            raise ConfigError(
                f"--dimensions {dimensions} is outside the {self.embedding_size} dimensions of model "
                f"{self.model_dir!r}'s embedding; give 1 to {self.embedding_size}"
            )

    def input_problem(self, item) -> str | None:
        """What is wrong with one input, worded to follow its name (None: nothing): a text must not be empty;
        token ids must lie below the vocabulary size, at most max_length of them."""
        if isinstance(item, str):
            return "is empty; send some text" if not item else None
        if not isinstance(item, (list, tuple)):
            return f"is a {type(item).__name__}, not a text"
        if any(isinstance(t, str) for t in item):
            return "holds several texts; a sentence encoder embeds one text per input (predict: one --text-column)"
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            return "is neither a text nor a list of token ids"
        if not item:
            return "is an empty list of token ids; send at least one"
        bad = next((j for j, t in enumerate(item) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"holds {item[bad]} at [{bad}], which is not a token id below {self.vocab_size}"
        if len(item) > self.max_length:
            return f"holds {len(item)} token ids, above the {self.max_length} the model reads (its max_length)"
        return None

    def token_ids(self, items: Sequence) -> list[list[int]]:
        """Each input's token ids: a text tokenized (truncated at max_length), token ids as given; DataError naming
        the first input that is neither."""
        for i, item in enumerate(items):
            problem = self.input_problem(item)
            if problem:
                raise DataError(f"input {i + 1} {problem}")
        from tuneforge.data.tokenize import CutCount

        ids = [None if isinstance(item, str) else list(item) for item in items]
        texts = [i for i, item in enumerate(items) if isinstance(item, str)]
        encoded, was_cut = self.encoder.tokenize_within([items[i] for i in texts])
        for i, row in zip(texts, encoded):
            ids[i] = row
        self.last_cut = CutCount(sum(was_cut), len(items), "texts", self.max_length)  # (token ids are never cut)
        return ids

    def encode(self, items: Sequence, batch_size: int = 64, dimensions: int | None = None) -> np.ndarray:
        """The embeddings of `items` (texts or token-id lists) as a float32 matrix, one row per input in order."""
        self.check_dimensions(dimensions)
        return self.encoder.encode_ids(self.token_ids(items), batch_size, dimensions)

    def predict(self, items: Sequence, batch_size: int = 64, dimensions: int | None = None) -> list[dict]:
        return [{"embedding": row.tolist()} for row in self.encode(items, batch_size, dimensions)]

    def embed(self, items: Sequence, batch_size: int = 64) -> list[Embedded]:
        ids = self.token_ids(items)
        return [Embedded(v, len(x)) for v, x in zip(self.encoder.encode_ids(ids, batch_size), ids)]
