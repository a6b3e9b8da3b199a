"""The end-of-run report (no process group): what it says for a finished, a stopped and a cached run."""

from pathlib import Path

from meshkd.recipe.lifecycle.run_report import RunFigures, run_report

BEFORE = {"val_loss_before": 5.5, "teacher_val_loss": 4.25, "val_bits_per_byte_before": 7.9,
          "teacher_val_bits_per_byte": 6.1, "val_kl_before": 0.5, "val_top1_agreement_before": 0.25}
AFTER = {"val_loss_after": 5.0, "val_bits_per_byte_after": 7.2, "val_kl_after": 0.375,
         "val_top1_agreement_after": 0.5}


def figures(**changes) -> RunFigures:
    values = dict(start_step=0, last_step=20, max_steps=20, tokens=10240.0, step_time_s=2.0, wall_s=12.5,
                  run_dir=Path("runs/x"), checkpoint=Path("runs/x/checkpoints/step_00000020"))
    return RunFigures(**{**values, **changes})


def table(report: str) -> dict[str, list[str]]:
    return {line[:36].strip(): line[36:].split() for line in report.splitlines()[1:]
            if line.startswith("  ") and ": " not in line}


def test_a_finished_run_reports_steps_rate_figures_before_and_after_and_its_outputs():
    report = run_report({**BEFORE, **AFTER, "hf_dir": "/abs/runs/x/hf_student"}, figures())
    lines = report.splitlines()
    assert lines[0] == ("meshkd train: finished 20 of 20 steps in 12.5 s: 20 trained in this run, 10,240 tokens, "
                        "5,120 tokens/s in the steps")
    assert table(report) == {"": ["before", "after", "teacher"],
                             "held-out loss (nats/token)": ["5.5000", "5.0000", "4.2500"],
                             "held-out bits per byte": ["7.9000", "7.2000", "6.1000"],
                             "KL(teacher || student)": ["0.5000", "0.3750"],
                             "top-1 agreement with the teacher": ["25.0%", "50.0%"]}
    assert lines[-3:] == ["  run directory: runs/x (metrics.jsonl, summary.json)",
                          "  last checkpoint: runs/x/checkpoints/step_00000020",
                          "  exported model: /abs/runs/x/hf_student"]
    assert not any(line != line.rstrip() for line in lines)


def test_a_stopped_run_says_why_where_to_continue_and_has_no_after_figures():
    report = run_report({**BEFORE, "stopped_at_step": 7}, figures(
        start_step=3, last_step=7, checkpoint=Path("runs/x/checkpoints/step_00000007"), stopped="SIGTERM"))
    lines = report.splitlines()
    assert lines[0].startswith("meshkd train: stopped at step 7 of 20 on SIGTERM (resumed at step 3) in 12.5 s: "
                               "4 trained in this run")
    assert table(report)["held-out loss (nats/token)"] == ["5.5000", "4.2500"]  # before and the teacher's
    assert lines[-1] == "  last checkpoint: runs/x/checkpoints/step_00000007 (continue with --resume)"


def test_figures_a_run_did_not_measure_are_left_out():
    """From a teacher cache: no teacher figure on held-out rows, no KL; checkpointing off; skipped steps said."""
    summary = {key: value for key, value in {**BEFORE, **AFTER}.items() if "kl" not in key and "teacher" not in key
               and "top1" not in key}
    report = run_report({**summary, "skipped_steps": 2}, figures(checkpoint=None, step_time_s=0.0))
    assert "tokens/s" not in report.splitlines()[0]
    assert "  skipped steps (a loss or gradient not finite): 2" in report
    assert set(table(report)) == {"", "held-out loss (nats/token)", "held-out bits per byte"}
    assert "checkpoint" not in report and "exported model" not in report
