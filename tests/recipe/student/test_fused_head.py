"""`kd.fused_output_loss` (on by default, `meshkd.recipe.student.fused_head`): the output layer applied inside the
loss trains the curve of whole logits, for full and top-k answers (exact and compact), a tied output layer, a LoRA
student, a dp 2 student under FSDP2, a cp 2, a tp 2 and a pp 2 student (tied too), CE alone, a bfloat16
(mixed-precision) student, two teachers combined by sum, mixture or route (with each teacher's figures) and a
teacher of another tokenizer by uld and gold (groups of several tokens across chunks); where it does not apply, the
step computes whole logits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.recipe.lifecycle.test_recipe import TrainRun
from tests.recipe.teacher.test_teacher_cache import COMPACT, TOPK, train_records
from tests.tiny import base_config, with_layout
from tests.world import run_world

pytestmark = pytest.mark.world

# name: (kd keys, the student's random_init keys, its model keys, other top-level keys)
CASES = {"full": ({}, {}, {}, {}), "topk": (TOPK, {}, {}, {}), "compact": (COMPACT, {}, {}, {}),
         "tied": (TOPK, {"tie_word_embeddings": True}, {}, {}), "ce_only": ({"kd_ratio": 0.0}, {}, {}, {}),
         "reverse_kl": ({"divergence": "reverse_kl"}, {}, {}, {}), "bfloat16": (TOPK, {}, {"dtype": "bfloat16"}, {}),
         "lora": (TOPK, {}, {}, {"peft": {"rank": 4, "alpha": 8.0}})}
TEACHER_CASES = ("sum", "mixture", "route")
CROSS_CASES = ("uld", "gold")
BFLOAT16_REL = 5e-3
"""A bfloat16 student's fused and whole-logits losses after its first step agree to this (measured: 1.8e-3 at
step 5): the first step's values are equal, but the output weight's gradient is accumulated in float32 from the
chunks' bfloat16 values where autocast rounds the whole sum to bfloat16 once (first grad_norm: 1.01921 against
1.01960; the float32 run's is 1.01726), and Adam carries the difference on."""


def runs_of(tmp, world: int, student: dict) -> dict[str, dict]:
    base = base_config(tmp)
    runs = {}
    for name, (kd, init, model, top_level) in CASES.items():
        for fused in (True, False):
            config = {**with_layout(base, student, None), **top_level}
            config["kd"].update(kd, fused_output_loss=fused, chunk_size=16)  # several chunks a micro-batch
            config["model"]["random_init"].update(init)
            config["model"].update(model)
            config["logging"]["run_dir"] = str(tmp / f"{name}_{'fused' if fused else 'whole'}")
            runs[f"{name}_{'fused' if fused else 'whole'}"] = config
    return runs


def teachers_runs(tmp) -> dict[str, dict]:
    """Two different teachers combined by sum and mixture (full answers), and routed (top-k answers)."""
    from tests.recipe.teacher.test_teachers import (
        MIXED,
        llama_teacher,
        qwen_teacher,
        routed_corpus,
        teacher,
        with_teachers,
    )

    corpus = routed_corpus(tmp / "routed_corpus")
    runs = {}
    for combine in TEACHER_CASES:
        for fused in (True, False):
            name = f"{combine}_{'fused' if fused else 'whole'}"
            kd = {"logits_transport": "topk", "topk": 16, "topk_tail_samples": 4} if combine == "route" else {}
            teachers = MIXED if combine != "route" else [teacher("code", llama_teacher(), 1.0),
                                                         teacher("prose", qwen_teacher(), 1.0)]  # weights unused
            config = with_teachers(tmp / name, {"dp_size": 1}, teachers, combine=combine, fused_output_loss=fused,
                                   chunk_size=16, **kd)
            if combine == "route":
                config["dataset"].update(paths=[corpus["both"]], teacher_key="teacher")
            runs[name] = config
    return runs


def cross_tokenizer_runs(tmp) -> dict[str, dict]:
    """A teacher of another tokenizer, its answers per aligned group (uld, gold); chunks of 8 tokens, so that
    groups of several student tokens straddle chunks."""
    from tests.recipe.teacher.test_cross_tokenizer import cross_config

    runs = {}
    for loss in CROSS_CASES:
        for fused in (True, False):
            name = f"{loss}_{'fused' if fused else 'whole'}"
            config = cross_config(tmp / name, {"dp_size": 1}, None)
            config["kd"]["cross_tokenizer"]["loss"] = loss
            config["kd"].update(fused_output_loss=fused, chunk_size=8)
            runs[name] = config
    return runs


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    runs = runs_of(tmp_path_factory.mktemp("fused"), 1, {"dp_size": 1})
    runs |= teachers_runs(tmp_path_factory.mktemp("fused_teachers"))
    runs |= cross_tokenizer_runs(tmp_path_factory.mktemp("fused_cross"))
    dp2 = runs_of(tmp_path_factory.mktemp("fused_dp2"), 2, {"dp_size": 2})
    results = run_world(1, [_named(TrainRun(config), name) for name, config in runs.items()], timeout_s=60,
                        deadline_s=600)
    for name in runs:
        results.check(name)
    cp2 = runs_of(tmp_path_factory.mktemp("fused_cp2"), 2, {"dp_size": 1, "cp_size": 2})
    tp2 = runs_of(tmp_path_factory.mktemp("fused_tp2"), 2, {"dp_size": 1, "tp_size": 2})
    pp2 = runs_of(tmp_path_factory.mktemp("fused_pp2"), 2, {"dp_size": 1, "pp_size": 2})
    chosen = {f"{layout}_{name}_{kind}": runs[f"{name}_{kind}"]
              for layout, runs, names in (("dp2", dp2, ("topk",)), ("cp2", cp2, ("topk",)), ("tp2", tp2, ("topk",)),
                                          ("pp2", pp2, ("topk", "tied"))) for name in names
              for kind in ("fused", "whole")}
    results = run_world(2, [_named(TrainRun(config), name) for name, config in chosen.items()],
                        timeout_s=60, deadline_s=400)
    for name in chosen:
        results.check(name)
    return runs | chosen


def _named(check, name: str):
    check.__name__ = name
    return check


LAYOUTS = ("dp2_topk", "cp2_topk", "tp2_topk", "pp2_topk", "pp2_tied")


@pytest.mark.parametrize("case", [*CASES, *TEACHER_CASES, *CROSS_CASES, *LAYOUTS])
def test_the_fused_output_layer_trains_the_curve_of_whole_logits(one_rank, case):
    fused, whole = (train_records(one_rank[f"{case}_{kind}"]) for kind in ("fused", "whole"))
    assert [(r["kind"], r["step"]) for r in fused] == [(r["kind"], r["step"]) for r in whole]
    assert [sorted(r) for r in fused] == [sorted(r) for r in whole]
    if case == "bfloat16":
        steps = [(mine, theirs) for mine, theirs in zip(fused, whole) if mine["kind"] == "train"]
        (first, reference), later = steps[0], steps[1:]
        assert [first[key] for key in ("loss", "ce_loss", "kd_loss")] == pytest.approx(
            [reference[key] for key in ("loss", "ce_loss", "kd_loss")], rel=1e-5, abs=1e-6)
        assert first["grad_norm"] == pytest.approx(reference["grad_norm"], rel=2e-3)
        assert [mine["loss"] for mine, _ in later] == pytest.approx([theirs["loss"] for _, theirs in later],
                                                                     rel=BFLOAT16_REL)
        return
    for record, reference in zip(fused, whole):
        for key, value in reference.items():
            if key.startswith("teacher_wait_s/"):  # each teacher's wait: a time
                continue
            if isinstance(value, float) and key != "grad_norm" and not key.endswith("perplexity"):
                assert record[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, record, reference)
            elif isinstance(value, float):
                assert record[key] == pytest.approx(value, rel=1e-4), (key, record, reference)


def test_it_applies_where_the_logits_reach_the_loss_as_the_head_makes_them_and_never_makes_them_whole(tmp_path):
    """`FusedHead.of`: a plain float32 or bfloat16 student gets one (computing in its dtype), and a pipeline's last
    stage (told to hand its last hidden states); a stage before the last, a model that soft-caps its logits, or
    `kd.fused_output_loss: false` do not. The step asks the student for its last hidden states and calls the loss
    on them: the value and the output layer's gradient of whole logits, with no [tokens, vocab] tensor made in
    forward or backward; an evaluation gets each chunk's logits; a model that changes its logits after its output
    layer is stopped at its first forward, naming the key."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaForCausalLM

    from meshkd.core.loss import cross_entropy_loss
    from meshkd.recipe.settings.config import ConfigError
    from meshkd.recipe.settings.config_loading import config_from_dict
    from meshkd.recipe.student.fused_head import FusedHead
    from meshkd.recipe.teacher.teacher_answers import LossContext
    from tests.tiny import tiny_llama_model

    config = config_from_dict(base_config_for_check(tmp_path))
    ce_only = config_from_dict(base_config_for_check(tmp_path, kd_ratio=0.0, chunk_size=8))
    plain = SimpleNamespace(tp_size=1, cp_size=1)
    model = tiny_llama_model(vocab=262)
    assert FusedHead.of(model, config, plain, None, 262) is not None
    head = FusedHead.of(model, ce_only, plain, None, 262)
    last = SimpleNamespace(causal_lm=model, hands_hidden_states=False)
    assert FusedHead.of(None, config, plain, last, 262) is not None and last.hands_hidden_states
    first = SimpleNamespace(causal_lm=SimpleNamespace(config=model.config, get_output_embeddings=torch.nn.Identity),
                            hands_hidden_states=False)
    assert FusedHead.of(None, config, plain, first, 262) is None and not first.hands_hidden_states
    bfloat16 = base_config_for_check(tmp_path)
    bfloat16["model"]["dtype"] = "bfloat16"
    assert FusedHead.of(model, config_from_dict(bfloat16), plain, None, 262).compute_dtype == torch.bfloat16
    off = base_config_for_check(tmp_path)
    off["kd"]["fused_output_loss"] = False
    assert FusedHead.of(model, config_from_dict(off), plain, None, 262) is None
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=262, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    assert FusedHead.of(gemma, config, plain, None, 262) is None
    granite = GraniteForCausalLM(GraniteConfig(vocab_size=262, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    assert FusedHead.of(granite, config, plain, None, 262) is None  # its logits are divided by logits_scaling
    ids = torch.randint(0, 262, (3, 16))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": torch.arange(16).repeat(3, 1),
             "attention_mask": torch.ones(3, 16, dtype=torch.int64)}
    whole = cross_entropy_loss(model(input_ids=ids, position_ids=batch["position_ids"]).logits, batch["labels"],
                               num_valid_tokens=48)
    whole.backward()
    expected = model.lm_head.weight.grad.clone()
    model.zero_grad()

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for value in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(value, torch.Tensor):
                    self.largest = max(self.largest, value.numel())
            return out

    with LargestTensor() as watched:
        hidden = head.hidden_states(model, None, batch)
        loss, values = head.loss(hidden, batch, None, LossContext(ce_only.kd), norm=torch.tensor(48.0))
        loss.backward()
    assert tuple(hidden.shape) == (3, 16, 32)
    whole = float(whole.detach())
    assert float(loss.detach()) == pytest.approx(whole, rel=1e-6)
    assert float(values["ce_loss"]) == pytest.approx(whole, rel=1e-6)
    torch.testing.assert_close(model.lm_head.weight.grad, expected, rtol=1e-5, atol=1e-7)
    assert watched.largest < 48 * 262  # the weight's gradient [262, 32] at most, never the 48 tokens' logits
    chunks = []  # an evaluation: each chunk's logits handed on, none made whole
    with torch.no_grad():
        head.evaluate(head.hidden_states(model, None, batch), lambda logits, tokens: chunks.append(
            (tuple(logits.shape), tokens)))
    assert [shape for shape, _ in chunks] == [(8, 262)] * 6
    assert [tokens.start for _, tokens in chunks] == [0, 8, 16, 24, 32, 40]

    class Halving(LlamaForCausalLM):  # changes its logits after its output layer, unknown to LOGIT_TRANSFORMS
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.logits = output.logits / 2
            return output

    halving = Halving(model.config)
    scaled = FusedHead.of(halving, ce_only, plain, None, 262)
    with pytest.raises(ConfigError, match=r"kd.fused_output_loss: Halving changes its logits after its "
                                          r"output layer.*set kd.fused_output_loss: false"):
        scaled.hidden_states(halving, None, batch)


def base_config_for_check(tmp_path, **kd) -> dict:
    config = base_config(tmp_path)
    config["kd"].update(kd)
    return config
