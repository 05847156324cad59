import pytest

from restkv import CompressionConfig, ConfigError
from restkv.config import option_names


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(method="nope", max_capacity_prompts=64), "--method 'nope' is not a known method"),
        (dict(method="snapkv", max_capacity_prompts=32, window_size=32), "--window_size 32 must be smaller"),
        (dict(method="snapkv", max_capacity_prompts=16, window_size=32), "--window_size 32 must be smaller"),
        (dict(method="snapkv", max_capacity_prompts=0), "--max_capacity_prompts must be >= 1"),
        (dict(method="snapkv", max_capacity_prompts=-8), "--max_capacity_prompts must be >= 1"),
        (dict(method="snapkv", compression_ratio=0.0), "--compression_ratio must lie in the open interval (0, 1)"),
        (dict(method="snapkv", compression_ratio=1.0), "--compression_ratio must lie in the open interval (0, 1)"),
        (dict(method="snapkv", compression_ratio=-0.5), "--compression_ratio must lie in the open interval (0, 1)"),
        (dict(method="snapkv"), "needs a budget"),
        (dict(method="snapkv", max_capacity_prompts=64, compression_ratio=0.5), "not both"),
        (dict(method="snapkv", max_capacity_prompts=64, kernel_size=4), "--kernel_size must be odd"),
        (dict(method="snapkv", max_capacity_prompts=64, pooling="median"), "--pooling 'median' is not allowed"),
        (dict(method="snapkv", max_capacity_prompts=64, gqa_score_agg="min"), "--gqa_score_agg"),
        (dict(method="streamingllm", max_capacity_prompts=64, n_sink=64), "--n_sink 64 must be smaller"),
        (dict(method="snapkv", max_capacity_prompts=64.5), "--max_capacity_prompts must be an integer"),
    ],
)
def test_invalid_settings_name_the_flag(options, fragment):
    with pytest.raises(ConfigError) as error:
        CompressionConfig(**options)
    assert fragment in str(error.value)


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(ConfigError, match="snapkv") as error:
        CompressionConfig(method="snapkvv", max_capacity_prompts=64)
    assert "streamingllm" in str(error.value)


def test_unknown_option_is_rejected_with_the_known_ones():
    with pytest.raises(ConfigError, match="unknown option") as error:
        CompressionConfig.from_options(method="snapkv", max_capacity_prompt=64)
    assert "max_capacity_prompts" in str(error.value)


def test_dict_and_replace_round_trip():
    config = CompressionConfig.from_any({"method": "snapkv", "max_capacity_prompts": 128})
    assert config == CompressionConfig(method="snapkv", max_capacity_prompts=128)
    changed = config.replace(max_capacity_prompts=256, pooling="maxpool")
    assert (changed.max_capacity_prompts, changed.pooling, changed.method) == (256, "maxpool", "snapkv")
    assert set(config.to_dict()) == set(option_names())


def test_fullkv_needs_no_budget_and_keeps_everything():
    config = CompressionConfig(method="fullkv")
    assert config.budget_for(5000) == 5000


@pytest.mark.parametrize("length, expected", [(1000, 128), (100, 100)])
def test_budget_is_tokens_per_head_capped_by_the_row(length, expected):
    assert CompressionConfig(max_capacity_prompts=128).budget_for(length) == expected


def test_ratio_budget_floors_the_kept_fraction():
    config = CompressionConfig(compression_ratio=0.9)
    assert config.budget_for(1005) == 100  # floor(1005 * 0.1)
    assert config.budget_for(1000) == 100  # not 99 from float noise


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(method="h2o", h2o_normalize="False"), "--h2o_normalize must be a boolean"),
        (dict(method="tova", tova_per_head="False"), "--tova_per_head must be a boolean"),
        (dict(method="l2norm", l2norm_protect_window="yes"), "--l2norm_protect_window must be a boolean"),
        (dict(method="snapkv", use_pyramid="no"), "--use_pyramid must be a boolean"),
        (dict(method="pyramidkv", pyramid_reference_rounding=1), "--pyramid_reference_rounding must be a boolean"),
        (dict(method="adakv", adakv_reference_allocation="True"), "--adakv_reference_allocation must be a boolean"),
        (dict(method="adakv", adakv_normalize=0), "--adakv_normalize must be a boolean"),
        (dict(method="headkv", headkv_window_outside="x"), "--headkv_window_outside must be a boolean"),
        (dict(method="cam", cam_expected="False"), "--cam_expected must be a boolean"),
        (dict(method="snapkv", residual="True"), "--residual must be a boolean"),
        (dict(method="l2norm", l2norm_skip_layers=5), "--l2norm_skip_layers must be a list of int values"),
        (dict(method="l2norm", l2norm_skip_layers="12"), "--l2norm_skip_layers must be a list of int values"),
        (dict(method="l2norm", l2norm_skip_layers=(0, "1")), "--l2norm_skip_layers must be an integer"),
        (dict(method="snapkv", window_size=True), "--window_size must be an integer"),
    ],
)
def test_options_of_the_wrong_type_name_the_flag(options, fragment):
    with pytest.raises(ConfigError) as error:
        CompressionConfig(max_capacity_prompts=64, **options)
    assert fragment in str(error.value)


def test_an_option_the_method_does_not_use_is_ignored_loudly_and_not_recorded():
    with pytest.warns(UserWarning, match=r"--pooling not used by --method h2o \(options of --method adakv"):
        config = CompressionConfig(method="h2o", max_capacity_prompts=64, pooling="maxpool")
    assert config.to_dict()["pooling"] is None  # the run settings do not claim it was used
    assert config == CompressionConfig(method="h2o", max_capacity_prompts=64)
    assert CompressionConfig(method="snapkv", max_capacity_prompts=64, pooling="maxpool").to_dict()["pooling"] == "maxpool"


@pytest.mark.parametrize("options, warning, switch_on", [
    (dict(decode_interval=4), r"--decode_interval not used by --method snapkv \(options of --decode_budget, "
     r"--decode_compression_ratio or --dms_decoding\)",
     dict(decode_budget=100)),
    (dict(reconstruction_chunk=64, reconstruction_reduce="mean"),
     r"--reconstruction_chunk, --reconstruction_reduce not used by --method snapkv \(options of --observation "
     r"reconstruction; --observation reconstruction\)", dict(observation="reconstruction")),
])
def test_an_option_whose_switch_is_off_is_ignored_loudly_and_not_recorded(options, warning, switch_on):
    """--decode_interval without --decode_budget, --reconstruction_chunk without the reconstruction
    observation: once recorded silently as if they had changed the run."""
    with pytest.warns(UserWarning, match=warning):
        config = CompressionConfig(method="snapkv", max_capacity_prompts=64, **options)
    plain = CompressionConfig(method="snapkv", max_capacity_prompts=64)
    assert config == plain and config.to_dict() == plain.to_dict()
    switched_on = config.replace(**switch_on)  # given, then used once its switch is on
    assert all(getattr(switched_on, name) == value for name, value in options.items())


def test_replace_drops_the_old_methods_options_and_keeps_the_shared_ones():
    restkv = CompressionConfig(method="restkv", max_capacity_prompts=64, alpha=0.5, kernel_size=7)
    snapkv = restkv.replace(method="snapkv")
    assert snapkv.alpha is None and snapkv.kernel_size == 7
    assert snapkv.replace(method="restkv").alpha == 0.3  # the dropped option is not resurrected


def test_files_lists_every_file_an_active_option_names():
    """What run_meta.json fingerprints: weights and head scores, by their option."""
    from pathlib import Path

    scores = str(Path(__file__).resolve().parents[2] / "data" / "heads_score" /
                 "smollm2-135m_retrieval_reasoning_heads.json")
    assert CompressionConfig(method="headkv", max_capacity_prompts=64, head_scores=scores).files() == {
        "head_scores": scores}
    assert CompressionConfig(method="snapkv", max_capacity_prompts=64).files() == {}


def test_every_option_that_names_a_file_is_fingerprinted():
    """A file option not declared names_file lets a resumed run mix the results of two files."""
    from restkv.config import flat_option_specs

    for name, declarations in flat_option_specs().items():
        for part, spec in declarations:
            if spec.kind is str and spec.choices is None and " file" in spec.help:
                assert spec.names_file, f"--{name} of {part.__name__} names a file but is not declared names_file"
