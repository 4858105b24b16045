"""The 0.2.x way in: imports, the converter registry, and options from TOML and the CLI."""

import importlib
import logging

import pytest
from torchtitan.config import ConfigManager
from torchtitan.protocols.model_converter import _registry_model_converter_cls, build_model_converters
from tt02_helpers import EXAMPLES, convert, meta_model, parallel_dims, parse

import titan_primus
from titan_primus.conversion import ConversionOptions
from titan_primus.torchtitan02 import CONVERTER_NAME, Float8Converter


def test_core_and_config_registry_import_under_0_2():
    importlib.import_module("titan_primus.config_registry")
    assert titan_primus.fp8_linear and titan_primus.select_backend


def test_the_0_3_adapter_refuses_0_2_with_an_import_error():
    with pytest.raises(ImportError):
        importlib.import_module("titan_primus.torchtitan")


def test_importing_the_adapter_registers_the_converter():
    assert _registry_model_converter_cls[CONVERTER_NAME] is Float8Converter
    assert CONVERTER_NAME == "titan_primus.float8"


def test_example_toml_reaches_the_converter():
    config = parse()
    assert config.model.converters == ["titan_primus.float8"]
    assert config.experimental.custom_import == "titan_primus.torchtitan02"
    assert config.titan_primus == ConversionOptions(filter_fqns=["router.gate"])
    container = build_model_converters(config, parallel_dims())
    (converter,) = container.converters
    assert isinstance(converter, Float8Converter) and converter.router.options is config.titan_primus


def test_cli_overrides_the_toml_section():
    config = parse(
        "--titan_primus.recipe",
        "tensorwise",
        "--titan_primus.filter_fqns",
        "router.gate,output",
        "--titan_primus.strict",
        "--titan_primus.device",
        "gfx950",
    )
    assert config.titan_primus == ConversionOptions(
        recipe="tensorwise", filter_fqns=["router.gate", "output"], strict=True, device="gfx950"
    )


@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise"])
def test_block_recipes_are_accepted_from_the_command_line(recipe):
    config = parse("--titan_primus.recipe", recipe)
    assert config.titan_primus.recipe == recipe
    (converter,) = build_model_converters(config, parallel_dims()).converters
    assert converter.router.options.recipe == recipe


def test_fp8_dispatch_is_read_from_the_section_and_the_command_line(tmp_path):
    toml = (EXAMPLES / "deepseek_v3_debug_fp8.toml").read_text()
    assert "fp8_dispatch = false" in toml
    (tmp_path / "dispatch.toml").write_text(toml.replace("fp8_dispatch = false", "fp8_dispatch = true"))
    config = ConfigManager().parse_args(["--job.config_file", str(tmp_path / "dispatch.toml")])
    assert config.titan_primus.fp8_dispatch is True
    assert parse("--titan_primus.fp8_dispatch").titan_primus.fp8_dispatch is True
    assert parse().titan_primus.fp8_dispatch is False


def test_unknown_option_in_the_section_is_refused_by_torchtitan(tmp_path):
    toml = (EXAMPLES / "llama3_debug_fp8.toml").read_text().replace('recipe = "rowwise"', 'recipes = "rowwise"')
    (tmp_path / "bad.toml").write_text(toml)
    with pytest.raises(ValueError, match="Invalid field names.*recipes"):
        ConfigManager().parse_args(["--job.config_file", str(tmp_path / "bad.toml")])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"filter_fqns": "router.gate"}, "'filter_fqns' must be a list of FQN substrings"),
        ({"recipe": "delayed"}, "unknown FP8 recipe 'delayed'; choose one of tensorwise, rowwise, rowwise_with_gw_hp"),
        ({"backend": "cublas"}, "unknown FP8 backend 'cublas'; registered backends: primus_turbo, torchao, emulated"),
        ({"strict": "yes"}, "'strict' must be true or false"),
        ({"fp8_dispatch": "true"}, "'fp8_dispatch' must be true or false"),
        ({"device": "mi300x"}, "unknown device profile 'mi300x'; known profiles: cpu, sm80"),
    ],
)
def test_bad_options_fail_when_the_converter_is_built(options, message):
    with pytest.raises(ValueError, match=message):
        convert(meta_model("llama3"), **options)


def test_without_the_section_the_defaults_apply(caplog):
    with caplog.at_level(logging.INFO, logger="titan_primus"):
        converter = Float8Converter(job_config=object(), parallel_dims=parallel_dims())
    assert converter.router.options == ConversionOptions()
    assert "no [titan_primus] options" in caplog.text
