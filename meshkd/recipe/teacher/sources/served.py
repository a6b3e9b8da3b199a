"""`served`: a teacher served elsewhere by `meshkd serve-teacher` (`teacher_model.url`), asked over HTTP
(`meshkd.recipe.teacher.served_teacher.ServedTeacher`). Preflight asks its health: it answers, speaks this
protocol, is the teacher `teacher_model`'s other keys describe (if given) and reads the ids the run writes."""

from __future__ import annotations

import torch.distributed as dist

from meshkd.core.topology import last_stage_ranks
from meshkd.recipe.settings.config import ConfigError
from meshkd.recipe.teacher import served_protocol
from meshkd.recipe.teacher.hidden_states import paired_layers
from meshkd.recipe.teacher.served_teacher import ServedTeacher, fetch, health
from meshkd.recipe.teacher.sources.base import SourceKind, TeacherCheck, answer_tokenizer, asks_http, register
from meshkd.recipe.teacher.teacher_cache import teacher_identity
from meshkd.recipe.teacher.teacher_head import TeacherHead


@register
class Served(SourceKind):
    name = "served"

    def describes(self, config, teacher, *, writing_cache):
        return asks_http(teacher, "meshkd", writing_cache)

    def check(self, config, teacher, tokenizer, *, student_rows):
        teacher_tokenizer = answer_tokenizer(config, teacher, tokenizer)
        url, section = teacher.model.url, teacher.model
        report = health(url)
        if report.get("protocol") != served_protocol.PROTOCOL_VERSION:
            raise ConfigError(f"teacher_model.url: the server at {url} speaks protocol {report.get('protocol')!r}, "
                              f"this meshkd {served_protocol.PROTOCOL_VERSION}: run the same meshkd release on both")
        if section.path is not None or section.random_init is not None:  # the teacher the config describes
            mine, theirs = teacher_identity(teacher), report.get("teacher", {})
            differ = [key for key in mine if mine[key] != theirs.get(key)]
            if differ:
                raise ConfigError(f"teacher_model: the teacher served at {url} is not the one this config describes "
                                  f"({differ[0]}: served {theirs.get(differ[0])!r}, here {mine[differ[0]]!r}); leave "
                                  f"teacher_model's other keys out to take it as it is")
        if report.get("vocabulary") != served_protocol.vocabulary_fingerprint(teacher_tokenizer):
            label = "teacher_model.tokenizer" if config.kd.cross_tokenizer is not None else "model.tokenizer"
            raise ConfigError(f"teacher_model.url: the teacher at {url} has another vocabulary than {label} (their "
                              "token -> id mappings differ): it reads the token ids that tokenizer writes")
        return TeacherCheck(teacher_tokenizer, vocab_rows=report["vocab_rows"], hidden_size=report["hidden_size"],
                            num_layers=report.get("num_layers"), report=report)

    def make(self, config, teacher, check, context):
        return ServedTeacher(teacher.model.url, **asking(config, teacher, context))

    def head(self, config, teacher, context, held):
        """The server's output layer (`served_protocol.HEAD_PATH`)."""
        data = fetch(teacher.model.url, f"{served_protocol.HEAD_PATH}?vocab_size={context.vocab_size}")
        return TeacherHead.from_bytes(data, device=context.device, held=held)


def asking(config, teacher, context) -> dict:
    """What a client of a served teacher is made with: whether this rank receives answers (a last stage), how
    long it retries, and the settings of the answers it asks for."""
    return {"device": context.device, "wait_s": config.collective_timeout_s,
            "receives": any(dist.get_rank() in ranks for ranks in last_stage_ranks(context.setup)),
            "settings": served_protocol.answer_settings(config.kd_of(teacher), seed=config.seed,
                                                        vocab_size=context.vocab_size,
                                                        hidden_layers=paired_layers(config, "teacher"))}
