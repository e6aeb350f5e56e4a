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
