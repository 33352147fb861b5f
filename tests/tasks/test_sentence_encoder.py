"""SentenceEncoder (tuneforge.tasks.sentence_encoder), what `tuneforge predict` and POST /v1/embeddings run: a batch
of texts of mixed lengths embedded on a CPU in runs of similar length, each text's vector what it gets alone. Its
agreement with sentence-transformers' own load of a folder is test_predict_embeddings.py's."""

from __future__ import annotations

import numpy as np


def test_a_batch_of_mixed_lengths_runs_in_narrower_forwards_with_each_texts_own_vector(tiny_encoder):
    """Two short texts and two long ones in one batch: more than one forward, every forward narrower than the
    padded batch and all of them reading fewer token positions together, and each vector the one the text gets
    in a batch of its own (within 1e-5)."""
    from tuneforge.tasks.sentence_encoder import SentenceEncoder

    encoder = SentenceEncoder(tiny_encoder, device="cpu", max_length=128)
    texts = ["ok", "a fox " * 40, "dull", "the owl sat by the river " * 12]
    lengths = [len(ids) for ids in encoder.tokenize(texts)]
    assert max(lengths) > 5 * min(lengths)
    shapes = []
    encoder.model.register_forward_pre_hook(lambda _, a, kw: shapes.append(kw["input_ids"].shape), with_kwargs=True)
    together = encoder.encode(texts)
    padded = len(texts) * max(lengths)
    assert len(shapes) > 1 and all(width < max(lengths) or rows < len(texts) for rows, width in shapes)
    assert sum(rows * width for rows, width in shapes) < 0.7 * padded
    alone = np.concatenate([encoder.encode([t]) for t in texts])
    assert np.abs(together - alone).max() < 1e-5
