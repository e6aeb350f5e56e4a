"""A fit killed by SIGKILL between checkpoints (no clean-up, no final save) resumes from its last whole checkpoint and
ends with the very head an uninterrupted run gives."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
RUN = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from test_train_ttt import make_trainer, rule_model, rule_records
from engine.train.fit import FitConfig, Trainer

kill_at = {kill_at}
if kill_at:
    step = Trainer.train_step
    def dying_step(self):
        if self.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self)
    Trainer.train_step = dying_step
config = FitConfig(ttt_steps=2, epochs=3, batch_tokens=120, warmup=2, save_every=3, eval_every=0)
trainer = make_trainer(rule_model(), rule_records(12, length=16), {out!r}, config, {features!r})
summary = trainer.fit()
torch.save({{"state": trainer.unwrapped.state_dict(), "resumed": summary["resumed"]}}, {result!r})
"""


def fit_in_a_process(tmp_path: Path, name: str, kill_at: int = 0) -> subprocess.CompletedProcess:
    code = RUN.format(tests=str(TESTS), kill_at=kill_at, out=str(tmp_path / name), features=str(tmp_path / f"{name}-f"),
                      result=str(tmp_path / f"{name}.pt"))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=TESTS.parent)


def test_a_fit_killed_midway_resumes_to_the_same_head(tmp_path):
    whole = fit_in_a_process(tmp_path, "whole")
    assert whole.returncode == 0, whole.stderr
    killed = fit_in_a_process(tmp_path, "split", kill_at=5)  # checkpoints at steps 3 and 6: steps 4-5 are lost
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (tmp_path / "split.pt").exists()
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir()) == ["step_0000003"]
    resumed = fit_in_a_process(tmp_path, "split")
    assert resumed.returncode == 0, resumed.stderr
    ends = {name: torch.load(tmp_path / f"{name}.pt") for name in ("whole", "split")}
    assert ends["split"]["resumed"] and not ends["whole"]["resumed"]
    assert ends["whole"]["state"].keys() == ends["split"]["state"].keys()
    for name, tensor in ends["whole"]["state"].items():
        assert torch.equal(tensor, ends["split"]["state"][name]), name
