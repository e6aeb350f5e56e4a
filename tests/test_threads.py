"""Threads that follow the load: the governor reads other processes' CPU use, and switching threads between steps
never changes a bit of the output."""
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_engine, tokens_of
from engine.model import kernels
from engine.model import threads as threads_module
from engine.model.groups import quantize
from engine.model.quant import QuantLinear
from engine.model.threads import ThreadGovernor, _busy_seconds

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


def test_other_processes_cpu_is_counted_and_this_ones_is_not(monkeypatch, two_threads):
    """On given readings of the machine's and this process's CPU seconds and a given clock, so that no other work on
    the machine changes the verdict: others' cores are the machine's CPU time less this process's, over the window;
    a reading within the window is not taken."""
    now, readings = [100.0], [(50.0, 10.0)]  # (every process's CPU seconds, this process's)
    monkeypatch.setattr(threads_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(threads_module, "_busy_seconds", lambda: readings[-1])
    governor = ThreadGovernor(cores=2, window_s=0.5, spare=0.4)
    governor.start()
    now[0] += 2.0
    readings.append((50.0 + 3.0 + 1.8, 10.0 + 1.8))  # others 1.5 cores over 2 s, this process 0.9
    assert governor.update() == 1 and governor.others == pytest.approx(1.5)
    now[0] += 0.2  # within the window: the reading stands
    readings.append((1000.0, 10.0))
    assert governor.update() == 1 and governor.others == pytest.approx(1.5)
    now[0] += 1.0
    readings.append((54.8 + 1.0, 11.8 + 1.1))  # this process alone, the machine's count a tick behind: never below 0
    assert governor.update() == 2 and governor.others == 0.0


def test_the_load_reading_includes_this_processs_own_cpu_time():
    """The real /proc readings: CPU time this process spends shows in both its own and the machine's figure (CPU
    seconds, not a share of the wall time, so the verdict holds however busy the machine is). The two figures are
    kept by different clocks (the machine's by sampled ticks, the process's from its measured run time), so over 0.3 s
    they may part by a few ticks either way: the machine's must hold most of the process's, not all of it to a tick."""
    machine, mine = _busy_seconds()
    spent = time.process_time() + 0.3
    while time.process_time() < spent:
        pass
    machine_after, mine_after = _busy_seconds()
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert mine_after - mine >= 0.3 - 2 * tick
    assert machine_after - machine >= 0.75 * (mine_after - mine)


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


def test_packed_layers_know_their_lone_row_kernel_for_every_thread_count_from_load(two_threads):
    """The governor may switch to any count from 1 to the cores: a packed layer measures oneDNN's lone-row
    summation order for all of them when it is built, so no decoding step after a switch pays the measurement
    (it made that step far slower, and the meter's plain-step timing with it). Measured together, the answers are
    those of measuring each thread count alone."""
    from engine.model import packed

    if not packed.packing_available():
        pytest.skip("this torch build has no oneDNN linear ops")
    shape = (1536, 576, torch.float32, False)
    for threads in (1, 2):
        packed._LONE_ROWS.pop((*shape, threads), None)
    packed.PackedLinear(torch.nn.Linear(1536, 576, bias=False))
    together = {threads: packed._LONE_ROWS.get((*shape, threads)) for threads in (1, 2)}
    assert None not in together.values(), together
    alone = {}
    for threads in (1, 2):
        del packed._LONE_ROWS[(*shape, threads)]
        alone[threads] = packed.lone_row_sums_differently(*shape, threads)
    assert alone == together
    assert torch.get_num_threads() == 2  # the measurement leaves the thread count as it was


def _others_cpu_seconds() -> float:
    """CPU seconds of this process's threads other than the calling one (torch's OpenMP workers among them)."""
    me, total = threading.get_native_id(), 0.0
    for task in Path("/proc/self/task").iterdir():
        if int(task.name) != me:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@pytest.mark.skipif(not kernels.available(), reason=f"engine/model/kernels: {kernels.unavailable_reason()}")
def test_the_engines_own_kernels_share_their_work_with_torchs_threads(two_threads):
    """engine/model/kernels must be built with OpenMP: without it their parallel loops run serially and the q4 matmul
    and the fixed-order attention would use one core of two. Seen as CPU time on torch's worker
    thread, not as a speed. Their rows come out the same bits with one thread or two."""
    generator = torch.Generator().manual_seed(0)
    layer = QuantLinear(quantize(torch.randn(2048, 1024, generator=generator) * 0.05, "Q4_1"), None)
    x = torch.randn(16, 1024, generator=generator)
    q, k, v = (torch.randn(1, heads, rows, 64, generator=generator) for heads, rows in ((9, 8), (3, 1500), (3, 1500)))
    layer(x), torch.ops.eagle_cpu.attention(q, k, v, None, 0.125)  # the worker threads exist from here on
    before = _others_cpu_seconds()
    for _ in range(200):  # ~0.1 s a thread, well above /proc's 10 ms ticks however fast the kernels are
        two = layer(x), torch.ops.eagle_cpu.attention(q, k, v, None, 0.125)
    assert _others_cpu_seconds() - before > 0.05, "the kernels ran on the calling thread alone"
    torch.set_num_threads(1)
    one = layer(x), torch.ops.eagle_cpu.attention(q, k, v, None, 0.125)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
