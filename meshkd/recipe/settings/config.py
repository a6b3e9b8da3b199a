"""Recipe configuration: typed dataclasses (YAML is their serialized form), built by `load_config`
(`config_loading`) and checked once at load (`config_checks`), both of which import this module and not the
reverse. A value derived from keys is a property that says so; none is rewritten."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from meshkd.core.answers.labels import SAMPLED_REVERSE_KL
from meshkd.core.teacher_protocol import LABEL_LOG_PROBS
from meshkd.recipe.records import format_named
from meshkd.recipe.settings.typed_yaml import ConfigError, apply_override

__all__ = ["ConfigError", "KDRecipeConfig", "apply_override"]


@dataclass
class ModelConfig:
    """Where a model comes from: exactly one of `path` (HF directory or .gguf file) or `random_init`; a teacher
    may instead be served elsewhere (`url`)."""
    path: str | None = None  # an HF model directory, or the directory of `gguf_file`
    url: str | None = None  # teacher: served by `meshkd serve-teacher` at http(s)://host:port, no ranks in training
    api: str = "meshkd"  # with url: meshkd (`meshkd serve-teacher`) | completions (vLLM's OpenAI-compatible server)
    served_model: str | None = None  # with api completions: the `model` its requests name; None: the server's default
    gguf_file: str | None = None  # a GGUF file inside `path`
    random_init: dict | None = None  # HF config kwargs with `model_type`: random weights, tiny models for tests
    keep_layers: list[int] | dict | None = None  # decoder layers kept, in order; {auto: N}: layer_selection
    tokenizer: str | None = None  # None: the model's own; "byte": meshkd's offline byte tokenizer; or a path
    dtype: str = "float32"  # the teacher's weights dtype; the student's compute dtype (float32 master weights)
    pure_half_precision: bool = False  # student: parameters and optimizer states in `dtype`, no float32 copy
    activation_checkpointing: bool = False  # student: each decoder layer recomputes its activations in backward
    seed: int = 0  # seeds `random_init`'s weights (and a LoRA student's adapters)
    # sdpa | eager | flex_attention (packed rows masked by FlexAttention block masks, not a 4D mask; GPU
    # students, CPU teachers); None: sdpa where the model supports it, else eager
    attn_implementation: str | None = None

    def parameter_dtype(self) -> str:
        """Derived: the student's parameter and optimizer-state dtype: float32, or `dtype` with pure_half_precision."""
        return self.dtype if self.pure_half_precision else "float32"


@dataclass
class DistributedConfig:
    """One role's parallel layout (see meshkd.core.topology)."""
    strategy: str = "fsdp2"  # fsdp2 | ddp: how data-parallel ranks share the student
    dp_size: int | None = None  # data-parallel ranks; None (shared meshes only): the world / (tp * cp * pp)
    dp_replicate_size: int = 1  # replica groups among the dp ranks (HSDP); each shards over dp / this
    tp_size: int = 1  # tensor-parallel ranks
    cp_size: int = 1  # context-parallel ranks (each holds a slice of the sequence)
    pp_size: int = 1  # pipeline stages
    ep_size: int = 1  # MoE expert-parallel ranks: tp_size, or with tp 1 the dp shard size; adds no ranks
    sequence_parallel: bool = False  # tensor parallel's activations sharded along the sequence; students refuse it
    pp_schedule: str = "1f1b"  # student pipeline schedule: 1f1b or gpipe


@dataclass
class RolloutEngineConfig:
    """A running vLLM server that draws the on-policy completions, its weights following the student's
    (meshkd.recipe.student.rollout_engine)."""
    url: str = ""  # http(s)://host:port of vLLM's OpenAI-compatible server, started with VLLM_SERVER_DEV_MODE=1
    served_model: str | None = None  # the `model` its requests name; None: the server's only model
    weights_dir: str | None = None  # the student's weights for the server to reload; None: RUN_DIR/rollout_weights
    dtype: str | None = None  # the weights written: float32 | bfloat16 (the server's --dtype); None: model.dtype
    sync_every: int = 1  # optimizer steps between two weight syncs
    max_staleness: int = 0  # optimizer steps the sampling weights may lag; 0: synchronous, >= 1: one step ahead
    max_concurrent_requests: int = 64  # requests in flight from one rank (one request a row)
    timeout_s: float = 600.0  # one request's limit (a reload's too)


@dataclass
class GenerationSettingsConfig:
    """How the student completes prompts with kd.mode: on_policy (meshkd.recipe.student.on_policy)."""
    max_new_tokens: int = 32  # tokens the student generates after each prompt at most
    temperature: float = 1.0  # 0: the likeliest token each time
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this much probability
    stop_tokens: list[int] | None = None  # None: the tokenizer's end-of-text token; []: none
    prompt_tokens: int = 32  # without dataset.prompt_key: each row's first document, cut to this many tokens
    seed: int = 0  # seeds each row's sampling and which micro-batches are on-policy
    evaluate: bool | None = None  # teacher_nll_of_samples at the first and last evaluation; None: on-policy runs
    engine: RolloutEngineConfig | None = None  # training completions from a vLLM server; None: the student's generate


@dataclass
class CrossTokenizerConfig:
    """A teacher with another tokenizer (`meshkd.recipe.corpus.aligned_data`): each row tokenized by both, aligned by
    bytes."""
    loss: str = "projection"  # projection (NeMo RL's X-Token) | uld (Boizard et al.) | gold (TRL's GOLD)
    teacher_sequence_length: int | None = None  # teacher tokens per row; None: step_scheduler.sequence_length


@dataclass
class HiddenStatesConfig:
    """Intermediate-layer KD (`meshkd.recipe.teacher.hidden_states`): paired decoder layers' outputs, before any final
    norm."""
    pairs: list[list[int]] | str = "kept"  # [[student layer, teacher layer], ...]; kept: model.keep_layers' own
    loss: str = "cosine"  # cosine (1 - cosine similarity) | mse (mean over the width), per counted position
    weight: float = 1.0  # the term's weight in the objective, beside CE and logit KD


@dataclass
class TeacherConfig:
    """One of several teachers (`teachers`): a name, its model, its weight in the objective and its ranks."""
    name: str = ""  # letters, digits, - and _ (what dataset.teacher_key and --teacher name)
    model: ModelConfig = field(default_factory=ModelConfig)  # a model section, as teacher_model
    weight: float = 1.0  # the weights are normalized to sum to 1 (kd.combine)
    distributed: DistributedConfig | None = None  # ranks of its own with this layout; None: the student's ranks
    logits_transport: str | None = None  # how its logits travel; None: kd.logits_transport
    cache: str | None = None  # its answers, from `meshkd cache-teacher CONFIG --teacher NAME`: no ranks for it


@dataclass
class KDConfig:
    """The objective: loss = (1 - kd_ratio) * CE + kd_ratio * KD, and how the teacher's answers reach it."""
    kd_ratio: float = 0.5  # the KD share of the loss; 1: no CE
    temperature: float = 1.0  # both distributions at temperature T, the divergence scaled by T^2
    ignore_index: int = -100  # the label of tokens no loss counts
    chunk_size: int | None = None  # tokens per loss chunk; None: one chunk
    logits_transport: str = "full"  # full | full_bf16 | topk: how teacher logits travel (meshkd.core.answers)
    topk: int = 64  # entries per token with logits_transport: topk
    topk_tail_samples: int = 32  # sampled tail tokens per token with topk; 0: one rest bucket for the tail
    topk_encoding: str = "exact"  # exact | compact: top-k answers packed (meshkd.core.answers.compact)
    fused_output_loss: bool = True  # the output layer applied inside the loss, chunk by chunk: no whole logits
    overlap_teacher: bool = True  # separate meshes: fetch the next micro-batch's teacher logits while training
    teacher_cache: str | None = None  # a directory `meshkd cache-teacher` writes; train reads it: no teacher ranks
    teacher_cache_coding: str = "entropy"  # entropy | fixed: compact answers in the cache (meshkd.core.cache_coding)
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient norm: stop (the run fails) | skip_step (no update)
    max_skipped_steps: int = 10  # with skip_step: the run fails at the next non-finite step after this many
    mode: str = "off_policy"  # off_policy: dataset text | on_policy: also the student's own completions
    on_policy_fraction: float = 1.0  # with on_policy: the share of micro-batches the student completes
    divergence: str = "forward_kl"  # forward_kl | reverse_kl | jsd | skew_forward_kl | skew_reverse_kl | tvd |
    # sampled_reverse_kl (on-policy: the reverse KL estimated on the student's sampled tokens, `sampled_estimator`)
    sampled_estimator: str = "k1"  # k1 | k3: sampled_reverse_kl's estimator of each token (meshkd.core.answers.labels)
    jsd_beta: float = 0.5  # beta of jsd, in (0, 1)
    skew_alpha: float = 0.1  # alpha of skew_forward_kl and skew_reverse_kl, in (0, 1)
    router_aux_loss_coef: float | None = None  # MoE student's load-balancing loss weight; None: its config's
    generation: GenerationSettingsConfig = field(default_factory=GenerationSettingsConfig)  # student completions
    cross_tokenizer: CrossTokenizerConfig | None = None  # a teacher with another tokenizer; None: the same one
    combine: str = "sum"  # several teachers: sum of divergences | mixture of distributions | route rows to one
    hidden_states: HiddenStatesConfig | None = None  # intermediate-layer KD; None: the logits alone

    @property
    def samples_the_divergence(self) -> bool:
        """Derived: whether the KD term is estimated on the sampled tokens (`divergence: sampled_reverse_kl`)."""
        return self.divergence == SAMPLED_REVERSE_KL

    @property
    def training_answer(self) -> str:
        """Derived: what training requests ask of the teacher: each label's log-probability for a divergence
        estimated on the sampled tokens, else `logits_transport`'s encoding."""
        return LABEL_LOG_PROBS if self.samples_the_divergence else self.logits_transport

    @property
    def evaluates_samples(self) -> bool:
        """Derived: whether evaluations score the student's completions (`generation.evaluate`; None: on-policy)."""
        return self.generation.evaluate if self.generation.evaluate is not None else self.mode == "on_policy"

    @property
    def generates(self) -> bool:
        """Derived: whether the student completes prompts: to train on them (on-policy), or to evaluate them."""
        return self.mode == "on_policy" or self.evaluates_samples


@dataclass
class HFDatasetConfig:
    """A Hugging Face dataset (`meshkd.recipe.corpus.hf_sources`), read from local files or the local Hub cache."""
    path: str = ""  # a save_to_disk directory, a Hub id, or a builder name
    name: str | None = None  # the subset (a Hub dataset's configuration)
    split: str = "train"  # the split to read
    revision: str | None = None  # a Hub dataset's revision (branch, tag or commit)
    data_files: list[str] | None = None  # the files a builder reads
    streaming: bool = False  # read row by row, no Arrow copy in the datasets cache


@dataclass
class DatasetConfig:
    """The corpus: text files (one document each), JSONL / parquet / CSV / arrow / JSON rows, an HF dataset."""
    paths: list[str] = field(default_factory=list)  # files and globs, read in order; ${stdlib}: Python's sources
    hf: HFDatasetConfig | None = None  # a Hugging Face dataset, read after the files of paths
    format: str | None = None  # text | jsonl: read every file of paths so; null: by extension
    records: str = "text"  # what a row holds: text | chat (messages) | prompt_completion (meshkd.recipe.records)
    train_on: str = "answers"  # chat / prompt_completion: answers | last_answer | all (tokens the loss counts)
    chat_template: bool | None = None  # prompt_completion rendered with model.tokenizer's template; null: if it has one
    text_key: str = "text"  # the column holding the text of text rows
    messages_key: str = "messages"  # chat: a list of {role, content}
    chat_roles: list[str] = field(default_factory=list)  # roles a message may have beyond system, user, assistant, tool
    prompt_key: str | None = None  # prompt_completion: the prompt column ("prompt"); text: on-policy prompts
    completion_key: str = "completion"  # prompt_completion: the completion column
    system_key: str | None = None  # prompt_completion: a column holding a system message
    context_key: str | None = None  # prompt_completion: a column joined before the prompt
    val_fraction: float = 0.05  # the share of documents held out for validation
    seed: int = 0  # seeds the split and the shuffling of rows
    max_documents: int | None = None  # read at most this many documents
    max_document_chars: int | None = None  # cut each document to this many characters
    packing: bool = True  # NEAT-pack several documents per row; false: one document per row
    token_store: str | None = None  # a directory of token stores (memory-mapped); null: $MESHKD_CACHE's
    tokenize_workers: int = 1  # processes that tokenize rows into the token store (spawned: guard your __main__)
    on_bad_file: str = "error"  # a binary or non-UTF-8 file: error (refused, named) | skip (left out, named)
    teacher_key: str | None = None  # with kd.combine route: the JSONL field naming each document's teacher

    @property
    def whole_prompts(self) -> bool:
        """Derived: whether on-policy prompts are whole (a `prompt_key` column, or rows that mark their answers)."""
        return self.prompt_key is not None or format_named(self.records).marks_answers


@dataclass
class StepSchedulerConfig:
    """How long the run trains, on how many rows a step, and when it evaluates and checkpoints."""
    max_steps: int = 100  # optimizer steps
    global_batch_size: int = 8  # rows per optimizer step, over all data-parallel ranks
    local_batch_size: int = 1  # rows per micro-batch on one data-parallel rank
    sequence_length: int = 256  # tokens per (packed) row
    val_every_steps: int | None = None  # evaluate also every this many steps; None: at the start and end only
    val_batches: int | None = None  # batches per evaluation; None: the whole validation split
    ckpt_every_steps: int | None = None  # checkpoint every this many steps; None: only when the run is stopped


@dataclass
class OptimizerConfig:
    """The student's optimizer and gradient clipping."""
    name: str = "adamw"  # adamw | sgd
    lr: float = 1e-4  # the peak learning rate
    weight_decay: float = 0.0  # decoupled weight decay (AdamW); L2 with sgd
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's beta1, beta2
    eps: float = 1e-8  # AdamW's epsilon
    max_grad_norm: float | None = 1.0  # clip the global gradient norm to this; None: no clipping


@dataclass
class LRSchedulerConfig:
    """The learning-rate factor over steps: linear warmup, then a decay to `min_lr_ratio`."""
    warmup_steps: int = 0  # steps of linear warmup from 1 / warmup_steps of the peak
    decay: str = "cosine"  # cosine | linear | constant
    total_steps: int | None = None  # length of the schedule; None: step_scheduler.max_steps
    min_lr_ratio: float = 0.1  # the factor at the schedule's end (`meshkd.recipe.student.train_step.lr_factor`)


@dataclass
class CheckpointConfig:
    """Sharded checkpoints of the run (to resume) and the trained student's HF export."""
    enabled: bool = True  # write checkpoints (and the HF export); false: neither
    dir: str | None = None  # default: RUN_DIR/checkpoints
    save_hf: bool = True  # write the final student in HF format to RUN_DIR/hf_student


@dataclass
class LoggingConfig:
    """Where the run writes its records, and what it shows while it runs."""
    run_dir: str = "runs/meshkd"  # RUN_DIR: metrics, the resolved config, checkpoints and the export
    progress_bar: bool = True  # a tqdm bar on rank 0
    tensorboard: bool = False  # also write TensorBoard events to RUN_DIR
    summary: bool = True  # rank 0 prints how the run ended and its figures (`meshkd.recipe.lifecycle.run_report`)


@dataclass
class PeftConfig:
    """LoRA adapters on the student (`meshkd.recipe.modeling.adapters`): the base weights frozen, the adapters
    trained."""
    rank: int = 8  # r: the inner dimension of each adapter's two matrices
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # on each adapter's input while training
    target_modules: str | list[str] = "all-linear"  # module names (or suffixes), or every linear but the head


@dataclass
class KDRecipeConfig:
    """A whole run: the student, its teacher(s) and their ranks, the objective, the data and the schedule."""
    model: ModelConfig = field(default_factory=ModelConfig)  # the student
    teacher_model: ModelConfig = field(default_factory=ModelConfig)  # the teacher (optional with kd.teacher_cache)
    separate_meshes: bool = False  # the teacher on ranks of its own, `teacher_distributed` (not with kd.teacher_cache)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # the student's layout
    teacher_distributed: DistributedConfig | None = None  # the teacher's own layout, with separate_meshes
    teachers: list[TeacherConfig] | None = None  # in place of the keys above, which are a list of one (teacher_list)
    kd: KDConfig = field(default_factory=KDConfig)  # the objective and the teacher's answers
    dataset: DatasetConfig = field(default_factory=DatasetConfig)  # the corpus and its rows
    step_scheduler: StepSchedulerConfig = field(default_factory=StepSchedulerConfig)  # steps, batches, intervals
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # the student's optimizer
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)  # the learning-rate schedule
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # checkpoints and the HF export
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # the run directory and what is shown
    peft: PeftConfig | None = None  # null: the whole student trains
    seed: int = 0  # seeds torch on every rank
    device: str = "auto"  # auto | cpu | cuda
    collective_timeout_s: float = 600.0  # how long a collective waits for a peer
    # How long ranks wait for each other to load and lay out models and data or resume, and a teacher on its
    # own ranks for the student's next request (which may follow a checkpoint save or the export).
    setup_timeout_s: float = 3600.0

    @property
    def teacher_sequence_length(self) -> int:
        """Derived: teacher tokens per row: `kd.cross_tokenizer.teacher_sequence_length`, else the student's."""
        cross = self.kd.cross_tokenizer
        if cross is not None and cross.teacher_sequence_length is not None:
            return cross.teacher_sequence_length
        return self.step_scheduler.sequence_length

    def teacher_list(self) -> list[TeacherConfig]:
        """Derived: the teachers as one list, what every teacher-side part of a run takes with the run's shared
        settings (`kd_of`, `layout_of`). The one-teacher keys are the list of one, named `teacher`: ranks of its
        own (`teacher_distributed`) with `separate_meshes`, its answers from `kd.teacher_cache` if set."""
        if self.teachers is not None:
            return self.teachers
        return [TeacherConfig(name="teacher", model=self.teacher_model, cache=self.kd.teacher_cache,
                              distributed=self.teacher_distributed if self.separate_meshes else None)]

    def teacher_named(self, name: str | None = None) -> TeacherConfig:
        """Derived: teacher `name` of `teacher_list`; None: the only one.

        Raises:
            ConfigError: no teacher of that name, or None with several, naming those there are.
        """
        teachers = {teacher.name: teacher for teacher in self.teacher_list()}
        if name is None and len(teachers) == 1:
            return next(iter(teachers.values()))
        if name not in teachers:
            raise ConfigError(f"teachers: {'give one of' if name is None else f'no teacher named {name!r}; give'} "
                              f"{', '.join(teachers)}")
        return teachers[name]

    def kd_of(self, teacher: TeacherConfig) -> KDConfig:
        """Derived: `kd` as `teacher` answers it: its own logits transport and cache."""
        return replace(self.kd, teacher_cache=teacher.cache,
                       logits_transport=teacher.logits_transport or self.kd.logits_transport)

    def layout_of(self, teacher: TeacherConfig) -> DistributedConfig:
        """Derived: `teacher`'s layout: that of its own ranks, else the student's."""
        return teacher.distributed or self.distributed

    def teacher_layouts(self) -> dict[str, DistributedConfig | None]:
        """Derived: teacher name -> the layout of its own ranks in training; None: the student's, its cache, or a
        server elsewhere (`model.url`)."""
        return {teacher.name: teacher.distributed if teacher.cache is None and teacher.model.url is None else None
                for teacher in self.teacher_list()}

    def teacher_weights(self) -> dict[str, float]:
        """Derived: teacher name -> its weight, normalized to sum to 1."""
        weights = {teacher.name: teacher.weight for teacher in self.teacher_list()}
        total = sum(weights.values())
        return {name: weight / total for name, weight in weights.items()}

    def to_dict(self) -> dict:
        """The resolved config as plain data (saved with the run); derived values are not keys."""
        return asdict(self)
