"""Property test (hypothesis, no process group): any config, however wrong, is accepted or refused in one line.

Generated configs are the tiny valid one with a few keys set to values of any type (numbers at the edges,
NaN and infinities, strings, lists, mappings, null; no huge sizes: a random_init of 2^40 layers would be
built), the keys drawn from every config section and from a
model's `random_init`. `config_from_dict` and then `preflight` either accept the config or raise a
ValueError (`ConfigError` included) or OSError whose message is one non-empty line; never another
exception (a TypeError, KeyError or IndexError would be a traceback for a user's mistake).
"""

from __future__ import annotations

import dataclasses
import typing

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshkd.recipe.lifecycle.preflight import preflight
from meshkd.recipe.settings.config import KDRecipeConfig
from meshkd.recipe.settings.config_loading import config_from_dict
from tests.tiny import base_config, with_layout

RANDOM_INIT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "vocab_size", "intermediate_size", "max_position_embeddings", "model_type", "head_dim")


def _keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for field in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[field.name]
        nested = [arg for arg in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(arg)]
        keys.append(prefix + field.name)
        if nested:
            keys += _keys(nested[0], f"{prefix}{field.name}.")
    return keys


KEYS = _keys(KDRecipeConfig) + [f"{section}.random_init.{key}" for section in ("model", "teacher_model")
                                for key in RANDOM_INIT_KEYS]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-3, max_value=300), st.sampled_from([0, 1, 2, 4, 1000]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["", "x", "llama", "topk", "byte", "/nonexistent"]),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.sampled_from(["a", "dp_size"]),
                                                                          scalars, max_size=2))


def _set(config: dict, dotted: str, value) -> None:
    node = config
    *parents, last = dotted.split(".")
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[last] = value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.sampled_from(KEYS), values), min_size=1, max_size=3))
def test_any_config_is_accepted_or_refused_in_one_line(tmp_path_factory, edits):
    config = with_layout(base_config(tmp_path_factory.mktemp("config")), {"dp_size": 1}, {"dp_size": 1})
    for key, value in edits:
        _set(config, key, value)
    try:
        preflight(config_from_dict(config))
    except (ValueError, OSError) as error:
        message = str(error)
        assert message and "\n" not in message, f"{type(error).__name__} not one line: {message!r}"
