"""Where one teacher's answers come from (a `meshkd.core.teacher_protocol.TeacherSource`), by its config:

- its cache (`kd.teacher_cache`, a manifest checked at preflight): `CachedTeacher`, no teacher process;
- ranks of its own (separate meshes, a bridge to them): `TeacherClient`;
- a server elsewhere (`teacher_model.url`): `ServedTeacher` (`meshkd serve-teacher`), or `CompletionsTeacher`
  (`teacher_model.api: completions`: vLLM's OpenAI-compatible server), asked over HTTP;
- the student's own ranks (shared meshes, the teacher loaded there): `LocalTeacher` over its `TeacherForward`,
  laid out here.
A new kind of source is one more case here and its module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshkd.core.bridge import KDMeshBridge
from meshkd.core.cross_tokenizer_loss import VocabularyMap
from meshkd.core.teacher_protocol import LocalTeacher, TeacherClient, TeacherSource
from meshkd.core.topology import DistributedSetup, last_stage_ranks
from meshkd.recipe.settings.config import KDRecipeConfig
from meshkd.recipe.teacher.completions_teacher import CompletionsTeacher
from meshkd.recipe.teacher.hidden_states import paired_layers
from meshkd.recipe.teacher.served_protocol import answer_settings
from meshkd.recipe.teacher.served_teacher import ServedTeacher
from meshkd.recipe.teacher.teacher_cache import CachedTeacher, rows_asked
from meshkd.recipe.teacher.teacher_worker import TeacherForward, lay_out_teacher


def teacher_source(view: KDRecipeConfig, *, manifest: dict | None, bridge: KDMeshBridge | None, loaded,
                   setup: DistributedSetup, device: torch.device, datasets: dict, vocab_size: int,
                   vocabulary_map: VocabularyMap | None) -> TeacherSource:
    """The source of the teacher `view` (its one-teacher config) describes. `manifest`: its cache's, when it
    answers from one; `bridge`: to its own ranks, when it has some; `loaded`: (model, checkpoint) as
    `load_teacher` loaded it on the student's ranks, otherwise; `datasets`: {"train", "validation"} rows."""
    if manifest is not None:
        return CachedTeacher(view.kd.teacher_cache, manifest, datasets, device=device,
                             asked=rows_asked(view, datasets, dp_size=setup.dp_size))
    section = view.teacher_model
    if section.url is not None:
        receives = any(dist.get_rank() in ranks for ranks in last_stage_ranks(setup))
        options = {"device": device, "receives": receives, "wait_s": view.collective_timeout_s,
                   "settings": answer_settings(view.kd, seed=view.seed, vocab_size=vocab_size,
                                               hidden_layers=paired_layers(view, "teacher"))}
        if section.api == "completions":
            return CompletionsTeacher(section.url, model=section.served_model, **options)
        return ServedTeacher(section.url, **options)
    if bridge is not None:
        return TeacherClient(bridge)
    runner = lay_out_teacher(*loaded, setup, device=device)
    return LocalTeacher(TeacherForward(runner, vocab_size=vocab_size, kd=view.kd, seed=view.seed,
                                       vocabulary_map=vocabulary_map, hidden_layers=paired_layers(view, "teacher")))
