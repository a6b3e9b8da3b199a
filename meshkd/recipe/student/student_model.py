"""The student model of a run: loaded as its layout needs, laid out, and tapped for hidden-state KD.

- `load_student`: the whole model where it is replicated (DDP, one process), else an empty skeleton and the
  checkpoint each rank reads its share of once laid out (FSDP2); float32 master weights unless
  `model.pure_half_precision` (`meshkd.parallel.mixed_precision`), a LoRA student's frozen base in the compute
  dtype; activation checkpointing and LoRA adapters added before any layout.
- `lay_out_student`: pipeline stages, or TP / CP / FSDP2 / DDP (`meshkd.parallel`), the weights read if not
  yet, the adapters initialised; the routers' load-balancing loss hooked on the whole model first, so the
  pipeline stages keep their routers' hooks.
- `student_hidden_states`: `kd.hidden_states`' student side on the laid-out model.
- `export_student`: the trained student as an HF directory; a LoRA student's adapters beside it.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from meshkd.core.topology import DistributedSetup
from meshkd.parallel.data_parallel import parallelize_student
from meshkd.parallel.sharded_loading import is_empty, load_shards
from meshkd.parallel.student_pipeline import StudentPipeline
from meshkd.recipe.common.faults import about
from meshkd.recipe.modeling import checkpoint as ckpt
from meshkd.recipe.modeling.adapters import add_adapters, checkpoint_names, export_adapters, init_adapters
from meshkd.recipe.modeling.loaders import load_section_model, load_section_model_for_layout
from meshkd.recipe.modeling.models import resolve_dtype
from meshkd.recipe.settings.config import KDRecipeConfig
from meshkd.recipe.student.router_loss import RouterLoss
from meshkd.recipe.student.train_step import enable_activation_checkpointing
from meshkd.recipe.teacher.hidden_states import HiddenStateProjections, LayerTap, StudentHiddenStates, paired_layers


def load_student(config: KDRecipeConfig, setup: DistributedSetup) -> tuple[torch.nn.Module, object | None]:
    """(the student, its checkpoint to read once laid out, or None when the model holds its weights)."""
    dtype = config.model.dtype if config.peft is not None else config.model.parameter_dtype()
    section = dataclasses.replace(config.model, dtype=dtype)
    with about("model"):
        if setup.strategy == "fsdp2":
            model, checkpoint = load_section_model_for_layout(section)
        else:
            model, checkpoint = load_section_model(section), None
        if config.model.activation_checkpointing:
            enable_activation_checkpointing(model)
    if config.peft is not None:  # before any layout (meshkd.recipe.modeling.adapters)
        with about("peft"):
            add_adapters(model, config.peft, seed=config.model.seed)
    return model, checkpoint


def lay_out_student(model: torch.nn.Module, checkpoint, config: KDRecipeConfig, setup: DistributedSetup, *,
                    device: torch.device, num_micro_batches: int,
                    ) -> tuple[torch.nn.Module, StudentPipeline | None, RouterLoss | None]:
    """(the laid-out model, or a pipelined student's stage model; its pipeline or None; its router loss)."""
    router_loss = RouterLoss.for_student(model, config.kd.router_aux_loss_coef)
    compute_dtype = resolve_dtype(config.model.dtype)
    pipeline = None
    if setup.pp_size > 1:
        pipeline = StudentPipeline(model, setup, device=device, schedule=setup.pp_schedule,
                                   num_micro_batches=num_micro_batches, router_loss=router_loss,
                                   compute_dtype=compute_dtype)
        laid_out = pipeline.stage_model
    else:
        # TeacherRunner and StudentPipeline move their model; parallelize_student leaves that to us.
        if not is_empty(model):  # else `load_shards` gives it storage on the device
            model.to(device)
        laid_out = parallelize_student(model, setup, compute_dtype=compute_dtype)
    if checkpoint is not None:
        names = checkpoint_names(laid_out) if config.peft is not None else None
        with about("model"):
            load_shards(laid_out, checkpoint, device=device, names=names)
        if config.peft is not None:
            init_adapters(laid_out, seed=config.model.seed)
    return laid_out, pipeline, router_loss


def student_hidden_states(model: torch.nn.Module, config: KDRecipeConfig, *, teacher_width: int | None,
                          device: torch.device) -> StudentHiddenStates | None:
    """A tap on the laid-out student's paired layers, and projections onto the teacher's width (the identity,
    without parameters, where the widths agree); None without `kd.hidden_states`."""
    hidden_states, layers = config.kd.hidden_states, paired_layers(config, "student")
    if hidden_states is None:
        return None
    model = getattr(model, "module", model)  # DDP's
    width = model.config.get_text_config().hidden_size
    projections = HiddenStateProjections(layers, student_width=width, teacher_width=teacher_width)
    return StudentHiddenStates(LayerTap(model, layers), weight=hidden_states.weight, projections=projections.to(device))


def export_student(model: torch.nn.Module, pipeline: StudentPipeline | None, config: KDRecipeConfig, run_dir: Path,
                   *, tokenizer, group) -> tuple[Path, Path | None]:
    """(RUN_DIR/hf_student: safetensors, config, tokenizer; RUN_DIR/hf_adapter, a LoRA student's adapters, or
    None) (`meshkd.recipe.modeling.checkpoint.export_hf`, `meshkd.recipe.modeling.adapters`)."""
    merge = adapters = None
    if config.peft is not None:
        adapters = run_dir / "hf_adapter"
        merge = functools.partial(export_adapters, config=getattr(model, "module", model).config, section=config.peft,
                                  base_path=config.model.path, adapter_dir=adapters)
    exported = ckpt.export_hf(run_dir / "hf_student", model=model, pipeline=pipeline, tokenizer=tokenizer,
                              group=group, dtype=resolve_dtype(config.model.dtype), merge_adapters=merge)
    return exported, adapters
