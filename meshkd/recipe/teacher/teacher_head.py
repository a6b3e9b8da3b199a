"""The teacher's output layer on the student's side, which turns hidden answers back into the teacher's logits
(`kd.logits_transport: hidden` or `hidden_bf16`, `meshkd.core.answers.hidden`).

Design. `TeacherHead.of(section, vocab_size=V)` builds the teacher's model class without weights (as its ranks do,
`load_section_model_for_layout`), puts in place of its decoder a module that hands back the hidden states it is
given (`_GivenHidden`), and reads only the output layer's weight (a tied head: the embedding's) from the checkpoint
(a model that cannot be read in pieces, a random-init or GGUF one, is built whole and its head kept). `logits(h,
columns)` runs the model's own forward on the hidden states h: its output layer, over the entries `columns`, and
whatever the forward does after it (Gemma 2's soft-cap, Granite's and Cohere's scales), never written here: those
are elementwise, so a slice of the vocabulary is computed alone. It runs in the teacher's dtype, as the teacher's
own forward does, and hands float32 on.

`to_bytes()` makes the head (its weight and the model's config) one safetensors file, as a served teacher hands it
to students (`from_bytes`) and a teacher cache keeps it (`save`, `saved`). Its `id` hashes the model's class, its
config (paths left out) and the weight: what a hidden answer names, so that one is never read with another
teacher's head.

Memory: V x H in the teacher's dtype a student rank, or its tensor-parallel slice (`held`), where the run never
needs a teacher's whole logits (one teacher, or several summed: a mixture or routed teachers combine whole
logits).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from meshkd.core.answers.hidden import OutputHead
from meshkd.parallel.sharded_loading import Checkpoint, load_shards
from meshkd.recipe.common.files import write_atomically
from meshkd.recipe.modeling.loaders import load_section_model_for_layout

HEAD_FILE = "head.safetensors"


class _GivenHidden(nn.Module):
    """In place of a model's decoder: hands its forward the hidden states set in `given`."""

    def __init__(self) -> None:
        super().__init__()
        self.given: torch.Tensor | None = None

    def forward(self, *args, **kwargs) -> _Outputs:
        return _Outputs(self.given)


class _Outputs:
    """A decoder's outputs as a causal LM's forward reads them: the last hidden states, nothing else (None)."""

    def __init__(self, hidden: torch.Tensor | None) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:  # only for what it does not hold: router logits, caches, ...
        return None

    def __getitem__(self, index):
        return (self.last_hidden_state,)[index]


class TeacherHead(OutputHead):
    """A teacher's output layer and what its forward does after it (module docstring)."""

    def __init__(self, causal_lm: nn.Module, head: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None, *,
                 held: slice | None = None) -> None:
        self.causal_lm, self.weight, self.bias = causal_lm, weight, bias
        self._head = head
        self.vocab_size = weight.shape[0]
        self.id = _fingerprint(causal_lm, weight, bias)
        self.held = slice(0, self.vocab_size)
        """The vocabulary entries whose weight this side keeps."""
        if held is not None:
            self.keep(held)
        self._given = _GivenHidden()
        setattr(causal_lm, causal_lm.base_model_prefix, self._given)
        causal_lm.eval()

    @classmethod
    def of(cls, section, *, vocab_size: int, device: torch.device | str = "cpu",
           held: slice | None = None) -> TeacherHead:
        """The head of the teacher a model section (`teacher_model`) describes, over its first `vocab_size` entries
        (the vocabulary the answers cover); `held`: the entries to keep, the rest dropped once the id is taken."""
        return cls.of_model(*load_section_model_for_layout(section), vocab_size=vocab_size, device=device, held=held)

    @classmethod
    def of_model(cls, model: nn.Module, checkpoint: Checkpoint | None = None, *, vocab_size: int,
                 device: torch.device | str = "cpu", held: slice | None = None) -> TeacherHead:
        """`of` a causal LM (taken over: its decoder is dropped), loaded or, with its `checkpoint`, without weights
        (`meshkd.parallel.sharded_loading.empty_causal_lm`): only its head is read then."""
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise ValueError(f"{type(model).__name__}'s output layer is {type(head).__name__}, not a linear layer: "
                             "its hidden states cannot be sent for its logits")
        setattr(model, model.base_model_prefix, _GivenHidden())  # the decoder's weights are never read
        if checkpoint is not None:
            load_shards(model, checkpoint, device="cpu")
        weight = head.weight.detach()[:vocab_size].to(device)
        bias = None if head.bias is None else head.bias.detach()[:vocab_size].to(device)
        return cls(model, head, weight, bias, held=held)

    @classmethod
    def from_bytes(cls, data: bytes, *, device: torch.device | str = "cpu", held: slice | None = None) -> TeacherHead:
        """The head `to_bytes` made."""
        from safetensors.torch import load
        from transformers import AutoConfig, AutoModelForCausalLM

        tensors = {name: tensor.to(device) for name, tensor in load(data).items()}
        # A safetensors file's header: its length (8 bytes, little-endian), then JSON with the metadata.
        length = int.from_bytes(data[:8], "little")
        config = AutoConfig.for_model(**json.loads(json.loads(data[8 : 8 + length])["__metadata__"]["config"]))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=tensors["weight"].dtype)
        head = model.get_output_embeddings()
        return cls(model, head, tensors["weight"], tensors.get("bias"), held=held)

    def to_bytes(self) -> bytes:
        """The head as one safetensors file: its weight (the whole of its `vocab_size` entries), its bias if any,
        and the model's config."""
        from safetensors.torch import save

        if self.held != slice(0, self.vocab_size):
            raise ValueError("a teacher head that keeps a slice of its vocabulary is not saved")
        tensors = {"weight": self.weight} if self.bias is None else {"weight": self.weight, "bias": self.bias}
        return save({name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()},
                    metadata={"config": self.causal_lm.config.to_json_string(), "id": self.id})

    @classmethod
    def saved(cls, directory: str | Path, *, device: torch.device | str = "cpu",
              held: slice | None = None) -> TeacherHead:
        """The head `save` wrote to `directory`."""
        return cls.from_bytes((Path(directory) / HEAD_FILE).read_bytes(), device=device, held=held)

    def save(self, directory: str | Path) -> None:
        """`to_bytes` in `directory`, for `saved`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_atomically(directory / HEAD_FILE, self.to_bytes())

    def keep(self, columns: slice) -> None:
        """Keep the weight of the vocabulary entries `columns` only (a tensor-parallel student's slice)."""
        self.weight = self.weight[columns].clone()
        self.bias = None if self.bias is None else self.bias[columns].clone()
        self.held = slice(columns.start, columns.start + self.weight.shape[0])

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, columns: slice) -> torch.Tensor:
        start, stop, _ = columns.indices(self.vocab_size)
        if start < self.held.start or stop > self.held.stop:
            raise ValueError(f"the teacher head keeps vocabulary entries [{self.held.start}, {self.held.stop}), "
                             f"asked for [{start}, {stop})")
        rows = slice(start - self.held.start, stop - self.held.start)
        head = self._head
        head.weight = nn.Parameter(self.weight[rows], requires_grad=False)
        head.bias = None if self.bias is None else nn.Parameter(self.bias[rows], requires_grad=False)
        self._given.given = hidden.to(self.weight.device, self.weight.dtype)[None]
        try:
            with torch.autocast(hidden.device.type, enabled=False):
                logits = self.causal_lm(input_ids=torch.zeros(hidden.shape[:1], dtype=torch.long,
                                                              device=self.weight.device)[None],
                                        use_cache=False).logits
        finally:
            self._given.given = None
        return logits[0].float()


def vocabulary_slice(vocab_size: int, mesh) -> slice:
    """The entries of a vocabulary of `vocab_size` that this rank holds when it is sharded over the 1-D `mesh` (as a
    DTensor's Shard places them: the student's vocabulary-parallel logits)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    (length,), (start,) = compute_local_shape_and_global_offset((vocab_size,), mesh, [Shard(0)])
    return slice(start, start + length)


def _fingerprint(causal_lm: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """sha256 of the model's class, its config's settings and the head's weights."""
    settings = {key: value for key, value in causal_lm.config.to_dict().items()
                if not key.startswith("_") and key not in ("transformers_version", "dtype", "torch_dtype")}
    digest = hashlib.sha256(type(causal_lm).__name__.encode())
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for tensor in (weight, bias):
        if tensor is not None:
            digest.update(str(tensor.dtype).encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


__all__ = ["HEAD_FILE", "TeacherHead", "vocabulary_slice"]
