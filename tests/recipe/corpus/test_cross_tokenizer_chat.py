"""Chat and prompt / completion rows with a teacher of another tokenizer (`kd.cross_tokenizer`).

The student reads the byte tokenizer and renders rows in ChatML; the teacher reads the 1024-entry byte-level
BPE of `examples/data/stdlib_json_bpe` and renders them with a Llama-3-style template that trims the answers.
Each side's targets are its own answer tokens, checked token by token, and every position KD counts pairs the
two sides at the same byte of the same answer. A one-process run trains on such rows to its last step.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from meshkd.recipe.corpus import data
from meshkd.recipe.corpus.aligned_data import aligned_packing
from meshkd.recipe.corpus.rows import BATCH_KEYS, TEACHER_POSITIONS, PackedDataset
from meshkd.recipe.modeling.models import byte_tokenizer
from meshkd.recipe.settings.config import ConfigError, DatasetConfig
from meshkd.recipe.settings.config_loading import config_from_dict
from tests.trees import packed

STUDENT = byte_tokenizer()
BPE = Path(__file__).parents[3] / "examples" / "data" / "stdlib_json_bpe"
LLAMA_TEMPLATE = (
    "{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
END, TEACHER_END = "<|im_end|>\n", "<|eot_id|>"
MULTI_TURN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "One?"},
              {"role": "assistant", "content": "  one, then é \n"}, {"role": "user", "content": "Two?"},
              {"role": "assistant", "content": "def two():\n    return 2"}]


def teacher_tokenizer(template: str | None = LLAMA_TEMPLATE):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(BPE))
    tokenizer.chat_template = template
    return tokenizer


def chat_rows(count: int) -> list[dict]:
    from meshkd.bench.corpora import stdlib_chat_rows

    rows = []
    for row in stdlib_chat_rows(max_rows=count, max_answer_chars=50):
        question, answer = (message["content"] for message in row["messages"])
        rows.append({"messages": [{"role": "user", "content": question[:30]},
                                  {"role": "assistant", "content": answer}]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def cross_rows(tmp_path: Path, rows: list[dict], teacher, *, sequence_length: int = 1024,
               teacher_sequence_length: int = 1024, pack: bool = False, **settings) -> PackedDataset:
    dataset = DatasetConfig(paths=[write_jsonl(tmp_path / "rows.jsonl", rows)], val_fraction=0.0, **settings)
    packing = aligned_packing(STUDENT, teacher, sequence_length=sequence_length,
                              teacher_sequence_length=teacher_sequence_length, pack=pack)
    train, _ = data.build_run_datasets(STUDENT, dataset, sequence_length=sequence_length, pack_texts=packing)
    return packed(train)


def targets(ids: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor, tokenizer) -> list[str]:
    """Per document of a row, the text of its targets that count."""
    return [tokenizer.decode(labels[(documents == d) & (labels != -100)]) for d in range(1, int(documents.max()) + 1)]


def kd_pairs(rows: PackedDataset, teacher) -> list[tuple[bytes, bytes]]:
    """Per position KD counts: the bytes of the rest of its document from the target on, in the student's tokens
    and in the teacher's (from the teacher position paired with it)."""
    from meshkd.core.token_bytes import token_bytes

    tables = {side: token_bytes(tokenizer) for side, tokenizer in (("student", STUDENT), ("teacher", teacher))}

    def spelled(ids: torch.Tensor, side: str) -> bytes:
        return b"".join(tables[side][i] or b"" for i in ids.tolist())

    pairs = []
    for row in range(len(rows)):
        batch = rows[row]
        ids, labels, documents, positions = (batch[key][0] for key in ("input_ids", "labels", "attention_mask",
                                                                       TEACHER_POSITIONS))
        teacher_ids, teacher_documents = batch["teacher_input_ids"][0], batch["teacher_attention_mask"][0]
        for position in ((positions >= 0) & (labels != -100)).nonzero().flatten().tolist():
            other = int(positions[position])
            assert teacher_documents[other] == documents[position]
            rest = ids[position + 1 :][documents[position + 1 :] == documents[position]]
            teacher_rest = teacher_ids[other + 1 :][teacher_documents[other + 1 :] == teacher_documents[other]]
            pairs.append((spelled(rest, "student"), spelled(teacher_rest, "teacher")))
    return pairs


def assert_paired_within(pairs: list[tuple[bytes, bytes]], answers: list[str]) -> None:
    """Every pair reads on from the same byte of the same answer on both sides, and every answer's first byte
    is paired."""
    starts = set()
    for student_rest, teacher_rest in pairs:
        found = [(answer, k) for answer in answers for k in range(len(answer.encode()))
                 if student_rest.startswith(answer.encode()[k:]) and teacher_rest.startswith(answer.encode()[k:])]
        assert found, (student_rest[:40], teacher_rest[:40])
        starts.update(answer for answer, k in found if k == 0)
    assert starts == set(answers)


def test_each_side_trains_its_own_answers_and_kd_pairs_them_by_their_bytes(tmp_path):
    teacher = teacher_tokenizer()
    rows = [{"messages": MULTI_TURN}, *chat_rows(8)]
    train = cross_rows(tmp_path, rows, teacher, records="chat")
    assert len(train) == len(rows)
    answers = [[m["content"] for m in row["messages"] if m["role"] == "assistant"] for row in rows]
    # The student's side is the one-tokenizer chat rows, token for token: its answers and ChatML's end marker.
    alone, _ = data.build_run_datasets(STUDENT, DatasetConfig(paths=[str(tmp_path / "rows.jsonl")], val_fraction=0.0,
                                                              records="chat"), sequence_length=1024, pack=False)
    for key in BATCH_KEYS:
        assert torch.equal(train[:][key], alone[:][key]), key
    for row, contents in enumerate(answers):
        batch = train[row]
        assert targets(batch["input_ids"][0], batch["labels"][0], batch["attention_mask"][0], STUDENT) == [
            "".join(content + END for content in contents)]
        # The teacher's: its own rendering's answers (trimmed by its template) and its end marker, nothing else.
        assert targets(batch["teacher_input_ids"][0], batch["teacher_labels"][0], batch["teacher_attention_mask"][0],
                       teacher) == ["".join(content.strip() + TEACHER_END for content in contents)]
        assert teacher.decode(batch["teacher_input_ids"][0][batch["teacher_attention_mask"][0] > 0]) == (
            teacher.apply_chat_template(rows[row]["messages"], tokenize=False))
    # KD counts positions inside the answers only, each pairing the same byte of one answer on both sides.
    assert_paired_within(kd_pairs(train, teacher), [content.strip() for contents in answers for content in contents])
    # The last answer only: KD follows the student's targets.
    last = cross_rows(tmp_path / "last", rows, teacher, records="chat", train_on="last_answer")
    assert_paired_within(kd_pairs(last, teacher), [contents[-1].strip() for contents in answers])


def test_packed_and_cut_rows_keep_both_masks_and_the_pairs(tmp_path):
    teacher = teacher_tokenizer()
    rows = chat_rows(12)
    whole = cross_rows(tmp_path, rows, teacher, records="chat")
    several = cross_rows(tmp_path / "packed", rows, teacher, records="chat", sequence_length=512,
                        teacher_sequence_length=256, pack=True)
    assert len(several) < len(rows)
    for side in ("", "teacher_"):
        assert int((several.extra[f"{side}labels"][0] if side else several.labels).ne(-100).sum()) == int(
            (whole.extra[f"{side}labels"][0] if side else whole.labels).ne(-100).sum())
    answers = [row["messages"][1]["content"].strip() for row in rows]
    assert_paired_within(kd_pairs(several, teacher), answers)
    # Rows of 64 and 24 tokens cut the documents (between groups, both sides together), prompts included.
    cut = cross_rows(tmp_path / "cut", rows, teacher, records="chat", sequence_length=64, teacher_sequence_length=24,
                     pack=True)
    assert len(cut) > 2 * len(rows)
    def reads(rest: bytes, text: bytes) -> bool:  # a piece may end inside the answer
        return len(rest) > 0 and rest[: len(text)] == text[: len(rest)]

    pairs, answers = kd_pairs(cut, teacher), [answer.encode() for answer in answers]
    assert pairs and all(any(reads(s, a[k:]) and reads(t, a[k:]) for a in answers for k in range(len(a)))
                         for s, t in pairs)


def test_prompt_completion_rows_with_a_template_on_one_side_only(tmp_path):
    teacher = teacher_tokenizer(template=None)  # renders prompt and completion as they are, EOS appended
    rows = [{"question": "2+2?", "answer": " 4, as é", "ctx": "Arithmetic."}]
    train = cross_rows(tmp_path, rows, teacher, records="prompt_completion", prompt_key="question",
                       completion_key="answer", context_key="ctx")
    batch = train[0]
    assert STUDENT.decode(batch["input_ids"][0][batch["attention_mask"][0] > 0]).endswith(
        "<|im_start|>assistant\n 4, as é" + END)
    assert teacher.decode(batch["teacher_input_ids"][0][batch["teacher_attention_mask"][0] > 0]) == (
        "Arithmetic.\n\n2+2? 4, as é" + teacher.eos_token)
    assert targets(batch["teacher_input_ids"][0], batch["teacher_labels"][0], batch["teacher_attention_mask"][0],
                   teacher) == [" 4, as é" + teacher.eos_token]
    assert_paired_within(kd_pairs(train, teacher), [" 4, as é"])


def test_one_tokenizer_on_both_sides_pairs_every_target(tmp_path):
    """The same template on both sides: the renderings are equal, aligned whole as text rows are."""
    train = cross_rows(tmp_path, [{"messages": MULTI_TURN}, *chat_rows(4)], STUDENT, records="chat")
    labels = train.labels
    assert torch.equal(train.extra["teacher_input_ids"][0], train.input_ids)
    assert torch.equal(train.extra["teacher_labels"][0], labels)
    positions = train.extra[TEACHER_POSITIONS][0]
    assert torch.equal(positions[labels != -100], (labels != -100).nonzero()[:, 1])


def test_a_template_that_changes_an_answer_or_is_missing_is_refused_naming_the_row(tmp_path):
    upper = teacher_tokenizer(LLAMA_TEMPLATE.replace("message['content'] | trim", "message['content'] | upper"))
    path = write_jsonl(tmp_path / "rows.jsonl", [{"messages": MULTI_TURN}])
    with pytest.raises(ValueError, match=re.escape(path) + r":1: the chat template of teacher_model.tokenizer does "
                                                            r"not write answer 0 as the row gives it"):
        cross_rows(tmp_path, [{"messages": MULTI_TURN}], upper, records="chat")
    with pytest.raises(ValueError, match=r"dataset.records 'chat' renders rows with the chat template of "
                                         r"teacher_model.tokenizer, which has none"):
        cross_rows(tmp_path, [{"messages": MULTI_TURN}], teacher_tokenizer(template=None), records="chat")
    refusing = teacher_tokenizer(LLAMA_TEMPLATE.replace("{% for message in messages %}", (
        "{% for message in messages %}{% if message['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}")))
    with pytest.raises(ValueError, match=re.escape(path) + r":1: the chat template of teacher_model.tokenizer "
                                                            r"refuses the row: no system role"):
        cross_rows(tmp_path, [{"messages": MULTI_TURN}], refusing, records="chat")


def test_on_policy_with_chat_rows_across_tokenizers_is_refused_naming_the_key(tmp_path):
    config = run_config(tmp_path, save_teacher=False)
    config["kd"].update(mode="on_policy", generation={"max_new_tokens": 8})
    with pytest.raises(ConfigError, match=r"dataset.records 'chat' with kd.cross_tokenizer does not yet work with "
                                          r"kd.mode on_policy"):
        config_from_dict(config)


def run_config(tmp: Path, *, save_teacher: bool = True) -> dict:
    """A one-process run on 40 chat rows, the teacher on the BPE with its own template."""
    from tests.tiny import base_config, with_layout

    config = base_config(tmp)
    config["dataset"] = {"paths": [write_jsonl(tmp / "chat.jsonl", chat_rows(40))], "records": "chat",
                         "val_fraction": 0.2, "seed": 3}
    config["step_scheduler"].update(sequence_length=256, max_steps=8)
    config["kd"]["cross_tokenizer"] = {"teacher_sequence_length": 160}
    if save_teacher:
        teacher_tokenizer().save_pretrained(tmp / "teacher_tokenizer")
    config["teacher_model"]["tokenizer"] = str(tmp / "teacher_tokenizer")
    config["teacher_model"]["random_init"]["vocab_size"] = 1024
    return with_layout(config, {"dp_size": 1}, None)


@pytest.mark.world
def test_a_run_on_chat_rows_across_tokenizers_trains_on_the_answers(tmp_path):
    """It trains to its end on the answers alone; reading the rows from the token store, or the teacher's
    answers from its cache (which keeps the teacher's tokenizer with its template), gives its curve."""
    import copy

    from meshkd.recipe.corpus.batches import iterate_batches
    from meshkd.recipe.lifecycle.preflight import preflight
    from tests.recipe.lifecycle.test_recipe import TrainRun, curve
    from tests.recipe.teacher.test_teacher_cache import WriteCache, train_records
    from tests.world import run_world

    config = run_config(tmp_path)
    config["kd"]["logits_transport"] = "full_bf16"  # what a cache holds exactly
    runs = {name: copy.deepcopy(config) for name in ("stored", "write_cache", "cached")}
    runs["stored"]["dataset"]["token_store"] = str(tmp_path / "tokens")
    for name in ("write_cache", "cached"):
        runs[name]["kd"]["teacher_cache"] = str(tmp_path / "cache")
    for name, run in runs.items():
        run["logging"]["run_dir"] = str(tmp_path / name)
    checks = [TrainRun(config, name="memory"), TrainRun(runs["stored"], name="stored"),
              WriteCache(runs["write_cache"], "write_cache"), TrainRun(runs["cached"], name="cached")]
    results = run_world(1, checks, timeout_s=60, deadline_s=500)
    for check in checks:
        results.check(check.__name__)
    assert len(list((tmp_path / "tokens").glob("*/groups.bin"))) == 1  # both sides read from the store
    for name in ("stored", "cached"):
        assert curve(train_records(runs[name])) == pytest.approx(curve(train_records(config)), abs=1e-6), name
    without_teacher = copy.deepcopy(runs["cached"])
    without_teacher.pop("teacher_model")  # the cache's own copy of the teacher's tokenizer renders its side
    assert preflight(config_from_dict(without_teacher)).teacher_tokenizer.chat_template == LLAMA_TEMPLATE
    records = train_records(config)
    steps = [r for r in records if r["kind"] == "train"]
    assert len(steps) == 8
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    assert sum(r["loss"] for r in steps[-3:]) < sum(r["loss"] for r in steps[:3])
    # Each step counts exactly the student's answer tokens of the rows it draws.
    parsed = config_from_dict(config)
    packing = aligned_packing(STUDENT, teacher_tokenizer(), sequence_length=256, teacher_sequence_length=160, pack=True)
    train, _ = data.build_run_datasets(STUDENT, parsed.dataset, sequence_length=256, pack_texts=packing)
    batches = iterate_batches(train, global_batch_size=4, dp_rank=0, dp_size=1, seed=parsed.dataset.seed)
    assert [r["num_tokens"] for r in steps] == [int((next(batches)["labels"] != -100).sum()) for _ in steps]
