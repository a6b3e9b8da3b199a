"""Host syncs of a run on the default path, counted on the CPU as CUDA would make them (`tests.device_syncs`).

The default path: top-k answers from a teacher on its own rank (separate meshes), the fused output layer,
an FSDP2 student. Its steady training steps (after the first, which warm up) make one host sync each on the
student's training thread, the step's one read of its reduced figures, whatever the number of micro-batches
per step; its held-out evaluation makes as many whatever the number of chunks the fused output layer cuts a
micro-batch into. Each world is one run: 2 ranks, the student and the teacher.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.tiny import base_config, with_layout

STEPS = 4
EVAL_CHUNKS = (4, 32)  # tokens per fused chunk in the last evaluation: 8 chunks and 1 of each 32-token row


class _CountedStep:
    """The recipe's `TrainStep` with each call's syncs counted (it hands every other attribute to the step)."""

    def __init__(self, step, per_step: list[Counter]) -> None:
        self.step, self.per_step = step, per_step

    def __getattr__(self, name: str):
        return getattr(self.step, name)

    def __call__(self, feed, **kwargs):
        from tests.device_syncs import DeviceSyncs

        with DeviceSyncs() as counter:
            try:
                return self.step(feed, **kwargs)
            finally:
                self.per_step.append(counter.syncs())


def count_run_syncs(rank: int, config: dict, out: str) -> None:
    """Train `config`, counting on the student rank each step's syncs and those of the last evaluation, once per
    chunk size of `EVAL_CHUNKS` after one uncounted; the student writes them to `out` as
    {"steps": [...], "evaluations": {chunk: ...}}."""
    from meshkd.recipe.lifecycle.run import KDRecipe
    from meshkd.recipe.lifecycle.student_trainer import StudentTrainer
    from meshkd.recipe.settings.config_loading import config_from_dict
    from tests.device_syncs import DeviceSyncs

    recipe, per_step, evaluations = KDRecipe(config_from_dict(config)), [], {}
    try:
        recipe.setup()
        role = recipe.role
        is_student = isinstance(role, StudentTrainer)
        if is_student:
            assert role.step.fused_head is not None, "the default path fuses the output layer"
            role.step = _CountedStep(role.step, per_step)
            held_out, kd = role.evaluation.held_out, role.step.fused_head.kd

            def counted_held_out(*, with_teacher: bool = False):
                if len(per_step) < STEPS:  # the first evaluation, before training
                    return held_out(with_teacher=with_teacher)
                # Once uncounted first: the bridge reads a request's header only while its layout is new.
                figures = held_out(with_teacher=with_teacher)
                for chunk in EVAL_CHUNKS:
                    kd.chunk_size = chunk
                    with DeviceSyncs() as counter:
                        figures = held_out(with_teacher=with_teacher)
                    evaluations[chunk] = counter.syncs()
                return figures

            role.evaluation.held_out = counted_held_out
        recipe.train()
    finally:
        recipe.cleanup()
    if is_student:
        Path(out).write_text(json.dumps({"steps": per_step, "evaluations": evaluations}))


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict[int, dict]:
    """By micro-batches per step (1 and 4): the student's counted syncs of a default-path run."""
    from meshkd.core.local_world import spawn_world

    runs = {}
    for num_micro_batches in (1, 4):
        tmp_path = tmp_path_factory.mktemp(f"m{num_micro_batches}")
        config = with_layout(base_config(tmp_path), {"dp_size": 1}, {"dp_size": 1})  # FSDP2 over one rank
        config["step_scheduler"].update(max_steps=STEPS, global_batch_size=num_micro_batches, local_batch_size=1)
        config["kd"].update(logits_transport="topk", topk=8, chunk_size=16)
        out = tmp_path / "syncs.json"
        assert spawn_world(2, count_run_syncs, (config, str(out)), timeout_s=60, deadline_s=300) is None
        runs[num_micro_batches] = json.loads(out.read_text())
    return runs


def _by_line(counts: Counter) -> str:
    return ", ".join(f"{where}: {count}" for where, count in counts.most_common()) or "none"


# A teacher request reads the bridge's header words back on the requesting thread: per validation batch, not
# per chunk (in training the prefetcher's thread asks). How many depends on whether the answer's layout is new.
PER_REQUEST = ("bridge.py", "teacher_protocol.py")


def _without(counts: Counter, sources: tuple[str, ...]) -> Counter:
    return Counter({key: count for key, count in counts.items() if not any(source in key for source in sources)})


def _steady_totals(counted: dict[int, dict], leave_out: tuple[str, ...]) -> dict[int, list[int]]:
    totals = {}
    for num_micro_batches, run in counted.items():
        steps = [_without(Counter(counts), leave_out) for counts in run["steps"]]
        assert len(steps) == STEPS
        steady = steps[1:]  # the first step warms up
        totals[num_micro_batches] = [sum(counts.values()) for counts in steady]
        print(f"M={num_micro_batches}: syncs per steady step {totals[num_micro_batches]}; by source over the "
              f"{len(steady)} steps: {_by_line(sum(steady, Counter()))}")
        assert all(total <= 1 for total in totals[num_micro_batches]), (
            f"M={num_micro_batches}: more than one host sync in a step: {_by_line(sum(steady, Counter()))}")
    assert totals[1] == totals[4], f"the syncs of a step depend on its micro-batches: {totals}"
    return totals


def _evaluations(counted: dict[int, dict], leave_out: tuple[str, ...]) -> None:
    for num_micro_batches, run in counted.items():
        evaluations = {int(chunk): Counter(counts) for chunk, counts in run["evaluations"].items()}
        assert sorted(evaluations) == sorted(EVAL_CHUNKS)
        for chunk, counts in evaluations.items():
            print(f"M={num_micro_batches}, chunks of {chunk} tokens: {sum(counts.values())} syncs in the last "
                  f"evaluation; by source: {_by_line(counts)}")
        few, many = (_without(evaluations[chunk], PER_REQUEST + leave_out)
                     for chunk in sorted(EVAL_CHUNKS, reverse=True))
        assert few == many, (f"an evaluation's syncs grow with its chunks: {_by_line(few)} with chunks of "
                             f"{max(EVAL_CHUNKS)} tokens, {_by_line(many)} with chunks of {min(EVAL_CHUNKS)}")


@pytest.mark.world
def test_a_steady_training_step_syncs_once_whatever_its_micro_batches(counted):
    _steady_totals(counted, ())


@pytest.mark.world
def test_an_evaluation_syncs_no_more_with_more_chunks(counted):
    _evaluations(counted, ())
