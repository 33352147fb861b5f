"""Helpers every task shares (tuneforge/tasks/base.py)."""

from transformers import BartConfig, BertConfig, EncoderDecoderConfig, GPT2Config, LlamaConfig, T5Config

from tuneforge.tasks.base import set_dropout


def dropouts(config) -> dict:
    return {k: v for k, v in vars(config).items() if isinstance(v, float) and ("dropout" in k or "pdrop" in k)}


def test_set_dropout_reaches_each_architectures_own_names():
    expected = {
        BertConfig: {"hidden_dropout_prob", "attention_probs_dropout_prob"},
        GPT2Config: {"resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"},
        T5Config: {"dropout_rate", "classifier_dropout"},
        LlamaConfig: {"attention_dropout"},
        BartConfig: {"dropout", "attention_dropout", "activation_dropout", "classifier_dropout"},
    }
    for kind, names in expected.items():
        config = set_dropout(kind(), 0.05)
        assert dropouts(config) == dict.fromkeys(names, 0.05), kind.__name__
    assert set_dropout(BartConfig(encoder_layerdrop=0.2), 0.0).encoder_layerdrop == 0.2  # layer drop is not dropout


def test_set_dropout_recurses_into_encoder_decoder_and_none_keeps_the_model_own():
    pair = EncoderDecoderConfig.from_encoder_decoder_configs(BertConfig(), BertConfig())
    set_dropout(pair, 0.0)
    assert (
        dropouts(pair.encoder)
        == dropouts(pair.decoder)
        == {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    )
    assert dropouts(set_dropout(BertConfig(), None)) == {
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
    }
