"""Threads that follow the load: the governor reads other processes' CPU use, and switching threads between steps
never changes a bit of the output."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_engine, tokens_of
from engine.model import kernels
from engine.model.quant import QuantLinear, quantize
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
    """engine/model/kernels must be built with OpenMP: without it at::parallel_for runs serially and the q4 matmul and
    the fixed-order attention would use one core of two. Seen as CPU time on torch's worker
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
