"""Recipe configuration: typed dataclasses, validated once at load; YAML is only their serialized form.

`load_config(path, overrides)` reads YAML, applies `a.b=value` overrides (values parsed as YAML), and
builds the dataclass tree, rejecting unknown keys and mistyped values with the dotted key in the message
(`meshkd.recipe.typed_yaml`).
Cross-field rules (batch sizes that must divide, the parallel layout) are checked in `validate`, still
before any process group or model exists. `to_dict` gives the resolved config to save with the run.
"""

from __future__ import annotations

import dataclasses
import math
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshkd.core.loss import check_divergence
from meshkd.core.topology import validate_kd_config, validate_teacher_layouts
from meshkd.recipe.records import RECORD_FORMATS, TRAIN_ON
from meshkd.recipe.typed_yaml import ConfigError, apply_override, build, parse_yaml

MAX_WORLD_SIZE = 1 << 20
"""Ranks a layout may need at most: a typo of a size key should not build a mesh of a trillion ranks."""


@dataclass
class ModelConfig:
    """Where a model comes from: exactly one of `path` (HF directory or .gguf file) or `random_init`."""

    path: str | None = None
    gguf_file: str | None = None
    random_init: dict | None = None  # HF config kwargs with `model_type`: tiny models for tests
    # Layer pruning: the decoder layers to keep, in order, or {auto: N} to keep the N that measure most
    # important (meshkd.recipe.layer_selection; optional by: block | layer, calibration_rows).
    keep_layers: list[int] | dict | None = None
    tokenizer: str | None = None  # None: the model's own; "byte": meshkd's offline byte tokenizer
    # The teacher's weights dtype; the student's compute dtype (its master weights stay float32, see below).
    dtype: str = "float32"
    # Student only: its parameters and optimizer states in `dtype` itself, no float32 master weights (about 8
    # bytes a parameter with AdamW instead of 16; updates below half a bfloat16 step of a weight round away).
    pure_half_precision: bool = False
    # Student only: recompute each decoder layer's activations in backward instead of keeping them (the
    # model's own activation checkpointing; about a third more compute for memory of one layer at a time).
    activation_checkpointing: bool = False
    seed: int = 0
    attn_implementation: str | None = None  # sdpa | eager; None: sdpa where the model supports it, else eager

    def parameter_dtype(self) -> str:
        """A student's parameters' (and so its gradients' and optimizer states') dtype: float32 master weights
        under a half-precision `dtype`, which is then the compute dtype; `dtype` itself with pure_half_precision."""
        return self.dtype if self.pure_half_precision else "float32"


@dataclass
class DistributedConfig:
    """One role's parallel layout (see meshkd.core.topology)."""

    strategy: str = "fsdp2"
    dp_size: int | None = None
    dp_replicate_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"  # student pipeline schedule: 1f1b or gpipe


@dataclass
class GenerationSettingsConfig:
    """How the student completes prompts with kd.mode: on_policy (meshkd.recipe.on_policy)."""

    max_new_tokens: int = 32
    temperature: float = 1.0  # 0: the likeliest token each time
    top_p: float = 1.0
    stop_tokens: list[int] | None = None  # None: the tokenizer's end-of-text token; []: none
    prompt_tokens: int = 32  # without dataset.prompt_key: each row's first document, cut to this many tokens
    seed: int = 0
    # Also score greedy completions of the validation prompts at the first and last evaluation: the teacher's
    # loss per generated token (teacher_nll_of_samples). None: on with kd.mode on_policy.
    evaluate: bool | None = None


@dataclass
class CrossTokenizerConfig:
    """A teacher with another tokenizer (`meshkd.recipe.aligned_data`): both tokenizations of each row,
    aligned by bytes; the teacher's answer projected onto the student's vocabulary."""

    # projection: the teacher's answer on the student's vocabulary (NeMo RL's X-Token), then kd.divergence and
    # kd.logits_transport; uld: sorted probabilities of aligned groups (Boizard et al.); gold: TRL GOLD's hybrid
    loss: str = "projection"
    # Teacher tokens per row; None: step_scheduler.sequence_length. A row closes when either side is full: about
    # sequence_length x the teacher's tokens per student token fills both (preflight measures it on the corpus and
    # warns when either side's rows are under 90% full: `meshkd.recipe.aligned_data.check_row_lengths`)
    teacher_sequence_length: int | None = None


@dataclass
class TeacherConfig:
    """One of several teachers (`teachers`): a name, its model, its weight in the objective and its ranks."""

    name: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    weight: float = 1.0  # the weights are normalized to sum to 1 (kd.combine)
    distributed: DistributedConfig | None = None  # ranks of its own with this layout; None: the student's ranks
    logits_transport: str | None = None  # how its logits travel; None: kd.logits_transport
    # Its answers from this directory, written by `meshkd cache-teacher CONFIG --teacher NAME` (with
    # `distributed` as the writer's layout): training runs no ranks for it
    cache: str | None = None


@dataclass
class KDConfig:
    kd_ratio: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    chunk_size: int | None = None  # tokens per loss chunk; None: one chunk
    logits_transport: str = "full"  # full | full_bf16 | topk: how teacher logits travel (meshkd.core.logits_codec)
    topk: int = 64  # entries per token with logits_transport: topk
    topk_tail_samples: int = 32  # sampled tail tokens per token with topk; 0: one rest bucket for the tail
    overlap_teacher: bool = True  # separate meshes: fetch the next micro-batch's teacher logits while training
    teacher_cache: str | None = None  # a directory `meshkd cache-teacher` writes; train reads it: no teacher ranks
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient norm: stop (the run fails) | skip_step (no update)
    max_skipped_steps: int = 10  # with skip_step: the run fails at the next non-finite step after this many
    mode: str = "off_policy"  # off_policy: dataset text | on_policy: also the student's own completions
    on_policy_fraction: float = 1.0  # with on_policy: the share of micro-batches the student completes
    divergence: str = "forward_kl"  # forward_kl | reverse_kl | jsd (meshkd.core.loss)
    jsd_beta: float = 0.5  # beta of jsd, in (0, 1)
    # An MoE student's router load-balancing loss weight; None: its config's router_aux_loss_coef (0 for a
    # dense student); 0: off (meshkd.recipe.router_loss)
    router_aux_loss_coef: float | None = None
    generation: GenerationSettingsConfig = field(default_factory=GenerationSettingsConfig)
    cross_tokenizer: CrossTokenizerConfig | None = None  # a teacher with another tokenizer; None: the same one
    # Several teachers (`teachers`): sum (the weighted sum of the divergences to each) | mixture (the
    # divergence to the weighted mixture of their distributions) | route (each row's divergence to the one
    # teacher its documents name in dataset.teacher_key)
    combine: str = "sum"

    @property
    def evaluates_samples(self) -> bool:
        """Whether evaluations score the student's completions (`generation.evaluate`; None: on-policy runs)."""
        return self.generation.evaluate if self.generation.evaluate is not None else self.mode == "on_policy"

    @property
    def generates(self) -> bool:
        """Whether the student completes prompts: to train on them (on-policy), or to evaluate them."""
        return self.mode == "on_policy" or self.evaluates_samples


@dataclass
class HFDatasetConfig:
    """A Hugging Face dataset (`meshkd.recipe.hf_sources`): a `save_to_disk` directory, a Hub id read from the
    local cache, or a `datasets` builder (parquet, json, csv, arrow) with `data_files`."""

    path: str = ""
    name: str | None = None  # the subset (a Hub dataset's configuration)
    split: str = "train"
    revision: str | None = None
    data_files: list[str] | None = None
    streaming: bool = False  # read row by row, no Arrow copy in the datasets cache


@dataclass
class DatasetConfig:
    """Text files (each one document), JSONL / parquet / CSV / arrow / JSON rows and a Hugging Face dataset;
    `${stdlib}` expands to Python's stdlib sources."""

    paths: list[str] = field(default_factory=list)
    hf: HFDatasetConfig | None = None  # a Hugging Face dataset, read after the files of paths
    format: str | None = None  # text | jsonl: read every file of paths so; null: by extension
    records: str = "text"  # what a row holds: text | chat (messages) | prompt_completion (meshkd.recipe.records)
    train_on: str = "answers"  # chat / prompt_completion: answers | last_answer | all (tokens the loss counts)
    chat_template: bool | None = None  # prompt_completion rendered with model.tokenizer's template; null: if it has one
    text_key: str = "text"
    messages_key: str = "messages"  # chat: a list of {role, content}
    # On-policy prompts of text rows: this column, whole (else each document's start); prompt_completion: the
    # prompt column (null: "prompt")
    prompt_key: str | None = None
    completion_key: str = "completion"
    system_key: str | None = None  # prompt_completion: a column holding a system message
    context_key: str | None = None  # prompt_completion: a column joined before the prompt
    val_fraction: float = 0.05
    seed: int = 0
    max_documents: int | None = None
    max_document_chars: int | None = None
    packing: bool = True  # NEAT-pack several documents per row; false: one document per row
    # A directory of token stores: the corpus tokenized once and read by memory map (meshkd.recipe.token_store);
    # null: tokenized in memory at every start
    token_store: str | None = None
    # Processes that render and tokenize rows into the token store (spawned: a script of your own that builds the
    # data guards its entry point with `if __name__ == "__main__":`)
    tokenize_workers: int = 1
    on_bad_file: str = "error"  # a binary or non-UTF-8 file: error (refused, named) | skip (left out, named)
    # With several teachers and kd.combine route: the JSONL field naming each document's teacher (rows hold
    # one teacher's documents; each row asks only its teacher)
    teacher_key: str | None = None

    @property
    def whole_prompts(self) -> bool:
        """Whether on-policy prompts are whole prompts of their own, one per row: the `prompt_key` column of text
        rows, or all of a chat / prompt_completion row before its last answer (else each row's start)."""
        return self.prompt_key is not None or self.records != "text"


@dataclass
class StepSchedulerConfig:
    max_steps: int = 100
    global_batch_size: int = 8  # rows per optimizer step, over all data-parallel ranks
    local_batch_size: int = 1  # rows per micro-batch on one data-parallel rank
    sequence_length: int = 256
    val_every_steps: int | None = None
    val_batches: int | None = None  # None: the whole validation split
    ckpt_every_steps: int | None = None


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 0
    decay: str = "cosine"  # cosine | linear | constant
    total_steps: int | None = None  # length of the schedule; None: step_scheduler.max_steps
    min_lr_ratio: float = 0.1

    def factor(self, max_steps: int):
        """step -> learning-rate factor: linear warmup, then constant, linear or cosine decay to min_lr_ratio."""
        total = self.total_steps or max_steps

        def factor(step: int) -> float:
            if step < self.warmup_steps:
                return (step + 1) / self.warmup_steps
            if self.decay == "constant":
                return 1.0
            progress = min(1.0, (step - self.warmup_steps) / max(1, total - self.warmup_steps))
            shape = 0.5 * (1 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1 - progress
            return self.min_lr_ratio + (1 - self.min_lr_ratio) * shape

        return factor


@dataclass
class CheckpointConfig:
    enabled: bool = True
    dir: str | None = None  # default: RUN_DIR/checkpoints
    save_hf: bool = True  # write the final student in HF format to RUN_DIR/hf_student


@dataclass
class LoggingConfig:
    run_dir: str = "runs/meshkd"
    progress_bar: bool = True
    tensorboard: bool = False
    summary: bool = True  # rank 0 prints how the run ended and its figures (`meshkd.recipe.run_report`)


@dataclass
class PeftConfig:
    """LoRA adapters on the student (`meshkd.recipe.adapters`): the base weights frozen, the adapters trained."""

    rank: int = 8  # r: the inner dimension of each adapter's two matrices
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # on each adapter's input while training
    target_modules: str | list[str] = "all-linear"  # peft's: module names (or name suffixes), or every linear layer
    # but the output head


@dataclass
class KDRecipeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    teacher_model: ModelConfig = field(default_factory=ModelConfig)
    separate_meshes: bool = False
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    teacher_distributed: DistributedConfig | None = None
    # Several teachers at once, in place of teacher_model / teacher_distributed / separate_meshes
    teachers: list[TeacherConfig] | None = None
    kd: KDConfig = field(default_factory=KDConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    step_scheduler: StepSchedulerConfig = field(default_factory=StepSchedulerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    peft: PeftConfig | None = None  # null: the whole student trains
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    collective_timeout_s: float = 600.0
    setup_timeout_s: float = 3600.0  # how long ranks wait for each other to load models and data

    def get(self, key: str, default: Any = None) -> Any:
        """Topology view (`meshkd.core.topology._ConfigLike`): the typed sections, read as they are.

        Training from a teacher cache runs no teacher ranks: the view has the student's layout only.
        """
        if self.kd.teacher_cache is not None and key in ("separate_meshes", "teacher_distributed"):
            return False if key == "separate_meshes" else None
        return getattr(self, key, default)

    @property
    def teacher_layout(self) -> DistributedConfig:
        """The teacher's own layout: `teacher_distributed` on separate meshes, else the student's."""
        return self.teacher_distributed if self.separate_meshes and self.teacher_distributed else self.distributed

    @property
    def teacher_sequence_length(self) -> int:
        """Teacher tokens per row: `kd.cross_tokenizer.teacher_sequence_length`, else the student's."""
        cross = self.kd.cross_tokenizer
        if cross is not None and cross.teacher_sequence_length is not None:
            return cross.teacher_sequence_length
        return self.step_scheduler.sequence_length

    def teacher_views(self) -> dict[str, KDRecipeConfig]:
        """Teacher name -> the one-teacher config of that teacher (its model, ranks, transport and cache; the
        rest this config's). The one-teacher form is one view, named "teacher": this config itself."""
        if not self.teachers:
            return {"teacher": self}
        return {teacher.name: dataclasses.replace(
            self, teachers=None, teacher_model=teacher.model, separate_meshes=teacher.distributed is not None,
            teacher_distributed=teacher.distributed,
            kd=dataclasses.replace(self.kd, logits_transport=teacher.logits_transport or self.kd.logits_transport,
                                   teacher_cache=teacher.cache))
            for teacher in self.teachers}

    def teacher_layouts(self) -> dict[str, DistributedConfig | None]:
        """Several teachers: name -> the layout of its own ranks in training; None: on the student's ranks (or
        read from its cache)."""
        return {teacher.name: teacher.distributed if teacher.cache is None else None for teacher in self.teachers}

    def teacher_weights(self) -> dict[str, float]:
        """Teacher name -> its weight, normalized to sum to 1."""
        if not self.teachers:
            return {"teacher": 1.0}
        total = sum(teacher.weight for teacher in self.teachers)
        return {teacher.name: teacher.weight / total for teacher in self.teachers}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def config_from_dict(data: dict, overrides: list[str] = ()) -> KDRecipeConfig:
    """Build and validate a config from a dict plus overrides."""
    data = dict(data or {})
    for assignment in overrides:
        apply_override(data, assignment)
    config = build(KDRecipeConfig, data, "")
    validate(config)
    return config


def load_config(path: str | Path, overrides: list[str] = ()) -> KDRecipeConfig:
    """Read a YAML config file, apply overrides, build and validate it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = parse_yaml(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return config_from_dict(data or {}, overrides)


def required_world_size(config: KDRecipeConfig) -> int | None:
    """The number of processes the layout needs, or None when shared meshes leave dp_size open."""
    def ranks(section: DistributedConfig) -> int | None:
        if section.dp_size is None:
            return None
        return section.dp_size * section.tp_size * section.cp_size * section.pp_size

    student = ranks(config.distributed)
    if config.teachers:
        own = [ranks(layout) for layout in config.teacher_layouts().values() if layout is not None]
        if not own:
            return student
        return None if student is None or None in own else student + sum(own)
    if not config.get("separate_meshes") or config.teacher_distributed is None:
        return student
    teacher = ranks(config.teacher_distributed)
    return None if student is None or teacher is None else student + teacher


def expand_path(pattern: str) -> str:
    """Expand `${stdlib}` (this interpreter's standard library sources) and `~` in a dataset path."""
    return str(Path(pattern.replace("${stdlib}", sysconfig.get_paths()["stdlib"])).expanduser())


def validate(config: KDRecipeConfig) -> None:
    """Cross-field checks that need no process group; raises ConfigError naming the key."""
    if config.peft is not None:
        _check_peft(config)
    if config.teachers is not None:
        _check_teachers(config)
        for name, view in config.teacher_views().items():
            try:
                _validate_one(view, check_world=False)
            except ConfigError as error:
                raise ConfigError(f"teachers.{name}: {error}") from None
        _check_world(config, lambda world_size: validate_teacher_layouts(
            config.distributed, config.teacher_layouts(), world_size), "distributed and teachers[i].distributed")
        return
    if config.dataset.teacher_key is not None:
        raise ConfigError("dataset.teacher_key routes rows to one of several teachers: give them in teachers "
                          "(with kd.combine route), or leave the key out")
    _validate_one(config, check_world=True)


def _check_peft(config: KDRecipeConfig) -> None:
    peft = config.peft
    if peft.rank < 1:
        raise ConfigError(f"peft.rank must be >= 1, got {peft.rank}")
    if not (peft.alpha > 0 and math.isfinite(peft.alpha)):
        raise ConfigError(f"peft.alpha must be a positive finite number, got {peft.alpha}")
    if not 0 <= peft.dropout < 1:
        raise ConfigError(f"peft.dropout must be in [0, 1), got {peft.dropout}")
    if not peft.target_modules:
        raise ConfigError("peft.target_modules is empty: name the modules to adapt, or all-linear")
    if config.distributed.tp_size > 1:
        raise ConfigError(f"peft with distributed.tp_size({config.distributed.tp_size}) > 1 is not supported: the "
                          f"model's tensor-parallel plan shards linear layers, which LoRA layers wrap; use dp, cp "
                          f"or pp for a LoRA student")
    if config.model.pure_half_precision:
        raise ConfigError("peft with model.pure_half_precision: the adapters train in float32 on the frozen base; "
                          "set model.pure_half_precision to false")


def _check_world(config: KDRecipeConfig, check_layout: Callable[[int], Any], sections: str) -> None:
    """The world the layout needs (when it says): not absurdly large, laid out by `check_layout` (ValueError
    naming the key), its student's batches divisible by its data-parallel size."""
    world_size = required_world_size(config)
    if world_size is None:
        return
    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(f"the layout needs {world_size} ranks, more than meshkd lays out ({MAX_WORLD_SIZE}): check "
                          f"the *_size keys of {sections}")
    try:
        check_layout(world_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    steps, student_dp = config.step_scheduler, config.distributed.dp_size
    if steps.global_batch_size % (steps.local_batch_size * student_dp):
        raise ConfigError(
            f"step_scheduler.global_batch_size({steps.global_batch_size}) must be divisible by "
            f"local_batch_size({steps.local_batch_size}) * distributed.dp_size({student_dp})"
        )


def _check_teachers(config: KDRecipeConfig) -> None:
    """`teachers` replaces the one-teacher keys; names, weights and the combining rule."""
    given = {"teacher_model": config.teacher_model != ModelConfig(), "teacher_distributed":
             config.teacher_distributed is not None, "separate_meshes": config.separate_meshes}
    clash = [key for key, used in given.items() if used]
    if clash:
        raise ConfigError(f"teachers replaces {', '.join(clash)}: give each teacher's model and layout in its "
                          "entry (teachers[i].model, teachers[i].distributed; none: on the student's ranks)")
    if not config.teachers:
        raise ConfigError("teachers is empty: give at least one teacher, or use teacher_model")
    names = [teacher.name for teacher in config.teachers]
    for index, teacher in enumerate(config.teachers):
        if not teacher.name or not teacher.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"teachers[{index}].name must be a name of letters, digits, - and _, got "
                              f"{teacher.name!r}")
        if teacher.name in names[:index]:
            raise ConfigError(f"teachers[{index}].name {teacher.name!r} is already teachers"
                              f"[{names.index(teacher.name)}]'s: each teacher needs a name of its own")
        if not (teacher.weight >= 0 and math.isfinite(teacher.weight)):
            raise ConfigError(f"teachers.{teacher.name}.weight must be a finite number >= 0, got {teacher.weight}")
    if sum(teacher.weight for teacher in config.teachers) <= 0:
        raise ConfigError("teachers: every weight is 0; give at least one teacher a weight > 0")
    kd = config.kd
    if kd.combine not in ("sum", "mixture", "route"):
        raise ConfigError(f"kd.combine must be sum, mixture or route, got {kd.combine!r}")
    if (kd.combine == "route") != (config.dataset.teacher_key is not None):
        raise ConfigError("kd.combine route sends each row to the teacher its documents name: it needs "
                          "dataset.teacher_key (the JSONL field with the name), and dataset.teacher_key needs it")
    if kd.combine == "route":
        _check_routing(config)
    if kd.combine == "mixture":
        for teacher in config.teachers:
            transport = teacher.logits_transport or kd.logits_transport
            if transport not in ("full", "full_bf16"):
                raise ConfigError(f"kd.combine mixture mixes the teachers' whole distributions: "
                                  f"teachers.{teacher.name}.logits_transport (or kd.logits_transport) must be full "
                                  f"or full_bf16, got {transport!r}")
    if kd.teacher_cache is not None:
        raise ConfigError("kd.teacher_cache: with several teachers each has its own, teachers[i].cache")
    if kd.cross_tokenizer is not None:
        raise ConfigError("kd.cross_tokenizer does not yet work with several teachers (teachers); use one teacher "
                          "(teacher_model) for it")


def _check_routing(config: KDRecipeConfig) -> None:
    cached = [teacher.name for teacher in config.teachers if teacher.cache is not None]
    if cached:
        raise ConfigError(f"teachers.{cached[0]}.cache does not yet work with kd.combine route (a cache holds "
                          "the rows of unrouted packing)")
    for teacher in config.teachers:
        if teacher.weight != 1.0:
            raise ConfigError(f"teachers.{teacher.name}.weight: with kd.combine route each row learns from its "
                              "own teacher alone, so weights have no effect; leave them out")
    transports = {teacher.logits_transport or config.kd.logits_transport for teacher in config.teachers}
    if len(transports) > 1:
        raise ConfigError(f"kd.combine route puts the teachers' answers for one micro-batch together: give every "
                          f"teacher the same logits_transport, got {sorted(transports)}")
    if config.kd.mode == "on_policy":
        raise ConfigError("kd.combine route does not yet work with kd.mode on_policy (the prompts would need "
                          "their teacher too)")


def _validate_one(config: KDRecipeConfig, *, check_world: bool) -> None:
    """`validate` of a one-teacher config; `check_world`: also the layout against the world it needs."""
    for label, model in (("model", config.model), ("teacher_model", config.teacher_model)):
        if (label == "teacher_model" and config.kd.teacher_cache is not None and model.path is None
                and model.random_init is None):
            continue  # no teacher given: the cache's stands
        if (model.path is None) == (model.random_init is None):
            raise ConfigError(f"{label}: set exactly one of {label}.path or {label}.random_init")
        if isinstance(model.keep_layers, dict):
            _check_layer_selection(label, model.keep_layers)
        if model.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"{label}.dtype must be float32, bfloat16 or float16, got {model.dtype!r}")
        # The recipe hands attention prepared 4D masks, which flash and flex attention do not take.
        if model.attn_implementation not in (None, "sdpa", "eager"):
            raise ConfigError(f"{label}.attn_implementation: {model.attn_implementation!r} is not supported; "
                              "use sdpa or eager")
    _check_student_precision(config.model, config.teacher_model)
    kd = config.kd
    if not 0.0 <= kd.kd_ratio <= 1.0:
        raise ConfigError(f"kd.kd_ratio must be in [0, 1], got {kd.kd_ratio}")
    if not (kd.temperature > 0 and math.isfinite(kd.temperature)):
        raise ConfigError(f"kd.temperature must be a finite number > 0, got {kd.temperature}")
    if kd.logits_transport not in ("full", "full_bf16", "topk"):
        raise ConfigError(f"kd.logits_transport must be full, full_bf16 or topk, got {kd.logits_transport!r}")
    if kd.topk < 1 or kd.topk_tail_samples < 0:
        raise ConfigError(f"kd.topk must be >= 1 and kd.topk_tail_samples >= 0, got {kd.topk}, {kd.topk_tail_samples}")
    if kd.on_nonfinite not in ("stop", "skip_step"):
        raise ConfigError(f"kd.on_nonfinite must be stop or skip_step, got {kd.on_nonfinite!r}")
    if kd.max_skipped_steps < 0:
        raise ConfigError(f"kd.max_skipped_steps must be >= 0, got {kd.max_skipped_steps}")
    _check_on_policy(config)
    _check_cross_tokenizer(config)
    router = kd.router_aux_loss_coef
    if router is not None and not (router >= 0 and math.isfinite(router)):
        raise ConfigError(f"kd.router_aux_loss_coef must be a finite number >= 0 or null, got {router}")
    if kd.chunk_size is not None and kd.chunk_size < 1:
        raise ConfigError(f"kd.chunk_size must be >= 1, got {kd.chunk_size}")
    _check_dataset(config)
    steps = config.step_scheduler
    for name in ("max_steps", "global_batch_size", "local_batch_size", "sequence_length"):
        if getattr(steps, name) < 1:
            raise ConfigError(f"step_scheduler.{name} must be >= 1, got {getattr(steps, name)}")
    for name in ("val_every_steps", "val_batches", "ckpt_every_steps"):
        if getattr(steps, name) is not None and getattr(steps, name) < 1:
            raise ConfigError(f"step_scheduler.{name} must be >= 1 or null, got {getattr(steps, name)}")
    _check_optimizer(config.optimizer)
    schedule = config.lr_scheduler
    if schedule.decay not in ("cosine", "linear", "constant"):
        raise ConfigError(f"lr_scheduler.decay must be cosine, linear or constant, got {schedule.decay!r}")
    if schedule.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps must be >= 0, got {schedule.warmup_steps}")
    if schedule.total_steps is not None and schedule.total_steps < 1:
        raise ConfigError(f"lr_scheduler.total_steps must be >= 1 or null, got {schedule.total_steps}")
    if not 0.0 <= schedule.min_lr_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_ratio must be in [0, 1], got {schedule.min_lr_ratio}")
    if not (config.collective_timeout_s > 0 and math.isfinite(config.collective_timeout_s)):
        raise ConfigError(f"collective_timeout_s must be a finite number of seconds > 0, got "
                          f"{config.collective_timeout_s}")
    if not (config.setup_timeout_s > 0 and math.isfinite(config.setup_timeout_s)):
        raise ConfigError(f"setup_timeout_s must be a finite number of seconds > 0, got {config.setup_timeout_s}")
    if config.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu or cuda, got {config.device!r}")
    if check_world:
        _check_world(config, lambda world_size: validate_kd_config(config, world_size),
                     "distributed and teacher_distributed")


def _check_dataset(config: KDRecipeConfig) -> None:
    dataset = config.dataset
    if dataset.on_bad_file not in ("error", "skip"):
        raise ConfigError(f"dataset.on_bad_file must be error or skip, got {dataset.on_bad_file!r}")
    if not dataset.paths and dataset.hf is None:
        raise ConfigError("dataset.paths is empty and dataset.hf unset: give text, JSONL, parquet, CSV, arrow or "
                          "JSON files (globs allowed), or a Hugging Face dataset")
    if dataset.hf is not None and not dataset.hf.path:
        raise ConfigError("dataset.hf.path is empty: give a save_to_disk directory, a Hub id or a datasets builder")
    if dataset.tokenize_workers < 1:
        raise ConfigError(f"dataset.tokenize_workers must be >= 1, got {dataset.tokenize_workers}")
    if dataset.records not in RECORD_FORMATS:
        raise ConfigError(f"dataset.records must be one of {', '.join(RECORD_FORMATS)}, got {dataset.records!r}")
    if dataset.train_on not in TRAIN_ON:
        raise ConfigError(f"dataset.train_on must be one of {', '.join(TRAIN_ON)}, got {dataset.train_on!r}")
    if dataset.records != "text" and config.kd.cross_tokenizer is not None:
        raise ConfigError(f"dataset.records {dataset.records!r} with kd.cross_tokenizer is not supported yet (each "
                          "side would render the row with its own template); use text rows")


def _check_on_policy(config: KDRecipeConfig) -> None:
    kd, generation = config.kd, config.kd.generation
    try:
        check_divergence(kd.divergence, kd.jsd_beta, kd.logits_transport)
    except ValueError as error:
        raise ConfigError(f"kd.divergence / kd.jsd_beta / kd.logits_transport: {error}") from None
    if kd.mode not in ("off_policy", "on_policy"):
        raise ConfigError(f"kd.mode must be off_policy or on_policy, got {kd.mode!r}")
    if not 0.0 <= kd.on_policy_fraction <= 1.0:
        raise ConfigError(f"kd.on_policy_fraction must be in [0, 1], got {kd.on_policy_fraction}")
    if generation.max_new_tokens < 1 or generation.prompt_tokens < 1:
        raise ConfigError(f"kd.generation.max_new_tokens and prompt_tokens must be >= 1 (a prompt is never empty), "
                          f"got {generation.max_new_tokens}, {generation.prompt_tokens}")
    if not (generation.temperature >= 0 and math.isfinite(generation.temperature)):
        raise ConfigError(f"kd.generation.temperature must be a finite number >= 0, got {generation.temperature}")
    if not 0.0 < generation.top_p <= 1.0:
        raise ConfigError(f"kd.generation.top_p must be in (0, 1], got {generation.top_p}")
    if any(token < 0 for token in generation.stop_tokens or ()):
        raise ConfigError(f"kd.generation.stop_tokens must be token ids >= 0, got {generation.stop_tokens}")
    sequence_length = config.step_scheduler.sequence_length
    longest = (1 if config.dataset.whole_prompts else generation.prompt_tokens) + generation.max_new_tokens
    if kd.mode == "on_policy" and longest > sequence_length:
        raise ConfigError(f"kd.generation.prompt_tokens ({generation.prompt_tokens}) + max_new_tokens "
                          f"({generation.max_new_tokens}) exceed step_scheduler.sequence_length ({sequence_length})"
                          if not config.dataset.whole_prompts else
                          f"kd.generation.max_new_tokens ({generation.max_new_tokens}) leaves no room for a prompt "
                          f"in step_scheduler.sequence_length ({sequence_length})")
    if kd.mode != "on_policy" and not generation.evaluate:
        return
    if kd.teacher_cache is not None:
        raise ConfigError("kd.mode on_policy and kd.generation.evaluate need a live teacher to score the "
                          "student's completions; kd.teacher_cache holds logits of dataset text only")
    if kd.kd_ratio == 0 and kd.mode == "on_policy":
        raise ConfigError("kd.mode on_policy with kd.kd_ratio 0 trains on the student's own samples without "
                          "a teacher; set kd.kd_ratio > 0 (1 is GKD's pure divergence)")
    student = config.distributed
    if student.pp_size > 1 or student.cp_size > 1:
        raise ConfigError(f"kd.mode on_policy / kd.generation.evaluate: the student generates with its whole "
                          f"model on each rank's own prompts, which pipeline and context parallel students do not "
                          f"hold; got distributed.pp_size {student.pp_size}, cp_size {student.cp_size} (use dp and tp)")


def _check_cross_tokenizer(config: KDRecipeConfig) -> None:
    cross, kd, student = config.kd.cross_tokenizer, config.kd, config.distributed
    if cross is None:
        return
    if cross.loss not in ("projection", "uld", "gold"):
        raise ConfigError(f"kd.cross_tokenizer.loss must be projection, uld or gold, got {cross.loss!r}")
    if cross.loss != "projection":  # the teacher sends each group's whole distribution over its own vocabulary
        needs = {"kd.logits_transport": ("full", kd.logits_transport), "kd.teacher_cache": (None, kd.teacher_cache),
                 "distributed.tp_size": (1, student.tp_size)}
        for key, (needed, value) in needs.items():
            if value != needed:
                raise ConfigError(f"kd.cross_tokenizer.loss {cross.loss} needs {key} {needed}, got {value!r} (the "
                                  "teacher answers each group's whole distribution over its own vocabulary)")
        divergences = ("forward_kl",) if cross.loss == "uld" else ("forward_kl", "reverse_kl")
        if kd.divergence not in divergences:
            raise ConfigError(f"kd.divergence {kd.divergence} with kd.cross_tokenizer.loss {cross.loss}: it takes "
                              f"{' or '.join(divergences)}" + (" (ULD is a distance of its own: leave the key at "
                                                              "forward_kl)" if cross.loss == "uld" else ""))
    if cross.teacher_sequence_length is not None and cross.teacher_sequence_length < 2:
        raise ConfigError(f"kd.cross_tokenizer.teacher_sequence_length must be >= 2 or null, "
                          f"got {cross.teacher_sequence_length}")
    if kd.divergence == "reverse_kl" and cross.loss == "projection":
        raise ConfigError("kd.divergence reverse_kl with kd.cross_tokenizer: the projected teacher gives no "
                          "probability to student tokens no teacher token maps to (an infinite reverse KL); use "
                          "forward_kl or jsd")
    unsupported = {f"distributed.pp_size {student.pp_size}": student.pp_size > 1,
                   f"distributed.cp_size {student.cp_size}": student.cp_size > 1}
    refused = [name for name, used in unsupported.items() if used]
    if refused:
        raise ConfigError(f"kd.cross_tokenizer does not yet work with {', '.join(refused)}: the student's rows carry "
                          "the teacher's tokenization whole (students use dp and tp)")


def _check_student_precision(student: ModelConfig, teacher: ModelConfig) -> None:
    if teacher.pure_half_precision:
        raise ConfigError("teacher_model.pure_half_precision: the teacher runs forward only and keeps "
                          "teacher_model.dtype as its weights' dtype; the key is for the student")
    if teacher.activation_checkpointing:
        raise ConfigError("teacher_model.activation_checkpointing: the teacher runs forward only and keeps no "
                          "activations for a backward; the key is for the student")
    if student.dtype == "float16":
        raise ConfigError("model.dtype float16: a float16 student needs dynamic loss scaling, which meshkd does "
                          "not do (its gradients underflow below 6e-8 and its activations overflow above 65504); "
                          "use bfloat16, which has float32's range at the same memory")
    if student.pure_half_precision and student.dtype != "bfloat16":
        raise ConfigError(f"model.pure_half_precision keeps the parameters in model.dtype, which must then be "
                          f"bfloat16; got {student.dtype!r}")


def _check_layer_selection(label: str, selection: dict) -> None:
    key = f"{label}.keep_layers"
    if label != "model":
        raise ConfigError(f"{key}: {{auto: N}} chooses a student's layers; give the teacher's as a list")
    unknown = sorted(set(selection) - {"auto", "by", "calibration_rows"})
    if unknown or "auto" not in selection:
        raise ConfigError(f"{key} must be a list of layers or {{auto: N}} (optional by, calibration_rows), got "
                          f"{selection}")
    for name in ("auto", "calibration_rows"):
        value = selection.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}.{name} must be an integer >= 1, got {value!r}")
    if selection.get("by", "block") not in ("block", "layer"):
        raise ConfigError(f"{key}.by must be block or layer, got {selection['by']!r}")


def _check_optimizer(optimizer: OptimizerConfig) -> None:
    """Values torch would reject only inside the workers, or accept and train to NaN with."""
    if optimizer.name not in ("adamw", "sgd"):
        raise ConfigError(f"optimizer.name must be adamw or sgd, got {optimizer.name!r}")
    if not (optimizer.lr > 0 and math.isfinite(optimizer.lr)):
        raise ConfigError(f"optimizer.lr must be a finite number > 0, got {optimizer.lr}")
    if not (optimizer.weight_decay >= 0 and math.isfinite(optimizer.weight_decay)):
        raise ConfigError(f"optimizer.weight_decay must be a finite number >= 0, got {optimizer.weight_decay}")
    if not (optimizer.eps > 0 and math.isfinite(optimizer.eps)):
        raise ConfigError(f"optimizer.eps must be a finite number > 0, got {optimizer.eps}")
    if len(optimizer.betas) != 2 or not all(0.0 <= beta < 1.0 for beta in optimizer.betas):
        raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {optimizer.betas}")
    if optimizer.max_grad_norm is not None and not (optimizer.max_grad_norm > 0
                                                    and math.isfinite(optimizer.max_grad_norm)):
        raise ConfigError(f"optimizer.max_grad_norm must be a finite number > 0 or null, got {optimizer.max_grad_norm}")
