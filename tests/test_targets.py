"""The one label-alignment rule (aniso_plugins.core.targets): which token each LM-head output position
predicts, derived from what the model's own loss does, and the example boundaries of packed
batches. References are written out here (explicit index arithmetic), not taken from the code."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from aniso_plugins import LabelAlignment, SetupError, alignment_of, sequence_ids
from aniso_plugins.core.targets import target_rule


def _meta(config_cls, model_cls, **kw) -> nn.Module:
    with torch.device("meta"):
        return model_cls(config_cls(**kw))


SMALL = dict(vocab_size=32)
ENC_DEC = dict(d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=1, decoder_attention_heads=1,
               encoder_ffn_dim=8, decoder_ffn_dim=8, pad_token_id=0, **SMALL)  # fmt: skip


@pytest.mark.parametrize(
    "build, kind",
    [
        (lambda: _meta(transformers.GPT2Config, transformers.GPT2LMHeadModel, n_layer=1, n_embd=8, n_head=1, **SMALL), "causal"),
        (lambda: _meta(transformers.LlamaConfig, transformers.LlamaForCausalLM, hidden_size=8, intermediate_size=8,
                       num_hidden_layers=1, num_attention_heads=1, **SMALL), "causal"),  # fmt: skip
        (lambda: _meta(transformers.BertConfig, transformers.BertForMaskedLM, hidden_size=8, num_hidden_layers=1,
                       num_attention_heads=1, intermediate_size=8, **SMALL), "aligned"),  # fmt: skip
        (lambda: _meta(transformers.T5Config, transformers.T5ForConditionalGeneration, d_model=8, d_kv=4, d_ff=8,
                       num_layers=1, num_heads=1, **SMALL), "seq2seq"),  # fmt: skip
        (lambda: _meta(transformers.MT5Config, transformers.MT5ForConditionalGeneration, d_model=8, d_kv=4, d_ff=8,
                       num_layers=1, num_heads=1, **SMALL), "seq2seq"),  # fmt: skip
        (lambda: _meta(transformers.MarianConfig, transformers.MarianMTModel, decoder_start_token_id=0, **ENC_DEC), "seq2seq"),
        (lambda: _meta(transformers.PegasusConfig, transformers.PegasusForConditionalGeneration, **ENC_DEC), "seq2seq"),
        (lambda: _meta(transformers.M2M100Config, transformers.M2M100ForConditionalGeneration, **ENC_DEC), "seq2seq"),
        (lambda: _meta(transformers.BartConfig, transformers.BartForConditionalGeneration, **ENC_DEC), "seq2seq"),
    ],
    ids=["gpt2", "llama", "bert-mlm", "t5", "mt5", "marian", "pegasus", "m2m100", "bart"],
)
def test_alignment_follows_the_models_own_loss(build, kind):
    assert alignment_of(build()) == LabelAlignment(kind)


def test_alignment_it_cannot_tell_is_refused_naming_targets():
    class MyLM(nn.Module):  # no config, no transformers class: nothing says how its loss aligns
        pass

    with pytest.raises(SetupError, match="targets="):
        alignment_of(MyLM())
    xlm = _meta(transformers.XLMConfig, transformers.XLMWithLMHeadModel, emb_dim=8, n_layers=1, n_heads=1, **SMALL)
    with pytest.raises(SetupError, match=r"XLMWithLMHeadModel.*hands the labels to self\.pred_layer.*targets="):
        alignment_of(xlm)  # its head computes the loss (and it is listed as both): only the user can say
    assert target_rule("aligned", lambda: alignment_of(xlm)) == LabelAlignment("aligned")  # never asked
    with pytest.raises(SetupError, match="targets="):
        target_rule(None, None)  # a head named by path: no model to ask
    with pytest.raises(SetupError, match="expected one of"):
        target_rule("shifted", None)


def test_targets_of_each_alignment():
    labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    batch = {"labels": labels, "input_ids": labels.clamp_min(0), "decoder_input_ids": torch.zeros_like(labels)}
    causal = LabelAlignment("causal").read(batch)
    assert causal.targets.tolist() == [[6, 7, -100, -100], [9, -100, -100, -100]]
    assert causal.input_ids is batch["input_ids"]
    shifted = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])  # the collator's own shift wins, as in ForCausalLMLoss
    assert LabelAlignment("causal").read({**batch, "shift_labels": shifted}).targets is shifted
    assert LabelAlignment("aligned").read(batch).targets is labels
    seq2seq = LabelAlignment("seq2seq").read(batch)
    assert seq2seq.targets is labels and seq2seq.input_ids is batch["decoder_input_ids"]  # the decoder's own inputs
    assert seq2seq.attention_mask is None  # the encoder's mask never stands in for the decoder's
    assert LabelAlignment("aligned").read({"input_ids": labels}).targets is None


def test_sequence_ids_from_each_packing_key():
    # three examples of lengths 3, 2, 4 in one row, as DataCollatorWithFlattening packs them
    expected = [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert sequence_ids((1, 9), position_ids=positions).tolist() == expected
    assert sequence_ids((1, 9), position_ids=positions + 2).tolist() == expected  # RoBERTa-style numbering from 2
    assert sequence_ids((1, 9), cu_seq_lens=torch.tensor([0, 3, 5, 9])).tolist() == expected
    assert sequence_ids((1, 9), seq_idx=torch.tensor(expected)).tolist() == expected
    # one example per row (ordinary position ids): one id per row, all equal (not read back to tell)
    assert sequence_ids((2, 4), position_ids=torch.arange(4).expand(2, 4)).tolist() == [[0] * 4] * 2
    assert sequence_ids((1, 5), position_ids=torch.tensor([[1, 1, 0, 1, 2]])).tolist() == [[0, 1, 2, 2, 2]]
    assert sequence_ids((2, 4)) is None
    read = LabelAlignment("causal").read({"labels": torch.ones(1, 9, dtype=torch.long), "position_ids": positions})
    assert read.sequence_ids.tolist() == expected
    seq2seq = {"labels": torch.ones(1, 9, dtype=torch.long), "position_ids": positions}
    assert LabelAlignment("seq2seq").read(seq2seq).sequence_ids is None  # position_ids are the encoder's
