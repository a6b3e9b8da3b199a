"""LoRA students (the `peft` section): the peft library's adapters on a frozen student.

Design. `add_adapters` has peft replace each target linear layer of the student with its LoRA layer in place
(`inject_adapter_in_model`): the model keeps its transformers class, forward and module paths, so the layouts
lay it out as any student (dp with FSDP2 or DDP, cp, pp; tp is refused at config load: the model's tensor-
parallel plan shards linear layers, which LoRA layers wrap). Under FSDP2 the student is built without weights,
as any student there: its base weights are read in shards once laid out, under their checkpoint names
(`checkpoint_names`: a LoRA layer holds its linear layer as `base_layer`), and the adapters get their initial
values then (`init_adapters`). peft freezes the base weights, which load in the compute dtype (`model.dtype`:
bfloat16 halves the base's memory); the adapters start from peft's default init (A Kaiming-uniform, B = 0, so
the student starts as its base), drawn from generators seeded by `model.seed` and each adapter's name, so the
same on every rank and layout, and are float32 master weights with float32 optimizer states, trained in the
compute dtype as any student's (`meshkd.parallel.mixed_precision`: its dtype is the trained parameters'; FSDP2
gathers the base and the adapters in the compute dtype). `model.pure_half_precision` is refused with peft.
Only what trains is kept beyond the model: the optimizer holds the adapters alone (`trainable_parameters`),
and checkpoints hold the adapters and their optimizer state (`meshkd.recipe.modeling.checkpoint`: frozen parameters are
left out; a resumed run reads its base from `model.path` again).

The export (`export_adapters`, on the rank holding the gathered state dict) writes two directories: the
student with the adapters merged into its weights (`hf_student/`, which plain transformers loads, as for
any student) and the adapters alone (`hf_adapter/`, which `PeftModel.from_pretrained(base, ...)` loads on
the base of `model.path`, pruned as `model.keep_layers` says).
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import torch
from torch import nn

ADAPTER_NAME = "default"  # peft's name of a model's one adapter
_SAVED_PREFIX = "base_model.model."  # how `PeftModel` names the wrapped model's weights in adapter files


def lora_config(section, *, base_path: str | None = None):
    """peft's `LoraConfig` of a `peft` config section (`PeftConfig`)."""
    from peft import LoraConfig

    return LoraConfig(r=section.rank, lora_alpha=section.alpha, lora_dropout=section.dropout,
                      target_modules=section.target_modules, base_model_name_or_path=base_path)


def add_adapters(model: nn.Module, section, *, seed: int) -> None:
    """Put LoRA adapters on `model` in place and freeze everything else; the adapters get their initial
    values (`init_adapters`) unless the model is on the meta device (then once it is laid out and loaded).

    Raises:
        ValueError: naming `peft.target_modules` when it matches no module of the model.
    """
    from peft import inject_adapter_in_model

    with torch.random.fork_rng(devices=[]):  # peft's own init draws from the global generator
        try:
            inject_adapter_in_model(lora_config(section), model, adapter_name=ADAPTER_NAME)
        except ValueError as error:
            message = " ".join(str(error).split())
            raise ValueError(f"peft.target_modules {section.target_modules!r}: {message}") from None
    for parameter in trainable_parameters(model):  # float32 masters on a base in the compute dtype
        parameter.data = parameter.data.float()
    if not any(parameter.is_meta for parameter in model.parameters()):
        init_adapters(model, seed=seed)


def _is_adapter(name: str) -> bool:
    return f".lora_A.{ADAPTER_NAME}." in name or f".lora_B.{ADAPTER_NAME}." in name


@torch.no_grad()
def init_adapters(model: nn.Module, *, seed: int) -> None:
    """peft's default init of every adapter of `model` (laid out or not: each rank writes its share): A
    Kaiming-uniform (a = sqrt(5), as `nn.Linear`) from a generator seeded by `seed` and the adapter's name,
    B zeros."""
    from meshkd.parallel.sharded_loading import fill_from_whole

    for name, parameter in getattr(model, "module", model).named_parameters():  # DDP's inner names
        if not _is_adapter(name):
            continue
        whole = torch.zeros(parameter.shape, dtype=torch.float32)
        if ".lora_A." in name:
            generator = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
            nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
        fill_from_whole(parameter, whole)


def checkpoint_names(model: nn.Module) -> dict[str, str | None]:
    """`load_shards`' names of a LoRA student: each base weight's name in the checkpoint (without
    `base_layer`), None for the adapters (not in the checkpoint: `init_adapters` fills them)."""
    return {name: None if _is_adapter(name) else name.replace(".base_layer.", ".")
            for name, _ in model.named_parameters()}


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer updates: all of a full student's, a LoRA student's adapters."""
    return [parameter for parameter in model.parameters() if parameter.requires_grad]


def export_adapters(state_dict: dict[str, torch.Tensor], *, config, section, base_path: str | None,
                    adapter_dir: Path) -> dict[str, torch.Tensor]:
    """Write the adapters of a gathered LoRA student's `state_dict` to `adapter_dir`; returns the merged
    student's state dict (the names and shapes of the base model, each adapted weight W + alpha / r B A).

    `config`: the student's transformers config (an empty model of it is built on the meta device, with the
    same adapters, to merge them by peft's own code)."""
    from peft import get_peft_model_state_dict, inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)
    inject_adapter_in_model(lora_config(section), shell, adapter_name=ADAPTER_NAME)
    shell.load_state_dict(state_dict, assign=True)
    adapters = get_peft_model_state_dict(shell, adapter_name=ADAPTER_NAME)
    adapter_dir.mkdir(parents=True, exist_ok=True)
    save_file({_SAVED_PREFIX + name: tensor.contiguous() for name, tensor in adapters.items()},
              adapter_dir / "adapter_model.safetensors")
    lora_config(section, base_path=base_path).save_pretrained(adapter_dir)
    for name, module in list(shell.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, attribute = name.rpartition(".")
            setattr(shell.get_submodule(parent), attribute, module.get_base_layer())
    return shell.state_dict()
