"""AnisoConfig as a frozen, validated value; the error hierarchy; the built-in plugin registry;
the configuration through transformers' HfArgumentParser, tyro and LightningCLI."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import typing
import warnings

import pytest
import torch
from torch import nn

import aniso_plugins
from aniso_plugins import AnisoConfig, AnisoError, ConfigError, ModelHandle, SetupError, StateError
from aniso_plugins.core import registry
from aniso_plugins.core.config import HEADS, METHODS, METRICS
from aniso_plugins.core.builtins import aniso_make_plugins
from aniso_plugins.core.state import load_state, save_state

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

# A configuration where every field differs from its default (parsers must carry each one).
NON_DEFAULT = dict(
    method=("hinge", "simctg", "uniformity"),
    head="lowrank",
    ignore_index=-1,
    alpha=0.05,
    alpha_tokens=65536,
    window=7,
    special_ids=(0, 1),
    agg_g1=False,
    agg_g2=False,
    agg_static_after=3,
    agg_freeze_rare=True,
    agg_parts=("a", "c"),
    fused_loss=True,
    fused_chunk_size=64,
    reg_weight=0.5,
    reg_every_microbatch=True,
    reg_exclude_ids=(2,),
    hinge_margin=0.25,
    hinge_sample=16,
    hinge_block=128,
    spectrum_prior="exp",
    spectrum_c1=2.0,
    spectrum_c2=0.02,
    spectrum_gamma=0.5,
    simctg_weight=0.5,
    simctg_margin=0.25,
    simctg_block=64,
    uniformity_weight=0.5,
    uniformity_t=1.5,
    uniformity_on=("head", "hidden"),
    uniformity_sample=32,
    uniformity_block=64,
    simcse_weight=0.5,
    simcse_temperature=0.1,
    simcse_pooling="mean",
    coupled_adam_decay=True,
    coupled_adam_scale=2.0,
    mu_loss_weight=0.5,
    lowrank_rank=4,
    lowrank_init="random",
    metrics=("frequency", "geometry", "eval", "bottleneck"),
    metrics_every=5,
    group_fractions=(0.1, 0.6, 0.3),
    hidden_samples=32,
    bottleneck_every=9,
    update_efficiency=True,
    update_efficiency_eps=(0.05,),
    update_efficiency_positions=16,
    uniformity_rows=64,
    ethayarajh_words=8,
    group_tokens="seen",
    under_trained_threshold=0.4,
    under_trained_reference_ids=(3,),
    load_entry_points=False,
    on_state_mismatch="reset",
    report_at_end=True,
)


def test_non_default_covers_every_field():
    exclusive = {"rare_fraction"}  # exclusive with alpha; tests/test_agg_gating.py parses it
    assert set(NON_DEFAULT) | exclusive == {f.name for f in dataclasses.fields(AnisoConfig)}
    default = AnisoConfig()
    assert all(getattr(default, k) != v for k, v in NON_DEFAULT.items())


# --- errors -------------------------------------------------------------------------------------
def test_error_hierarchy_keeps_the_builtin_bases_and_one_class_per_error():
    assert issubclass(ConfigError, AnisoError) and issubclass(ConfigError, ValueError)
    assert issubclass(SetupError, AnisoError) and issubclass(SetupError, RuntimeError)
    assert issubclass(StateError, AnisoError) and issubclass(StateError, RuntimeError)
    assert issubclass(AnisoError, Exception) and not issubclass(AnisoError, (ValueError, RuntimeError))
    from aniso_plugins.core import config, errors, model, state

    assert config.ConfigError is errors.ConfigError is aniso_plugins.ConfigError
    assert model.SetupError is errors.SetupError is aniso_plugins.SetupError
    assert state.StateError is errors.StateError is aniso_plugins.StateError
    assert errors.AnisoError is aniso_plugins.AnisoError
    for cls in (AnisoError, ConfigError, SetupError, StateError):
        assert cls.__doc__ and "\n" not in cls.__doc__.strip()


def test_raised_errors_are_caught_as_aniso_error_and_as_their_builtin(tmp_path):
    def raise_config():
        AnisoConfig(alpha=-1)

    def raise_setup():
        ModelHandle(nn.Sequential(nn.Linear(2, 2)), head="lm_head")

    def raise_state():
        path = tmp_path / "state.safetensors"
        save_state(path, {"agg": {"x": torch.zeros(2)}}, AnisoConfig(method="agg").to_dict())
        load_state(path, AnisoConfig().to_dict())

    for raise_, builtin, error in [
        (raise_config, ValueError, ConfigError),
        (raise_setup, RuntimeError, SetupError),
        (raise_state, RuntimeError, StateError),
    ]:
        try:
            raise_()
        except AnisoError as e:
            assert type(e) is error and isinstance(e, builtin)
        else:
            pytest.fail(f"{raise_.__name__} raised nothing")
        with pytest.raises(builtin):
            raise_()


# --- frozen, hashable, tuples -------------------------------------------------------------------
def test_config_is_frozen_and_replace_validates_again():
    cfg = AnisoConfig(method="agg")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.alpha = -1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.metrics = ("geometry", "geometry")
    assert cfg.alpha is None and cfg.metrics == ("geometry",)  # None: 0.03 (or rare_fraction's)
    changed = cfg.replace(alpha=0.1, metrics=["eval"])
    assert (changed.alpha, changed.metrics, changed.method) == (0.1, ("eval",), ("agg",))
    assert cfg.alpha is None  # the original is untouched
    assert dataclasses.replace(cfg, alpha=0.1) == cfg.replace(alpha=0.1)
    with pytest.raises(ConfigError, match="alpha=-1"):
        cfg.replace(alpha=-1)
    with pytest.raises(ConfigError, match="alpha=-1"):
        dataclasses.replace(cfg, alpha=-1)
    with pytest.raises(ConfigError, match="unknown configuration fields.*'alhpa'"):
        cfg.replace(alhpa=0.1)


@pytest.mark.parametrize(
    "method, words",
    [
        (("none", "agg"), "'none' (plain MLE) cannot be combined"),
        (("cosreg", "spectrum"), "cosreg and spectrum both regularize the head rows"),
        (("agg", "simcse"), "simcse trains sentence encoders"),
        (("simctg", "simcse"), "simctg is for causal-LM training"),
        ((), "name at least one method"),
        (("agg", "agg"), "listed twice in method"),
    ],
)
def test_method_combinations_that_cannot_work_are_refused(method, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        AnisoConfig(method=method)


def test_update_efficiency_without_the_bottleneck_probe_is_refused():
    with pytest.raises(ConfigError, match="add 'bottleneck' to metrics"):
        AnisoConfig(update_efficiency=True, metrics=("geometry",))
    assert AnisoConfig(update_efficiency=True, metrics=("bottleneck",)).update_efficiency


def test_one_method_name_and_lists_of_methods_are_the_same_field():
    assert AnisoConfig(method="agg") == AnisoConfig(method=["agg"]) == AnisoConfig(method=("agg",))
    cfg = AnisoConfig(method="agg, simctg")
    assert cfg.method == ("agg", "simctg") and cfg.uses("agg") and not cfg.uses("cosreg")
    assert AnisoConfig(method=("agg", "uniformity", "cosreg")).uses("uniformity")


def test_state_written_when_method_was_one_string_still_resumes(tmp_path):
    path = tmp_path / "s.safetensors"
    old = AnisoConfig(method="agg").to_dict() | {"method": "agg"}  # 0.1 wrote a string
    save_state(path, {"agg": {"x": torch.ones(1)}}, old)
    assert load_state(path, AnisoConfig(method="agg").to_dict())["agg"]["x"].item() == 1.0
    with pytest.raises(StateError, match="method"):
        load_state(path, AnisoConfig(method=("agg", "simctg")).to_dict())


def test_config_is_hashable_and_compares_by_value():
    a = AnisoConfig(method="agg", special_ids=[0, 1], metrics=["geometry", "eval"])
    b = AnisoConfig(method="agg", special_ids=(0, 1), metrics=("geometry", "eval"))
    assert a == b and hash(a) == hash(b) and len({a, b, AnisoConfig()}) == 2
    assert a != AnisoConfig(method="agg", special_ids=(0, 1))


def test_sequence_fields_are_tuples_whatever_was_passed():
    cfg = AnisoConfig(
        special_ids=[0, 1],
        reg_exclude_ids="2, 3 4",
        agg_parts=["a,b"],
        metrics=iter(["eval"]),
        group_fractions=[0.2, "0.5", 0.3],
    )
    assert cfg.special_ids == (0, 1) and cfg.reg_exclude_ids == (2, 3, 4) and cfg.agg_parts == ("a", "b")
    assert cfg.metrics == ("eval",) and cfg.group_fractions == (0.2, 0.5, 0.3)
    sequences = ("special_ids", "reg_exclude_ids", "agg_parts", "metrics", "group_fractions")
    assert all(type(getattr(cfg, f)) is tuple for f in sequences)
    assert cfg.special_ids + cfg.reg_exclude_ids == (0, 1, 2, 3, 4)
    assert AnisoConfig(special_ids=(torch.tensor(5),)).special_ids == (5,)  # integer tensors are token ids
    assert AnisoConfig(metrics="").metrics == () == AnisoConfig(metrics=[""]).metrics
    default = AnisoConfig()
    assert (default.special_ids, default.agg_parts, default.metrics) == ((), ("b", "c"), ("geometry",))
    assert default.group_fractions == (0.2, 0.5, 0.3)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"special_ids": (1.5,)}, ["special_ids", "1.5", "int"]),
        ({"special_ids": (True,)}, ["special_ids", "True"]),
        ({"reg_exclude_ids": "0 x"}, ["reg_exclude_ids", "'x'", "int"]),
        ({"metrics": ("geometry", 3)}, ["metrics", "3", "str"]),
        ({"metrics": None}, ["metrics=None", "list"]),
        ({"group_fractions": (0.5, "half", 0.25)}, ["group_fractions", "'half'", "float"]),
    ],
)
def test_sequence_elements_of_the_wrong_type_name_the_field(kwargs, words):
    with pytest.raises(ConfigError) as e:
        AnisoConfig(**kwargs)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"metrics": ("geometry", "geometry")}, "'geometry' is listed twice in metrics"),
        ({"metrics": ("eval", "frequency", "eval")}, "'eval' is listed twice in metrics"),
        ({"metrics": "geometry, geometry"}, "'geometry' is listed twice in metrics"),
        ({"agg_parts": ("b", "c", "b")}, "'b' is listed twice in agg_parts"),
    ],
)
def test_duplicates_in_sequence_fields_raise(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        AnisoConfig(**kwargs)


def test_dict_round_trip_keeps_every_field():
    cfg = AnisoConfig(**NON_DEFAULT)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data["metrics"] == ["frequency", "geometry", "eval", "bottleneck"]  # JSON lists
    assert AnisoConfig.from_dict(data) == cfg
    assert AnisoConfig.from_dict({}) == AnisoConfig()


# --- registry -----------------------------------------------------------------------------------
def test_config_names_are_the_registry_names():
    assert METHODS == tuple(registry.METHODS) and HEADS == tuple(registry.HEADS) and METRICS == tuple(registry.METRICS)
    assert {"none", "agg", "cosreg", "hinge", "spectrum"} <= set(METHODS)
    assert {"keep", "untie", "lowrank"} <= set(HEADS)
    assert registry.NEEDS_TARGET_COUNTS <= set(METRICS)


def _config_for(field: str, name: str) -> AnisoConfig:
    kw = {"metrics": ()}
    if field == "head" and name == "lowrank":
        kw["lowrank_rank"] = 2
    kw[field] = (name,) if field == "metrics" else name
    return AnisoConfig(**kw)


@pytest.mark.parametrize(
    "field, name",
    [("method", m) for m in METHODS] + [("head", h) for h in HEADS] + [("metrics", m) for m in METRICS],
)
def test_every_registered_name_resolves_to_a_named_plugin_class(field, name):
    spec = registry.TABLES[field][name]
    cls = registry.plugin_class(field, name)
    if spec is None:
        assert cls is None and name in ("none", "keep")
        return
    assert isinstance(cls, type) and cls is registry.resolve(spec)
    config = _config_for(field, name)
    counts = registry.resolve(registry.TARGET_COUNTS)()
    plugin = cls(config, counts) if name in registry.NEEDS_TARGET_COUNTS else cls(config)
    assert isinstance(getattr(plugin, "name", None), str) and plugin.name  # class or instance attribute


def test_unknown_names_raise_config_error_listing_the_known_ones():
    with pytest.raises(ConfigError) as e:
        AnisoConfig(metrics=("geometry", "spectra"))
    assert "metrics='spectra'" in str(e.value) and all(m in str(e.value) for m in METRICS)
    with pytest.raises(ConfigError) as e:
        registry.plugin_class("metrics", "spectra")
    assert "metrics='spectra'" in str(e.value) and all(m in str(e.value) for m in METRICS)
    with pytest.raises(ConfigError, match="method='agk'.*cosreg"):
        registry.plugin_class("method", "agk")
    with pytest.raises(ValueError, match="import string"):
        registry.resolve("aniso_plugins.metrics.geometry.plugin.GeometryPlugin")


def test_make_plugins_builds_head_method_counter_and_metrics_in_config_order():
    config = AnisoConfig(head="lowrank", lowrank_rank=2, method="agg", metrics=("eval", "geometry", "frequency"))
    plugins = aniso_make_plugins(config)
    names = [type(p).__name__ for p in plugins]
    assert names == [
        "HeadSurgeryPlugin", "AGGPlugin", "TargetCountsPlugin", "EvalPlugin", "GeometryPlugin", "FrequencyGroupsPlugin",
        "FusedLossPlugin",
    ]
    counts = plugins[2]
    assert plugins[3].counts is counts and plugins[5].counts is counts  # one shared counter
    made = aniso_make_plugins(AnisoConfig(method="spectrum", metrics=("hidden",), fused_loss=False))
    assert [type(p).__name__ for p in made] == ["RegularizerPlugin", "HiddenStatesPlugin"]
    assert aniso_make_plugins(AnisoConfig(metrics=(), fused_loss=False)) == []


# --- transformers' HfArgumentParser -------------------------------------------------------------
def _hf_parser():
    transformers = pytest.importorskip("transformers")
    return transformers.HfArgumentParser((transformers.TrainingArguments, AnisoConfig))


def _hf_flags(values: dict) -> list[str]:
    flags = []
    for k, v in values.items():
        if isinstance(v, tuple):
            flags += [f"--{k}", *map(str, v)]
        else:
            flags += [f"--{k}", str(v)]
    return flags


def test_hf_argument_parser_reads_the_flags_next_to_training_arguments(tmp_path):
    parser = _hf_parser()
    args = ["--output_dir", str(tmp_path), "--method", "agg", "--metrics", "geometry", "frequency"]
    args += ["--special_ids", "0", "1", "--alpha", "0.05", "--learning_rate", "0.001"]
    training, cfg = parser.parse_args_into_dataclasses(args)
    assert cfg == AnisoConfig(method="agg", metrics=("geometry", "frequency"), special_ids=(0, 1), alpha=0.05)
    assert cfg.metrics == ("geometry", "frequency") and type(cfg.special_ids) is tuple
    assert training.learning_rate == 0.001 and training.output_dir == str(tmp_path)
    _, default = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    assert default == AnisoConfig()
    _, both = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--method", "agg", "simctg"])
    assert both.method == ("agg", "simctg") and both.uses("simctg")


def test_hf_argument_parser_carries_every_field(tmp_path):
    _, cfg = _hf_parser().parse_args_into_dataclasses(["--output_dir", str(tmp_path), *_hf_flags(NON_DEFAULT)])
    assert cfg == AnisoConfig(**NON_DEFAULT)


def test_hf_argument_parser_boolean_and_empty_list_flags(tmp_path):
    parser = _hf_parser()
    out = ["--output_dir", str(tmp_path)]
    _, cfg = parser.parse_args_into_dataclasses(out + ["--agg_freeze_rare", "--no_agg_g1", "--no-agg-g2", "--metrics", ""])
    assert cfg == AnisoConfig(agg_freeze_rare=True, agg_g1=False, agg_g2=False, metrics=())
    _, cfg = parser.parse_args_into_dataclasses(out + ["--fused_loss", "false", "--load_entry_points", "False"])
    assert cfg == AnisoConfig(fused_loss=False, load_entry_points=False)  # bool | None: a value is needed
    _, cfg = parser.parse_args_into_dataclasses(out + ["--fused_loss", "True"])
    assert cfg == AnisoConfig(fused_loss=True) and AnisoConfig().fused_loss is None
    _, cfg = parser.parse_args_into_dataclasses(out + ["--metrics", "geometry,eval", "--window", "9"])
    assert cfg == AnisoConfig(metrics=("geometry", "eval"), window=9)


def test_hf_argument_parser_dict_and_json_file(tmp_path):
    parser = _hf_parser()
    data = {"output_dir": str(tmp_path), "method": "agg", "metrics": ["geometry", "frequency"], "special_ids": [0, 1]}
    expected = AnisoConfig(method="agg", metrics=("geometry", "frequency"), special_ids=(0, 1))
    assert parser.parse_dict(data)[1] == expected
    path = tmp_path / "args.json"
    path.write_text(json.dumps(data))
    assert parser.parse_json_file(str(path))[1] == expected
    path.write_text(json.dumps({"output_dir": str(tmp_path), **AnisoConfig(**NON_DEFAULT).to_dict()}))
    assert parser.parse_json_file(str(path))[1] == AnisoConfig(**NON_DEFAULT)


@pytest.mark.parametrize(
    "flags, data, message",
    [
        (["--alpha", "-1"], {"alpha": -1}, "alpha=-1(.0)?: expected a number > 0"),
        (["--metrics", "geometry", "spectra"], {"metrics": ["geometry", "spectra"]}, "metrics='spectra'"),
        (["--metrics", "geometry", "geometry"], {"metrics": ["geometry"] * 2}, "'geometry' is listed twice in metrics"),
        (["--group_fractions", "0.5", "0.5"], {"group_fractions": [0.5, 0.5]}, "group_fractions"),
        (["--head", "lowrank"], {"head": "lowrank"}, "lowrank_rank=None"),
    ],
)
def test_hf_argument_parser_bad_values_raise_config_error_naming_the_field(tmp_path, flags, data, message):
    with pytest.raises(ConfigError, match=message):
        _hf_parser().parse_args_into_dataclasses(["--output_dir", str(tmp_path), *flags])
    with pytest.raises(ConfigError, match=message):
        _hf_parser().parse_dict({"output_dir": str(tmp_path), **data})


# --- tyro (torchtitan's CLI) --------------------------------------------------------------------
def test_tyro_round_trip_without_type_warnings():
    tyro = pytest.importorskip("tyro")
    flags = []
    hints = typing.get_type_hints(AnisoConfig)
    three_valued = {name for name, kind in hints.items() if kind == (bool | None)}  # --name True
    for k, v in NON_DEFAULT.items():
        name = k.replace("_", "-")
        if isinstance(v, bool) and k not in three_valued:
            flags.append(f"--{name}" if v else f"--no-{name}")
        elif isinstance(v, tuple):
            flags += [f"--{name}", *map(str, v)]
        else:
            flags += [f"--{name}", str(v)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. tyro's "annotated with list, default is a tuple"
        assert tyro.cli(AnisoConfig, args=flags) == AnisoConfig(**NON_DEFAULT)
        assert tyro.cli(AnisoConfig, args=[]) == AnisoConfig()
        assert tyro.cli(AnisoConfig, args=["--metrics"]).metrics == ()
        start = AnisoConfig(method="agg", metrics=("geometry", "eval"))
        assert tyro.cli(AnisoConfig, default=start, args=["--alpha", "0.1"]) == start.replace(alpha=0.1)


# --- LightningCLI -------------------------------------------------------------------------------
try:
    import lightning.pytorch as _pl
except ImportError:  # pragma: no cover - without the lightning extra
    _pl = None


if _pl is not None:

    class TinyLightningLM(_pl.LightningModule):
        """Enough of a LightningModule for LightningCLI to instantiate (nothing is trained)."""

        def __init__(self, vocab: int = 16, dim: int = 8) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.lm_head = nn.Linear(dim, vocab, bias=False)

        def forward(self, ids):
            return self.lm_head(self.embed(ids))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


def next_token_targets(batch) -> torch.Tensor:
    """A targets function a YAML can name (jsonargparse needs the ``-> torch.Tensor``)."""
    return batch["labels"][:, 1:]


def _lightning_cli(args, monkeypatch):
    pytest.importorskip("jsonargparse")
    if _pl is None:
        pytest.skip("lightning is not installed")
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr("sys.argv", ["train.py"])  # pytest's own arguments are not the CLI's
    cli = LightningCLI(TinyLightningLM, run=False, args=args, save_config_callback=None, seed_everything_default=0)
    from aniso_plugins.integrations.lightning import AnisoCallback

    found = [c for c in cli.trainer.callbacks if isinstance(c, AnisoCallback)]
    assert len(found) == 1
    return found[0]


def _trainer(root, callback: dict) -> dict:
    return {"trainer": {"logger": False, "default_root_dir": str(root), "callbacks": [callback]}}


YAML = """
trainer:
  logger: false
  enable_checkpointing: false
  default_root_dir: {root}
  callbacks:
    - class_path: aniso_plugins.integrations.lightning.AnisoCallback
      init_args:
        config:
          method: agg
          alpha: 0.05
          special_ids: [0, 1]
          metrics: [geometry, frequency]
          agg_g1: false
        head: lm_head
        input_embedding: embed
        targets: {module}.next_token_targets
"""


def test_lightning_cli_yaml_configures_the_callback(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    path.write_text(YAML.format(root=tmp_path, module=__name__))
    callback = _lightning_cli(["--config", str(path)], monkeypatch)
    expected = AnisoConfig(
        method="agg", alpha=0.05, special_ids=(0, 1), metrics=("geometry", "frequency"), agg_g1=False
    )
    assert callback.config == expected and type(callback.config.metrics) is tuple
    assert callback._paths == {"head": "lm_head", "input_embedding": "embed", "blocks": None}
    assert callback._targets is next_token_targets
    # command-line overrides of the YAML, and the config given by class_path
    override = ["--trainer.callbacks.config.metrics", "[eval]"]
    callback = _lightning_cli(["--config", str(path), *override], monkeypatch)
    assert callback.config == expected.replace(metrics=("eval",))
    override = ["--trainer.callbacks.config.method", "[agg, simctg]"]  # a list; `method: agg` above is one name
    callback = _lightning_cli(["--config", str(path), *override], monkeypatch)
    assert callback.config.method == ("agg", "simctg")
    cb = {
        "class_path": "aniso_plugins.integrations.lightning.AnisoCallback",
        "init_args": {"config": {"class_path": "aniso_plugins.AnisoConfig", "init_args": {"method": "cosreg"}}},
    }
    callback = _lightning_cli(_trainer(tmp_path, cb), monkeypatch)
    assert callback.config == AnisoConfig(method="cosreg")
    cb["init_args"]["targets"] = "causal"  # an alignment name instead of a function
    assert _lightning_cli(_trainer(tmp_path, cb), monkeypatch)._targets == "causal"


def test_lightning_cli_bad_config_value_names_the_field(tmp_path, monkeypatch):
    cb = {
        "class_path": "aniso_plugins.integrations.lightning.AnisoCallback",
        "init_args": {"config": {"method": "agg", "metrics": ["geometry", "geometry"]}},
    }
    with pytest.raises(ValueError, match="'geometry' is listed twice in metrics"):
        _lightning_cli(_trainer(tmp_path, cb), monkeypatch)
    cb["init_args"]["config"] = {"alpha": -1}
    with pytest.raises(ValueError, match="alpha=-1.0: expected a number > 0"):
        _lightning_cli(_trainer(tmp_path, cb), monkeypatch)


# --- options beside their feature -----------------------------------------------------------------
def test_each_feature_declares_its_options_and_the_config_is_their_union():
    from aniso_plugins.methods.agg.options import AGGOptions
    from aniso_plugins.methods.heads.options import HeadOptions

    names = [f.name for f in dataclasses.fields(AnisoConfig)]
    assert names[:3] == ["method", "head", "ignore_index"] and len(names) == len(set(names))
    own = {c: {f.name for f in dataclasses.fields(c)} - {f.name for b in c.__bases__ for f in dataclasses.fields(b)}
           for c in AnisoConfig.option_classes()}  # fmt: skip
    assert own[AGGOptions] == {"alpha", "alpha_tokens", "rare_fraction", "window", "special_ids", "agg_g1", "agg_g2",
                               "agg_static_after", "agg_freeze_rare", "agg_parts"}  # fmt: skip
    assert set().union(*own.values()) == set(names)  # every field has one home
    assert AnisoConfig.state_fields() == ("method", "head", "ignore_index", "alpha", "alpha_tokens", "rare_fraction",
                                          "special_ids", "lowrank_rank")  # fmt: skip
    assert HeadOptions.STATE_FIELDS == ("lowrank_rank",)
    with pytest.raises(ConfigError, match="alpha=0: expected a number > 0"):  # AGGOptions.validate, inside AnisoConfig
        AnisoConfig(alpha=0)


def test_a_third_party_plugin_gets_options_through_the_same_route(tmp_path):
    from head_norm_options import HeadNormOptions
    from third_party_plugin import HeadNormPlugin, aniso_make_plugins
    from transformers import HfArgumentParser

    Config = AnisoConfig.extend(HeadNormOptions)
    config = Config(method="agg", head_norm_coef=0.5)
    assert isinstance(config, AnisoConfig) and config.alpha is None
    assert aniso_make_plugins(config)[0].coef == 0.5 and HeadNormPlugin.from_config(AnisoConfig()).coef == 1e-4
    with pytest.raises(ConfigError, match="head_norm_coef=-1"):
        Config(head_norm_coef=-1)
    with pytest.raises(ConfigError, match="unknown configuration fields"):
        AnisoConfig.from_dict({"head_norm_coef": 0.5})
    assert Config.from_dict(config.to_dict()) == config
    (parsed,) = HfArgumentParser(Config).parse_args_into_dataclasses(["--head_norm_coef", "0.25", "--method", "agg"])
    assert parsed.head_norm_coef == 0.25 and parsed.method == ("agg",)
    with pytest.raises(ConfigError, match="redefines the fields"):
        AnisoConfig.extend(HeadNormOptions).extend(HeadNormOptions)
    # installed with its entry points, its options are fields of AnisoConfig itself
    dist = tmp_path / "head_norm_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: head-norm-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[aniso_plugins]\nhead_norm_plugins = third_party_plugin\n\n[aniso_plugins.options]\nhead_norm = head_norm_options:HeadNormOptions\n"
    )
    code = (
        "from aniso_plugins import AnisoConfig, AnisoPlugins\n"
        "c = AnisoConfig(method='cosreg', head_norm_coef=0.125)\n"
        "print(c.head_norm_coef, AnisoPlugins(c).get('head_norm').coef)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), EXAMPLES, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0.125", "0.125"]


def test_adapter_defaults_come_from_the_features_options():
    """A feature declares where its default differs by adapter; the adapters read it without
    naming the field (no built-in feature differs now: the fused loss decides by itself)."""
    from head_norm_options import HeadNormOptions

    assert AnisoConfig.adapter_defaults("torchtitan") == {} and AnisoConfig.adapter_defaults("hf") == {}

    class Differs(HeadNormOptions):
        ADAPTER_DEFAULTS = {"torchtitan": {"head_norm_coef": 0.5}}

    assert AnisoConfig.extend(Differs).adapter_defaults("torchtitan") == {"head_norm_coef": 0.5}
