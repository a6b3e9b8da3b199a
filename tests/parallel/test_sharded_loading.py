"""Sharded loading: a model built without weights, laid out, then filled with this rank's share only.

Single process: the empty model has no parameter storage, pruning maps layers to their stored index, MoE
checkpoints stored one tensor per expert (as transformers writes them) fill the model's merged expert
tensors, and a checkpoint that stores a tensor under a name nothing maps is refused (None: the caller
loads the whole model).
In a 4-rank world: a teacher laid out tp2 / pp2 (tied embeddings) / pp2 x tp2, MoE teachers (Qwen3-MoE ep2,
Mixtral tp2 and pp2 x ep2), students under FSDP2 x tp2 (a dense one and a Qwen3-MoE) and pp2 x dp2, each
loaded in shards, equal the fully loaded model (logits, every parameter), and hold only their share of the
parameters; a Qwen3-MoE student with its experts over 4 dp ranks, loaded in shards, gets the fully loaded
model's gradients.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from meshkd.core.packing import configure_packing
from meshkd.parallel.data_parallel import parallelize_student, scale_expert_gradients
from meshkd.parallel.sharded_loading import empty_causal_lm, is_empty, load_shards
from meshkd.parallel.student_pipeline import StudentPipeline
from meshkd.parallel.teacher_runner import TeacherRunner
from meshkd.parallel.tensor_parallel import experts_left_whole
from meshkd.recipe.modeling.models import load_causal_lm, save_hf_model
from tests.tiny import full, neat_layout
from tests.world import layout_setups, world_test

WORLD = 4
VOCAB = 67
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MODELS = {"llama": {"model_type": "llama", **SHAPE},
          "qwen3_tied": {"model_type": "qwen3", "head_dim": 8, "tie_word_embeddings": True, **SHAPE},
          # transformers stores MoE experts one tensor per expert and projection (model.layers.0.mlp.experts.0.
          # gate_proj.weight, ... / block_sparse_moe.experts.0.w1.weight), merged into one tensor when loaded.
          "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 16, **SHAPE},
          "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, **SHAPE},
          "deepseek_v3": {"model_type": "deepseek_v3", **SHAPE, "num_key_value_heads": 4, "q_lora_rank": 24,
                          "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                          "first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
                          "topk_group": 1, "n_shared_experts": 1, "moe_intermediate_size": 16}}
PER_EXPERT = {"qwen3_moe": "model.layers.0.mlp.experts.3.up_proj.weight",
              "mixtral": "model.layers.0.block_sparse_moe.experts.3.w3.weight",
              "deepseek_v3": "model.layers.1.mlp.experts.3.up_proj.weight"}


def saved_model(name: str, root: Path) -> Path:
    """The random-init model `name` saved as a Hugging Face directory under `root` (written once)."""
    directory = root / name
    if not (directory / "config.json").is_file():
        save_hf_model(load_causal_lm(random_init=MODELS[name], seed=4), None, directory)
    return directory


def batch() -> dict:
    generator = torch.Generator().manual_seed(0)
    mask, positions = neat_layout([[6, 5], [11]], 11)
    return {"input_ids": torch.randint(0, VOCAB, (2, 11), generator=generator), "attention_mask": mask,
            "position_ids": positions}


def test_empty_model_holds_no_weights_and_maps_pruned_layers(tmp_path):
    directory = saved_model("llama", tmp_path)
    model, checkpoint = empty_causal_lm(directory, keep_layers=[0, 2, 3], dtype=torch.float32,
                                        attn_implementation=None)
    assert is_empty(model) and model.config._attn_implementation == "sdpa"
    assert checkpoint.sources["model.layers.1.mlp.up_proj.weight"].name == "model.layers.2.mlp.up_proj.weight"
    load_shards(model, checkpoint, device="cpu")
    assert not is_empty(model)
    expected = load_causal_lm(path=directory, keep_layers=[0, 2, 3])
    inputs = batch()["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(input_ids=inputs).logits, expected(input_ids=inputs).logits)


@pytest.mark.parametrize("name", ["qwen3_tied", "llama"])
@pytest.mark.parametrize("keep_layers", [None, [1, 3]])
def test_loaded_in_one_process_it_is_the_configured_architecture(tmp_path, name, keep_layers):
    """Tied embeddings stay one matrix; the parameter count is from_pretrained's (of the pruned model)."""
    directory = saved_model(name, tmp_path)
    model, checkpoint = empty_causal_lm(directory, keep_layers=keep_layers, dtype=torch.float32,
                                        attn_implementation=None)
    load_shards(model, checkpoint, device="cpu")
    expected = load_causal_lm(path=directory, keep_layers=keep_layers)
    assert_architecture(model, expected)


def assert_architecture(model: torch.nn.Module, expected: torch.nn.Module) -> None:
    """`model` (laid out or not) ties what `expected` ties and has as many parameters (global sizes)."""
    tied = expected.get_output_embeddings().weight is expected.get_input_embeddings().weight
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    assert tied == bool(expected.config.tie_word_embeddings)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in expected.parameters())


@pytest.mark.parametrize("name", list(PER_EXPERT))
def test_per_expert_checkpoint_is_read_as_the_models_merged_experts(tmp_path, name):
    directory = saved_model(name, tmp_path)
    assert PER_EXPERT[name] in load_file(str(directory / "model.safetensors"))
    model, checkpoint = empty_causal_lm(directory, keep_layers=[1, 3], dtype=torch.float32,
                                        attn_implementation=None)
    assert "model.layers.3." in str(checkpoint.sources["model.layers.1.mlp.experts.down_proj"])  # the kept layer
    load_shards(model, checkpoint, device="cpu")
    expected = load_causal_lm(path=directory, keep_layers=[1, 3])
    assert_parameters_equal(model.named_parameters(), dict(expected.named_parameters()), name)


def test_checkpoint_under_other_names_is_not_loaded_in_shards(tmp_path):
    directory = saved_model("llama", tmp_path)
    state = load_file(str(directory / "model.safetensors"))
    state["model.layers.0.mlp.experts.0.weight"] = state.pop("model.layers.0.mlp.up_proj.weight")
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    assert empty_causal_lm(directory, keep_layers=None, dtype=torch.float32, attn_implementation=None) is None
    (directory / "model.safetensors").unlink()  # no weights at all
    assert empty_causal_lm(directory, keep_layers=None, dtype=torch.float32, attn_implementation=None) is None


def test_shape_mismatch_names_the_tensor(tmp_path):
    directory = saved_model("llama", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 48
    (directory / "config.json").write_text(json.dumps(config))
    model, checkpoint = empty_causal_lm(directory, keep_layers=None, dtype=torch.float32, attn_implementation=None)
    try:
        load_shards(model, checkpoint, device="cpu")
    except ValueError as error:
        assert "model.layers.0.mlp.gate_proj.weight" in str(error) and "(64, 32)" in str(error)
    else:
        raise AssertionError("a checkpoint tensor of the wrong shape was accepted")


def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path):
    directory = saved_model("llama", tmp_path)
    (directory / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        empty_causal_lm(directory, keep_layers=None, dtype=torch.float32, attn_implementation=None)


# ---------------------------------------------------------------------------------------------------------
# Distributed


def shared_root() -> Path:
    return Path(tempfile.gettempdir()) / f"meshkd-sharded-{os.getppid()}"  # the ranks' common parent


def shared_directory(name: str) -> Path:
    """A saved model every rank reads: rank 0 writes it, the others wait."""
    if dist.get_rank() == 0:
        saved_model(name, shared_root())
    dist.barrier()
    return shared_root() / name


def check_remove_saved_models():
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(shared_root(), ignore_errors=True)


def setup_for(section: dict):
    return layout_setups({"distributed": section}, WORLD).student


def local_numel(model: torch.nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def run_teacher(name: str, section: dict, max_share: float) -> None:
    directory = shared_directory(name)
    reference = configure_packing(load_causal_lm(path=directory).eval())
    model, checkpoint = empty_causal_lm(directory, keep_layers=None, dtype=torch.float32, attn_implementation=None)
    total = sum(p.numel() for p in reference.parameters())
    runner = TeacherRunner(model, setup_for(section), device="cpu")
    load_shards(model, checkpoint, device="cpu")
    if section.get("pp_size", 1) == 1:  # else this rank holds one stage
        assert_architecture(model, reference)
    share = local_numel(model) / total
    assert share <= max_share, f"{name} {section}: this rank holds {share:.2f} of the parameters"
    logits = runner.logits(batch())
    if runner.is_last:
        with torch.no_grad():
            expected = reference(**batch()).logits
        assert (full(logits) - expected).abs().max().item() <= 1e-5


def check_teacher_tp2():
    run_teacher("llama", {"tp_size": 2}, max_share=0.6)
    run_teacher("qwen3_tied", {"tp_size": 2}, max_share=0.6)


def check_teacher_pp2_tied():
    run_teacher("qwen3_tied", {"pp_size": 2}, max_share=0.75)


def check_teacher_pp2_tp2():
    run_teacher("llama", {"pp_size": 2, "tp_size": 2}, max_share=0.4)


def check_moe_teachers_ep2_and_tp2():
    run_teacher("qwen3_moe", {"tp_size": 2, "ep_size": 2}, max_share=0.6)
    # tp alone splits experts only where the family's tp plan says so (transformers 5.24; from 5.25 it keeps
    # them whole); ep_size = tp_size spreads them on every release.
    whole = experts_left_whole(load_causal_lm(random_init=MODELS["mixtral"]))
    run_teacher("mixtral", {"tp_size": 2}, max_share=1.0 if whole else 0.6)
    run_teacher("mixtral", {"tp_size": 2, "ep_size": 2}, max_share=0.6)
    run_teacher("mixtral", {"pp_size": 2, "tp_size": 2, "ep_size": 2}, max_share=0.4)


def assert_parameters_equal(named_parameters, expected: dict, what: str) -> None:
    for name, parameter in named_parameters:
        assert torch.equal(full(parameter).detach(), expected[name]), f"{what}: {name}"


def check_student_fsdp2_tp2():
    directory = shared_directory("qwen3_tied")
    expected = dict(load_causal_lm(path=directory).named_parameters(remove_duplicate=False))
    model, checkpoint = empty_causal_lm(directory, keep_layers=None, dtype=torch.float32, attn_implementation=None)
    model = parallelize_student(model, setup_for({"tp_size": 2}))
    load_shards(model, checkpoint, device="cpu")
    assert local_numel(model) <= 0.3 * sum(p.numel() for p in dict.fromkeys(expected.values()))
    assert_parameters_equal(model.named_parameters(), expected, "fsdp2 x tp2")
    assert_architecture(model, load_causal_lm(path=directory))


def check_student_pp2_dp2_tied():
    directory = shared_directory("qwen3_tied")
    expected = dict(load_causal_lm(path=directory).named_parameters(remove_duplicate=False))
    model, checkpoint = empty_causal_lm(directory, keep_layers=None, dtype=torch.float32, attn_implementation=None)
    pipe = StudentPipeline(model, setup_for({"pp_size": 2}), device="cpu", schedule="gpipe", num_micro_batches=2)
    load_shards(pipe.stage_model, checkpoint, device="cpu")
    assert_parameters_equal(pipe.stage_model.named_parameters(), expected, "pp2 x dp2")
    assert not is_empty(pipe.stage_model)


def check_moe_student_fsdp2_tp2():
    directory = shared_directory("qwen3_moe")
    expected = dict(load_causal_lm(path=directory).named_parameters())
    # Experts whole on each tp rank (the tp plans of transformers 5.25 on) are sharded by FSDP2 over dp alone.
    whole = experts_left_whole(load_causal_lm(random_init=MODELS["qwen3_moe"]))
    for section, share in (({"tp_size": 2}, 0.55 if whole else 0.3), ({"tp_size": 2, "ep_size": 2}, 0.3)):
        model, checkpoint = empty_causal_lm(directory, keep_layers=None, dtype=torch.float32,
                                            attn_implementation=None)
        model = parallelize_student(model, setup_for(section))
        load_shards(model, checkpoint, device="cpu")
        held = local_numel(model) / sum(p.numel() for p in expected.values())
        assert held <= share, f"moe fsdp2 x {section}: this rank holds {held:.2f} of the parameters"
        assert_parameters_equal(model.named_parameters(), expected, f"moe fsdp2 x {section}")


def check_moe_student_experts_over_dp():
    """Sharded loading gives the parameters new storage; the experts' gradients still come out right."""
    directory = shared_directory("qwen3_moe")
    ids = batch()["input_ids"]
    reference = load_causal_lm(path=directory)
    reference(input_ids=ids, labels=ids).loss.backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    model, checkpoint = empty_causal_lm(directory, keep_layers=None, dtype=torch.float32, attn_implementation=None)
    model = parallelize_student(model, setup_for({"ep_size": 4}))  # one expert per rank and layer
    load_shards(model, checkpoint, device="cpu")
    model(input_ids=ids, labels=ids).loss.backward()  # the same rows on every rank: FSDP2's average is exact
    scale_expert_gradients(model)
    experts = [name for name, _ in model.named_parameters() if ".experts." in name]
    assert experts and all(dict(model.named_parameters())[name].to_local().shape[0] == 1 for name in experts)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(full(parameter.grad), expected[name], rtol=1e-4, atol=1e-6, msg=name)


CHECKS = [check_teacher_tp2, check_teacher_pp2_tied, check_teacher_pp2_tp2, check_moe_teachers_ep2_and_tp2,
          check_student_fsdp2_tp2, check_moe_student_fsdp2_tp2, check_moe_student_experts_over_dp,
          check_student_pp2_dp2_tied, check_remove_saved_models]

test_sharded_loading_world = world_test(WORLD, CHECKS, timeout_s=60.0, deadline_s=240.0)
