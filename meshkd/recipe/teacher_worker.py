"""The teacher's role in a run: load only its share of the teacher, lay it out, answer requests.

On separate meshes the teacher-only ranks run a `TeacherWorker`: it builds the teacher without weights
where the checkpoint allows (`meshkd.parallel.sharded_loading`), lays it out with `TeacherRunner`, reads
this rank's share, and serves the student through `meshkd.core.teacher_protocol.TeacherServer` until the
student sends STOP_TEACHER. `TeacherForward` is the answer to one request (the runner's logits cut to the
common vocabulary, encoded as asked); on shared meshes the student trainer calls it directly. A teacher with
another tokenizer (`kd.cross_tokenizer`) reads its own tokenization of the rows and projects its answer onto
the student's vocabulary at the aligned positions (`meshkd.recipe.aligned_data`) before encoding it, so the
transport and the student's loss are those of one tokenizer; its log-probabilities of labels are of its own.
"""

from __future__ import annotations

import torch

from meshkd.core.bridge import KDMeshBridge
from meshkd.core.cross_tokenizer_loss import VocabularyMap, build_vocabulary_map, project_teacher_logits
from meshkd.core.logits_codec import LABEL_LOG_PROBS, WITH_LABEL_LOG_PROBS, encode_teacher_rows, label_log_probs
from meshkd.core.teacher_protocol import Encoded, TeacherRequest, TeacherServer
from meshkd.core.topology import DistributedSetup
from meshkd.parallel.sharded_loading import Checkpoint, load_shards
from meshkd.parallel.teacher_runner import TeacherRunner
from meshkd.recipe.aligned_data import (
    GROUPS,
    TEACHER_POSITIONS,
    group_positions,
    kd_labels,
    teacher_group_log_probs,
    teacher_side,
)
from meshkd.recipe.config import KDConfig, KDRecipeConfig
from meshkd.recipe.faults import FaultWatch
from meshkd.recipe.loaders import load_section_model_for_layout
from meshkd.recipe.preflight import about


class TeacherForward:
    """The teacher's answer to a request: its logits over the common vocabulary, encoded as asked.

    `encodes`: whether this rank encodes (the rank that sends the answer); elsewhere the answer is None.
    `vocabulary_map`: a teacher with another tokenizer; its answers are projected onto the student's
    `vocab_size` entries.
    """

    def __init__(self, runner: TeacherRunner, *, vocab_size: int, kd: KDConfig, seed: int, encodes: bool = True,
                 vocabulary_map: VocabularyMap | None = None):
        self.runner = runner
        self.vocab_size = vocab_size
        self.kd = kd
        self.seed = seed
        self.encodes = encodes
        self.vocabulary_map = vocabulary_map

    def __call__(self, request: TeacherRequest) -> Encoded | None:
        if request.batch["input_ids"].shape[0] == 0:  # routed: no row of this micro-batch is this teacher's
            empty = torch.zeros(0, request.batch["input_ids"].shape[1], self.vocab_size, device=self.runner.device)
            return self.encode(empty, request.batch, request.logits_transport) if self.encodes else None
        logits = self.runner.logits(teacher_side(request.batch))
        if logits is None or not self.encodes:
            return None
        cross = self.kd.cross_tokenizer
        if cross is None:
            logits = logits[..., : self.vocab_size]
        elif request.logits_transport != LABEL_LOG_PROBS and cross.loss != "projection":
            return {"mode": GROUPS, "log_probs": teacher_group_log_probs(
                logits, request.batch, temperature=self.kd.temperature, ignore_index=self.kd.ignore_index)}
        elif request.logits_transport != LABEL_LOG_PROBS:
            logits = self.project(logits, request.batch)
        return self.encode(logits, request.batch, request.logits_transport)

    def project(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """[rows, student sequence, student vocab]: at each student position KD counts (`kd_labels`), the
        teacher's distribution at the paired teacher position projected onto the student's vocabulary (as
        logits at `kd.temperature`); 0 elsewhere."""
        ignore = self.kd.ignore_index
        counted = kd_labels(batch, ignore) != ignore
        paired = group_positions(batch, TEACHER_POSITIONS, logits.shape[1], ignore)  # in `counted`'s order
        projected = project_teacher_logits(logits.flatten(0, 1)[paired], self.vocabulary_map,
                                           temperature=self.kd.temperature, student_vocab_size=self.vocab_size)
        result = projected.new_zeros(*counted.shape, self.vocab_size)
        result[counted] = projected
        return result

    def encode(self, logits: torch.Tensor, batch: dict, mode: str) -> Encoded:
        """Encode as `mode`, or give each label's log-probability (`LABEL_LOG_PROBS`), or both in one answer
        (`with_label_log_probs(mode)`, what an evaluation asks for the held-out KL beside the teacher's loss).

        Each row's tail samples are seeded by that row's tokens, so a resumed run, and a teacher cache
        written ahead of time, draw the same ones whatever the rows are batched with."""
        kd = self.kd
        if mode == LABEL_LOG_PROBS:  # of the teacher's own tokens, whichever tokenizer
            return label_log_probs(logits, teacher_side(batch)["labels"], ignore_index=kd.ignore_index)
        if mode in WITH_LABEL_LOG_PROBS:
            encoded = self.encode(logits, batch, mode.partition("+")[0])
            return {**encoded, "label_log_probs": self.encode(logits, batch, LABEL_LOG_PROBS)["log_probs"]}
        # One host sync for the whole batch, not one per row.
        seeds = [self.seed + total for total in batch["input_ids"].sum(dim=-1).tolist()]
        return encode_teacher_rows(logits, mode, seeds=seeds, k=min(kd.topk, logits.shape[-1]),
                                   temperature=kd.temperature, tail_samples=kd.topk_tail_samples)


def teacher_vocabulary_map(config: KDRecipeConfig, checked, *, losses: tuple[str, ...]) -> VocabularyMap | None:
    """How the teacher's vocabulary meets the student's (from the preflight's two tokenizers), when
    `kd.cross_tokenizer.loss` is one of `losses` (the ones that read it where it is built); else None."""
    if config.kd.cross_tokenizer is None or config.kd.cross_tokenizer.loss not in losses:
        return None
    with about("model.tokenizer / teacher_model.tokenizer"):
        return build_vocabulary_map(checked.tokenizer, checked.teacher_tokenizer)


def load_teacher(config: KDRecipeConfig) -> tuple[torch.nn.Module, Checkpoint | None]:
    """The teacher model, without weights when they can be read in shards once it is laid out."""
    with about("teacher_model"):
        return load_section_model_for_layout(config.teacher_model)


def lay_out_teacher(model: torch.nn.Module, checkpoint: Checkpoint | None, setup: DistributedSetup, *,
                    device: torch.device) -> TeacherRunner:
    """Lay the teacher out over `setup`, then read this rank's share of its weights."""
    runner = TeacherRunner(model, setup, device=device)
    if checkpoint is not None:
        with about("teacher_model"):
            load_shards(model, checkpoint, device=device)
    return runner


class TeacherWorker:
    """A teacher-only rank (separate meshes): the recipe calls load, lay_out, resume, run, close in order."""

    def __init__(self, config: KDRecipeConfig, setup: DistributedSetup, faults: FaultWatch, device: torch.device,
                 *, name: str = "teacher"):
        self.config = config  # the one-teacher config of this teacher (`KDRecipeConfig.teacher_views`)
        self.setup = setup
        self.faults = faults
        self.device = device
        self.name = name

    def load(self, checked: dict) -> None:
        """This rank's share of the teacher (built without weights where it can be); `checked`: each teacher's
        preflight, by name."""
        self.model, self._checkpoint = load_teacher(self.config)
        self.vocabulary_map = teacher_vocabulary_map(self.config, checked[self.name], losses=("projection",))

    def vocab_rows(self) -> dict[str, int]:
        """Output-embedding rows of the models held here, by name."""
        return {self.name: self.model.get_output_embeddings().weight.shape[0]}

    def lay_out(self, vocab_size: int, bridges: dict[str, KDMeshBridge]) -> None:
        runner = lay_out_teacher(self.model, self._checkpoint, self.setup, device=self.device)
        self.server = TeacherServer(bridges[self.name])
        self.forward = TeacherForward(runner, vocab_size=vocab_size, kd=self.config.kd, seed=self.config.seed,
                                      encodes=self.server.is_output, vocabulary_map=self.vocabulary_map)

    def resume(self, resume: bool) -> None:
        """Nothing to restore: the teacher is frozen."""

    def run(self) -> dict:
        """Serve the student's requests until it sends STOP_TEACHER; a lost student is reported as such."""
        with self.faults.watch("serving the student", "student"):
            self.server.serve(self.forward)
        return {}

    def close(self) -> None:
        pass
