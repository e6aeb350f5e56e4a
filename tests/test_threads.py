"""Threads that follow the load: the governor reads other processes' CPU use, and switching threads between steps
never changes a bit of the output."""
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import tiny_engine, tokens_of
from engine.threads import ThreadGovernor, _busy_seconds

pytestmark = pytest.mark.skipif(_busy_seconds() is None, reason="the governor reads Linux's /proc")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_threads_for_the_cores_others_leave():
    governor = ThreadGovernor(cores=2, spare=0.4)
    assert [governor.threads_for(o) for o in (0.0, 0.3, 0.5, 1.0, 1.7, 3.0)] == [2, 2, 1, 1, 1, 1]
    assert ThreadGovernor(cores=8).threads_for(2.2) == 6


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_busy_process_is_counted_and_this_one_is_not(two_threads):
    """Whatever else the machine runs, the reading includes what the busy process used and leaves out this
    process's own work (its threads must not make the engine give up a core)."""
    governor = ThreadGovernor(cores=2, window_s=0.5)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        governor.start()
        used_before, mine_before, started = _cpu_seconds(busy.pid), _cpu_seconds(os.getpid()), time.monotonic()
        deadline = started + 1.0
        while time.monotonic() < deadline:  # this process keeps a core busy too
            pass
        threads = governor.update()
        elapsed = time.monotonic() - started
        busy_cores = (_cpu_seconds(busy.pid) - used_before) / elapsed
        my_cores = (_cpu_seconds(os.getpid()) - mine_before) / elapsed
    finally:
        busy.kill()
        busy.wait()
    assert busy_cores > 0.05, "the busy process did not run: the reading means nothing"
    assert governor.others >= busy_cores - 0.1
    assert governor.others <= os.cpu_count() - my_cores + 0.15  # this process's own work is not others'
    assert threads == governor.threads_for(governor.others)


class Alternating(ThreadGovernor):
    """Flips between one and two threads at every step: the worst schedule a load could cause."""

    def update(self) -> int:
        torch.set_num_threads(3 - torch.get_num_threads())
        return torch.get_num_threads()


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_switching_threads_between_steps_changes_no_token(kind, prompt, two_threads):
    engine = tiny_engine("llama-h64-l8-gqa", kind, pack=True)
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=60))
    engine.threads = Alternating(cores=2)
    assert tokens_of(engine.generate(prompt, method="eagle", max_new_tokens=60)) == vanilla
    assert tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=60)) == vanilla


def test_a_forward_gives_the_same_bits_with_one_and_two_threads(two_threads):
    engine = tiny_engine("qwen3-h64-l9", "eagle3", pack=True)
    ids = torch.randint(0, 16, (40,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        hidden, _ = engine.target.forward(ids, engine.target.new_cache())
        logits[threads] = engine.target.logits(hidden)
    assert torch.equal(logits[1], logits[2])
