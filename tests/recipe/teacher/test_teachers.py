"""Several teachers at once (`teachers`): how their answers combine, and that no layout changes the curve.

Two identical teachers at weights 0.5 / 0.5 are one teacher, whichever way they combine; a teacher of weight 0
drops out; two different teachers (a Llama and a Qwen2) on ranks of their own, each in its own layout, or one
on the student's ranks beside another on its own, train the curve of the same two teachers in one process;
a resumed run continues it exactly. Routed rows (`kd.combine: route`) reach only the teacher their documents
name, counted against the rows each step draws. Bad `teachers` configs are refused naming the key.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from meshkd.core.topology import validate_teacher_layouts
from meshkd.recipe.settings.config import ConfigError
from meshkd.recipe.settings.config_loading import config_from_dict
from meshkd.recipe.settings.layout_checks import required_world_size
from tests.recipe.lifecycle.test_recipe import RecipeRuns, TrainRun, config_world_size, curve
from tests.tiny import STEPS, base_config, tiny_llama
from tests.world import WorldsBySize


def llama_teacher() -> dict:
    return tiny_llama(3, seed=2)  # base_config's teacher


def qwen_teacher() -> dict:
    section = tiny_llama(3, seed=5)
    section["random_init"]["model_type"] = "qwen2"
    return section


def with_teachers(tmp: Path, student: dict, teachers: list[dict], **kd) -> dict:
    """base_config with `teachers` (name, model, weight, distributed?) in place of its teacher_model."""
    config = base_config(tmp)
    del config["teacher_model"]
    config["distributed"] = student
    config["teachers"] = copy.deepcopy(teachers)
    config["kd"].update(kd)
    return config


def teacher(name: str, model: dict, weight: float, layout: dict | None = None) -> dict:
    return {"name": name, "model": model, "weight": weight, **({"distributed": layout} if layout else {})}


ONE_PROCESS = {"dp_size": 1}
MIXED = [teacher("code", llama_teacher(), 0.7), teacher("prose", qwen_teacher(), 0.3)]


def teachers_runs(tmp: Path) -> dict[str, tuple[dict, bool]]:
    one = base_config(tmp / "one")
    one["distributed"] = ONE_PROCESS
    runs = {"one_teacher": (one, False)}
    runs["list_of_one"] = (with_teachers(tmp / "list_of_one", ONE_PROCESS, [teacher("code", llama_teacher(), 1.0)]),
                           False)
    twins = [teacher("a", llama_teacher(), 0.5), teacher("b", llama_teacher(), 0.5)]
    for combine in ("sum", "mixture"):
        runs[f"twins_{combine}"] = (with_teachers(tmp / f"twins_{combine}", ONE_PROCESS, twins, combine=combine),
                                    False)
        # Teacher "other" (a Qwen2) weighs nothing: the Llama's curve alone.
        dropped = [teacher("other", qwen_teacher(), 0.0), teacher("kept", llama_teacher(), 2.0)]
        runs[f"weight_zero_{combine}"] = (with_teachers(tmp / f"weight_zero_{combine}", ONE_PROCESS, dropped,
                                                        combine=combine), False)
        runs[f"reference_{combine}"] = (with_teachers(tmp / f"reference_{combine}", ONE_PROCESS, MIXED,
                                                      combine=combine), False)
    # Each teacher in a layout of its own beside a data-parallel student: 2 + 2 + 2 ranks.
    own = [{**MIXED[0], "distributed": {"dp_size": 1, "tp_size": 2}},
           {**MIXED[1], "distributed": {"dp_size": 1, "pp_size": 2}}]
    runs["tp2_and_pp2_sum"] = (with_teachers(tmp / "tp2_and_pp2", {"dp_size": 2}, own), False)
    # One teacher on the student's ranks, the other on a rank of its own.
    shared_and_own = [MIXED[0], {**MIXED[1], "distributed": {"dp_size": 1}}]
    for combine in ("sum", "mixture"):
        runs[f"shared_and_own_{combine}"] = (with_teachers(tmp / f"shared_and_own_{combine}", ONE_PROCESS,
                                                           shared_and_own, combine=combine), False)
    # Stopped after step 3 of 5 (latest checkpoint: step 2), then resumed to the end.
    config = with_teachers(tmp / "resume", ONE_PROCESS, shared_and_own)
    config["checkpoint"] = {"enabled": True, "save_hf": False}
    config["step_scheduler"]["ckpt_every_steps"] = 2
    first = copy.deepcopy(config)
    first["step_scheduler"]["max_steps"] = 3
    first["lr_scheduler"]["total_steps"] = STEPS
    runs["resume_first"] = (first, False)
    runs["resume"] = (config, True)

    # On-policy: every teacher scores the student's completions (twins: the one teacher's curve).
    on_policy = {"mode": "on_policy", "on_policy_fraction": 0.5, "generation": {"prompt_tokens": 8,
                                                                                 "max_new_tokens": 12}}
    one_on_policy = copy.deepcopy(one)
    one_on_policy["kd"].update(copy.deepcopy(on_policy))
    one_on_policy["logging"]["run_dir"] = str(tmp / "one_on_policy" / "run")
    runs["one_teacher_on_policy"] = (one_on_policy, False)
    config = with_teachers(tmp / "twins_on_policy", ONE_PROCESS, [twins[0], {**twins[1], "distributed":
                                                                             {"dp_size": 1}}],
                           **copy.deepcopy(on_policy))
    runs["twins_on_policy"] = (config, False)

    # Teacher "prose" sends top-16 answers (with 4 tail samples) from a rank of its own; "code" full ones.
    topk_prose = [MIXED[0], {**MIXED[1], "distributed": {"dp_size": 1}, "logits_transport": "topk"}]
    runs["prose_topk"] = (with_teachers(tmp / "prose_topk", ONE_PROCESS, topk_prose, topk=16, topk_tail_samples=4),
                          False)

    # Teacher "prose" read from a cache it wrote as tp 2, beside "code" live on a rank of its own.
    runs["prose_cached"] = (cached_prose(tmp), False)

    # Routing: documents that all name "code" (the Llama alone), and documents of both teachers.
    corpus = routed_corpus(tmp / "routed_corpus")
    single = base_config(tmp / "routed_single")
    single["distributed"], single["dataset"]["paths"] = ONE_PROCESS, [corpus["code"]]
    runs["routed_single_teacher"] = (single, False)
    routed = [teacher("code", llama_teacher(), 1.0), teacher("prose", qwen_teacher(), 1.0)]
    config = with_teachers(tmp / "routed_all_code", ONE_PROCESS, routed, combine="route")
    config["dataset"].update(paths=[corpus["code"]], teacher_key="teacher")
    runs["routed_all_code"] = (config, False)
    for name, student, teachers in (("routed_reference", ONE_PROCESS, routed),
                                    ("routed_layout", {"dp_size": 2}, [{**routed[0], "distributed": {"dp_size": 1}},
                                                                       routed[1]])):
        config = with_teachers(tmp / name, student, teachers, combine="route", logits_transport="topk", topk=16,
                               topk_tail_samples=4)
        config["dataset"].update(paths=[corpus["both"]], teacher_key="teacher")
        runs[name] = (config, False)
    # The same routed rows read from a token store.
    stored = copy.deepcopy(runs["routed_reference"][0])
    stored["dataset"]["token_store"] = str(tmp / "routed_store" / "tokens")
    stored["logging"]["run_dir"] = str(tmp / "routed_store" / "run")
    runs["routed_stored"] = (stored, False)
    # Whole logits in every run (`kd.fused_output_loss: false`), so that runs whose sums are made in other orders
    # (one teacher against two, one process against layouts) may agree to the last digits (the fused layer's own
    # agreement with whole logits, several teachers' too: tests/recipe/student/test_fused_head.py).
    for config, _ in runs.values():
        config["kd"]["fused_output_loss"] = False
    return runs


def cached_prose(tmp: Path) -> dict:
    teachers = [{**MIXED[0], "distributed": {"dp_size": 1}},
                {**MIXED[1], "distributed": {"dp_size": 1, "tp_size": 2}, "cache": str(tmp / "prose_cache")}]
    return with_teachers(tmp / "prose_cached", ONE_PROCESS, teachers)


class WriteTeacherCache:
    """A check that writes teacher `name`'s cache as `meshkd cache-teacher CONFIG --teacher NAME` does."""

    def __init__(self, config: dict, name: str) -> None:
        self.config, self.name, self.__name__ = config, name, f"write_cache_{name}"

    def world_size(self) -> int:
        config = config_from_dict(self.config)
        layout = config.layout_of(config.teacher_named(self.name))
        return layout.dp_size * layout.tp_size * layout.cp_size * layout.pp_size

    def __call__(self) -> None:
        from meshkd.commands import cached_teacher
        from meshkd.recipe.lifecycle.cache_writer import cache_teacher

        config = config_from_dict(self.config)
        cache_teacher(config, cached_teacher(config, self.name), shard_rows=3)


class TeachersRuns(RecipeRuns):
    """`RecipeRuns` whose worlds first write the caches of `writes` (each a `WriteTeacherCache`)."""

    def __init__(self, runs: dict[str, tuple[dict, bool]], writes: list[WriteTeacherCache]) -> None:
        self.configs = {name: config for name, (config, _) in runs.items()}
        trains = [(config_world_size(config), TrainRun(config, resume, name=name))
                  for name, (config, resume) in runs.items()]
        self._worlds = WorldsBySize([(write.world_size(), write) for write in writes] + trains)


def routed_corpus(directory: Path) -> dict[str, str]:
    """JSONL files: "code" (every document names the teacher "code") and "both" (code and prose documents)."""
    directory.mkdir(parents=True)
    documents = [f"def f{index}():\n    return {index * 7 % 23}\n" for index in range(24)]
    prose = [f"The {index}th word is w{index * 5 % 17}, and so on. " * 2 for index in range(24)]
    files = {"code": [{"text": text, "teacher": "code"} for text in documents],
             "both": [{"text": text, "teacher": name} for pair in zip(documents, prose)
                      for text, name in zip(pair, ("code", "prose"))]}
    for name, records in files.items():
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return {name: str(directory / f"{name}.jsonl") for name in files}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> RecipeRuns:
    runs = teachers_runs(tmp_path_factory.mktemp("teachers"))
    return TeachersRuns(runs, [WriteTeacherCache(runs["prose_cached"][0], "prose")])


def train(records: list[dict]) -> list[dict]:
    return [record for record in records if record["kind"] == "train"]


@pytest.mark.world
@pytest.mark.parametrize("combine", ["sum", "mixture"])
def test_two_identical_teachers_at_half_weight_each_are_one_teacher(runs, combine):
    one, twins = runs.records("one_teacher"), runs.records(f"twins_{combine}")
    assert curve(twins) == pytest.approx(curve(one), rel=1e-6, abs=1e-9)
    for record in train(twins):  # each teacher's own divergence is the one teacher's
        assert record["kd_loss/a"] == pytest.approx(record["kd_loss"], rel=1e-6)
        assert record["kd_loss/b"] == pytest.approx(record["kd_loss"], rel=1e-6)
        assert record["teacher_wait_s/a"] >= 0 and record["teacher_wait_s/b"] >= 0
    first = twins[0]
    assert first["kind"] == "eval" and first["teacher_val_loss/a"] == pytest.approx(first["teacher_val_loss"])
    assert first["val_kl/b"] == pytest.approx(one[0]["val_kl"], rel=1e-6)


@pytest.mark.world
def test_one_teacher_given_as_a_list_of_one_is_the_one_teacher_run(runs):
    def figures(records: list[dict]) -> list[dict]:  # all but the timings
        return [{key: value for key, value in record.items() if not key.endswith("_s")}
                for record in records]

    one, listed = runs.records("one_teacher"), runs.records("list_of_one")
    assert figures(listed) == figures(one)  # the same figures under the same keys: no per-teacher keys


@pytest.mark.world
@pytest.mark.parametrize("combine", ["sum", "mixture"])
def test_a_teacher_of_weight_zero_drops_out(runs, combine):
    records = runs.records(f"weight_zero_{combine}")
    assert curve(records) == pytest.approx(curve(runs.records("one_teacher")), rel=1e-6, abs=1e-9)
    # Still asked, and still scored: its divergence is logged, its weight in the evaluation's means 0.
    assert all(record["kd_loss/other"] != record["kd_loss/kept"] for record in train(records))
    assert records[0]["teacher_val_loss"] == pytest.approx(records[0]["teacher_val_loss/kept"])


@pytest.mark.world
def test_the_two_combining_rules_differ_for_different_teachers(runs):
    summed, mixed = runs.records("reference_sum"), runs.records("reference_mixture")
    for record in train(summed):  # the sum is the weighted sum of the logged divergences
        assert record["kd_loss"] == pytest.approx(0.7 * record["kd_loss/code"] + 0.3 * record["kd_loss/prose"])
    first_mixed = train(mixed)[0]
    # The KL to a mixture is at most the mixture of the KLs (convexity), and here strictly less.
    assert first_mixed["kd_loss"] < 0.7 * first_mixed["kd_loss/code"] + 0.3 * first_mixed["kd_loss/prose"]


@pytest.mark.world
@pytest.mark.parametrize("name, combine", [("tp2_and_pp2_sum", "sum"), ("shared_and_own_sum", "sum"),
                                           ("shared_and_own_mixture", "mixture")])
def test_teachers_in_their_own_layouts_train_the_one_process_curve(runs, name, combine):
    reference, laid_out = curve(runs.records(f"reference_{combine}")), curve(runs.records(name))
    assert laid_out[:3] == pytest.approx(reference[:3], rel=1e-5)
    assert laid_out == pytest.approx(reference, rel=1e-4)


@pytest.mark.world
def test_a_resumed_run_with_two_teachers_continues_the_curve_exactly(runs):
    runs.records("resume_first")
    resumed = [record for record in train(runs.records("resume")) if record["step"] > 2]
    assert [record["step"] for record in resumed] == [3, 4, 5]
    assert curve(resumed) == pytest.approx(curve(runs.records("shared_and_own_sum"))[6:], rel=1e-4)


# ---------------------------------------------------------------------------------------------------------
# Bad configs, refused at load naming the key


def refusal(tmp_path: Path, change) -> str:
    config = with_teachers(tmp_path, ONE_PROCESS, MIXED)
    change(config)
    with pytest.raises(ConfigError) as raised:
        config_from_dict(config)
    return str(raised.value)


CASES = {
    "teacher_model beside teachers": (lambda c: c.update(teacher_model=llama_teacher()), "teachers replaces "
                                      "teacher_model"),
    "two teachers of one name": (lambda c: c["teachers"][1].update(name="code"), "teachers[1].name 'code'"),
    "a name that is no name": (lambda c: c["teachers"][0].update(name="a b"), "teachers[0].name"),
    "a negative weight": (lambda c: c["teachers"][1].update(weight=-1), "teachers.prose.weight"),
    "every weight 0": (lambda c: [t.update(weight=0) for t in c["teachers"]], "every weight is 0"),
    "no teacher": (lambda c: c.update(teachers=[]), "teachers is empty"),
    "an unknown rule": (lambda c: c["kd"].update(combine="max"),
                        "kd.combine must be one of mixture, route, sum, got 'max'"),
    "routing without the field": (lambda c: c["kd"].update(combine="route"), "it needs dataset.teacher_key"),
    "the field without routing": (lambda c: c["dataset"].update(teacher_key="teacher"),
                                  "dataset.teacher_key routes rows to their teachers: it needs a kd.combine that "
                                  "does (route), not sum"),
    "weights of routed teachers": (lambda c: (c["kd"].update(combine="route"),
                                              c["dataset"].update(teacher_key="teacher")),
                                   "teachers.code.weight: with kd.combine route"),
    "routed teachers of two transports": (lambda c: (c["kd"].update(combine="route"),
                                                     c["dataset"].update(teacher_key="teacher"),
                                                     [t.update(weight=1.0) for t in c["teachers"]],
                                                     c["teachers"][0].update(logits_transport="topk")),
                                          "give every teacher the same logits_transport"),
    "routing to one teacher": (lambda c: (c.update(teachers=[{**c["teachers"][0], "weight": 1.0}]),
                                          c["kd"].update(combine="route"), c["dataset"].update(teacher_key="teacher")),
                               "kd.combine route sends each row to one of several teachers"),
    "a mixture of top-k answers": (lambda c: (c["kd"].update(combine="mixture"),
                                              c["teachers"][1].update(logits_transport="topk")),
                                   "teachers.prose.logits_transport"),
    "one cache for several teachers": (lambda c: c["kd"].update(teacher_cache="cache"),
                                       "kd.teacher_cache: with several teachers each has its own, teachers[i].cache"),
    "a cached teacher of routed rows": (lambda c: (c["kd"].update(combine="route"),
                                                   c["dataset"].update(teacher_key="teacher"),
                                                   [t.update(weight=1.0) for t in c["teachers"]],
                                                   c["teachers"][1].update(cache="cache")),
                                        "teachers.prose.cache does not yet work with kd.combine route"),
    "a teacher's own mistake": (lambda c: c["teachers"][1]["model"].update(dtype="float64"),
                                "teachers.prose: teacher_model.dtype"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_teachers_configs_are_refused_naming_the_key(tmp_path, case):
    change, expected = CASES[case]
    assert expected in refusal(tmp_path, change)


def test_a_world_the_layouts_do_not_fill_is_refused_naming_each_section():
    with pytest.raises(ValueError, match=r"distributed: dp_size\(2\).*teachers.prose.distributed: dp_size\(1\) \* "
                                         r"tp_size\(3\).* 5 != world size 4"):
        validate_teacher_layouts({"dp_size": 2}, {"code": None, "prose": {"dp_size": 1, "tp_size": 3}}, 4)


def test_the_world_is_the_students_ranks_and_each_teachers_own(tmp_path):
    own = [{**MIXED[0], "distributed": {"dp_size": 1, "tp_size": 2}}, {**MIXED[1], "distributed": {"dp_size": 2}}]
    assert required_world_size(config_from_dict(with_teachers(tmp_path, {"dp_size": 2}, own))) == 6
    shared = [MIXED[0], {**MIXED[1], "distributed": {"dp_size": 1}}]
    assert required_world_size(config_from_dict(with_teachers(tmp_path, {"dp_size": 1}, shared))) == 2
    # Without a teacher of its own ranks the student's dp_size may stay open (from the process count).
    assert required_world_size(config_from_dict(with_teachers(tmp_path, {}, MIXED))) is None


# ---------------------------------------------------------------------------------------------------------
# Routing


@pytest.mark.world
def test_rows_routed_to_one_teacher_train_its_curve_and_the_other_answers_none(runs):
    records = runs.records("routed_all_code")
    assert curve(records) == pytest.approx(curve(runs.records("routed_single_teacher")), rel=1e-6, abs=1e-9)
    for record in train(records):
        assert record["teacher_rows/code"] == 4 and record["teacher_rows/prose"] == 0
        # A teacher's own divergence per token of its rows; none logged for a teacher with no rows.
        assert "kd_loss/prose" not in record and record["kd_tokens/prose"] == 0
        assert record["kd_loss/code"] == pytest.approx(record["kd_loss"], rel=1e-6)


def expected_routes(config: dict) -> list[dict[str, int]]:
    """Per step, how many rows of its global batch name each teacher (the data the run reads, in-process)."""
    from meshkd.core.teacher_ensemble import ROUTE
    from meshkd.recipe.corpus.batches import iterate_batches
    from meshkd.recipe.modeling.loaders import load_section_tokenizer
    from meshkd.recipe.student.step_data import run_datasets

    parsed = config_from_dict(config)
    train_set = run_datasets(parsed, load_section_tokenizer(parsed.model), None)[0]
    steps = parsed.step_scheduler
    batches = iterate_batches(train_set, global_batch_size=steps.global_batch_size, dp_rank=0, dp_size=1,
                              seed=parsed.dataset.seed, start_step=0)
    counts = []
    for _ in range(steps.max_steps):
        routes = next(batches)[ROUTE][:, 0].tolist()
        counts.append({"code": routes.count(0), "prose": routes.count(1)})
    return counts


@pytest.mark.world
def test_each_row_reaches_only_its_teacher_in_any_layout(runs):
    reference, laid_out = runs.records("routed_reference"), runs.records("routed_layout")
    assert curve(laid_out)[:3] == pytest.approx(curve(reference)[:3], rel=1e-5)
    assert curve(laid_out) == pytest.approx(curve(reference), rel=1e-4)
    expected = expected_routes(runs.configs["routed_layout"])
    assert any(0 < counts["code"] < 4 for counts in expected)  # steps that ask both teachers
    for records in (reference, laid_out):
        answered = [{name: record[f"teacher_rows/{name}"] for name in ("code", "prose")} for record in train(records)]
        assert answered == expected
        for record, counts in zip(train(records), expected):  # each teacher's mean over its own tokens
            own = {name: record[f"kd_loss/{name}"] for name in counts if counts[name]}
            assert set(own) == {name for name in counts if f"kd_loss/{name}" in record}
            mixed = sum(own[name] * record[f"kd_tokens/{name}"] for name in own) / record["num_tokens"]
            assert mixed == pytest.approx(record["kd_loss"], rel=1e-6)


@pytest.mark.world
def test_routed_rows_from_a_token_store_train_the_same_curve(runs):
    records = runs.records("routed_stored")
    assert curve(records) == curve(runs.records("routed_reference"))
    assert [record["teacher_rows/code"] for record in train(records)] == [
        record["teacher_rows/code"] for record in train(runs.records("routed_reference"))]


def test_the_routing_field_needs_several_teachers_and_names_known_ones(tmp_path):
    config = base_config(tmp_path)
    config["dataset"]["teacher_key"] = "teacher"
    with pytest.raises(ConfigError, match="dataset.teacher_key routes rows to one of several teachers"):
        config_from_dict(config)
    from meshkd.recipe.modeling.loaders import load_section_tokenizer
    from meshkd.recipe.student.step_data import run_datasets

    corpus = routed_corpus(tmp_path / "routed")
    config = with_teachers(tmp_path, ONE_PROCESS, [teacher("code", llama_teacher(), 1.0),
                                                   teacher("poems", qwen_teacher(), 1.0)], combine="route")
    config["dataset"].update(paths=[corpus["both"]], teacher_key="teacher")
    parsed = config_from_dict(config)
    with pytest.raises(ValueError, match=r"both\.jsonl:2: dataset\.teacher_key 'teacher' names the teacher 'prose', "
                                         r"which is none of the teachers \['code', 'poems'\]"):
        run_datasets(parsed, load_section_tokenizer(parsed.model), None)
    # Before any worker starts: the file, the line, the value and the key.
    from meshkd.recipe.lifecycle.preflight import preflight_teachers

    with pytest.raises(ValueError, match=r"both.jsonl:2: dataset.teacher_key 'teacher' names the teacher 'prose', "
                                         r"which is none of the teachers \['code', 'poems'\]"):
        preflight_teachers(parsed)
    config["dataset"]["teacher_key"] = "nope"
    parsed = config_from_dict(config)
    with pytest.raises(ValueError, match=r"both.jsonl:1: the route key 'nope' must hold the name"):
        run_datasets(parsed, load_section_tokenizer(parsed.model), None)


@pytest.mark.world
def test_on_policy_every_teacher_scores_the_students_completions(runs):
    one, twins = runs.records("one_teacher_on_policy"), runs.records("twins_on_policy")
    assert curve(twins) == pytest.approx(curve(one), rel=1e-5)
    for record in train(twins):
        assert record["generated_tokens"] > 0
        assert record["kd_loss/a"] == pytest.approx(record["kd_loss/b"], rel=1e-5)
    assert twins[-1]["teacher_nll_of_samples/b"] == pytest.approx(one[-1]["teacher_nll_of_samples"], rel=1e-5)


@pytest.mark.world
def test_a_teacher_read_from_its_cache_beside_a_live_one_trains_the_live_curve(runs):
    records = runs.records("prose_cached")
    assert curve(records) == pytest.approx(curve(runs.records("reference_sum")), rel=1e-5)
    # Its cache holds label log-probabilities only for validation rows: its loss, not its KL, is evaluated.
    first = records[0]
    assert first["teacher_val_loss/prose"] == pytest.approx(runs.records("reference_sum")[0]["teacher_val_loss/prose"])
    assert "val_kl/code" in first and "val_kl/prose" not in first


def test_cache_teacher_names_the_teacher_of_several(tmp_path):
    from meshkd.commands import cached_teacher

    config = config_from_dict(cached_prose(tmp_path))
    with pytest.raises(ConfigError, match=r"name the one whose cache to write with --teacher NAME"):
        cached_teacher(config, None)
    with pytest.raises(ConfigError, match=r"teachers.code.cache: set it"):
        cached_teacher(config, "code")
    with pytest.raises(ConfigError, match=r"--teacher 'poems' is none of the teachers"):
        cached_teacher(config, "poems")
    prose = cached_teacher(config, "prose")
    assert prose.name == "prose" and config.kd_of(prose).teacher_cache == str(tmp_path / "prose_cache")
    assert config.layout_of(prose).tp_size == 2
    # Training runs no ranks for a cached teacher: the student's and "code"'s only.
    assert required_world_size(config) == 2


@pytest.mark.world
def test_each_teacher_sends_its_answers_in_its_own_transport(runs):
    full, mixed = train(runs.records("reference_sum"))[0], train(runs.records("prose_topk"))[0]
    # Step 1, the same student: the full teacher's divergence is unchanged, the top-k one's an estimate.
    assert mixed["kd_loss/code"] == pytest.approx(full["kd_loss/code"], rel=1e-6)
    assert mixed["kd_loss/prose"] != pytest.approx(full["kd_loss/prose"], rel=1e-4)
    assert mixed["kd_loss/prose"] == pytest.approx(full["kd_loss/prose"], rel=0.5)
