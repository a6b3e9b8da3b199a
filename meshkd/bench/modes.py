"""The transport bench's `modes` section: what each logits transport mode costs in bytes and in KD error.

On the demo teacher's real logits (SmolLM2-135M-Instruct) for standard-library source, for two students
(the demo's 8 of 30 layers, and a near one of 26), each registered kind of distribution's (`meshkd.core.answers`;
those holding indices at each top-k size of the settings) wire bytes per token and the relative error of its KD
loss, of d loss / d logits and of the output-head weight gradient, against full float32; for an encoding that
travels packed (compact top-k answers, `kd.topk_encoding: compact`) also the decoded answer's KL to the answer it
packs (nats a token, mean and largest); hidden answers read with the teacher's own output layer; the wire bytes
a token of each kind at the demo teacher's size and at a vocabulary of 151,936 and width of 896, beside the teacher
head a student rank holds for hidden answers; and the teacher cache's forms of top-k answers, entropy coded among
them (`meshkd.bench.cache_coding`). See `meshkd.bench.transport` for the whole bench.
"""

from __future__ import annotations

import copy
import statistics

import torch

from meshkd.bench.corpora import stdlib_token_rows
from meshkd.core.answers.hidden import hold_head
from meshkd.parallel.pruning import prune_layers
from meshkd.recipe.teacher.teacher_head import TeacherHead

# Two students: the demo's (8 of the teacher's 30 layers, before distillation: far from the teacher) and a
# near one (26 of 30 layers), standing in for a student late in distillation.
_STUDENTS = {"demo (8/30 layers)": [0, 1, 2, 3, 26, 27, 28, 29], "near (26/30 layers)": [*range(12), *range(16, 30)]}


def measure(settings: dict) -> dict:
    """The section's rows (per student, mode and temperature: medians over the samples) and its sizes."""
    from meshkd.core.answers import ANSWERS, distributions
    from meshkd.core.wire import payload_nbytes
    from meshkd.recipe.modeling import models
    from meshkd.recipe.settings.config import KDConfig

    source = models.demo_teacher_source()
    tokenizer = models.load_tokenizer(**source)
    teacher = models.load_causal_lm(**source)
    students = {name: prune_layers(copy.deepcopy(teacher), keep).eval() for name, keep in _STUDENTS.items()}
    samples = stdlib_token_rows(tokenizer, settings["mode_rows"], settings["mode_sequence"], settings["mode_samples"])
    sizes = [(k, 0) for k in settings["topk"]] + list(settings["topk_sampled"])
    variants = [(kind.name, k, m) for kind in distributions() for k, m in (sizes if kind.has_indices else [(None, 0)])]
    head = TeacherHead.of_model(copy.deepcopy(teacher), vocab_size=teacher.get_output_embeddings().weight.shape[0])
    hold_head(head)  # hidden answers are read with it
    per_sample: dict[tuple, list[dict]] = {}
    for sample, ids in enumerate(samples):
        inputs, labels = ids[:, :-1], ids[:, 1:]
        with torch.no_grad():
            output = teacher(input_ids=inputs, output_hidden_states=True)
            teacher_logits, teacher_hidden = output.logits.float(), output.hidden_states[-1]
        tokens, vocab = labels.numel(), teacher_logits.shape[-1]
        full_bytes = tokens * vocab * 4
        for student_name, student in students.items():
            with torch.no_grad():
                hidden = student.model(input_ids=inputs).last_hidden_state.float()
                student_logits = student.lm_head(hidden).float()
            for temperature in (1.0, 2.0):
                results = {}
                for mode, k, m in variants:
                    options = {"k": k, "temperature": temperature, "tail_samples": m, "seed": sample,
                               "chunk_size": 1024}
                    kind = ANSWERS.named(mode)
                    wire = {"mode": mode, "hidden": kind.rounded(teacher_hidden), "head": head.id} \
                        if kind.reads_hidden else kind.encode_logits(teacher_logits, **options)
                    encoded, decode_kl = ANSWERS.named(mode).decode(wire), None
                    kind = ANSWERS.named(encoded["mode"])
                    if encoded is not wire:  # what travels is packed; the loss reads its decoding
                        exact = kind.encode_logits(teacher_logits, **options)
                        decode_kl = (exact["log_probs"].exp() * (exact["log_probs"] - encoded["log_probs"])).sum(-1)
                    s = student_logits.clone().requires_grad_()
                    loss = kind.kernel(s, encoded, labels, KDConfig(temperature=temperature), norm=None,
                                       chunk_size=256)
                    loss.backward()
                    # The output-head weight gradient [vocab, hidden]: what the logit gradient becomes in parameter
                    # space, where sampling noise of single tokens averages out over the batch.
                    head_grad = s.grad.flatten(0, 1).T @ hidden.flatten(0, 1)
                    results[(mode, k, m)] = (float(loss.detach()), s.grad, head_grad, payload_nbytes(wire), decode_kl)
                reference, reference_grad, reference_head, _, _ = results[("full", None, 0)]
                for (mode, k, m), (value, grad, head_grad, nbytes, decode_kl) in results.items():
                    name = mode if k is None else f"{mode} k={k}" + (f" +{m} tail samples" if m else " (rest bucket)")
                    kl = {} if decode_kl is None else {"decode_kl_mean": float(decode_kl.mean()),
                                                       "decode_kl_max": float(decode_kl.max())}
                    per_sample.setdefault((student_name, name, temperature), []).append({**kl,
                        "bytes_per_token": nbytes / tokens, "bytes_ratio": nbytes / full_bytes,
                        "kd_full": reference, "kd_rel_error": value / reference - 1,
                        "grad_rel_error": float((grad - reference_grad).norm() / reference_grad.norm()),
                        "head_grad_rel_error": float((head_grad - reference_head).norm() / reference_head.norm()),
                    })  # fmt: skip
    rows = []
    for (student_name, name, temperature), entries in per_sample.items():
        rows.append({
            "student": student_name, "mode": name, "temperature": temperature,
            "bytes_per_token": statistics.median(e["bytes_per_token"] for e in entries),
            "bytes_ratio": statistics.median(e["bytes_ratio"] for e in entries),
            "kd_full": statistics.median(e["kd_full"] for e in entries),
            "kd_rel_error": statistics.median(e["kd_rel_error"] for e in entries),
            "kd_rel_error_worst": max((e["kd_rel_error"] for e in entries), key=abs),
            "grad_rel_error": statistics.median(e["grad_rel_error"] for e in entries),
            "head_grad_rel_error": statistics.median(e["head_grad_rel_error"] for e in entries),
            **({"decode_kl_mean": statistics.fmean(e["decode_kl_mean"] for e in entries),
                "decode_kl_max": max(e["decode_kl_max"] for e in entries)} if "decode_kl_mean" in entries[0] else {}),
        })  # fmt: skip
    from meshkd.bench import cache_coding

    return {"vocab": vocab, "tokens_per_sample": tokens, "samples": len(samples), "rows": rows,
            "hidden_states": _hidden_state_bytes(teacher, inputs, tokens),
            "answer_sizes": _answer_sizes(vocab, teacher.config.hidden_size),
            "cache_coding": cache_coding.measure(teacher, tokenizer)}


def _answer_sizes(vocab: int, width: int, tokens: int = 32) -> list[dict]:
    """Wire bytes a token of each kind of answer, measured on [1, tokens] positions of random logits and hidden
    states at the demo teacher's vocabulary and width and at Qwen2.5-0.5B's (151,936 x 896), beside the teacher head a
    student rank holds for hidden answers (bfloat16 weight, whole and under tp 2)."""
    from meshkd.core.answers import ANSWERS
    from meshkd.core.wire import payload_nbytes

    rows = []
    for size, hidden_size in ((vocab, width), (151936, 896)):
        generator = torch.Generator().manual_seed(0)
        logits = torch.randn(1, tokens, size, generator=generator) * 3
        hidden = torch.randn(1, tokens, hidden_size, generator=generator)
        for mode, k, m in (("full", None, 0), ("full_bf16", None, 0), ("topk", 64, 32), ("topk_compact", 50, 0),
                           ("hidden", None, 0), ("hidden_bf16", None, 0)):
            kind = ANSWERS.named(mode)
            wire = {"mode": mode, "hidden": kind.rounded(hidden), "head": "0" * 64} if kind.reads_hidden else \
                kind.encode_logits(logits, k=k, temperature=1.0, tail_samples=m, seed=0, chunk_size=1024)
            name = mode if k is None else f"{mode} k={k}" + (f" +{m} tail samples" if m else "")
            rows.append({"vocab": size, "width": hidden_size, "mode": name,
                         "bytes_per_token": payload_nbytes(wire) / tokens,
                         "head_mib": size * hidden_size * 2 / 2**20 if kind.reads_hidden else 0.0})
    return rows


def _hidden_state_bytes(teacher, inputs: torch.Tensor, tokens: int) -> list[dict]:
    """Wire bytes per token of `kd.hidden_states`' part of an answer (`with_hidden_states`, as the teacher sends
    it), for one pair and for the demo student's kept layers, in bfloat16 (full_bf16, topk) and float32 (full)."""
    from meshkd.recipe.teacher.hidden_states import LayerTap
    from meshkd.recipe.teacher.teacher_answers import with_hidden_states

    kept = _STUDENTS["demo (8/30 layers)"]
    tap = LayerTap(teacher, kept)
    with torch.no_grad(), tap.on():
        teacher(input_ids=inputs)
    outputs = tap.take()
    rows = []
    for pairs in (1, len(kept)):
        for transport in ("full_bf16", "full"):
            sent = with_hidden_states({}, outputs[:pairs], transport)["hidden_states"]
            rows.append({"pairs": pairs, "dtype": str(sent.dtype).removeprefix("torch."), "width": sent.shape[-1],
                         "bytes_per_token": sent.numel() * sent.element_size() / tokens})
    return rows
