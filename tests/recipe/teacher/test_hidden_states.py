"""Intermediate-layer KD (`kd.hidden_states`): a student identical to its teacher, paired layer for layer, has a
term of exactly 0 and trains as plain KD; with a projection (the widths differ) every layout trains the
one-process curve, a run from the teacher cache follows the live one, and a resumed run continues exactly;
the projection's gradient is the finite differences'; bad configs are refused naming the key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from meshkd.recipe.lifecycle.preflight import preflight
from meshkd.recipe.settings.config import ConfigError, HiddenStatesConfig
from meshkd.recipe.settings.config_loading import config_from_dict
from meshkd.recipe.settings.kd_checks import pairs_of
from meshkd.recipe.teacher.hidden_states import HiddenStateProjections, hidden_state_loss
from tests.recipe.lifecycle.test_recipe import TrainRun
from tests.recipe.teacher.test_teacher_cache import run_all, train_records
from tests.tiny import base_config, tiny_llama, with_layout
from tests.world import run_world

STEPS = 4
PAIRS = [[0, 1], [1, 2]]  # the 2-layer student's layers with the 3-layer teacher's last two


def hidden_config(root: Path, name: str, *, hidden: dict | None, student: dict, teacher: dict | None = None,
                  model: dict | None = None) -> dict:
    config = with_layout(base_config(root), student, teacher)
    config["kd"].update(logits_transport="full")
    if hidden is not None:
        config["kd"]["hidden_states"] = hidden
    if model is not None:
        config["model"] = model
    config["step_scheduler"]["max_steps"] = STEPS
    config["logging"]["run_dir"] = str(root / name)
    return config


def wider_student() -> dict:
    """A 2-layer student 48 wide under the 32-wide teacher: its pairs go through projections."""
    model = tiny_llama(2, seed=1)
    model["random_init"] = {**model["random_init"], "hidden_size": 48}
    return model


def train_curve(config: dict, keys=("loss", "ce_loss", "kd_loss", "hidden_state_loss")) -> list[float]:
    return [record[key] for record in train_records(config) if record["kind"] == "train" for key in keys]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    """One process: an identical student with and without identity pairs; the wider student live, from its cache,
    and stopped after 2 steps then resumed."""
    root = tmp_path_factory.mktemp("hidden_one")
    same = tiny_llama(3, seed=2)  # the teacher's own config
    runs = {name: hidden_config(root, name, hidden=hidden, student={"dp_size": 1}, model=same)
            for name, hidden in (("plain", None), ("identity", {"pairs": [[0, 0], [1, 1], [2, 2]], "loss": "mse"}))}
    runs["lora_identity"] = {**copy.deepcopy(runs["identity"]), "peft": {"rank": 4}}  # B = 0: the base at step 1
    runs["on_policy_identity"] = copy.deepcopy(runs["identity"])
    runs["on_policy_identity"]["kd"].update(mode="on_policy", generation={"prompt_tokens": 8, "max_new_tokens": 8})
    for name in ("lora_identity", "on_policy_identity"):
        runs[name]["logging"]["run_dir"] = str(root / name)
    wider = dict(hidden={"pairs": PAIRS}, student={"dp_size": 1}, model=wider_student())
    runs["one_process"] = hidden_config(root, "one_process", **wider)
    cache = str(root / "cache")
    for name in ("write_cache", "cached"):
        runs[name] = hidden_config(root, name, **wider)
        runs[name]["kd"]["teacher_cache"] = cache
    first = hidden_config(root, "resumed", **wider)
    first["checkpoint"] = {"enabled": True, "save_hf": True}
    first["step_scheduler"].update(max_steps=2, ckpt_every_steps=2)
    first["lr_scheduler"]["total_steps"] = STEPS
    resumed = copy.deepcopy(first)
    resumed["step_scheduler"]["max_steps"] = STEPS
    runs["resume_first"] = first
    run_all(1, runs)
    # Resumed from the first run's checkpoint of step 2, in a world of its own.
    run_world(1, [TrainRun(resumed, resume=True, name="resumed")], timeout_s=60, deadline_s=300).check("resumed")
    return {**runs, "resumed": resumed}


LAYOUTS = {"shared_dp2": ({"dp_size": 2}, None), "shared_tp2": ({"dp_size": 1, "tp_size": 2}, None),
           "shared_cp2": ({"dp_size": 1, "cp_size": 2}, None), "ddp_dp2": ({"dp_size": 2, "strategy": "ddp"}, None),
           "separate": ({"dp_size": 1}, {"dp_size": 1}),
           "separate_teacher_tp2": ({"dp_size": 1}, {"dp_size": 1, "tp_size": 2}),
           "separate_teacher_cp2": ({"dp_size": 1}, {"dp_size": 1, "cp_size": 2}),
           # Teacher layer 1 on the first stage, sent to the last; layer 2 on the last.
           "separate_teacher_pp2": ({"dp_size": 1}, {"dp_size": 1, "pp_size": 2})}


@pytest.fixture(scope="module")
def laid_out(tmp_path_factory) -> dict:
    """The wider student in each layout: two-rank worlds, then three-rank ones (a teacher over two ranks)."""
    root = tmp_path_factory.mktemp("hidden_layouts")
    runs = {name: hidden_config(root, name, hidden={"pairs": PAIRS}, student=student, teacher=teacher,
                                model=wider_student()) for name, (student, teacher) in LAYOUTS.items()}
    three = ("separate_teacher_tp2", "separate_teacher_cp2", "separate_teacher_pp2")
    run_all(2, {name: config for name, config in runs.items() if name not in three})
    run_all(3, {name: runs[name] for name in three})
    return runs


@pytest.mark.world
def test_an_identical_student_paired_layer_for_layer_has_a_zero_term_and_trains_as_plain_kd(one_rank):
    plain, identity = train_records(one_rank["plain"]), train_records(one_rank["identity"])
    first = next(record for record in identity if record["kind"] == "train")
    assert first["hidden_state_loss"] == 0.0  # exactly: the same outputs, float32 on the wire
    # Its gradient is 0 too: the first update is plain KD's, so the second step's CE and KD are plain KD's.
    steps = {record["step"]: record for record in identity if record["kind"] == "train"}
    reference = {record["step"]: record for record in plain if record["kind"] == "train"}
    assert steps[1]["loss"] == reference[1]["loss"]
    assert (steps[2]["ce_loss"], steps[2]["kd_loss"]) == (reference[2]["ce_loss"], reference[2]["kd_loss"])
    assert steps[2]["hidden_state_loss"] > 0  # the student has moved away from the teacher


@pytest.mark.world
@pytest.mark.parametrize("run", ["lora_identity", "on_policy_identity"])
def test_a_lora_student_and_on_policy_rows_have_the_term_too(one_rank, run):
    """A LoRA student starts as its base, and on-policy rows are the student's own completions: paired with an
    identical teacher, both have a term of exactly 0 at step 1, then the student moves away."""
    losses = [record["hidden_state_loss"] for record in train_records(one_rank[run]) if record["kind"] == "train"]
    assert losses[0] == 0.0 and losses[-1] > 0


@pytest.mark.world
def test_the_term_trains_the_paired_layers_towards_the_teachers(one_rank):
    losses = [record["hidden_state_loss"] for record in train_records(one_rank["one_process"])
              if record["kind"] == "train"]
    assert len(losses) == STEPS and all(loss > 0 for loss in losses)
    loss_weighted = [record["loss"] for record in train_records(one_rank["one_process"]) if record["kind"] == "train"]
    without = [0.5 * record["ce_loss"] + 0.5 * record["kd_loss"] for record in train_records(one_rank["one_process"])
               if record["kind"] == "train"]
    assert loss_weighted == pytest.approx([a + b for a, b in zip(without, losses)], rel=1e-6)


@pytest.mark.world
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_trains_the_one_process_curve(one_rank, laid_out, layout):
    reference, curve = train_curve(one_rank["one_process"]), train_curve(laid_out[layout])
    assert curve[:4] == pytest.approx(reference[:4], rel=1e-5)
    assert curve == pytest.approx(reference, rel=1e-4)


@pytest.mark.world
def test_a_run_from_the_cache_follows_the_live_teacher(one_rank):
    assert train_curve(one_rank["cached"]) == pytest.approx(train_curve(one_rank["one_process"]), abs=1e-6)


@pytest.mark.world
def test_a_resumed_run_continues_exactly(one_rank):
    from torch.distributed.checkpoint import FileSystemReader

    assert train_curve(one_rank["resumed"]) == train_curve(one_rank["one_process"])
    saved = FileSystemReader(str(Path(one_rank["resumed"]["logging"]["run_dir"], "checkpoints", "step_00000002"))
                             ).read_metadata().state_dict_metadata
    assert {key for key in saved if "hidden_state_projections" in key}, "the projections are in the checkpoint"


@pytest.mark.world
def test_the_export_is_the_student_alone(one_rank):
    from transformers import AutoModelForCausalLM

    from meshkd.recipe.modeling.models import load_causal_lm
    from tests.recipe.modeling.test_export import num_parameters

    exported = AutoModelForCausalLM.from_pretrained(Path(one_rank["resumed"]["logging"]["run_dir"], "hf_student"))
    assert exported.config.hidden_size == 48
    assert num_parameters(exported) == num_parameters(load_causal_lm(random_init=wider_student()["random_init"]))


# ---------------------------------------------------------------------------------------------------------
# The term, the projection, the pairs and the refusals: no process group


@pytest.mark.parametrize("loss", ["mse", "cosine"])
def test_the_projections_gradient_is_the_finite_differences(loss):
    torch.manual_seed(0)
    projections = HiddenStateProjections([(0, 0), (1, 1)], student_width=5, teacher_width=3).double()
    names = [name for name, _ in projections.named_parameters()]
    student = [torch.randn(2, 4, 5, dtype=torch.float64) for _ in names]
    teacher = torch.randn(2, 4, 2, 3, dtype=torch.float64)
    counted = torch.rand(2, 4, generator=torch.Generator().manual_seed(1)) > 0.3

    def term(*weights):
        def projected(index: int, hidden: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(projections, dict(zip(names, weights)), (index, hidden))
        return hidden_state_loss(student, teacher, counted, loss=loss, norm=7.0, projections=projected)

    weights = tuple(torch.randn_like(parameter, requires_grad=True) for parameter in projections.parameters())
    assert torch.autograd.gradcheck(term, weights)


def test_a_projection_starts_as_the_shared_coordinates():
    projections = HiddenStateProjections([(0, 0)], student_width=4, teacher_width=3)
    hidden = torch.arange(8.0).reshape(2, 4)
    assert torch.equal(projections(0, hidden), hidden[:, :3])
    assert not list(HiddenStateProjections([(0, 0)], student_width=4, teacher_width=4).parameters())


def test_kept_pairs_each_kept_layer_with_the_teacher_layer_it_came_from():
    assert pairs_of(HiddenStatesConfig(pairs="kept"), [0, 3, 5]) == [(0, 0), (1, 3), (2, 5)]
    assert pairs_of(HiddenStatesConfig(pairs=[[1, 4]]), None) == [(1, 4)]


def test_the_term_counts_the_positions_kd_counts():
    student = [torch.zeros(1, 3, 2)]
    teacher = torch.tensor([[[[1.0, 1.0]], [[2.0, 2.0]], [[3.0, 3.0]]]])  # [rows, sequence, pairs, width]
    counted = torch.tensor([[True, False, True]])
    assert hidden_state_loss(student, teacher, counted, loss="mse", norm=2.0).item() == pytest.approx((1 + 9) / 2)
    assert hidden_state_loss([teacher[:, :, 0] * 3], teacher, counted, loss="cosine", norm=2.0).item() == \
        pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("changes, message", [
    ({"kd": {"hidden_states": {"pairs": "kept"}}}, r"kd\.hidden_states\.pairs: kept pairs the layers model\."
                                                   r"keep_layers kept"),
    ({"kd": {"hidden_states": {"pairs": [[0, 1, 2]]}}}, r"kd\.hidden_states\.pairs must be a non-empty list"),
    ({"kd": {"hidden_states": {"pairs": [[0, 0]], "loss": "l1"}}}, r"kd\.hidden_states\.loss must be mse or cosine"),
    ({"kd": {"hidden_states": {"pairs": [[0, 0]], "weight": -1.0}}}, r"kd\.hidden_states\.weight must be"),
    ({"kd": {"hidden_states": {"pairs": [[0, 0]]}, "cross_tokenizer": {}}}, r"kd\.hidden_states with kd\."
                                                                             r"cross_tokenizer"),
    ({"kd": {"hidden_states": {"pairs": [[0, 0]]}}, "distributed": {"dp_size": 1, "pp_size": 2}},
     r"kd\.hidden_states with distributed\.pp_size\(2\) > 1 is not supported"),
    ({"kd": {"hidden_states": {"pairs": [[0, 0]]}}, "teacher_model": None,
      "teachers": [{"name": "a", "model": tiny_llama(3, seed=2)}, {"name": "b", "model": tiny_llama(3, seed=3)}]},
     r"kd\.hidden_states does not yet work with several teachers"),
])
def test_bad_hidden_state_settings_are_refused_naming_the_key(tmp_path, changes, message):
    config = base_config(tmp_path)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        elif value is None:
            config.pop(key)
        else:
            config[key] = value
    with pytest.raises(ConfigError, match=message):
        config_from_dict(config)


@pytest.mark.parametrize("pairs, message", [([[2, 0]], r"kd\.hidden_states\.pairs \[\[2, 0\]\]: the student has 2 "
                                                      r"decoder layers, \[0, 2\)"),
                                           ([[0, 3]], r"the teacher has 3 decoder layers")])
def test_a_layer_out_of_range_is_refused_before_any_process_starts(tmp_path, pairs, message):
    config = base_config(tmp_path)
    config["kd"]["hidden_states"] = {"pairs": pairs}
    with pytest.raises(ConfigError, match=message):
        preflight(config_from_dict(config))
