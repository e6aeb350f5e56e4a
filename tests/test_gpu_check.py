"""scripts/gpu_check.py without a GPU: a clear refusal, and its verification-cost timing on a tiny model."""
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclass looks its module up while being defined
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_refuses_without_cuda(gpu_check, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--out", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2
    assert "no CUDA GPU visible" in capsys.readouterr().err and not (tmp_path / "out.json").exists()


def test_verification_curve_times_each_tree_size(gpu_check):
    settings = dataclasses.replace(gpu_check.CPU_DRY_RUN, tree_sizes=[1, 4, 16], repeats=1)
    rows = gpu_check.verification_curve(settings)
    assert [r["tree_tokens"] for r in rows] == [1, 4, 16]
    assert rows[0]["ratio"] == 1.0 and all(r["ms"] > 0 for r in rows)


def test_suggested_total_tokens(gpu_check):
    curve = [{"tree_tokens": t, "ratio": r} for t, r in [(1, 1.0), (8, 1.02), (32, 1.2), (64, 1.6)]]
    assert gpu_check.suggested_total_tokens(curve, 1.25) == 32
    assert gpu_check.suggested_total_tokens(curve, 1.01) is None
