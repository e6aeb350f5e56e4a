"""Flags declared on their fields: a command line's defaults are the settings object's, and what it parses comes
back as that object, for the load options and the fit alike."""
from __future__ import annotations

import argparse

import pytest

from engine.flags import add_flags, flag_values
from engine.options import LoadOptions
from engine.train.fit import FitConfig


@pytest.mark.parametrize("settings", [FitConfig, LoadOptions])
def test_an_empty_command_line_gives_the_defaults(settings):
    parser = argparse.ArgumentParser()
    add_flags(settings, parser)
    parsed = flag_values(settings, parser.parse_args([]))
    assert parsed and all(getattr(settings(), name) == value for name, value in parsed.items())


def test_the_fit_flags_come_back_as_a_fit_config():
    parser = argparse.ArgumentParser()
    add_flags(FitConfig, parser)
    args = parser.parse_args(["--ttt-steps", "3", "--lr", "3e-4", "--train-lm-head", "--align-topk", "4"])
    config = FitConfig(**flag_values(FitConfig, args))
    assert (config.ttt_steps, config.lr, config.train_lm_head, config.align_topk) == (3, 3e-4, True, 4)
    assert config.step_decay == FitConfig().step_decay  # a field without a flag keeps its default


def test_only_adds_the_flags_named():
    parser = argparse.ArgumentParser()
    add_flags(LoadOptions, parser, only=("base", "kernels"))
    assert set(flag_values(LoadOptions, parser.parse_args([]))) == {"base", "kernels"}


def test_the_benchs_tree_and_sampling_flags_come_from_their_fields():
    """Unset, the tree's shape is the tree's own; set, each flag lands on its field; a static tree refuses a shape."""
    from engine.draft.tree import DynamicTree
    from engine.tools.bench import build_parser, decode_params

    parser = build_parser()
    plain = decode_params(parser.parse_args([]))
    assert plain.tree == DynamicTree() and plain.sampling.temperature == 0.0 and plain.max_new_tokens == 128
    shaped = decode_params(parser.parse_args(["--total-tokens", "6", "--draft-top-k", "3", "--min-prob", "0.1",
                                              "--temperature", "0.7", "--seed", "5"]))
    assert (shaped.tree.total_tokens, shaped.tree.top_k, shaped.tree.min_prob) == (6, 3, 0.1)
    assert (shaped.sampling.temperature, shaped.seed) == (0.7, 5)
    with pytest.raises(ValueError, match="static tree has fixed paths"):
        decode_params(parser.parse_args(["--tree", "static", "--depth", "3"]))
