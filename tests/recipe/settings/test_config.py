"""Config: typed loading, overrides, and bad configs failing at load with the key named."""

import pytest
import yaml

from meshkd.recipe.settings.config import ConfigError, apply_override
from meshkd.recipe.settings.config_loading import config_from_dict, load_config
from meshkd.recipe.settings.layout_checks import required_world_size
from tests.tiny import base_config, with_layout


def test_yaml_and_overrides_build_the_typed_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(with_layout(base_config(tmp_path), {"dp_size": 2}, {"dp_size": 1, "tp_size": 2})))
    config = load_config(path, ["step_scheduler.max_steps=7", "kd.temperature=1.5", "optimizer.betas=[0.8, 0.9]"])
    assert config.step_scheduler.max_steps == 7 and config.kd.temperature == 1.5
    assert config.optimizer.betas == [0.8, 0.9] and config.teacher_distributed.tp_size == 2
    assert required_world_size(config) == 4
    assert config.teacher_layouts() == {"teacher": config.teacher_distributed}  # one teacher: the list of one


def test_numbers_in_exponent_form_are_numbers_in_files_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    rest = {key: value for key, value in base_config(tmp_path).items() if key != "optimizer"}
    path.write_text("optimizer: {lr: 1e-3, eps: 1E-8}\n" + yaml.safe_dump(rest))
    config = load_config(path)
    assert (config.optimizer.lr, config.optimizer.eps) == (1e-3, 1e-8)
    assert load_config(path, ["optimizer.lr=5e-4"]).optimizer.lr == 5e-4


def test_override_syntax_errors_name_the_override():
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_override({}, "no_equals_sign")
    with pytest.raises(ConfigError, match=r"override 'step_scheduler.max_steps=\[1': the value is not valid YAML"):
        apply_override({}, "step_scheduler.max_steps=[1")


def test_missing_or_malformed_files_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(tmp_path / "list.yaml")


ON_POLICY = {"mode": "on_policy", "generation": {"prompt_tokens": 8, "max_new_tokens": 8}}


def engine(**keys) -> dict:
    """An on-policy `kd` section whose completions a vLLM server draws, with `kd.generation.engine` keys."""
    return {**ON_POLICY, "generation": {**ON_POLICY["generation"], "engine": {"url": "http://h:1", **keys}}}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"step_scheduler": {"max_step": 3}}, r"step_scheduler.max_step"),
        ({"kd": {"kd_ratio": "high"}}, r"kd.kd_ratio must be a number"),
        ({"kd": {"kd_ratio": 1.5}}, r"kd.kd_ratio must be in \[0, 1\]"),
        ({"optimizer": {"lr": -1.0}}, r"optimizer.lr must be a finite number > 0"),
        ({"teacher_distributed": {"dp_size": 1}}, r"teacher_distributed is set but separate_meshes is false"),
        ({"distributed": {"dp_size": 3}, "step_scheduler": {"global_batch_size": 4}}, r"global_batch_size\(4\)"),
        ({"dataset": {"paths": []}}, r"dataset.paths is empty"),
        ({"model": {"path": "x", "random_init": {"model_type": "llama"}}}, r"exactly one of model.path"),
        ({"unknown_section": {}}, r"unknown config key\(s\) \['unknown_section'\]"),
        ({"model": {"attn_implementation": "flash_attention_2"}},
         r"model.attn_implementation: 'flash_attention_2' is not supported; use sdpa, eager or flex_attention"),
        ({"teacher_model": {"attn_implementation": "flash_attention_2"}}, r"teacher_model.attn_implementation"),
        ({"model": {"attn_implementation": "flex_attention"}, "device": "cpu"},
         r"flex_attention has no backward on the CPU"),
        # On-policy distillation (sequence_length 32 in the base config).
        ({"kd": {"mode": "online"}}, r"kd.mode must be off_policy or on_policy"),
        ({"kd": {"mode": "on_policy", "generation": {"prompt_tokens": 30, "max_new_tokens": 8}}},
         r"prompt_tokens \(30\) \+ max_new_tokens \(8\) exceed step_scheduler.sequence_length \(32\)"),
        ({"kd": {"mode": "on_policy", "generation": {"max_new_tokens": 32}}, "dataset": {"prompt_key": "prompt"}},
         r"max_new_tokens \(32\) leaves no room for a prompt"),
        ({"kd": {"mode": "on_policy", "generation": {"prompt_tokens": 0}}}, r"a prompt is never empty"),
        ({"kd": {"generation": {"temperature": -1.0}}}, r"kd.generation.temperature must be a finite number >= 0"),
        ({"kd": {"generation": {"top_p": 0.0}}}, r"kd.generation.top_p must be in \(0, 1\]"),
        ({"kd": {"generation": {"stop_tokens": [-1]}}}, r"kd.generation.stop_tokens must be token ids"),
        ({"kd": {"on_policy_fraction": 1.5}}, r"kd.on_policy_fraction must be in \[0, 1\]"),
        ({"kd": {"divergence": "reverse_kl", "logits_transport": "topk"}},
         r"kd.divergence .*reverse_kl needs the teacher's whole distribution"),
        ({"kd": {"divergence": "jsd", "jsd_beta": 0.0}}, r"jsd_beta must lie strictly between 0 and 1"),
        ({"kd": {"divergence": "sampled_reverse_kl"}},
         r"kd.divergence sampled_reverse_kl estimates the reverse KL on the student's own sampled tokens: it needs "
         r"kd.mode on_policy with kd.on_policy_fraction 1 .*got kd.mode 'off_policy'"),
        ({"kd": {"divergence": "sampled_reverse_kl", "mode": "on_policy", "sampled_estimator": "k2"}},
         r"kd.sampled_estimator must be k1 or k3, got 'k2'"),
        ({"kd": {"divergence": "skew_reverse_kl", "skew_alpha": 1.0}},
         r"kd.divergence / kd.jsd_beta / kd.skew_alpha .*skew_alpha must lie strictly between 0 and 1"),
        ({"kd": {"divergence": "tvd", "logits_transport": "topk"}}, r"divergence tvd needs the teacher's whole"),
        ({"kd": {"divergence": "kl"}}, r"divergence must be one of"),
        ({"kd": {**ON_POLICY, "kd_ratio": 0.0}}, r"on_policy with kd.kd_ratio 0"),
        ({"kd": {**ON_POLICY, "teacher_cache": "cache"}}, r"need a live teacher"),
        ({"kd": ON_POLICY, "distributed": {"dp_size": 1, "pp_size": 2}},
         r"pipeline and context parallel students .*pp_size 2"),
        ({"kd": {"generation": {"evaluate": True}}, "distributed": {"dp_size": 1, "cp_size": 2}},
         r"kd.generation.evaluate: .*cp_size 2"),
        # A vLLM server drawing the completions (kd.generation.engine).
        ({"kd": {"generation": {"engine": {"url": "http://h:1"}}}}, r"kd.generation.engine draws the training"),
        ({"kd": engine(url="h:1")}, r"kd.generation.engine.url must be http"),
        ({"kd": engine(sync_every=2)},
         r"sync_every 2 lets the sampling weights lag 1 step\(s\), more than max_staleness 0"),
        ({"kd": engine(sync_every=2, max_staleness=1)},
         r"lag 2 step\(s\), more than max_staleness 1"),
        ({"kd": engine(max_staleness=-1)},
         r"kd.generation.engine.sync_every must be >= 1 and max_staleness >= 0"),
        ({"kd": engine(dtype="int8")},
         r"kd.generation.engine.dtype must be"),
    ],
)
def test_bad_configs_fail_at_load_naming_the_key(tmp_path, change, message):
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, None)
    for section, values in change.items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section] = {**config[section], **values}
        else:
            config[section] = values
    with pytest.raises(ConfigError, match=message):
        config_from_dict(config)


@pytest.mark.parametrize("name", ["tiny_separate", "tiny_pipeline", "tiny_gemma", "tiny_on_policy", "tiny_teachers",
                                  "tiny_cross_tokenizer", "hf_gpu", "chat_kd"])
def test_example_configs_load(name):
    from pathlib import Path

    config = load_config(Path(__file__).parents[3] / "examples" / f"{name}.yaml")
    assert required_world_size(config) >= 2


def test_the_embedded_demo_config_loads_once_its_teacher_is_filled_in(tmp_path):
    from importlib import resources

    path = resources.files("meshkd") / "configs" / "demo.yaml"
    config = load_config(path, [f"model.path={tmp_path}", f"teacher_model.path={tmp_path}"])
    assert config.model.keep_layers["auto"] == 20 and required_world_size(config) == 4
    # meshkd demo --on-policy and the off-policy run it is compared with.
    from meshkd.demo import _OFF_POLICY_BESIDE, _ON_POLICY

    paths = [f"model.path={tmp_path}", f"teacher_model.path={tmp_path}"]
    on = load_config(path, paths + _ON_POLICY)
    assert (on.kd.mode, on.kd.divergence, on.step_scheduler.sequence_length) == ("on_policy", "reverse_kl", 64)
    beside = load_config(path, paths + _OFF_POLICY_BESIDE)
    assert beside.kd.mode == "off_policy" and beside.kd.generation.evaluate
    assert beside.step_scheduler.sequence_length == on.step_scheduler.sequence_length
    # as their figures in docs/ were measured, whatever rows a step the text demo takes
    assert on.step_scheduler.global_batch_size == beside.step_scheduler.global_batch_size == 4
    assert on.optimizer.lr == beside.optimizer.lr == 1e-3


def test_a_run_from_a_teacher_cache_needs_no_teacher_ranks_and_no_teacher():
    from pathlib import Path

    config = load_config(Path(__file__).parents[3] / "examples" / "tiny_cached.yaml")
    assert required_world_size(config) == 1  # the student only; cache-teacher runs the teacher's layout
    assert config.layout_of(config.teacher_named()).tp_size == 2
    data = {"model": {"random_init": {"model_type": "llama"}}, "dataset": {"paths": ["x.txt"]},
            "kd": {"teacher_cache": "cache"}}
    assert config_from_dict(data).teacher_model.path is None  # the cache's teacher stands
    data["kd"] = {}
    with pytest.raises(ConfigError, match="teacher_model: set exactly one of"):
        config_from_dict(data)


def test_each_teacher_is_a_spec_of_teacher_list_and_the_settings_it_changes_are_asked_of_the_config(tmp_path):
    """The one-teacher keys are a list of one; a teacher is found by name (the only one without); `kd_of` and
    `layout_of` give what a teacher changes of the run's settings; a wrong name is refused naming those there are."""
    from tests.recipe.teacher.test_teachers import llama_teacher, qwen_teacher, teacher, with_teachers

    one = config_from_dict(with_layout(base_config(tmp_path), {"dp_size": 1}, {"dp_size": 2}))
    (only,) = one.teacher_list()
    assert one.teacher_named() is not None and only.model == one.teacher_model and only.cache is None
    assert one.layout_of(only).dp_size == 2 and one.kd_of(only) == one.kd
    several = with_teachers(tmp_path, {"dp_size": 1}, [teacher("code", llama_teacher(), 1.0, {"dp_size": 1}),
                                                       teacher("prose", qwen_teacher(), 1.0)])
    several["teachers"][1].update(logits_transport="topk", cache=str(tmp_path / "cache"))
    config = config_from_dict(several)
    code, prose = config.teacher_named("code"), config.teacher_named("prose")
    assert config.layout_of(code).dp_size == 1 and config.layout_of(prose) is config.distributed
    assert config.kd_of(code).logits_transport == "full" and config.kd_of(code).teacher_cache is None
    assert config.kd_of(prose).logits_transport == "topk" and config.kd_of(prose).teacher_cache == str(
        tmp_path / "cache")
    assert config.kd.logits_transport == "full"  # the run's own settings stay as given
    with pytest.raises(ConfigError, match=r"teachers: give one of code, prose"):
        config.teacher_named()
    with pytest.raises(ConfigError, match=r"teachers: no teacher named 'poems'; give code, prose"):
        config.teacher_named("poems")
