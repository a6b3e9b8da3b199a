"""Trainable parameters, optimizer state and peak memory of a LoRA student against the same student trained
whole.

    meshkd bench --only lora [--quick] [--json OUT]

The student, the data and the step are the precision section's (`meshkd.bench.precision`: a random Llama of
56 M parameters, 7 M with --quick, 4 steps of one row, AdamW, one rank, each variant in a fresh process so
that its peak is its own), in mixed bfloat16 (float32 master weights, the forward under autocast), as
`model.dtype: bfloat16` trains: whole, and with LoRA adapters of rank 16 on every linear layer but the
output head (`peft: {rank: 16, alpha: 32}`), the base frozen in bfloat16, the adapters float32. Ratios are
to the whole student's.
"""

from __future__ import annotations

from meshkd.bench.precision import _student, measure

LORA = {"rank": 16, "alpha": 32.0, "target_modules": "all-linear"}


def run_section(quick: bool) -> dict:
    """{"lora": results}, printed as they are measured."""
    rows = []
    for name, lora in (("whole student", None), ("LoRA r=16 all-linear", LORA)):
        row = {"variant": name, **measure("mixed bfloat16", quick, lora)}
        whole = rows[0] if rows else row
        row.update(trainable_ratio=row["trainable_parameters"] / whole["trainable_parameters"],
                   optimizer_state_ratio=row["optimizer_state_bytes"] / whole["optimizer_state_bytes"],
                   peak_ratio=row["peak_mib"] / whole["peak_mib"],
                   step_time_ratio=row["step_time_s"] / whole["step_time_s"])
        rows.append(row)
        print(f"lora {name:>20}: {row['trainable_parameters'] / 1e6:.2f} M trainable of "
              f"{row['parameters'] / 1e6:.1f} M "
              f"({row['trainable_ratio']:.4f}), optimizer state {row['optimizer_state_bytes'] / 2**20:.1f} MiB "
              f"({row['optimizer_state_ratio']:.4f}), peak {row['peak_mib']:.0f} MiB ({row['peak_ratio']:.2f}), "
              f"step {row['step_time_s']:.3f} s ({row['step_time_ratio']:.2f})")
    return {"lora": {"rows": rows, "student": _student(quick), "adapters": LORA}}
