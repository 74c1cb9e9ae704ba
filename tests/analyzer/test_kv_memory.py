"""The memory to buy: a model's KV bytes per token and per block, read from its config.json or
the table, models whose KV these formulas do not describe refused by name, and the analyzer's
working set turned into GiB and the flags of three servers. (Against vLLM's own
FullAttentionSpec: benchmarks/caching_models.py --vllm-wheel.)"""

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from analyzer.kv_memory import KNOWN_MODELS, UnsupportedModel, kv_shape, memory_to_buy, server_flags
from analyzer.request_logs import Writer, chat, write_log

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name, per_token", [("Llama-3.1-8B", 128 * 1024), ("Llama-3.1-70B", 320 * 1024),
                                             ("Qwen2.5-7B", 56 * 1024), ("Mistral-7B-v0.3", 128 * 1024),
                                             ("SmolLM2-135M", 23_040)])
def test_the_table_gives_k_and_v_for_every_kv_head_in_every_layer(name, per_token):
    shape = KNOWN_MODELS[name]
    assert shape.bytes_per_token() == per_token
    assert [shape.bytes_per_block(b) for b in (8, 16, 32)] == [b * per_token for b in (8, 16, 32)]


def write_config(tmp_path, **fields):
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
              "torch_dtype": "bfloat16", **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_float32_checkpoint_is_sized_as_vllm_serves_it_in_bfloat16(tmp_path):
    """vLLM's --dtype auto downcasts a float32 checkpoint (the course's default model's config
    says float32): its KV blocks are bfloat16, half the bytes the config's dtype would give."""
    shape = kv_shape(str(write_config(tmp_path, torch_dtype="float32", head_dim=64)))
    assert (shape.dtype, shape.config_dtype) == ("bfloat16", "float32")
    assert shape.bytes_per_block(16) == 4 * 16 * 2 * (64 + 64) * 2
    assert kv_shape(str(write_config(tmp_path, torch_dtype="float16"))).config_dtype is None  # served as it is


def test_a_config_json_gives_the_shape_and_a_kv_dtype_overrides_it(tmp_path):
    folder = write_config(tmp_path, head_dim=128)
    shape = kv_shape(str(folder))
    assert (shape.num_layers, shape.num_kv_heads, shape.head_size, shape.dtype) == (4, 2, 128, "bfloat16")
    assert kv_shape(str(folder / "config.json"), "fp8").bytes_per_token() == shape.bytes_per_token() // 2
    (tmp_path / "multimodal").mkdir()
    multimodal = write_config(tmp_path / "multimodal",
                              text_config={"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256})
    assert kv_shape(str(multimodal)).num_kv_heads == 4  # its text model has no num_key_value_heads: one per head


@pytest.mark.parametrize("fields, message", [
    ({"kv_lora_rank": 512}, "multi-head latent attention"),
    ({"sliding_window": 4096}, "sliding-window attention"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window attention"),
])
def test_models_whose_kv_the_formula_does_not_describe_are_refused_by_name(tmp_path, fields, message):
    with pytest.raises(UnsupportedModel, match=message):
        kv_shape(str(write_config(tmp_path, **fields)))


def test_an_unused_sliding_window_is_not_a_window_and_unknown_models_are_named(tmp_path):
    assert kv_shape(str(write_config(tmp_path, sliding_window=131072, use_sliding_window=False))).num_layers == 4
    with pytest.raises(UnsupportedModel, match="neither a config.json nor one of Llama-3.1-8B"):
        kv_shape("no/such-model")


def test_the_working_set_and_the_running_requests_become_gib_and_flags():
    m = memory_to_buy(KNOWN_MODELS["Llama-3.1-8B"], 16, working_set=1024, concurrency=4, context=1000)
    assert m.running_blocks == 4 * 63 and m.blocks == 1024 + 252
    assert m.gib(m.cache_blocks) == 2.0  # 1,024 blocks of 2 MiB
    flags = server_flags(m)
    assert flags["vLLM"].startswith(f"--block-size 16 --num-gpu-blocks-override 1276 (or --kv-cache-memory-bytes "
                                    f"{1276 * 2 * 2**20})")
    assert "--max-total-tokens 20416" in flags["SGLang"]
    # 16,384 tokens of 128 KiB of K/V and 12 bytes of cell each: 2,048.2 MiB
    assert flags["llama.cpp"].startswith("-c 4000 --parallel 4 --kv-unified --cache-ram 2049")


@pytest.mark.slow
def test_the_analyzer_prints_the_memory_to_buy_for_each_caching_model(tmp_path):
    from analyzer import workload_analyzer

    w = Writer(0)
    system = "You are a tutor. " + w.words(40)
    path = tmp_path / "chats.jsonl"
    write_log(path, [chat(system, w.sentence(3, 12)) for _ in range(30)])
    for like in ("vllm", "sglang", "llamacpp"):
        out = io.StringIO()
        workload_analyzer.main([str(path), "--like", like, "--kv-model", "Llama-3.1-8B", "--concurrency", "8",
                                "--context", "2048"], console=Console(file=out, width=300))
        text = out.getvalue()
        assert "Memory to buy for Llama-3.1-8B" in text and "8 running request(s) of 2,048 tokens hold 2.00 GiB" in text
        assert "--num-gpu-blocks-override" in text and "--max-total-tokens" in text and "--cache-ram" in text


def test_the_analyzer_refuses_a_model_it_cannot_size_without_a_traceback(tmp_path, capsys):
    from analyzer import workload_analyzer

    config = write_config(tmp_path, kv_lora_rank=512) / "config.json"
    with pytest.raises(SystemExit) as exit_info:
        workload_analyzer.main([str(ROOT / "lessons/data/chatbot.jsonl.xz"), "--kv-model", str(config)])
    assert exit_info.value.code == 2 and "multi-head latent attention" in capsys.readouterr().err


def test_stage_10s_worked_example(tokenizer):
    """The multi-turn log, eight users at a time, sized for Llama-3.1-8B with 16 running
    requests of 4,096 tokens: the figures stage 10 and docs/analyzer.md print."""
    from analyzer.request_logs import interleave, read_log
    from analyzer.log_replay import LIKE, hit_rate_curve, tokenize_log

    requests = interleave(read_log(ROOT / "lessons/data/multi_turn.jsonl.xz"), 8)
    prompts, salts = tokenize_log(requests, tokenizer), [r.cache_salt for r in requests]
    working_sets = {like: hit_rate_curve(prompts, salts, 16, LIKE[like]).working_set
                    for like in ("vllm", "sglang", "llamacpp")}
    assert working_sets == {"vllm": 394, "sglang": 393, "llamacpp": 466}
    m = memory_to_buy(KNOWN_MODELS["Llama-3.1-8B"], 16, working_sets["vllm"], concurrency=16, context=4096)
    assert (round(m.gib(m.cache_blocks), 2), round(m.gib(), 2)) == (0.77, 8.77)
    assert server_flags(m)["vLLM"] == "--block-size 16 --num-gpu-blocks-override 4490 (or --kv-cache-memory-bytes " \
                                      "9416212480)"
    # llama.cpp's prompt cache counts 12 bytes of cell a token beside the K/V: 788.07 MiB, rounded up
    assert "--cache-ram 789 " in server_flags(m)["llama.cpp"]
    own = memory_to_buy(KNOWN_MODELS["Llama-3.1-8B"], 16, working_sets["llamacpp"], concurrency=16, context=4096)
    assert "--cache-ram 933 " in server_flags(own)["llama.cpp"]  # stage 10's row for llama.cpp, its own 466 blocks
