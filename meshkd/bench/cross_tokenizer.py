"""A teacher with another tokenizer: bytes per token, the projected answer's wire bytes, and the step time of
cross-tokenizer KD against same-tokenizer KD of the same student on the same text.

    meshkd bench --only cross_tokenizer [--quick] [--json OUT]

The text: the Python standard library's json and email sources (at most 6000 characters a document, as
the demo). The student reads a byte-level BPE of 4096 entries trained on that text
(`meshkd.recipe.modeling.transplant.train_byte_level_bpe`); the cross-tokenizer teacher reads the demo teacher's
tokenizer (SmolLM2, 49152 entries). Measured:
- bytes per token of each tokenizer over all of the text (UTF-8 bytes / tokens, no special tokens);
- the wire bytes per student token of the teacher's answer as `kd.logits_transport` encodes it (full,
  full_bf16, topk with k = 64 and 32 tail samples): the recipe's own `TeacherForward` projects teacher
  logits onto the student's vocabulary at the aligned positions and encodes them, for the aligned rows of
  the first documents; beside it, what the teacher's unprojected full logits would weigh per student token;
- the step time of `meshkd train` with a teacher of the other tokenizer (`kd.cross_tokenizer`) against one
  with the student's own, alternating (same, cross, same, cross, ...) in one run. Random-init Llamas on
  separate meshes, one rank each: the student (hidden 128, 2 layers, 4096 entries) is the same on both
  sides; both teachers are hidden 512, 8 layers with a 49152-row table (the same-tokenizer one reads the
  student's tokenizer and KD compares its first 4096 logits), so the ratio is the cost of the
  cross-tokenizer path itself (both tokenizations, the alignment, the projection), not of a teacher of
  another size. The figure: median step time over the steps after the second of each run, and the ratio
  cross / same of those medians.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import yaml

TEXT_PATTERNS = ["${stdlib}/json/*.py", "${stdlib}/email/*.py"]
MAX_CHARS = 6000
STUDENT_VOCAB = 4096
TEACHER_ROWS = 49152  # the demo teacher's table
WIRE_MODES = {"full": {}, "full_bf16": {}, "topk": {"topk": 64, "topk_tail_samples": 32}}


def bench_texts() -> list[str]:
    """The bench's documents, in file order."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(path for pattern in TEXT_PATTERNS for path in glob.glob(pattern.replace("${stdlib}", stdlib)))
    return [text for text in (Path(path).read_text(errors="replace")[:MAX_CHARS] for path in files) if text.strip()]


def bytes_per_token(tokenizer, texts: list[str]) -> float:
    """UTF-8 bytes of `texts` per token of `tokenizer` (no special tokens)."""
    tokens = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    return sum(len(text.encode()) for text in texts) / tokens


class _RandomTeacher:
    """Stands in for the teacher runner: random logits of the teacher's width (an answer's size does not
    depend on its values)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def outputs(self, batch: dict, *, logits: bool = True, hidden: bool = False):
        import torch

        generator = torch.Generator().manual_seed(0)
        return torch.randn(*batch["input_ids"].shape, self.vocab, generator=generator), None


def wire_bytes(student_tokenizer, teacher_tokenizer, texts: list[str], *, sequence: int, rows: int) -> dict:
    """Bytes per student token of the projected answer in each mode, on the aligned rows of `texts`."""
    from meshkd.core.teacher_protocol import TeacherRequest
    from meshkd.core.vocabulary_map import build_vocabulary_map
    from meshkd.core.wire import payload_nbytes
    from meshkd.recipe.corpus.aligned_data import aligned_packing
    from meshkd.recipe.settings.config import KDConfig
    from meshkd.recipe.teacher.teacher_worker import TeacherForward

    packed = aligned_packing(student_tokenizer, teacher_tokenizer, sequence_length=sequence,
                             teacher_sequence_length=sequence, pack=True)(texts)
    batch = packed[slice(0, rows)]
    student_tokens = int((batch["labels"] >= 0).sum())
    teacher_tokens = int((batch["teacher_labels"] >= 0).sum())
    vocabulary_map = build_vocabulary_map(student_tokenizer, teacher_tokenizer)
    teacher_vocab = len(teacher_tokenizer)
    result = {"student_tokens": student_tokens, "teacher_tokens": teacher_tokens,
              "aligned_positions": int((batch["teacher_positions"] >= 0).sum()),
              "unprojected_full_per_student_token": teacher_tokens * teacher_vocab * 4 / student_tokens}
    for mode, options in WIRE_MODES.items():
        forward = TeacherForward(_RandomTeacher(teacher_vocab), vocab_size=len(student_tokenizer),
                                 kd=KDConfig(logits_transport=mode, **options), seed=0, vocabulary_map=vocabulary_map)
        answer = forward(TeacherRequest(batch=batch, logits_transport=mode))
        result[f"{mode}_per_student_token"] = payload_nbytes(answer) / student_tokens
    return result


def random_llama(hidden: int, layers: int, vocab: int, tokenizer: str, seed: int) -> dict:
    """A model section: a random-init Llama (8 heads, 4 KV heads, MLP 4 x hidden) reading `tokenizer`."""
    return {"random_init": {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 4 * hidden,
                            "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4,
                            "vocab_size": vocab, "max_position_embeddings": 512},
            "tokenizer": tokenizer, "seed": seed}


def _config(root: Path, name: str, student_tokenizer: str, teacher_tokenizer: str | None, steps: int,
            sizes: dict) -> dict:
    """`meshkd train` of the student (own tokenizer) with a teacher of `teacher_tokenizer` (None: the student's)."""
    kd = {"kd_ratio": 1.0, "chunk_size": 256}
    if teacher_tokenizer is not None:
        kd["cross_tokenizer"] = {"loss": "projection"}
    return {
        "model": random_llama(sizes["student_hidden"], sizes["student_layers"], sizes["student_vocab"],
                              student_tokenizer, 1),
        "teacher_model": random_llama(sizes["teacher_hidden"], sizes["teacher_layers"], sizes["teacher_rows"],
                                      teacher_tokenizer or student_tokenizer, 2),
        "separate_meshes": True, "distributed": {"dp_size": 1}, "teacher_distributed": {"dp_size": 1},
        "kd": kd,
        "dataset": {"paths": TEXT_PATTERNS, "val_fraction": 0.05, "max_document_chars": MAX_CHARS},
        "step_scheduler": {"max_steps": steps, "global_batch_size": 4, "local_batch_size": 2,
                           "sequence_length": sizes["sequence"], "val_batches": 1},
        "optimizer": {"lr": 1e-3}, "checkpoint": {"enabled": False},
        "logging": {"run_dir": str(root / name), "progress_bar": False},
    }


def train_records(config: dict, path: Path) -> list[dict]:
    """The train records (metrics.jsonl) of one `meshkd train` run of `config`, written to `path`, after its
    second step (the first ones warm up); OMP_NUM_THREADS 1 a process unless set."""
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run([sys.executable, "-m", "meshkd", "train", str(path)], env=env, capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise RuntimeError(f"meshkd train {path.stem} failed:\n{result.stderr[-3000:]}")
    metrics = Path(config["logging"]["run_dir"], "metrics.jsonl")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [record for record in records if record["kind"] == "train" and record["step"] > 2]


def _train_step_times(config: dict, path: Path) -> list[float]:
    """Step times of one `meshkd train` run of `config` after its second step (`train_records`)."""
    return [record["step_time_s"] for record in train_records(config, path)]


SIZES = {"student_hidden": 128, "student_layers": 2, "student_vocab": STUDENT_VOCAB, "teacher_hidden": 512,
         "teacher_layers": 8, "teacher_rows": TEACHER_ROWS, "sequence": 256}


def run(teacher_tokenizer_dir: str, *, repeats: int, steps: int, sizes: dict = SIZES) -> dict:
    """The section's figures with the teacher tokenizer at `teacher_tokenizer_dir` (a directory holding a
    tokenizer); the student's is trained here on the bench's text."""
    from meshkd.recipe.modeling.models import load_tokenizer
    from meshkd.recipe.modeling.transplant import train_byte_level_bpe

    texts = bench_texts()
    teacher_tokenizer = load_tokenizer(path=teacher_tokenizer_dir)
    with tempfile.TemporaryDirectory(prefix="meshkd-bench-cross-") as scratch:
        root = Path(scratch)
        student_tokenizer = train_byte_level_bpe(texts, sizes["student_vocab"])
        student_tokenizer.save_pretrained(root / "student_tokenizer")
        student_tokenizer = load_tokenizer(path=root / "student_tokenizer")
        result = {
            "documents": len(texts), "text_bytes": sum(len(text.encode()) for text in texts),
            "student_vocab": len(student_tokenizer), "teacher_vocab": len(teacher_tokenizer),
            "student_bytes_per_token": bytes_per_token(student_tokenizer, texts),
            "teacher_bytes_per_token": bytes_per_token(teacher_tokenizer, texts),
            "wire": wire_bytes(student_tokenizer, teacher_tokenizer, texts, sequence=sizes["sequence"], rows=4),
        }
        times: dict[str, list[float]] = {"same": [], "cross": []}
        for repeat in range(repeats):
            for side, tokenizer in (("same", None), ("cross", teacher_tokenizer_dir)):
                config = _config(root, f"{side}{repeat}", str(root / "student_tokenizer"), tokenizer, steps, sizes)
                times[side] += _train_step_times(config, root / f"{side}{repeat}.yaml")
    same, cross = statistics.median(times["same"]), statistics.median(times["cross"])
    return {**result, "sizes": dict(sizes), "step_time_same_s": same, "step_time_cross_s": cross,
            "step_time_ratio_cross_over_same": cross / same, "steps_measured": {k: len(v) for k, v in times.items()}}


def run_section(quick: bool) -> dict:
    """{"cross_tokenizer": results}, printed as they are measured; `quick`: one run of each side, 6 steps
    (else two of 12)."""
    from meshkd.recipe.modeling.models import converted_gguf, demo_teacher_source

    source = demo_teacher_source()
    started = time.perf_counter()
    results = run(str(converted_gguf(source["path"], source["gguf_file"])), repeats=1 if quick else 2,
                  steps=6 if quick else 12)
    wire = results["wire"]
    print(f"cross_tokenizer: {results['documents']} documents, {results['text_bytes']} bytes: "
          f"{results['student_bytes_per_token']:.2f} bytes per token for the student's BPE of "
          f"{results['student_vocab']}, {results['teacher_bytes_per_token']:.2f} for the teacher's "
          f"{results['teacher_vocab']}")
    print(f"answer per student token, projected onto the student's vocabulary: full "
          f"{wire['full_per_student_token']:.0f} B, full_bf16 {wire['full_bf16_per_student_token']:.0f} B, topk 64 "
          f"+ 32 tail {wire['topk_per_student_token']:.0f} B (the teacher's own full logits would be "
          f"{wire['unprojected_full_per_student_token']:.0f} B)")
    print(f"train step: same-tokenizer KD {results['step_time_same_s']:.3f} s, cross-tokenizer KD "
          f"{results['step_time_cross_s']:.3f} s, ratio cross / same {results['step_time_ratio_cross_over_same']:.3f} "
          f"(the section took {time.perf_counter() - started:.0f} s)")
    return {"cross_tokenizer": results}
