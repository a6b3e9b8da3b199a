"""The demo's greedy completions: teacher, pruned student and trained student, each by its own generate."""

from meshkd.recipe.lifecycle.completions import compare_completions
from meshkd.recipe.modeling import models
from meshkd.recipe.settings.config import ModelConfig
from tests.tiny import tiny_llama


def test_a_student_equal_to_the_teacher_completes_as_the_teacher_and_pruning_changes_the_text(tmp_path):
    section = ModelConfig(**tiny_llama(4, seed=5))
    teacher = models.load_causal_lm(random_init=section.random_init, seed=section.seed)
    models.save_hf_model(teacher, models.byte_tokenizer(), tmp_path / "trained")
    texts = compare_completions(section, [0, 3], {"trained student": tmp_path / "trained"}, "def f(x):",
                                max_new_tokens=12)
    assert list(texts) == ["teacher", "pruned student", "trained student"]
    assert texts["trained student"] == texts["teacher"] and len(texts["teacher"].encode()) >= 1
    assert texts["pruned student"] != texts["teacher"]
