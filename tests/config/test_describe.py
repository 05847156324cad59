"""``restkv.describe``: a method's options, source and composition, read from the registry."""

import pytest

import restkv
from restkv.config import ConfigError
from restkv.config.options import KINDS, registered


def test_a_method_shows_its_options_with_defaults_help_and_source():
    snapkv = restkv.describe("snapkv")
    assert snapkv.options["kernel_size"].default == 5 and "smoothing" in snapkv.options["kernel_size"].help
    assert "arXiv 2404.14469" in snapkv.reference
    text = str(snapkv)
    assert "--kernel_size 5: odd kernel of the spatial smoothing" in text
    assert "[none | avgpool | maxpool | adaptive]" in text and "Source: SnapKV: Li et al., 2024" in text


def test_a_method_shows_what_it_composes_with_and_why_not():
    snapkv = restkv.describe("snapkv")
    assert {"adakv", "pyramid", "uniform"} <= set(snapkv.composes["allocation"])
    assert {"residual", "think", "critical"} <= set(snapkv.composes["switch"])
    assert not snapkv.refused and "dms" in snapkv.needs  # --dms needs its threshold with any method
    kvzip = restkv.describe("kvzip")
    assert kvzip.defined_with == ("--allocation model_ranked",) and kvzip.composes["allocation"] == ("model_ranked",)
    assert "block_press" in kvzip.refused["switch"] and "adakv" in kvzip.refused["allocation"]
    assert "--allocation <each> does not apply to it" in str(kvzip)
    cam = restkv.describe("cam")
    assert "--merge cam" in cam.defined_with and "residual" in cam.refused["switch"]
    assert restkv.describe("pyramidkv").defined_with == ("--method snapkv's scores", "--allocation pyramid")


def test_a_method_that_needs_a_file_says_so():
    headkv = restkv.describe("headkv")
    assert "--head_scores FILE" in headkv.needs_first and "Needs first:" in str(headkv)


def test_other_kinds_of_part_are_described_too():
    residual = restkv.describe("residual", kind="switch")
    assert "arXiv 2607.29591" in residual.reference and "--residual_iters 4" in str(residual)
    assert "KIVI" in restkv.describe("kivi", kind="quantization").reference


@pytest.mark.parametrize("name, kind, words", [
    ("snapkvv", "method", "--method 'snapkvv' is not a known method"),
    ("residuals", "switch", "--residuals is not a known switch"),
    ("snapkv", "policy", "kind 'policy' is not a kind of part"),
])
def test_unknown_names_are_refused_listing_the_known(name, kind, words):
    with pytest.raises(ConfigError, match=words):
        restkv.describe(name, kind=kind)


def test_every_part_names_its_own_source():
    missing = [f"{kind} {cls.name}" for kind in KINDS for cls in registered(kind) if not vars(cls).get("reference")]
    assert not missing
