"""Model families: each runs its own forward under every layout, and matches its single-process self.

For tiny random-init models of each family (sliding windows, soft-capping, multipliers, fused projections,
q/k norms and MoE experts set where the family has them), in one 4-rank gloo world:
- teacher (`TeacherRunner`) tp2 x cp2, pp2 x tp2 and, for MoE families, ep2 (whole experts over the tp
  ranks): logits equal the HF model's own forward, on an ordinary batch
  and on a NEAT-packed one (the packed reference is the unsharded model with `configure_packing`, which
  test_packing checks against per-document forwards);
- student tp2 x cp2 (`parallelize_student`, FSDP2 over the cp axis) and pp2 x tp2 (`StudentPipeline`):
  logits, loss and every parameter gradient equal the single-process model's on the same packed batch
  (families whose embeddings are tied by default, Gemma's, keep them tied on the pipelined student); MoE
  students also with ep2 (dp 2 x tp 2, experts whole over the tp ranks), a pipelined one pp2 x tp2 x ep2,
  and a Qwen3-MoE one with ep4 over its 4 data-parallel ranks (one expert per rank and layer).
"""

from __future__ import annotations

import copy

import torch

from meshkd.core.loss import cross_entropy_loss
from meshkd.core.packing import configure_packing
from meshkd.parallel.context_parallel import shard_student_batch
from meshkd.parallel.data_parallel import parallelize_student, scale_expert_gradients
from meshkd.parallel.student_pipeline import StudentPipeline
from meshkd.parallel.teacher_runner import TeacherRunner
from meshkd.recipe.modeling.models import load_causal_lm
from tests.tiny import full, neat_layout
from tests.world import layout_setups, world_test

WORLD = 4
VOCAB = 67  # odd, so the vocabulary splits unevenly over tp
ATOL = 2e-5

_SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
_MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
FAMILIES = {
    "llama": {},
    "qwen2": dict(use_sliding_window=True, sliding_window=5, max_window_layers=2),
    "qwen3": dict(head_dim=8),
    "mistral": dict(sliding_window=5),
    "gemma2": dict(head_dim=8, sliding_window=5, final_logit_softcapping=3.0, attn_logit_softcapping=5.0),
    "gemma3_text": dict(head_dim=8, sliding_window=5, layer_types=_MIXED, final_logit_softcapping=3.0),
    "phi3": {},
    "olmo2": {},
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
    "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=5, layer_types=_MIXED),
    # Multi-head latent attention (low-rank q and kv, rope and no-rope head parts, v heads of another width), a
    # dense first layer, then routed experts in groups plus a shared expert.
    "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=4,
                        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, moe_intermediate_size=16),
}


def family_model(family: str, *, seed: int = 3) -> torch.nn.Module:
    return load_causal_lm(random_init={"model_type": family, **{**_SHAPE, **FAMILIES[family]}}, seed=seed)


def _batches() -> tuple[dict, dict]:
    generator = torch.Generator().manual_seed(1)
    plain = {"input_ids": torch.randint(0, VOCAB, (2, 13), generator=generator)}  # 13: CP pads
    mask, positions = neat_layout([[7, 4, 3], [9, 5]], 14)
    packed = {"input_ids": torch.randint(0, VOCAB, (2, 14), generator=generator), "attention_mask": mask,
              "position_ids": positions}
    labels = torch.randint(0, VOCAB, (2, 14), generator=generator)
    labels[mask == 0] = -100
    packed["labels"] = labels
    return plain, packed


PLAIN, PACKED = _batches()
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def setup_for(section: dict):
    return layout_setups({"distributed": section}, WORLD).student


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    actual = full(actual).detach()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = (actual - expected).abs().max().item()
    assert error <= ATOL, f"{what}: max abs error {error:.3g} > {ATOL}"


def inputs_of(batch: dict) -> dict:
    return {key: batch[key] for key in MODEL_INPUTS if key in batch}


def assert_whole_experts_per_rank(model: torch.nn.Module, section: dict) -> None:
    """With ep_size > 1, each rank runs 1/ep of every layer's experts (and holds no more than that)."""
    ep = section.get("ep_size", 1)
    if ep > 1:
        blocks = [module for name, module in model.named_modules() if name.endswith(".experts")]
        total = next(getattr(model.config, key) for key in ("num_experts", "num_local_experts", "n_routed_experts")
                     if hasattr(model.config, key))
        assert blocks and all(ep * block.num_experts == total for block in blocks)
        for name, parameter in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                assert ep * parameter.to_local().shape[0] <= parameter.shape[0] == total, name


def check_teacher(family: str, section: dict) -> None:
    model = family_model(family)
    plain_reference = copy.deepcopy(model).eval()
    packed_reference = configure_packing(copy.deepcopy(model).eval())
    runner = TeacherRunner(model, setup_for(section), device="cpu")
    assert_whole_experts_per_rank(model, section)
    for batch, reference in ((PLAIN, plain_reference), (PACKED, packed_reference)):
        logits = runner.logits(batch if runner.is_first else None)
        if runner.is_last:
            with torch.no_grad():
                expected = reference(**inputs_of(batch)).logits
            assert_close(logits, expected, f"{family} teacher {section} logits")
        else:
            assert logits is None


def _reference_step(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    reference = configure_packing(model)
    logits = reference(**inputs_of(PACKED)).logits
    loss = cross_entropy_loss(logits, PACKED["labels"], num_valid_tokens=_num_valid())
    loss.backward()
    # A tied output head appears under its own name too: a pipelined student holds it as a second copy.
    grads = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False) if p.grad is not None}
    return loss.item(), grads, logits.detach()


def _num_valid() -> int:
    return int((PACKED["labels"] != -100).sum())


def _compare_gradients(named_parameters, reference: dict[str, torch.Tensor], what: str) -> int:
    compared = 0
    for name, parameter in named_parameters:
        if parameter.grad is None:
            continue  # a parameter no token reached (an expert nobody routed to) has no gradient here either
        assert name in reference, f"{what}: {name} has a gradient, the reference's has none"
        assert_close(parameter.grad, reference[name], f"{what} grad {name}")
        compared += 1
    return compared


def check_student(family: str, section: dict) -> None:
    """Every dp rank trains on the whole packed batch: FSDP2's average over dp is then the reference gradient."""
    setup = setup_for(section)
    ref_loss, ref_grads, ref_logits = _reference_step(family_model(family))
    model = parallelize_student(configure_packing(family_model(family)), setup)
    assert_whole_experts_per_rank(model, section)
    local, shard = shard_student_batch(PACKED, setup)
    logits = model(**inputs_of(local)).logits
    loss = cross_entropy_loss(logits, local["labels"], num_valid_tokens=_num_valid())
    if setup.cp_size == 1:
        assert_close(logits, ref_logits, f"{family} student {section} logits")
        assert abs(loss.item() - ref_loss) <= ATOL
    (loss * setup.cp_size).backward()  # FSDP2 averages over dp x cp; the cp shares must be summed
    scale_expert_gradients(model)  # experts over the dp ranks sum their ranks' gradients: the same average
    compared = _compare_gradients(model.named_parameters(), ref_grads, f"{family} student {section}")
    assert compared >= 8, f"only {compared} gradients compared"


def check_student_pipeline(family: str, section: dict) -> None:
    setup = setup_for(section)
    _, ref_grads, ref_logits = _reference_step(family_model(family))
    pipe = StudentPipeline(family_model(family), setup, device="cpu", schedule="gpipe",
                           num_micro_batches=2)
    rows = [{key: value[i : i + 1] for key, value in PACKED.items()} for i in range(2)]
    losses = {}

    def loss_fn(index: int, logits: torch.Tensor) -> torch.Tensor:
        assert_close(logits, ref_logits[index : index + 1], f"{family} {section} logits {index}")
        losses[index] = loss = cross_entropy_loss(logits, rows[index]["labels"], num_valid_tokens=_num_valid())
        return loss

    pipe.step(rows, loss_fn)
    assert sorted(losses) == ([0, 1] if pipe.is_last else [])
    compared = _compare_gradients(pipe.stage_model.named_parameters(), ref_grads, f"{family} student {section}")
    assert compared >= 4, f"only {compared} gradients compared"


class FamilyCheck:
    """A picklable check of one family in one layout, named for the test report."""

    def __init__(self, function, family: str, section: dict):
        self.function, self.family, self.section = function, family, section
        layout = "_".join(f"{key.split('_')[0]}{value}" for key, value in section.items())
        self.__name__ = f"{function.__name__}_{family}_{layout}"

    def __call__(self) -> None:
        self.function(self.family, self.section)


# Each family in every role and layout kind, with layouts combined to keep the world short: tp with cp (the
# 4 ranks hold one replica), and pp with tp.
TP_CP, PP_TP = {"tp_size": 2, "cp_size": 2}, {"pp_size": 2, "tp_size": 2}
MOE = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
CHECKS = [
    FamilyCheck(function, family, section)
    for family in FAMILIES
    for function, section in ((check_teacher, TP_CP), (check_teacher, PP_TP), (check_student, TP_CP),
                              (check_student_pipeline, PP_TP))
] + [FamilyCheck(function, family, {"tp_size": 2, "ep_size": 2}) for family in MOE
      for function in (check_teacher, check_student)] + [
    FamilyCheck(check_student_pipeline, "mixtral", {"pp_size": 2, "tp_size": 2, "ep_size": 2}),
    FamilyCheck(check_student, "qwen3_moe", {"ep_size": 4})]  # experts over the 4 dp ranks, one each

test_families_world = world_test(WORLD, CHECKS, timeout_s=60.0, deadline_s=900.0)
