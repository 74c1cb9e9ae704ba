"""What every pass runs with, per device (engine/cpu_threads.py, model_loader.resolve_dtype): the
CPU side runs here; the GPU side's choices are flags and functions a CPU can check."""

import time

import pytest
import torch

from engine import kv_pool
from engine import one_request
from engine.batch_engine import BatchRunner
from engine.cpu_threads import GPU_ATTENTION, GpuClock, ThreadChooser, one_pass
from engine.model_loader import resolve_dtype
from engine.request import SamplingParams


def test_the_default_dtype_follows_what_the_device_computes_natively(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype(None, cuda) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert resolve_dtype(None, cuda) == torch.float16  # emulated bf16 is slow: fp16 instead
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", cuda) == torch.bfloat16  # a dtype given is kept


def test_a_gpu_pass_never_lets_cudnn_plan_attention_and_puts_the_flags_back():
    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())
    with one_pass(ThreadChooser(), torch.device("cuda"), "decode"):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()) == before
    assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in GPU_ATTENTION


def test_a_requests_pool_copies_run_with_the_thread_count_its_forward_pass_gets(make_engine, monkeypatch):
    """Beside busy programs the chooser picks one thread; the gather and the write of the
    one-request step must run with it too, not with torch's setting."""
    engine = make_engine()
    chooser = engine.threads
    chooser.most, chooser.threads, chooser.next_probe = torch.get_num_threads(), 1, 10**9  # as after a busy step
    seen = {}
    for name in ("gather", "write"):
        real = getattr(kv_pool.PagedKVPool, name)

        def spy(self, *args, _real=real, _name=name):
            seen.setdefault(_name, set()).add(torch.get_num_threads())
            return _real(self, *args)

        monkeypatch.setattr(kv_pool.PagedKVPool, name, spy)
    most = torch.get_num_threads()
    one_request.generate(engine.parts, "r", list(range(100, 120)), SamplingParams(max_tokens=3))  # stage 7's step
    assert seen == {"gather": {1}, "write": {1}}
    assert torch.get_num_threads() == most  # put back after each step


def test_a_gpu_clock_reads_nothing_on_a_cpu():
    clock = GpuClock("cpu")
    clock.start()
    assert clock.stop() is None


def test_each_prefill_phase_and_each_batched_step_get_the_gpus_clock_beside_the_wall(make_engine, gpu_clock_on):
    """What the demo, stage 7 and --bench gpu print on a GPU: each phase of a request's prefill
    on the GPU's clock beside its wall time (the two clocks are one here, so each GPU reading
    is at most its phase's wall time), and each batched step's pass and sampling."""
    engine = make_engine()
    reply = one_request.generate(engine.parts, "r", list(range(100, 120)), SamplingParams(max_tokens=3))
    phases = ("lookup", "gather", "forward", "write", "sample")
    assert set(reply.prefill.gpu_ms) == set(phases)
    for phase in phases:
        assert 0 <= reply.prefill.gpu_ms[phase] <= getattr(reply.prefill, f"{phase}_ms")
    assert reply.prefill.gpu_ms["forward"] > 0
    runner = BatchRunner(engine.parts, choose_threads=False, max_num_seqs=2, max_num_batched_tokens=64)
    runner.add("b", list(range(200, 210)), SamplingParams(max_tokens=2))
    started = time.perf_counter()
    runner.step()
    assert 0 < runner.last_gpu_ms <= (time.perf_counter() - started) * 1e3
    for request in list(runner.scheduler.running):
        runner.scheduler.finish(request)
    assert make_engine().generate([5, 6, 7], max_tokens=1).prefill.gpu_ms is None  # the loop's path: no phases
