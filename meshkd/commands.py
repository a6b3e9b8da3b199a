"""The `meshkd` commands as functions: train, cache-teacher, prepare-data, prune, plot (`meshkd.cli` parses
the command line and calls them; `meshkd.demo` runs a sequence of them).

`serve_teacher_command` serves the config's teacher over HTTP (`meshkd.recipe.lifecycle.teacher_service`).
`train_command` validates the config and runs the recipe's preflight checks in the calling process (a typo
or a missing file fails in seconds, before any process starts), then starts the local processes through
torch's own launcher (`meshkd.launcher`: gloo on CPU, NCCL on CUDA). Inside an existing torchrun world it
trains in that world directly. `cache_teacher_command` does the same with the teacher's ranks only, writing
the teacher's answers to `kd.teacher_cache` (`meshkd.recipe.lifecycle.cache_writer`). Each returns the exit status;
a bad config or input raises `ConfigError` / `ValueError` / `OSError` for the caller to print. Each command reads
the config file once; the overrides it adds (a GGUF model converted, the student's layers selected) rebuild the
config from that one document, and reach the workers as `--set` arguments.
"""

from __future__ import annotations

import math

from meshkd import launcher
from meshkd.recipe.settings.config import ConfigError, KDRecipeConfig
from meshkd.recipe.settings.config_loading import config_from_dict, load_config, read_config_document
from meshkd.recipe.settings.layout_checks import required_world_size


def _world_size(needed: int | None, nproc: int | None, dp_key: str = "distributed.dp_size") -> int:
    if nproc is None:
        if needed is None:
            raise ConfigError(f"{dp_key} is null: pass --nproc N to say how many processes to start")
        return needed
    if needed is not None and needed != nproc:
        raise ConfigError(f"the config lays out {needed} ranks but --nproc is {nproc}")
    return nproc


def _set_args(overrides: list[str]) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


def selected_layers(config: KDRecipeConfig, *, resume: bool = False) -> list[str]:
    """`["model.keep_layers=[...]"]` when `config` asks for `{auto: N}` (measured, or read from the run
    directory's record; see `meshkd.recipe.student.layer_selection`), else `[]`."""
    if not isinstance(config.model.keep_layers, dict):
        return []
    from meshkd.recipe.modeling.loaders import load_section_tokenizer
    from meshkd.recipe.student import layer_selection

    keep = layer_selection.resolve(config, load_section_tokenizer(config.model), resume=resume,
                                   measure_here=not launcher.inside_torchrun())
    return [f"model.keep_layers={keep}"]


def _converted_gguf_sources(config: KDRecipeConfig) -> list[str]:
    """Overrides pointing each GGUF model section at its model converted once to an HF directory
    (`meshkd.recipe.modeling.models.converted_gguf`): every worker then loads only its share, and in a fraction of
    the time. Under the user's own torchrun the ranks load the GGUF file as it is (they would race)."""
    if launcher.inside_torchrun():
        return []
    from meshkd.recipe.modeling.models import converted_gguf

    converted = []
    for label in ("model", "teacher_model"):
        section = getattr(config, label)
        if section.path is not None and (section.gguf_file is not None or str(section.path).endswith(".gguf")):
            directory = converted_gguf(section.path, section.gguf_file)
            converted += [f"{label}.path={directory}", f"{label}.gguf_file="]
    return converted


def _read(config_path: str, overrides: list[str]) -> tuple[dict, KDRecipeConfig]:
    """The config file's document (its one read) and the config it builds with `overrides`."""
    document = read_config_document(config_path)
    return document, config_from_dict(document, overrides)


def _resolved(document: dict, config: KDRecipeConfig, overrides: list[str], *,
              resume: bool = False) -> tuple[KDRecipeConfig, list[str]]:
    """The config the workers build and their overrides: `overrides` plus those that GGUF conversion and layer
    selection add, each config built again from `document` (`config`: that of `overrides` alone)."""
    converted = _converted_gguf_sources(config)
    if converted:
        overrides = [*overrides, *converted]
        config = config_from_dict(document, overrides)
    layers = selected_layers(config, resume=resume)  # of the converted model, when it was a GGUF file
    if layers:
        overrides = [*overrides, *layers]
        config = config_from_dict(document, overrides)
    return config, overrides


def train_command(config_path: str, overrides: list[str], nproc: int | None, resume: bool) -> int:
    """`meshkd train`: as one rank inside torchrun, else preflight here and launch the workers."""
    document, config = _read(config_path, overrides)
    config, overrides = _resolved(document, config, overrides, resume=resume)
    if launcher.inside_torchrun():
        from meshkd.recipe.lifecycle.run import KDRecipe

        return launcher.run_here(lambda: KDRecipe(config, resume=resume).run())
    from meshkd.recipe.lifecycle.preflight import preflight_teachers
    from meshkd.recipe.lifecycle.world import check_gpu_count

    preflight_teachers(config)
    world_size = _world_size(required_world_size(config), nproc)
    check_gpu_count(config, world_size)  # every process is started on this node
    resuming = ["--resume"] if resume else []
    return launcher.launch(world_size, ["train", config_path, *_set_args(overrides), *resuming])


def cached_teacher(config, name: str | None):
    """The teacher whose cache `meshkd cache-teacher` writes (of `config.teacher_list()`): the only one, or with
    several teachers (`teachers`) the one named by `--teacher` (its `cache`, its `distributed` layout)."""
    names = [teacher.name for teacher in config.teacher_list()]
    if name is not None and config.teachers is None:
        raise ConfigError("--teacher names one of several teachers (teachers); this config has one teacher")
    if name is None and len(names) > 1:
        raise ConfigError(f"this config has several teachers: name the one whose cache to write with --teacher NAME "
                          f"(one of {names})")
    if name is not None and name not in names:
        raise ConfigError(f"--teacher {name!r} is none of the teachers {names}")
    teacher = config.teacher_named(name)
    if teacher.cache is None:
        if config.teachers is not None:
            raise ConfigError(f"teachers.{teacher.name}.cache: set it to the directory to write the cache to")
        raise ConfigError("kd.teacher_cache: set it to the directory to write the cache to "
                          "(e.g. --set kd.teacher_cache=runs/teacher_cache)")
    return teacher


def cache_teacher_command(config_path: str, overrides: list[str], nproc: int | None, shard_rows: int | None,
                          teacher: str | None = None) -> int:
    """`meshkd cache-teacher`: as `train_command`, with the teacher's ranks only."""
    document, config = _read(config_path, overrides)
    config, overrides = _resolved(document, config, overrides)
    cached = cached_teacher(config, teacher)
    if launcher.inside_torchrun():
        from meshkd.recipe.lifecycle.cache_writer import cache_teacher

        return launcher.run_here(lambda: cache_teacher(config, cached, shard_rows=shard_rows))
    from meshkd.recipe.lifecycle.preflight import preflight

    checked = preflight(config, cached, writing_cache=True)
    world_size = _teacher_world_size(config, cached, nproc, asks_server=checked.source.outside_job)
    extra = ["--shard-rows", str(shard_rows)] if shard_rows is not None else []
    extra += ["--teacher", teacher] if teacher is not None else []
    return launcher.launch(world_size, ["cache-teacher", config_path, *_set_args(overrides), *extra])


def _teacher_world_size(config, teacher, nproc: int | None, *, asks_server: bool = False) -> int:
    """The processes a world of `teacher`'s ranks alone needs (cache-teacher, serve-teacher), checked against
    `nproc` and the GPUs this node sees; `asks_server`: cache-teacher's writers asking a served teacher instead
    (1, or `nproc`)."""
    from meshkd.recipe.lifecycle.world import check_gpu_count

    layout = config.layout_of(teacher)
    sizes = (layout.dp_size, layout.tp_size, layout.cp_size, layout.pp_size)
    needed = None if layout.dp_size is None else math.prod(sizes)
    dp_key = "teacher_distributed.dp_size" if teacher.distributed is not None else "distributed.dp_size"
    if asks_server:
        needed = nproc or 1
    world_size = _world_size(needed, nproc, dp_key)
    check_gpu_count(config, world_size)
    return world_size


def serve_teacher_command(config_path: str, overrides: list[str], nproc: int | None, options) -> int:
    """`meshkd serve-teacher`: the teacher's checks here, then its ranks (`meshkd.recipe.lifecycle.teacher_service`)
    serve until stopped. `options`: a `ServeOptions`."""
    document, config = _read(config_path, overrides)
    config, overrides = _resolved(document, config, overrides)
    section = config.teacher_model
    if config.teachers is not None or (section.path is None and section.random_init is None):
        raise ConfigError("meshkd serve-teacher serves teacher_model as its path or random_init give it (its url is "
                          "where students find it); this config " + ("has several teachers (teachers)" if
                          config.teachers is not None else "gives neither"))
    options.check()
    teacher = config.teacher_named()
    if launcher.inside_torchrun():
        from meshkd.recipe.lifecycle.teacher_service import serve_teacher

        return launcher.run_here(lambda: serve_teacher(config, teacher, options))
    from meshkd.recipe.lifecycle.preflight import preflight_teacher

    preflight_teacher(config, teacher)
    world_size = _teacher_world_size(config, teacher, nproc)
    flags = {"--host": options.host, "--port": options.port, "--max-batch-tokens": options.max_batch_tokens,
             "--max-request-tokens": options.max_request_tokens, "--tls-cert": options.tls_cert,
             "--tls-key": options.tls_key, "--address-file": options.address_file}
    extra = [str(item) for flag, value in flags.items() if value is not None for item in (flag, value)]
    return launcher.launch(world_size, ["serve-teacher", config_path, *_set_args(overrides), *extra])


def prune_command(config_path: str, overrides: list[str]) -> int:
    document, config = _read(config_path, overrides)
    if not isinstance(config.model.keep_layers, dict):
        raise ConfigError("model.keep_layers: set it to {auto: N} to have the N most important layers chosen "
                          "(e.g. --set 'model.keep_layers={auto: 8}')")
    _resolved(document, config, overrides)
    return 0


def plot_command(run_dirs: list[str], out: str | None, labels: list[str] | None) -> int:
    from meshkd.recipe.lifecycle.plot import plot_runs

    print(plot_runs(run_dirs, out, labels))
    return 0


def prepare_data_command(config_path: str, overrides: list[str]) -> int:
    """`meshkd prepare-data`: the token store of the config's corpus and its packing, written here; and that of
    its whole on-policy prompts when the run completes them (`DatasetConfig.whole_prompts`)."""
    config = load_config(config_path, overrides)
    from meshkd.recipe.modeling.loaders import load_section_tokenizer
    from meshkd.recipe.student.step_data import run_datasets
    from meshkd.recipe.teacher.sources import cross_teacher_tokenizer

    tokenizer = load_section_tokenizer(config.model)
    # With kd.cross_tokenizer the store holds the teacher's tokens too (a cache's teacher tokenizer if it names none).
    teacher_tokenizer = (cross_teacher_tokenizer(config.teacher_list()[0]) if config.kd.cross_tokenizer is not None
                         else None)
    train, val, train_prompts, val_prompts = run_datasets(config, tokenizer, teacher_tokenizer)
    manifest = train.store.manifest
    teacher = (f", the teacher's {manifest['teacher_tokens']} ({manifest['teacher_token_dtype']}) in "
               f"{manifest['groups']} group bounds" if "teacher_tokens" in manifest else "")
    print(f"meshkd prepare-data: {train.store.directory}: {manifest['documents']} documents, "
          f"{manifest['tokens']} tokens ({manifest['token_dtype']}){teacher}; training {len(train)} "
          f"rows, validation {len(val)} rows of {config.step_scheduler.sequence_length} tokens")
    if train_prompts is not None:
        print(f"meshkd prepare-data: {train_prompts.store.directory}: on-policy prompts, training "
              f"{len(train_prompts)}, validation {len(val_prompts)}")
    return 0
