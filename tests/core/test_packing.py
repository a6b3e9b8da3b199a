"""Tests for meshkd.core.packing: NEAT-packed rows must give each document the logits it gets alone.

Pure tier: tiny random-init transformers models (sdpa and eager) packed vs one document at a time,
pipeline stages, and the local KD check (the masks themselves: tests/core/test_masks.py). One-rank gloo:
the same hooks building context-parallel masks. Multi-rank tier: one 4-rank gloo world where ranks 0-1
hold student parts and ranks 2-3 teacher parts.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshkd.core.packing import (
    LAYOUT_ATTR,
    NEAT_INDEXED,
    configure_kd_teacher_packing,
    configure_packing,
    enable_cp_masks,
    packing_layout,
)
from tests.tiny import neat_layout, tiny_llama_model
from tests.world import world_test

VOCAB = 64
ROWS = ((5, 7, 4), (9, 6))  # document lengths per row; rows are padded to ROW_LENGTH
ROW_LENGTH = 19


def tiny_llama(attn: str = "sdpa", *, seed: int = 0) -> nn.Module:
    """A random-init LlamaForCausalLM small enough to run in milliseconds."""
    return tiny_llama_model(vocab=VOCAB, seed=seed, attn=attn, max_positions=64).eval()


def packed_batch(rows=ROWS, *, seed: int = 1) -> dict[str, torch.Tensor]:
    """input_ids, indexed attention_mask and per-document position_ids [len(rows), ROW_LENGTH]."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (len(rows), ROW_LENGTH), generator=generator)
    attention_mask, position_ids = neat_layout(rows, ROW_LENGTH)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def logits(model: nn.Module, **batch: torch.Tensor) -> torch.Tensor:
    """[batch, sequence, vocab] logits (or the last hidden states of a bare decoder)."""
    with torch.no_grad():
        output = model(**batch, use_cache=False)
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


def worst_document_gap(model: nn.Module, packed: torch.Tensor, batch: dict[str, torch.Tensor], rows=ROWS) -> float:
    """Largest |packed - alone| over every document's tokens, each document run alone through `model`."""
    worst = 0.0
    for row, lengths in enumerate(rows):
        start = 0
        for length in lengths:
            alone = logits(model, input_ids=batch["input_ids"][row : row + 1, start : start + length])
            worst = max(worst, (packed[row : row + 1, start : start + length] - alone).abs().max().item())
            start += length
    return worst


def assert_packed_matches_documents(model: nn.Module, rows=ROWS, *, call=None) -> None:
    batch = packed_batch(rows)
    packed = (call or logits)(model, **batch)
    assert not packed.isnan().any(), "padding rows must not produce NaN"
    gap = worst_document_gap(model, packed, batch, rows)
    assert gap < 1e-5, f"packed logits differ from per-document logits by {gap}"


# ---- whole models -----------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logits_match_documents_alone(attn):
    model = configure_packing(tiny_llama(attn))
    assert packing_layout(model) == NEAT_INDEXED
    assert_packed_matches_documents(model)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_unconfigured_model_mixes_documents(attn):
    # The reference comparison must be able to fail: without configure_packing documents see each other.
    model = tiny_llama(attn)
    batch = packed_batch()
    assert worst_document_gap(model, logits(model, **batch), batch) > 1e-3


def test_positional_arguments_are_converted():
    model = configure_packing(tiny_llama())
    batch = packed_batch()
    with torch.no_grad():
        packed = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"], use_cache=False).logits
    assert worst_document_gap(model, packed, batch) < 1e-5


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_one_document_row_is_an_ordinary_mask(attn):
    plain = tiny_llama(attn)
    packed = configure_packing(copy.deepcopy(plain))
    input_ids = packed_batch()["input_ids"]
    lengths = (ROW_LENGTH, 12)  # right padding: default position ids are per-document ones
    mask = torch.stack([(torch.arange(ROW_LENGTH) < n).long() for n in lengths])
    for attention_mask in (mask, mask.bool(), None):
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        expected = logits(plain, input_ids=input_ids, **kwargs)
        actual = logits(packed, input_ids=input_ids, **kwargs)
        for row, n in enumerate(lengths):
            torch.testing.assert_close(actual[row, :n], expected[row, :n], atol=1e-5, rtol=0)


def test_incremental_decoding_with_cache_matches_ordinary_model():
    plain = tiny_llama()
    packed = configure_packing(copy.deepcopy(plain))
    input_ids = packed_batch()["input_ids"][:1, :8]
    outputs = []
    for model in (plain, packed):
        with torch.no_grad():
            first = model(input_ids=input_ids[:, :6], attention_mask=torch.ones(1, 6, dtype=torch.long), use_cache=True)
            step = model(
                input_ids=input_ids[:, 6:8],
                attention_mask=torch.ones(1, 8, dtype=torch.long),
                cache=first.cache,
                use_cache=True,
            )
        outputs.append(step.logits)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=0)


def test_configure_is_idempotent_and_per_instance():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def registries():
        return dict(ALL_ATTENTION_FUNCTIONS._global_mapping), dict(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping)

    before = registries()
    model, other = tiny_llama(), tiny_llama()
    assert configure_packing(model) is model
    hooks = (len(model._forward_pre_hooks), len(model.model._forward_pre_hooks))
    configure_packing(model)
    configure_packing(model.model)
    assert (len(model._forward_pre_hooks), len(model.model._forward_pre_hooks)) == hooks == (1, 1)
    assert_packed_matches_documents(model)
    # transformers' global registries are untouched and another instance keeps the ordinary behaviour.
    assert registries() == before
    assert packing_layout(other) is None and not other._forward_pre_hooks
    batch = packed_batch()
    assert worst_document_gap(other, logits(other, **batch), batch) > 1e-3
    # A deep copy of a configured model is configured on its own.
    twin = copy.deepcopy(model)
    assert packing_layout(twin) == NEAT_INDEXED
    assert_packed_matches_documents(twin)


def test_cp_masks_reuse_the_packing_hooks_and_need_them():
    with pytest.raises(ValueError, match="configure_packing"):
        enable_cp_masks(tiny_llama(), None, cp_size=2, cp_rank=0)
    # One cp rank: its share is the whole sequence, so the cp masks are the plain ones.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = configure_packing(tiny_llama())
        enable_cp_masks(model, dist.group.WORLD, cp_size=1, cp_rank=0)
        assert (len(model._forward_pre_hooks), len(model.model._forward_pre_hooks)) == (1, 1)
        assert_packed_matches_documents(model)
        with pytest.raises(ValueError, match="this rank's share"):
            logits(model, input_ids=torch.zeros(1, 4, dtype=torch.int64), attention_mask=torch.ones(1, 5))
    finally:
        dist.destroy_process_group()


# ---- pipeline stages and wrappers -------------------------------------------------------------------


class BatchStage(nn.Module):
    """A stage whose forward takes the whole batch as one dict, like some pipeline schedules call it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.inner = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.inner(**batch, use_cache=False).logits


def test_pipeline_stage_with_pruned_layers():
    model = tiny_llama()
    model.model.layers = model.model.layers[:1]  # the stage keeps one of the two decoder layers
    configure_packing(model)
    assert_packed_matches_documents(model)


def test_inner_decoder_alone():
    model = tiny_llama()
    decoder = configure_packing(model.model)
    assert packing_layout(decoder) == NEAT_INDEXED
    assert packing_layout(model) == NEAT_INDEXED  # the causal LM contains a configured decoder
    assert_packed_matches_documents(decoder)


def test_wrapper_without_attention_mask_argument():
    stage = configure_packing(BatchStage(tiny_llama()))
    assert packing_layout(stage) == NEAT_INDEXED and not stage._forward_pre_hooks
    batch = packed_batch()
    with torch.no_grad():
        packed = stage(batch)
    assert worst_document_gap(stage.inner, packed, batch) < 1e-5


def test_sliding_window_model():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=3,
        attn_implementation="sdpa",
    )
    assert_packed_matches_documents(configure_packing(MistralForCausalLM(config).eval()))


def test_unsupported_models_are_rejected_untouched():
    with pytest.raises(ValueError, match="attention_mask"):
        configure_packing(nn.Linear(4, 4))
    model = tiny_llama()
    model.config._attn_implementation = "flash_attention_2"  # builds its own masks: ours would be ignored
    with pytest.raises(ValueError, match="flash_attention_2"):
        configure_packing(model)
    assert packing_layout(model) is None and not model._forward_pre_hooks
    model = tiny_llama()
    model.config.layer_types = ["chunked_attention"] * model.config.num_hidden_layers
    with pytest.raises(ValueError, match="chunked_attention"):
        configure_packing(model)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_models_mixing_attention_kinds(family):
    """Sliding and full layers in one model: each layer gets the mask of its kind, as the model's own masks do."""
    from meshkd.recipe.modeling.models import load_causal_lm

    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, sliding_window=3)
    extra = {"qwen2": dict(use_sliding_window=True, max_window_layers=1), "gemma2": dict(head_dim=8)}[family]
    model = load_causal_lm(random_init={"model_type": family, **shape, **extra}, seed=0)
    assert len(set(model.config.layer_types)) == 2
    assert_packed_matches_documents(configure_packing(model))


# ---- configure_kd_teacher_packing, same mesh (local check) ------------------------------------------


def test_local_kd_configures_teacher_like_students():
    teacher, student = tiny_llama(seed=1), configure_packing(tiny_llama(seed=2))
    configure_kd_teacher_packing([teacher], [student])
    assert packing_layout(teacher) == NEAT_INDEXED
    assert_packed_matches_documents(teacher)


def test_local_kd_without_packing_leaves_teacher_alone():
    teacher = tiny_llama(seed=1)
    configure_kd_teacher_packing([teacher], [tiny_llama(seed=2)])
    assert packing_layout(teacher) is None and not teacher._forward_pre_hooks


def test_local_kd_disagreements_raise():
    packed, plain = configure_packing(tiny_llama(seed=2)), tiny_llama(seed=3)
    teacher = tiny_llama(seed=1)
    with pytest.raises(ValueError, match=r"student parts disagree.*'neat-indexed' on part 0.*no packing.* on part 1"):
        configure_kd_teacher_packing([teacher], [packed, plain])
    assert packing_layout(teacher) is None  # nothing is configured when the students disagree
    with pytest.raises(ValueError, match=r"students use no packing.*teachers use 'neat-indexed' on part 0"):
        configure_kd_teacher_packing([configure_packing(teacher)], [plain])
    with pytest.raises(ValueError, match="no student parts"):
        configure_kd_teacher_packing([teacher], [])
    with pytest.raises(ValueError, match="no teacher parts"):
        configure_kd_teacher_packing([], [packed])
    with pytest.raises(TypeError, match="sequence of modules"):
        configure_kd_teacher_packing(teacher, [packed])


def test_declared_layouts_are_respected():
    student = tiny_llama(seed=2)
    setattr(student, LAYOUT_ATTR, "some-other-layout")
    with pytest.raises(ValueError, match="some-other-layout"):
        configure_kd_teacher_packing([tiny_llama(seed=1)], [student])


# ---- configure_kd_teacher_packing, separate meshes: 4-rank world --------------------------------------
# Ranks 0-1 hold student parts, ranks 2-3 teacher parts; every rank calls with the control group.

STUDENT_RANKS = (0, 1)
_groups: dict[str, dist.ProcessGroup] = {}


def control_group() -> dist.ProcessGroup:
    if "control" not in _groups:
        _groups["control"] = dist.new_group(list(range(dist.get_world_size())))
    return _groups["control"]


def parts(*, pack_students: bool | dict[int, bool], teacher: nn.Module | None = None):
    """(teacher_parts, student_parts) for this rank."""
    rank = dist.get_rank()
    if rank in STUDENT_RANKS:
        pack = pack_students if isinstance(pack_students, bool) else pack_students[rank]
        student = tiny_llama(seed=10 + rank)
        return [], [configure_packing(student) if pack else student]
    return [teacher if teacher is not None else tiny_llama(seed=1)], []


def check_group_agreement_configures_teachers():
    teachers, students = parts(pack_students=True)
    configure_kd_teacher_packing(teachers, students, control_group())
    for teacher in teachers:
        assert packing_layout(teacher) == NEAT_INDEXED
        assert_packed_matches_documents(teacher)


def check_group_without_packing_leaves_teachers_alone():
    teachers, students = parts(pack_students=False)
    configure_kd_teacher_packing(teachers, students, control_group())
    assert all(packing_layout(teacher) is None for teacher in teachers)


def check_group_student_disagreement_raises_everywhere():
    teachers, students = parts(pack_students={0: True, 1: False})
    with pytest.raises(ValueError, match=r"'neat-indexed' on rank 0 part 0; no packing .* on rank 1 part 0"):
        configure_kd_teacher_packing(teachers, students, control_group())
    assert all(packing_layout(teacher) is None for teacher in teachers)


def check_group_teacher_disagreement_raises_everywhere():
    teacher = configure_packing(tiny_llama(seed=1)) if dist.get_rank() == 3 else None
    teachers, students = parts(pack_students=False, teacher=teacher)
    with pytest.raises(ValueError, match=r"students use no packing.*'neat-indexed' on rank 3 part 0"):
        configure_kd_teacher_packing(teachers, students, control_group())


def check_group_configure_failure_raises_everywhere():
    # Rank 2's teacher part cannot consume an attention mask; its peers must not wait for it forever.
    teacher = nn.Linear(4, 4) if dist.get_rank() == 2 else None
    teachers, students = parts(pack_students=True, teacher=teacher)
    with pytest.raises(ValueError, match=r"failed on rank 2: ValueError: cannot configure NEAT packing on Linear"):
        configure_kd_teacher_packing(teachers, students, control_group())


def check_group_bad_arguments_raise_everywhere():
    teachers, students = parts(pack_students=True)
    if dist.get_rank() == 1:
        students = students[0]  # a bare module instead of a sequence
    with pytest.raises(ValueError, match=r"failed on rank 1: TypeError: student_parts must be a sequence"):
        configure_kd_teacher_packing(teachers, students, control_group())


def check_world_usable_after_errors():
    total = torch.ones(1)
    dist.all_reduce(total, group=control_group())
    dist.all_reduce(total)
    assert total.item() == 4 * dist.get_world_size()


CHECKS = [
    check_group_agreement_configures_teachers,
    check_group_without_packing_leaves_teachers_alone,
    check_group_student_disagreement_raises_everywhere,
    check_group_teacher_disagreement_raises_everywhere,
    check_group_configure_failure_raises_everywhere,
    check_group_bad_arguments_raise_everywhere,
    check_world_usable_after_errors,
]

test_separate_meshes = world_test(4, CHECKS)

