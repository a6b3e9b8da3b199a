"""The teacher's role in a run: load only its share of the teacher, lay it out, answer requests.

On separate meshes the teacher-only ranks run a `TeacherWorker`: it builds the teacher without weights
where the checkpoint allows (`meshkd.parallel.sharded_loading`), lays it out with `TeacherRunner`, reads
this rank's share, and serves the student through `meshkd.core.teacher_protocol.TeacherServer` until the
student sends STOP_TEACHER. `TeacherForward` is the answer to one request: the runner's logits cut to the
common vocabulary, made into the kind of answer asked (`meshkd.recipe.teacher.teacher_answers`: each kind's
`encode`); on shared meshes the student trainer calls it directly. A teacher with another tokenizer
(`kd.cross_tokenizer`) reads its own tokenization of the rows; its distribution is projected onto the
student's vocabulary at the aligned positions (`Distribution.projected`) before it is encoded, so the
transport and the student's loss are those of one tokenizer, or sent per aligned group for `uld` / `gold`
(`GroupDistributions`); its log-probabilities of labels are of its own. With `kd.hidden_states` the
teacher's paired layers' outputs travel beside its training answers (`meshkd.recipe.teacher.hidden_states`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist

from meshkd.core.bridge import KDMeshBridge
from meshkd.core.logits import materialize_teacher_logits
from meshkd.core.teacher_protocol import Encoded, TeacherRequest, TeacherServer
from meshkd.core.topology import DistributedSetup
from meshkd.core.vocabulary_map import VocabularyMap, build_vocabulary_map
from meshkd.parallel.sharded_loading import Checkpoint, load_shards
from meshkd.parallel.stages import decoder_of, stage_layers
from meshkd.parallel.teacher_runner import TeacherRunner
from meshkd.recipe.common.faults import FaultWatch, about
from meshkd.recipe.corpus.rows import teacher_side
from meshkd.recipe.modeling.loaders import load_section_model_for_layout
from meshkd.recipe.settings.config import KDConfig, KDRecipeConfig, ModelConfig, TeacherConfig
from meshkd.recipe.teacher.hidden_states import LayerTap, paired_layers
from meshkd.recipe.teacher.teacher_answers import EncodeContext, answer_type, with_hidden_states
from meshkd.recipe.teacher.teacher_head import TeacherHead


class TeacherForward:
    """The teacher's answer to a request: its logits, made into the kind of answer the request and the run ask
    for (`meshkd.recipe.teacher.teacher_answers.answer_type`).

    `encodes`: whether this rank encodes (the rank that sends the answer); elsewhere the answer is None.
    `vocabulary_map`: a teacher with another tokenizer; its answers are projected onto the student's
    `vocab_size` entries. `hidden_layers`: the teacher layers of `kd.hidden_states`' pairs, in their order.
    """

    def __init__(self, runner: TeacherRunner, *, vocab_size: int, kd: KDConfig, seed: int, encodes: bool = True,
                 vocabulary_map: VocabularyMap | None = None, hidden_layers: list[int] | None = None,
                 section: ModelConfig | None = None):
        self.runner = runner
        self.encodes = encodes
        self.section = section
        self.context = EncodeContext(kd, seed=seed, vocab_size=vocab_size, vocabulary_map=vocabulary_map)
        self.tap = LayerTap(runner.model, hidden_layers) if hidden_layers else None
        # With the pairs, the stage holding each decoder layer (a pipelined teacher's outputs go from there to the
        # last stage).
        self._stage_of = {} if self.tap is None else {
            index: stage for stage in range(runner.pp_size)
            for index in stage_layers(len(decoder_of(runner.model).layers), runner.pp_size, stage)}

    @functools.cached_property
    def head_id(self) -> str:
        """The id of the teacher's output layer, which its hidden answers name (`TeacherHead`)."""
        if self.section is None:
            raise ValueError("this teacher makes no hidden answers: it was not given its model section")
        return TeacherHead.of(self.section, vocab_size=self.context.vocab_size).id

    def __call__(self, request: TeacherRequest) -> Encoded | None:
        batch = request.batch
        hidden = final = None
        reads_hidden = answer_type(request.logits_transport, self.context.kd).reads_hidden
        with_logits = request.with_label_log_probs or not reads_hidden
        if batch["input_ids"].shape[0] == 0:  # routed: no row of this micro-batch is this teacher's
            length = batch["input_ids"].shape[1]
            logits = torch.zeros(0, length, self.context.vocab_size, device=self.runner.device)
            if reads_hidden:
                width = self.runner.model.config.get_text_config().hidden_size
                final = torch.zeros(0, length, width, dtype=self.runner.dtype, device=self.runner.device)
        else:
            with self.tap.on() if self.tap else contextlib.nullcontext():
                logits, final = self.runner.outputs(teacher_side(batch), logits=with_logits, hidden=reads_hidden)
            if self.tap:
                hidden = self.paired_outputs(batch)
        if (logits is None and final is None) or not self.encodes:
            return None
        return self.encode(logits, batch, request.logits_transport, hidden,
                           with_label_log_probs=request.with_label_log_probs, final_hidden=final)

    def paired_outputs(self, batch: dict) -> list[torch.Tensor] | None:
        """The teacher's outputs of the paired layers [rows, sequence, width], whole, in the pairs' order, on the
        last pipeline stage (None on the stages before it); every rank of the replica takes part.

        Each stage gathers the outputs of the layers it holds over its tp and cp ranks, as the logits are
        (`materialize_teacher_logits`); a stage before the last sends its own to the last stage, pair by pair in
        the pairs' order, which the last stage receives in that order (so no two wait on each other)."""
        runner, rows, length = self.runner, *batch["input_ids"].shape
        held = {index: materialize_teacher_logits(output, runner.mesh, length)
                for index, output in self.tap.take_held().items()}
        if runner.pp_size == 1:
            return [held[index] for index in self.tap.layers]
        last, outputs = runner.pp_size - 1, []
        for index in self.tap.layers:
            owner = self._stage_of[index]
            if runner.pp_rank == owner and owner != last:
                dist.send(held[index].contiguous(), group_dst=last, group=runner.pp_group)
            elif runner.is_last:
                if owner != last:
                    width = runner.model.config.get_text_config().hidden_size
                    held[index] = torch.empty(rows, length, width, dtype=runner.dtype, device=runner.device)
                    dist.recv(held[index], group_src=owner, group=runner.pp_group)
                outputs.append(held[index])
        return outputs if runner.is_last else None

    def encode(self, logits: torch.Tensor | None, batch: dict, transport: str,
               hidden: list[torch.Tensor] | None = None, *, with_label_log_probs: bool = False,
               final_hidden: torch.Tensor | None = None) -> Encoded:
        """The answer on the wire to a request for `transport` (`TeacherRequest.logits_transport`, and
        `with_label_log_probs`), from the teacher's logits [rows, its sequence, its vocab] of `batch`: with one
        tokenizer cut to the vocabulary both share, then made by the kind of answer asked (`answer_type`: its
        `encode`; a kind that `reads_hidden`, from the last hidden states `final_hidden`, named by the teacher's
        `head_id`); with the paired layers' outputs `hidden` where it is a training answer (`with_hidden_states`)."""
        kind = answer_type(transport, self.context.kd)
        if logits is not None and self.context.kd.cross_tokenizer is None:
            logits = logits[..., : self.context.vocab_size]
        if kind.reads_hidden:
            wire = kind.encode(logits, batch, dataclasses.replace(self.context, head_id=self.head_id),
                               with_label_log_probs=with_label_log_probs, hidden=final_hidden)
        else:
            wire = kind.encode(logits, batch, self.context, with_label_log_probs=with_label_log_probs)
        return with_hidden_states(wire, hidden, transport, with_label_log_probs=with_label_log_probs)


def teacher_vocabulary_map(config: KDRecipeConfig, checked, *, losses: tuple[str, ...]) -> VocabularyMap | None:
    """How the teacher's vocabulary meets the student's (from the preflight's two tokenizers), when
    `kd.cross_tokenizer.loss` is one of `losses` (the ones that read it where it is built); else None."""
    if config.kd.cross_tokenizer is None or config.kd.cross_tokenizer.loss not in losses:
        return None
    with about("model.tokenizer / teacher_model.tokenizer"):
        return build_vocabulary_map(checked.tokenizer, checked.teacher_tokenizer)


def load_teacher(teacher: TeacherConfig) -> tuple[torch.nn.Module, Checkpoint | None]:
    """The teacher's model, without weights when they can be read in shards once it is laid out."""
    with about("teacher_model"):
        return load_section_model_for_layout(teacher.model)


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

    def __init__(self, config: KDRecipeConfig, teacher: TeacherConfig, setup: DistributedSetup, faults: FaultWatch,
                 device: torch.device):
        self.config = config  # the run's
        self.teacher = teacher  # the one served here, of `config.teacher_list()`
        self.setup = setup
        self.faults = faults
        self.device = device
        self.name = teacher.name

    def load(self, checked: dict) -> None:
        """This rank's share of the teacher (built without weights where it can be); `checked`: each teacher's
        preflight, by name."""
        self.model, self._checkpoint = load_teacher(self.teacher)
        self.vocabulary_map = teacher_vocabulary_map(self.config, checked[self.name], losses=("projection",))

    def vocab_rows(self) -> dict[str, int]:
        """Output-embedding rows of the models held here, by name."""
        return {self.name: self.model.get_output_embeddings().weight.shape[0]}

    def lay_out(self, vocab_size: int, bridges: dict[str, KDMeshBridge]) -> None:
        runner = lay_out_teacher(self.model, self._checkpoint, self.setup, device=self.device)
        self.server = TeacherServer(bridges[self.name])
        self.forward = TeacherForward(runner, vocab_size=vocab_size, kd=self.config.kd_of(self.teacher),
                                      seed=self.config.seed, encodes=self.server.is_output,
                                      vocabulary_map=self.vocabulary_map,
                                      hidden_layers=paired_layers(self.config, "teacher"),
                                      section=self.teacher.model)

    def resume(self, resume: bool) -> None:
        """Nothing to restore: the teacher is frozen."""

    def run(self) -> dict:
        """Serve the student's requests until it sends STOP_TEACHER; a lost student is reported as such."""
        with self.faults.watch("serving the student", "student"):
            self.server.serve(self.forward)
        return {}

    def close(self) -> None:
        pass
