"""Configuration errors that help (issue #43 item 5): names matched in any case, a value of
another option pointed there, "did you mean" for misspelt values and keywords (every plugin's
fields included), the type named when it is wrong, and a model without an LM head answered with
its family's class that has one (or measured through its input embedding, metrics only)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import transformers as T

from aniso_plugins import AnisoConfig, ConfigError, OutputEmbeddingsHandle, SetupError, TrainingSession, find_handle
from aniso_plugins.core import registry
from aniso_plugins.core.options import Options, check_choice, check_range


def cfg(**kw) -> AnisoConfig:
    return AnisoConfig(**{"load_entry_points": False, **kw})


def message(**kw) -> str:
    with pytest.raises(ConfigError) as e:
        cfg(**kw)
    return str(e.value)


# --- 1. names in any case -------------------------------------------------------------------------


@pytest.mark.parametrize("field, written, stored, extra", [
    ("spectrum_prior", "POLY", "poly", {}),
    ("lowrank_init", "Random", "random", {"head": "lowrank", "lowrank_rank": 4}),
    ("group_tokens", "Seen", "seen", {}),
    ("uniformity_on", ("HEAD", "Hidden"), ("head", "hidden"), {}),
    ("agg_parts", ("A", "C"), ("a", "c"), {}),
    ("simcse_pooling", "MEAN", "mean", {"method": "simcse"}),
])
def test_plugin_owned_names_are_matched_in_any_case(field, written, stored, extra):
    assert getattr(cfg(**{field: written, **extra}), field) == stored
    name = stored if isinstance(stored, str) else stored[0]
    misspelt = name + name[-1] if isinstance(stored, str) else (name + name[-1],)
    assert f"did you mean '{name}'?" in message(**{field: misspelt, **extra})

def test_method_metric_head_and_mismatch_names_are_matched_in_any_case_and_stored_as_listed():
    c = cfg(method="AGG", metrics="Geometry,FREQUENCY", head="LowRank", lowrank_rank=2, on_state_mismatch="Reset")
    assert (c.method, c.metrics, c.head, c.on_state_mismatch) == (("agg",), ("geometry", "frequency"), "lowrank", "reset")
    assert c == cfg(method="agg", metrics=("geometry", "frequency"), head="lowrank", lowrank_rank=2, on_state_mismatch="reset")
    assert c.uses("agg") and c.to_dict()["method"] == ["agg"]
    assert cfg(method=["CosReg", "SimCTG"]).method == ("cosreg", "simctg")
    assert c.replace(method="Hinge").method == ("hinge",)
    assert AnisoConfig.from_dict({"method": "UNIFORMITY", "metrics": ["Uniformity"]}).metrics == ("uniformity",)


def test_the_same_name_twice_in_another_case_is_a_duplicate():
    assert "'agg' is listed twice in method" in message(method=("agg", "AGG"))


def test_hf_argument_parser_takes_a_name_as_the_docs_write_it(tmp_path):
    from transformers import HfArgumentParser

    (parsed,) = HfArgumentParser(AnisoConfig).parse_dict({"method": ["AGG"], "metrics": ["Hidden"]})
    assert parsed.method == ("agg",) and parsed.metrics == ("hidden",)


# --- 2. a value of another option -------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, said",
    [
        (dict(method="lowrank"), "method='lowrank': expected one of none, agg"),
        (dict(method="LowRank"), "'LowRank' is not a value of method but of head: head='lowrank'"),
        (dict(method="lowrank"), "head='lowrank'"),
        (dict(metrics=["geometry", "agg"]), "'agg' is not a value of metrics but of method: method='agg'"),
        (dict(head="agg"), "method='agg'"),
        (dict(method="geometry"), "metrics='geometry'"),
        (dict(head="uniformity"), "of method or metrics: method='uniformity' or metrics='uniformity'"),
    ],
)
def test_a_value_of_another_option_points_there(kw, said):
    assert said in message(**kw)


def test_the_registry_points_a_value_of_another_table_there_too():
    with pytest.raises(ConfigError, match="method='lowrank'.*head='lowrank'"):
        registry.plugin_class("method", "lowrank")


# --- 3. did you mean --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, said",
    [
        (dict(method="agq"), "method='agq': expected one of none, agg, cosreg"),
        (dict(method="agq"), "did you mean 'agg'?"),
        (dict(metrics="geometri"), "metrics='geometri': expected one of geometry,"),
        (dict(metrics="geometri"), "did you mean 'geometry'?"),
        (dict(metrics="ethayaraj"), "did you mean 'ethayarajh'?"),
        (dict(head="untied"), "did you mean 'untie'?"),
        (dict(on_state_mismatch="rest"), "did you mean 'reset'?"),
    ],
)
def test_a_misspelt_name_gets_the_closest_ones(kw, said):
    assert said in message(**kw)


def test_a_choice_checked_by_a_plugin_gets_the_closest_ones():
    """`check_choice`, which a feature's `validate` calls (spectrum_prior, simcse_pooling, ...)."""
    with pytest.raises(ConfigError, match=r"simcse_pooling='maen': expected one of cls, mean; did you mean 'mean'\?"):
        cfg(simcse_pooling="maen")
    with pytest.raises(ConfigError, match=r"pick='Second': expected one of first, second; did you mean 'second'\?"):
        check_choice("pick", "Second", ("first", "second"))


@pytest.mark.parametrize(
    "kw, typo, meant",
    [
        (dict(alpah=0.1), "'alpah'", "did you mean 'alpha'?"),
        (dict(Alpha=0.1), "'Alpha'", "did you mean 'alpha'?"),
        (dict(metric="hidden"), "'metric'", "did you mean 'metrics'"),
        (dict(methods="agg"), "'methods'", "did you mean 'method'"),
        # fields owned by the plugins' options classes (the registry's OPTIONS)
        (dict(simcse_temprature=0.1), "'simcse_temprature'", "did you mean 'simcse_temperature'"),
        (dict(hidden_sample=8), "'hidden_sample'", "did you mean 'hidden_samples'"),
        (dict(lowrank_rnk=4), "'lowrank_rnk'", "did you mean 'lowrank_rank'"),
        (dict(agg=True), "'agg'", "a value, not a field: method='agg'"),
        (dict(geometry=True), "'geometry'", "metrics='geometry'"),
    ],
)
def test_an_unknown_keyword_is_a_type_error_naming_the_closest_fields(kw, typo, meant):
    with pytest.raises(TypeError) as e:
        cfg(**kw)
    text = str(e.value)
    assert not isinstance(e.value, ConfigError)  # what Python raises, as before: callers' except clauses hold
    assert f"AnisoConfig() got an unexpected keyword argument {typo}" in text and meant in text


def test_unknown_keywords_far_from_every_field_say_where_the_fields_are_listed():
    with pytest.raises(TypeError) as e:
        cfg(alpah=0.1, zzzqqq=1)
    text = str(e.value)
    assert "unexpected keyword arguments 'alpah' (did you mean 'alpha'?), 'zzzqqq' (no field of AnisoConfig" in text
    assert "docs/configuration.md" in text and "AnisoConfig.extend" in text


def test_a_third_party_plugins_fields_are_suggested_and_the_signature_is_kept():
    @dataclasses.dataclass(frozen=True)
    class NormOptions(Options):
        head_norm_coef: float = 1e-4

    Config = AnisoConfig.extend(NormOptions)
    assert Config(head_norm_coef=0.5, load_entry_points=False).head_norm_coef == 0.5
    with pytest.raises(TypeError, match=r"AnisoConfig\+NormOptions\(\) got an unexpected keyword argument "
                                        r"'head_norm_coeff' \(did you mean 'head_norm_coef'"):
        Config(head_norm_coeff=0.5)
    with pytest.raises(TypeError, match="'head_norm_coef' \\(no field of AnisoConfig.*installed, or with AnisoConfig.extend"):
        AnisoConfig(head_norm_coef=0.5)  # not installed: the base class has no such field
    for cls in (AnisoConfig, Config):  # parsers (jsonargparse, tyro) read the fields from the signature
        parameters = inspect.signature(cls).parameters
        assert "alpha" in parameters and "metrics" in parameters and "args" not in parameters
    assert "head_norm_coef" in inspect.signature(Config).parameters


def test_replace_and_from_dict_name_the_closest_fields_in_their_config_error():
    with pytest.raises(ConfigError, match=r"unknown configuration fields \['alhpa'\]: 'alhpa' \(did you mean 'alpha'\?\)"):
        cfg().replace(alhpa=0.1)
    with pytest.raises(ConfigError, match=r"'windw' \(did you mean 'window'"):
        AnisoConfig.from_dict({"windw": 4})


# --- 4. the type named --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, said",
    [
        (dict(method="agg", alpha="0.1"), "alpha='0.1' (str): expected a number > 0; did you mean alpha=0.1?"),
        (dict(reg_weight="1e-3"), "reg_weight='1e-3' (str): expected a number >= 0; did you mean reg_weight=0.001?"),
        (dict(reg_weight="heavy"), "reg_weight='heavy' (str): expected a number >= 0"),
        (dict(hinge_margin=True), "hinge_margin=True (bool): expected a number in [-1, 1]"),
        (dict(window="8"), "window='8' (str): expected an integer >= 1; did you mean window=8?"),
        (dict(window=8.0), "window=8.0 (float): expected an integer >= 1"),
        (dict(hidden_samples=None), "hidden_samples=None (NoneType): expected an integer >= 2"),
        (dict(head=None), "head=None (NoneType): expected one of keep, untie, lowrank"),
        (dict(head=1), "head=1 (int): expected one of keep"),
        (dict(method=["agg", 1]), "1 (int) is not a str"),
        (dict(metrics=None), "metrics=None (NoneType): expected a list of str values"),
    ],
)
def test_a_value_of_the_wrong_type_is_named_with_its_type(kw, said):
    assert said in message(**kw)


def test_a_value_of_the_right_type_is_named_without_it():
    assert message(reg_weight=-1.0).startswith("reg_weight=-1.0: expected a number >= 0")
    assert message(window=0).startswith("window=0: expected an integer >= 1")
    assert "did you mean" not in message(reg_weight="-1")  # a number that is refused as well: no hint
    with pytest.raises(ConfigError, match=r"^x='2' \(str\): expected a number in \(0, 1\]$"):
        check_range("x", "2", 0.0, 1.0, "a number in (0, 1]", low_open=True)


# --- 5. a model without an LM head --------------------------------------------------------------------
def bert() -> T.BertModel:
    return T.BertModel(T.BertConfig(vocab_size=64, hidden_size=24, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=48, max_position_embeddings=32))


def test_a_model_without_an_lm_head_is_answered_with_its_familys_class_with_one():
    with pytest.raises(SetupError) as e:
        OutputEmbeddingsHandle(bert())
    text = str(e.value)
    assert "found no LM head in BertModel" in text and "BertForMaskedLM or BertLMHeadModel" in text
    assert "head='embeddings.word_embeddings'" in text  # the measuring route, metrics only
    gpt2 = T.GPT2Model(T.GPT2Config(vocab_size=64, n_embd=24, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0))
    with pytest.raises(SetupError, match="found no LM head in GPT2Model.*load GPT2LMHeadModel.*head='wte'"):
        OutputEmbeddingsHandle(gpt2)


def test_find_handle_names_the_bare_model_inside_the_module_and_the_path_from_the_root():
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = bert()

    with pytest.raises(SetupError, match="BertModel.*BertForMaskedLM.*head='encoder.embeddings.word_embeddings'"):
        find_handle(Wrapper())
    with pytest.raises(SetupError, match="found no LM head in Linear: no submodule has get_output_embeddings"):
        find_handle(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("kw", [dict(method="agg"), dict(method="cosreg"), dict(head="untie")])
def test_methods_on_the_head_refuse_an_input_embedding_named_as_the_head(kw):
    model = bert()
    session = TrainingSession(cfg(metrics=(), **kw))
    with pytest.raises(SetupError, match="embedding lookup that makes no logits.*use BertForMaskedLM or BertLMHeadModel"):
        session.setup(OutputEmbeddingsHandle(model, head="embeddings.word_embeddings"))
    assert not any(p.grad is not None for p in model.parameters())


def test_metrics_measure_an_encoder_without_a_head_through_its_input_embedding(tmp_path):
    """The route the refusal names: a BertModel trained on a loss of its own in a Trainer, the
    geometry of its input embedding and its hidden states measured."""
    from transformers import Trainer, TrainingArguments

    from aniso_plugins.integrations.hf import AnisoCallback

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    model = bert()
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=True,
                             save_strategy="no", max_steps=1, per_device_train_batch_size=4, logging_steps=1,
                             remove_unused_columns=False, label_names=["labels"])  # fmt: skip
    callback = AnisoCallback(cfg(metrics=("geometry", "hidden")), head="embeddings.word_embeddings", targets="aligned")
    trainer = Trainer(model=model, args=args, train_dataset=Data(), callbacks=[callback],
                      compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.last_hidden_state.pow(2).mean())  # fmt: skip
    trainer.train()
    logged = {k: v for record in trainer.state.log_history for k, v in record.items()}
    assert "aniso/geometry/head/mean_cosine" in logged and "aniso/hidden/layer_0/mean_cosine" in logged
