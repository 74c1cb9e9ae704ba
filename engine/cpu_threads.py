"""
What each forward pass runs with: on a CPU, how many threads, chosen by measuring the
machine; on a GPU, which attention kernels (GPU_ATTENTION, and why).

Every forward pass the engines run goes through one_pass below: stage 7's one-request
engine (engine/one_request.py, which the demo runs; its step's copies to and from the pool too)
and stage 8's batched step (engine/batch_engine.py); so do the passes the lessons' own loops
(stages 1 and 2) and the benchmarks' floors time, and the engine's warm-up. A timing that
compares two of them holds both to one policy. Peers (transformers' generate, llama.cpp)
are not wrapped, nor are the lessons' untimed checks against them: they keep their own.

    cpu_sample / cores_used_by_others   how many cores other programs kept busy (/proc/stat)
    ThreadChooser                        torch's own thread count, or one when others are busy;
                                         ThreadChooser.running wraps one forward pass
    in_own_thread                        run passes on a thread that ends with them (one pool at a time)
    GPU_ATTENTION                        the attention kernels a pass may use on a GPU: none that plans per shape
    one_pass                             the wrap for one forward pass (and its step's copies) on any device
    synchronize                          wait for a GPU's queued work before a timing stops
    GpuClock                             CUDA events around a stretch of work: the GPU's time beside the wall's
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

def cpu_sample() -> tuple[float, float, float] | None:
    """(wall seconds, CPU seconds every process used, CPU seconds this process used), to take
    two of and subtract; None where /proc/stat is not (Linux has it; macOS and Windows do not).
    With two samples, (busy - ours) / wall is how many cores other programs kept busy."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle and iowait
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), time.process_time()


def cores_used_by_others(before, after) -> float | None:
    if before is None or after is None or after[0] <= before[0]:
        return None
    return max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0]))


class ThreadChooser:
    """Picks torch's thread count for each forward pass on a CPU, by measuring.

    Every matrix product and attention call of a step is a parallel region whose threads
    wait for each other at its end, spinning. On a quiet machine all threads (one per core)
    is fastest. When other programs keep the cores busy, the OS takes a core from one thread
    now and then, and every region waits, spinning, for it to come back, so beside busy
    programs one thread can beat all of them (docs/measured.md, "On a busy machine",
    has the figures). Which count is faster depends on the machine's load, which changes. So:

      - it starts with torch's own setting (`most`, all the cores);
      - it uses one thread from the step after one that says other programs are busy: they
        kept OTHERS cores or more busy during it (read from /proc/stat, on Linux), or a step
        with all the cores took SLOWER times the last step of its kind (prefill or decode,
        about as many tokens). After an idle pause there is no recent step to go by, so it
        watches the machine for GLANCE seconds first (glance);
      - with one thread it tries all the cores again now and then, on a decode step, and only
        when the last step saw the others quiet (a probe beside busy programs can cost
        seconds): if that step beats the last one-thread step of its kind, it goes back to
        all the cores. A probe that loses makes the next one twice as far away.

    >>> chooser = ThreadChooser()
    >>> chooser.choose("decode", most=2); chooser.record("decode", 2, 0.05, others=0.1)
    2
    >>> chooser.record("decode", 2, 0.24, others=1.8); chooser.choose("decode", most=2)   # busy now
    1
    """

    SLOWER = 2.0  # a step with all the cores this much slower than the last of its kind: busy
    OTHERS = 0.75  # cores other programs kept busy during a step: busy
    FIRST_PROBE = 25  # steps with one thread before all the cores are tried again
    IDLE = 1.0  # seconds without a step after which the machine is looked at again (glance)
    GLANCE = 0.05  # seconds of watching it then

    def __init__(self) -> None:
        self._start(None)

    def _start(self, most: int | None) -> None:
        self.most = self.threads = most  # torch's own setting, and the count in use
        self.last: dict[tuple, float] = {}  # (kind, threads) -> seconds of the latest such step
        self.others: float | None = None  # cores the other programs used during the latest step
        self.steps = 0
        self.next_probe = 0
        self.interval = self.FIRST_PROBE
        self.last_end = 0.0  # when the latest step ended (time.perf_counter)
        self.passes: dict[int, int] = {}  # thread count -> forward passes run with it
        self.used: int | None = None

    @contextlib.contextmanager
    def running(self, kind, may_probe: bool = True):
        """Run the block (one forward pass) with the count chosen for this kind of step, timed
        and watched; torch's own setting is put back after, for whatever else runs."""
        most = torch.get_num_threads()
        if most != self.most:  # someone changed torch's setting: start again from it
            self._start(most)
        if time.perf_counter() - self.last_end > self.IDLE:
            self.glance()  # no recent step to go by: is the machine busy now?
        threads = self.choose(kind, most, may_probe)
        started, sample = time.perf_counter(), cpu_sample()
        torch.set_num_threads(threads)  # for this pass only: the setting is the whole process's
        try:
            yield
        finally:
            torch.set_num_threads(most)
        self.passes[threads] = self.passes.get(threads, 0) + 1
        self.used = threads  # the count the latest pass ran with
        self.record(kind, threads, time.perf_counter() - started, cores_used_by_others(sample, cpu_sample()))

    def choose(self, kind, most: int, may_probe: bool = True) -> int:
        """The thread count for a step of this kind; most: torch.get_num_threads()."""
        if most != self.most:  # someone changed torch's setting: start again from it
            self._start(most)
        self.steps += 1
        quiet = self.others is None or self.others < self.OTHERS
        probe = (self.threads < most and may_probe and quiet and self.steps >= self.next_probe
                 and (kind, self.threads) in self.last)
        return most if probe else self.threads

    def glance(self) -> None:
        """Before the first step after a pause: how many cores do other programs use now? If
        OTHERS or more, the step starts with one thread. (Waits GLANCE seconds; nothing on a
        machine without /proc/stat.)"""
        before = cpu_sample()
        if before is None or self.threads is None:
            return
        time.sleep(self.GLANCE)
        self.others = cores_used_by_others(before, cpu_sample())
        if self.others >= self.OTHERS:
            self.threads = 1
            self.next_probe = self.steps + self.interval

    def record(self, kind, threads: int, seconds: float, others: float | None = None) -> None:
        """What a step with `threads` threads took; others: cores other programs used meanwhile."""
        before = self.last.get((kind, threads))
        self.last[kind, threads], self.others, self.last_end = seconds, others, time.perf_counter()
        busy = (others is not None and others >= self.OTHERS) or (before is not None and seconds > self.SLOWER * before)
        if threads != self.threads:  # a probe with all the cores: did it beat one thread?
            if seconds < self.last[kind, self.threads] and not busy:
                self.threads, self.interval = threads, self.FIRST_PROBE
            else:
                self.interval *= 2
            self.next_probe = self.steps + self.interval
        elif threads > 1 and busy:
            self.threads = 1  # other programs took some of the cores
            self.next_probe = self.steps + self.interval


# -----------------------------------------------------------------------------
# On a CPU: one thread's passes at a time
#
# torch runs a pass's parallel regions on OpenMP (libgomp, shipped inside the torch wheel),
# which keeps a pool of worker threads for each thread that has run a parallel region, for
# as long as that thread lives. Between two regions a worker spins a while before it sleeps,
# so the next region starts at once; but once the pools' workers outnumber the cores, libgomp
# cuts the spin to almost nothing (do_spin in libgomp/config/linux/wait.h of GCC: when
# gomp_managed_threads > gomp_available_cpus it spins gomp_throttled_spin_count_var times), and
# every region of every pass pays to wake its workers from the kernel. One parallel operator
# on the main thread (a pass, or the zeros of a large tensor) leaves a pool that lives as long
# as the main thread: beside the engine loop's, 16 requests batched behind one system prompt
# took 7 to 9 s where they take 5.0 to 7.2 s with the loop's pool alone (--bench throughput's
# (c), 2-core VM: docs/measured.md). So an Engine does its own tensor work outside its loop
# (loading, its pool's zeros, the step budget's calibration, warm_up) on threads that end
# with it, and the benchmarks run each way, peer or floor, with no other way's thread alive.
# A notebook that runs passes of its own on its main thread brings the second pool back.


def in_own_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a thread of its own that has ended when this returns: its result,
    or its error raised here. The OpenMP pool its passes made goes with the thread."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="passes") as one:  # leaving it joins the thread
        return one.submit(fn, *args, **kwargs).result()


def synchronize(device) -> None:
    """Wait for the work queued on `device`. A GPU runs kernels after the CPU has launched
    them, so a timing that stops without this measures the launch, and the time lands in
    whichever timing waits next. Every step time and TTFT the course prints ends here (or
    after a `.tolist()` / `int()` of a result, which waits too). Nothing on a CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class GpuClock:
    """The GPU's own clock around a stretch of work, beside the wall clock's: a CUDA event
    recorded on the stream where the stretch starts (start) and one where it ends (stop),
    and the milliseconds between them as the GPU ran them. On a CPU stop gives None.

    What it measures is the stream's time from the first event to the second, idle gaps
    included: where the CPU launches kernels slower than the GPU runs them (a small model's
    pass), the GPU waits between kernels and the two clocks read about the same; where they
    part, the wall's extra is the CPU's work before the first launch or after the last
    kernel. The GPU's busy time, kernel by kernel, is the profiler's (--bench gpu's profiled HIT).

    >>> clock = GpuClock("cpu"); clock.start(); clock.stop() is None
    True
    """

    def __init__(self, device):
        self.on = torch.device(device).type == "cuda"
        self.began = None

    def start(self) -> None:
        if self.on:
            self.began = torch.cuda.Event(enable_timing=True)
            self.began.record()

    def stop(self) -> float | None:
        """Milliseconds on the GPU since start (waiting for the stretch's work to finish); None on a CPU."""
        if not self.on:
            return None
        ended = torch.cuda.Event(enable_timing=True)
        ended.record()
        ended.synchronize()
        return self.began.elapsed_time(ended)


# -----------------------------------------------------------------------------
# On a GPU: the attention kernels every pass may use
#
# torch's scaled_dot_product_attention picks a kernel per call. For bf16 on an H100 it picks
# cuDNN's, and cuDNN builds a plan the first time it meets each new shape: on the first run
# of the demo there, every HIT (a new length of 10 to 32 computed tokens) spent ~1 s in that
# plan and came out 0.2x the MISS; with cuDNN left out the same HITs took 31 to 80 ms. Every
# request of a server has a new shape, so the course never lets it plan: FlashAttention where
# a call needs no mask (the dispatcher skips it where one is passed: the pool's attention and
# a cached prefix's bottom-right causal alignment pass one), else the memory-efficient kernel,
# else the math one. None of them needs a plan per shape.
GPU_ATTENTION = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def one_pass(chooser: ThreadChooser | None, device, kind, may_probe: bool = True):
    """The context one forward pass (and the copies of its step) runs in: on a CPU, the
    chooser's thread count for a pass of this kind (put back after; with no chooser,
    torch's own); on a GPU, the attention kernels of GPU_ATTENTION (there the CPU only
    launches kernels). kind: steps of the same kind are timed against each other, e.g.
    ("decode", 1) or ("prefill", tokens.bit_length()). may_probe: False for passes too
    costly to try all the cores on while other programs may be busy (a long prefill).

    >>> with one_pass(None, "cuda", "decode"):   # the flags are set even where no GPU is
    ...     torch.backends.cuda.cudnn_sdp_enabled()
    False
    """
    if torch.device(device).type == "cuda":
        return sdpa_kernel(list(GPU_ATTENTION))
    if chooser is None or torch.device(device).type != "cpu":
        return contextlib.nullcontext()
    return chooser.running(kind, may_probe)
