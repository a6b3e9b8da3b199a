"""keep_layers: {auto: N}: layers ranked by measured importance on the model's own forward, recorded per run."""

import json

import pytest
import torch

from meshkd.parallel.stages import decoder_of
from meshkd.recipe.modeling import models
from meshkd.recipe.settings.config import ConfigError
from meshkd.recipe.settings.config_loading import config_from_dict
from meshkd.recipe.student import layer_selection
from tests.tiny import base_config

IDENTITY_LAYER = 2


def _identity_layer_model(directory, family: dict) -> None:
    """A 5-layer random model whose layer IDENTITY_LAYER returns its input: its residual branches write zeros."""
    model = models.load_causal_lm(random_init={**family, "num_hidden_layers": 5}, seed=4)
    layer = decoder_of(model).layers[IDENTITY_LAYER]
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(directory)


FAMILIES = {
    "llama": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 262, "max_position_embeddings": 256},
    "qwen3": {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 262, "max_position_embeddings": 256},
}


def _config(tmp_path, keep_layers, **model):
    config = base_config(tmp_path)
    config["model"] = {"path": str(tmp_path / "model"), "tokenizer": "byte", "keep_layers": keep_layers, **model}
    return config_from_dict(config)


@pytest.fixture(params=sorted(FAMILIES))
def identity_model(request, tmp_path):
    _identity_layer_model(tmp_path / "model", FAMILIES[request.param])
    return tmp_path


@pytest.mark.parametrize("by", ["layer", "block"])
def test_an_identity_layer_ranks_least_important_and_is_dropped_first(identity_model, by, capsys):
    config = _config(identity_model, {"auto": 4, "by": by})
    keep = layer_selection.resolve(config, models.byte_tokenizer())
    assert keep == [i for i in range(5) if i != IDENTITY_LAYER]
    record = json.loads(layer_selection.selection_path(config).read_text())
    distances = record["layer_distance"]
    assert distances[IDENTITY_LAYER] < 1e-6 < min(d for i, d in enumerate(distances) if i != IDENTITY_LAYER)
    ranking = capsys.readouterr().out
    assert f"  {IDENTITY_LAYER}:0.000" in ranking and "keeping 4 of 5 layers" in ranking


@pytest.mark.world  # starts a process
def test_measured_in_a_child_process_the_record_is_the_same(tmp_path):
    # What a GPU launcher does, so that the model and its CUDA context leave with the child.
    _identity_layer_model(tmp_path / "model", FAMILIES["llama"])
    config = _config(tmp_path, {"auto": 4, "by": "block"})
    rows = layer_selection.calibration_rows(config, models.byte_tokenizer())
    assert layer_selection.measure_apart(config, rows) == layer_selection.measure(config, rows)
    with pytest.raises(ConfigError, match="more than the model's 5 layers"):  # its errors reach the parent
        layer_selection.measure_apart(_config(tmp_path, {"auto": 6}), rows)


def test_block_removal_drops_the_contiguous_block_whose_ends_are_closest():
    per_layer = [0.5, 0.1, 0.3, 0.2, 0.4]
    per_block = [0.9, 0.2, 0.6, 0.7]  # blocks of 2 starting at layers 0..3
    assert layer_selection.choose(per_layer, per_block, keep=3, by="block") == [0, 3, 4]
    assert layer_selection.choose(per_layer, per_block, keep=3, by="layer") == [0, 2, 4]


def test_the_record_is_reused_for_the_same_run_and_always_on_resume(identity_model, monkeypatch):
    config = _config(identity_model, {"auto": 3})
    tokenizer = models.byte_tokenizer()
    first = layer_selection.resolve(config, tokenizer)
    measured = []
    real_measure = layer_selection.measure
    monkeypatch.setattr(layer_selection, "measure", lambda *a: measured.append(1) or real_measure(*a))
    assert layer_selection.resolve(config, tokenizer) == first and not measured

    changed = _config(identity_model, {"auto": 3, "calibration_rows": 2})
    assert layer_selection.resolve(changed, tokenizer, resume=True) == first and not measured
    layer_selection.resolve(changed, tokenizer)
    assert measured == [1]  # another request: measured again, and recorded
    assert json.loads(layer_selection.selection_path(config).read_text())["request"]["calibration_rows"] == 2


def test_without_a_record_a_rank_under_torchrun_is_told_to_run_meshkd_prune(identity_model):
    with pytest.raises(ConfigError, match="model.keep_layers: .*meshkd prune"):
        layer_selection.resolve(_config(identity_model, {"auto": 3}), models.byte_tokenizer(), measure_here=False)


def test_a_damaged_record_is_named(identity_model):
    config = _config(identity_model, {"auto": 3})
    path = layer_selection.selection_path(config)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=f"model.keep_layers: {path} is damaged"):
        layer_selection.resolve(config, models.byte_tokenizer())


def test_more_layers_than_the_model_has_is_refused(identity_model):
    with pytest.raises(ConfigError, match="model.keep_layers.auto: 9 is more than the model's 5 layers"):
        layer_selection.resolve(_config(identity_model, {"auto": 9}), models.byte_tokenizer())


@pytest.mark.parametrize(("section", "keep_layers", "message"), [
    ("model", {"auto": 0}, "model.keep_layers.auto must be an integer >= 1"),
    ("model", {"auto": 2, "by": "width"}, "model.keep_layers.by must be block or layer"),
    ("model", {"auto": 2, "calibration_rows": 1.5}, "model.keep_layers.calibration_rows must be an integer"),
    ("model", {"keep": 2}, r"model.keep_layers must be a list of layers or \{auto: N\}"),
    ("teacher_model", {"auto": 2}, r"teacher_model.keep_layers: \{auto: N\} chooses a student's layers"),
])
def test_bad_selection_requests_are_refused_at_load(tmp_path, section, keep_layers, message):
    config = base_config(tmp_path)
    config[section]["keep_layers"] = keep_layers
    with pytest.raises(ConfigError, match=message):
        config_from_dict(config)
