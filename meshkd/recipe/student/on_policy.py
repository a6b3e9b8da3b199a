"""On-policy distillation: the student completes prompts itself, the teacher scores the completions.

Design (GKD, Agarwal et al. 2024). With `kd.mode: on_policy`, a share `kd.on_policy_fraction` of each
step's micro-batches is made of the student's own completions; the rest stays dataset text. Per micro-batch:
1. Prompts: the first `kd.generation.prompt_tokens` tokens of each row's first document, or with
   whole prompts (`build_prompt_set`): the `dataset.prompt_key` column of a text row, or all of a chat /
   prompt_completion row before its last answer (with the template's generation prompt).
2. The student, with its current weights, samples a completion of every prompt (`Sampler`; the default
   `ModelGenerate` runs the model's own `generate`: batched, KV cache, no grad).
3. `completion_batch` lays prompt + completion out as an ordinary row whose labels are the completion's
   tokens only: prompt and padding never count in the loss. The completion's token ids are the sampler's
   own, never text tokenized again, so the teacher scores exactly the tokens the student produced.
4. The teacher scores the rows through the teacher protocol like any micro-batch (any transport), while the
   student generates the next micro-batch; the student trains on them once the step's are all generated,
   so every completion of a step comes from the weights of that step (`OnPolicyStep`).

Several teachers routed per prompt (`kd.combine: route`): a prompt row carries its teacher's index under
`ROUTE` as every routed row does (`meshkd.recipe.corpus.routing`), and its completion row keeps it, so the
teacher ensemble asks each teacher for its own prompts' completions only, as it does off-policy.

Chat rows (rows a chat template renders): the prompt is every turn before the last answer with the template's
generation prompt, and a completion stops at the template's end-of-turn token as well as at EOS
(`sampling_settings`, `meshkd.recipe.records.chat_template.end_of_turn_token`), for every sampler.

Reproducible and layout-free: every row samples with its own generator, seeded by (generation seed, step,
the row's place in the global batch), so the completions depend neither on the data-parallel layout nor on
what a row is batched with, and a resumed run draws what the uninterrupted one drew. The decision which
micro-batches are on-policy depends on (seed, step, index) only, the same on every student rank.

Why every generation runs exactly `max_new_tokens` steps, cut at the first stop token afterwards: the
ranks of an FSDP2 or tensor-parallel student meet in collectives at every forward, so they must run the
same number of forwards whatever their samples.

Another engine: any object with `Sampler.sample`. With `kd.generation.engine` a running vLLM server draws the
training completions, its weights following the student's, synchronously or one step ahead
(`meshkd.recipe.student.rollout_engine.Rollouts`); the step then asks it for all of the step's completions at once
and makes the rows from them (evaluations keep `generate`).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from meshkd.core.teacher_ensemble import ROUTE
from meshkd.core.teacher_protocol import TeacherRequest, TeacherSource
from meshkd.recipe.corpus.data import build_run_datasets
from meshkd.recipe.corpus.rows import PackedDataset, padding_rows
from meshkd.recipe.records import format_named
from meshkd.recipe.records.chat_template import end_of_turn_token
from meshkd.recipe.student.train_step import TrainStep, step_items, sum_over_ranks


def row_seed(seed: int, step: int, row: int) -> int:
    """The sampling seed of global row `row` of step `step`: independent of layout and batching."""
    digest = hashlib.blake2b(f"{seed}:{step}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def is_on_policy(seed: int, step: int, index: int, fraction: float) -> bool:
    """Whether micro-batch `index` of step `step` is the student's own completions (else dataset text)."""
    if fraction >= 1.0 or fraction <= 0.0:
        return fraction >= 1.0
    return row_seed(seed, step, -1 - index) / (1 << 63) < fraction


def prompts_of(batch: dict[str, torch.Tensor], *, limit: int | None,
               eos_token_id: int | None) -> list[torch.Tensor | None]:
    """Each row's prompt: its first document, the end-of-text token dropped, cut to `limit` tokens; None for a
    padding row. A prompt keeps at least one token."""
    prompts = []
    for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
        tokens = ids[mask == 1]
        if len(tokens) == 0:
            prompts.append(None)
            continue
        if len(tokens) > 1 and eos_token_id is not None and int(tokens[-1]) == eos_token_id:
            tokens = tokens[:-1]
        prompts.append(tokens if limit is None else tokens[:limit])
    return prompts


def completion_batch(prompts: list[torch.Tensor | None], completions: list[torch.Tensor], *, sequence_length: int,
                     pad_token_id: int, routes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Rows prompt + completion, right-padded to `sequence_length`; labels the completion's tokens only.

    The label at position i is the token at i + 1 when that token belongs to the completion (so the logits
    at the prompt's last token predict the first generated token); -100 everywhere else. `routes`: the
    prompts' teachers ([rows, 1], `ROUTE`), which the rows keep.
    """
    batch = padding_rows(len(prompts), sequence_length, pad_token_id)
    if routes is not None:
        batch[ROUTE] = routes.detach().cpu().clone()
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        if prompt is None:
            continue
        tokens = torch.cat([prompt.cpu(), completion.cpu()])
        if len(tokens) > sequence_length:
            raise ValueError(f"a prompt of {len(prompt)} tokens and its completion of {len(completion)} exceed the "
                             f"sequence length {sequence_length}")
        length = len(tokens)
        batch["input_ids"][row, :length] = tokens
        batch["position_ids"][row, :length] = torch.arange(length)
        batch["attention_mask"][row, :length] = 1
        batch["labels"][row, len(prompt) - 1 : length - 1] = completion
    return batch


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are drawn (the `kd.generation` section)."""

    max_new_tokens: int
    temperature: float  # 0: the likeliest token each time
    top_p: float
    stop_tokens: tuple[int, ...]


class Sampler(Protocol):
    """What draws the student's completions: the seam for another engine."""

    def sample(self, prompts: list[torch.Tensor], seeds: list[int]) -> list[torch.Tensor]:
        """One completion per prompt (generated tokens only, ending at and including the first stop token),
        row i drawn with a generator seeded by `seeds[i]`. Every rank of the student calls it together."""


class ModelGenerate:
    """The default sampler: the student's own `generate`, batched with left padding and the KV cache.

    `model` is the module to call (the DDP wrapper's inner module; FSDP2 and tensor-parallel modules as they
    are). Sampling happens in a logits processor with one generator per row, so `generate` itself decodes
    greedily on scores that leave a single token possible; on a tensor-parallel student the processor
    gathers the vocabulary-sharded scores first.
    """

    def __init__(self, model: torch.nn.Module, settings: SamplingSettings, *, pad_token_id: int,
                 device: torch.device) -> None:
        self.model, self.settings, self.pad_token_id, self.device = model, settings, pad_token_id, device

    @torch.no_grad()
    def sample(self, prompts: list[torch.Tensor], seeds: list[int]) -> list[torch.Tensor]:
        from transformers import GenerationConfig, LogitsProcessorList

        settings = self.settings
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.int64)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = prompt
            attention_mask[row, width - len(prompt):] = 1
        # eos_token_id []: never stop early (see the module docstring); stop tokens are applied below.
        config = GenerationConfig(max_new_tokens=settings.max_new_tokens, do_sample=False, eos_token_id=[],
                                  pad_token_id=self.pad_token_id)
        was_training = self.model.training
        self.model.eval()
        try:
            with _gathered_once(self.model):
                output = self.model.generate(
                    input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                    generation_config=config, logits_processor=LogitsProcessorList([_RowSampler(settings, seeds)]),
                    # transformers would sync an FSDP model's ranks over the whole world (teacher ranks
                    # included) to stop together; every rank runs all max_new_tokens steps anyway.
                    synced_gpus=False,
                )
        finally:
            self.model.train(was_training)
        return [_cut_at_stop(row, settings.stop_tokens) for row in output[:, width:].cpu()]


@contextlib.contextmanager
def _gathered_once(model: torch.nn.Module) -> Iterator[None]:
    """An FSDP2 student keeps its layers gathered from the first decoding step to the last, then reshards.

    FSDP2 frees a layer's gathered parameters after each forward; decoding runs a forward per token, and
    gathering the whole model once per token costs far more than the forward itself."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [module for module in model.modules() if isinstance(module, FSDPModule)]
    inner = [module for module in sharded if module is not model]  # the root is never resharded after forward
    for module in inner:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module in inner:
            module.set_reshard_after_forward(True, recurse=False)
        for module in sharded:
            module.reshard()


class _RowSampler:
    """Draws each row's next token with its own generator; returns scores where only that token is possible."""

    def __init__(self, settings: SamplingSettings, seeds: list[int]) -> None:
        self.settings = settings
        self.seeds = seeds
        self.generators: list[torch.Generator] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if hasattr(scores, "full_tensor"):  # a tensor-parallel student's vocabulary-sharded scores
            scores = scores.full_tensor()
        scores = scores.float()
        if self.generators is None:
            # On the scores' device: no copy of [rows, vocab] scores to the host for every generated token. A
            # GPU's generator draws other tokens than the CPU's for the same seed, the same ones every run.
            self.generators = [torch.Generator(device=scores.device).manual_seed(seed) for seed in self.seeds]
        settings = self.settings
        if settings.temperature == 0:
            chosen = scores.argmax(-1)
        else:
            probs = torch.softmax(scores / settings.temperature, dim=-1)
            if settings.top_p < 1.0:
                probs = _nucleus(probs, settings.top_p)
            chosen = torch.stack([torch.multinomial(row, 1, generator=generator)[0]
                                  for row, generator in zip(probs, self.generators)])
        only = torch.full_like(scores, -math.inf)
        only.scatter_(-1, chosen[:, None], 0.0)
        return only.to(input_ids.device)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of likeliest tokens whose mass reaches `top_p` (at least one), renormalized."""
    sorted_probs, order = probs.sort(-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above each one
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, before < top_p)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def _cut_at_stop(tokens: torch.Tensor, stop_tokens: tuple[int, ...]) -> torch.Tensor:
    if stop_tokens:
        stops = torch.isin(tokens, torch.tensor(stop_tokens, dtype=tokens.dtype)).nonzero()
        if len(stops):
            return tokens[: int(stops[0]) + 1]
    return tokens


def sampling_settings(config, tokenizer, *, greedy: bool = False) -> SamplingSettings:
    """`kd.generation`'s settings; `greedy`: temperature 0. Stop tokens by default the tokenizer's EOS and, for
    rows a chat template renders (`chat`, templated `prompt_completion`), the template's end-of-turn token."""
    generation = config.kd.generation
    stops = generation.stop_tokens
    if stops is None:
        stops = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        turn_end = end_of_turn_token(tokenizer) if templated_rows(config.dataset, tokenizer) else None
        if turn_end is not None and turn_end not in stops:
            stops.append(turn_end)
    return SamplingSettings(max_new_tokens=generation.max_new_tokens,
                            temperature=0.0 if greedy else generation.temperature,
                            top_p=generation.top_p, stop_tokens=tuple(stops))


def templated_rows(dataset, tokenizer) -> bool:
    """Whether the `dataset` section's rows are rendered by `tokenizer`'s chat template (`dataset.records` chat,
    or prompt_completion unless `dataset.chat_template` is false)."""
    return (format_named(dataset.records).rendered and dataset.chat_template is not False
            and getattr(tokenizer, "chat_template", None) is not None)


class StudentCompletions:
    """A recipe's prompts completed by its student: `rows(batch, seeds)` for training and evaluation.

    Args:
        model: the module whose `generate` runs (DDP's inner module; FSDP2 and tensor-parallel as they are).
        config: the recipe config (`kd.generation`, `dataset`'s prompts, the sequence length).
        tokenizer: its EOS ends documents (dropped from prompts) and, by default, completions.
        greedy: the likeliest token each time, whatever `kd.generation.temperature` says (for evaluation).
        teacher_side: adds a teacher with another tokenizer's side to the rows made
            (`meshkd.recipe.corpus.aligned_data.CompletionAligner`); None: one tokenizer.
    """

    def __init__(self, model: torch.nn.Module, config, tokenizer, *, pad_token_id: int, device: torch.device,
                 greedy: bool = False, teacher_side: Callable[[dict], dict] | None = None) -> None:
        self.eos = tokenizer.eos_token_id
        settings = sampling_settings(config, tokenizer, greedy=greedy)
        self.sampler: Sampler = ModelGenerate(model, settings, pad_token_id=pad_token_id, device=device)
        self.limit = None if config.dataset.whole_prompts else config.kd.generation.prompt_tokens
        self.sequence_length = config.step_scheduler.sequence_length
        self.pad_token_id, self.device, self.teacher_side = pad_token_id, device, teacher_side

    def rows(self, batch: dict[str, torch.Tensor], seeds: list[int]) -> tuple[dict[str, torch.Tensor], int, int]:
        """(the rows prompt + completion of `batch`'s prompts on the device, tokens generated, prompts completed).

        A padding row (no prompt) is completed from one pad token, so every rank runs the same forwards, and
        is then left empty."""
        prompts = self.prompts(batch)
        pad = torch.tensor([self.pad_token_id])
        completions = self.sampler.sample([pad if prompt is None else prompt for prompt in prompts], seeds)
        return self.rows_of(prompts, completions, routes=batch.get(ROUTE))

    def prompts(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
        """`batch`'s prompts on the host (`prompts_of`), None for a padding row."""
        return [None if prompt is None else prompt.cpu()
                for prompt in prompts_of(batch, limit=self.limit, eos_token_id=self.eos)]

    def rows_of(self, prompts: list[torch.Tensor | None], completions: list[torch.Tensor], *,
                routes: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], int, int]:
        """(the rows prompt + completion on the device, tokens generated, prompts completed), as `rows`; `routes`:
        the prompts' teachers (`ROUTE` of their batch), which the rows keep."""
        rows = completion_batch(prompts, completions, sequence_length=self.sequence_length,
                                pad_token_id=self.pad_token_id, routes=routes)
        if self.teacher_side is not None:
            rows = self.teacher_side(rows)
        real = [completion for prompt, completion in zip(prompts, completions) if prompt is not None]
        return ({key: value.to(self.device) for key, value in rows.items()}, sum(map(len, real)), len(real))


class OnPolicyStep:
    """One on-policy step: the student completes the prompts of the step's on-policy micro-batches, the
    teacher scores each as soon as it is made (while the student completes the next), then the step trains.

    Completions of the whole step come before any update: all are drawn from the step's weights. A
    micro-batch reaches the teacher once it is made; its step's valid-token count, known only when all are
    made, goes with each pair the training step draws.

    Args:
        train_step: the step that trains on the pairs (`meshkd.recipe.student.train_step.TrainStep`).
        teacher: the run's teacher source.
        completions: makes the student's `StudentCompletions` with its current weights.
        rollouts: with `kd.generation.engine`, the server that draws the completions
            (`meshkd.recipe.student.rollout_engine.Rollouts`); None: the student's `generate`.
    """

    def __init__(self, config, *, train_step: TrainStep, teacher: TeacherSource,
                 completions: Callable[[], StudentCompletions], rollouts=None) -> None:
        self.kd, self.train_step, self.teacher, self.completions = config.kd, train_step, teacher, completions
        self.setup, self.rollouts = train_step.setup, rollouts

    def plan(self, completer: StudentCompletions, prompts: list[dict], *,
             step: int) -> dict[int, tuple[list[torch.Tensor], list[int]]]:
        """Micro-batch index -> (its prompts, a pad token for a padding row; its rows' seeds), for the on-policy
        micro-batches of step `step`."""
        kd, count = self.kd, len(prompts)
        dp_rank, planned = self.setup.dp_mesh.get_local_rank(), {}
        pad = torch.tensor([completer.pad_token_id])
        for index, batch in enumerate(prompts):
            if is_on_policy(kd.generation.seed, step, index, kd.on_policy_fraction):
                size = batch["input_ids"].shape[0]
                first = (dp_rank * count + index) * size  # the rows' place in the global batch
                planned[index] = ([pad if prompt is None else prompt for prompt in completer.prompts(batch)],
                                  [row_seed(kd.generation.seed, step, first + row) for row in range(size)])
        return planned

    def __call__(self, text: list[dict], prompts: list[dict], *, step: int, skipped_steps: int,
                 upcoming: Callable[[], list[dict] | None] | None = None) -> dict[str, float]:
        """Train step `step` (0-based) of the micro-batches `text`, each on-policy one replaced by the student's
        completions of the same place's `prompts` micro-batch; the step's metrics with the generation's.
        `upcoming`: the next step's prompt micro-batches (None after the last step), which a server drawing one
        step ahead completes while this step trains."""
        kd, count = self.kd, len(text)
        dp_rank = self.setup.dp_mesh.get_local_rank()
        made: queue.SimpleQueue = queue.SimpleQueue()

        def requests() -> Iterator[dict]:  # the micro-batches as they are made; None: generation failed
            for _ in range(count):
                micro_batch = made.get()
                if micro_batch is None:
                    return
                yield micro_batch

        completer, rows, figures = self.completions(), [], [0.0, 0.0, 0.0]  # tokens, completions, on-policy
        drawn = None
        if self.rollouts is not None:
            started = time.perf_counter()
            following = None if upcoming is None else lambda: (
                None if (batches := upcoming()) is None else self.plan(completer, batches, step=step + 1))
            drawn = self.rollouts.draw(step, self.plan(completer, prompts, step=step), following)
        feed = self.teacher.prefetch(requests(), depth=count,
                                     batch_fn=lambda micro_batch: TeacherRequest(micro_batch, kd.training_answer))
        with feed:
            started = started if drawn is not None else time.perf_counter()
            try:
                for index, micro_batch in enumerate(text):
                    if drawn is not None and index in drawn.completions:
                        micro_batch, tokens, completed = completer.rows_of(
                            completer.prompts(prompts[index]), drawn.completions[index],
                            routes=prompts[index].get(ROUTE))
                        figures = [figures[0] + tokens, figures[1] + completed, figures[2] + 1]
                    elif drawn is None and is_on_policy(kd.generation.seed, step, index, kd.on_policy_fraction):
                        size = prompts[index]["input_ids"].shape[0]
                        first = (dp_rank * count + index) * size  # the rows' place in the global batch
                        seeds = [row_seed(kd.generation.seed, step, first + row) for row in range(size)]
                        micro_batch, tokens, completed = completer.rows(prompts[index], seeds)
                        figures = [figures[0] + tokens, figures[1] + completed, figures[2] + 1]
                    rows.append(micro_batch)
                    made.put(micro_batch)
            finally:
                made.put(None)  # past the last request, or in place of the ones a failure left unmade
            generation_s = time.perf_counter() - started
            # The feed answers `rows` in order: each answer goes with its row's item, which holds the step's count.
            items = step_items(rows, ignore_index=kd.ignore_index)
            metrics = self.train_step(((item, answer) for item, (_, answer) in zip(items, feed)),
                                      skipped_steps=skipped_steps)
        tokens, completions = sum_over_ranks(figures[:2], self.setup, device=self.train_step.device)
        metrics.update(generated_tokens=tokens, mean_completion_length=tokens / max(completions, 1.0),
                       on_policy_share=figures[2] / count, generation_s=generation_s,
                       generation_tokens_per_s=tokens / generation_s if figures[2] else 0.0)
        if drawn is not None:
            metrics.update(rollout_staleness=float(drawn.staleness), rollout_wait_s=drawn.wait_s,
                           weight_sync_s=drawn.sync_s)
        return metrics


def build_prompt_set(tokenizer, dataset, *, max_prompt_tokens: int,
                     routes: list[str] | None = None) -> tuple[PackedDataset, PackedDataset]:
    """(train, validation) whole prompts, one per row, split as the rows are: the `dataset.prompt_key` column of
    text rows, or each chat / prompt_completion row's text before its last answer; `routes`: the teachers' names
    routed rows give (`dataset.teacher_key`), each prompt row then carrying its teacher (`ROUTE`).

    Raises ValueError naming the key when a prompt is longer than `max_prompt_tokens` (the sequence length
    less `max_new_tokens`) or no row has a non-empty prompt.
    """
    marked = format_named(dataset.records).marks_answers  # else the prompts are a column of their own
    key = (f"dataset.records {dataset.records!r} (the prompts before the answers)" if marked else
           f"dataset.prompt_key {dataset.prompt_key!r}")
    source = {"prompts": True} if marked else {"text_key": dataset.prompt_key}
    try:
        splits = build_run_datasets(tokenizer, dataset, sequence_length=max_prompt_tokens + 1, pack=False,
                                    routes=routes, **source)
    except ValueError as error:
        raise ValueError(f"{key}: {error}") from None
    for split in splits:
        if len(split) != split.num_documents:  # a prompt was cut into pieces: it did not fit one row
            raise ValueError(
                f"{key}: {len(split) - split.num_documents} prompt piece(s) beyond the "
                f"limit of {max_prompt_tokens} tokens (step_scheduler.sequence_length less "
                f"kd.generation.max_new_tokens): shorten the prompts or raise the sequence length")
    return splits
