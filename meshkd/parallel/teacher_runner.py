"""Forward-only teacher over its `DistributedSetup`: pipeline split, tensor, expert and context parallel.

Model code knows nothing of parallelism and is never copied: the runner takes an ordinary transformers
decoder-only LM and changes the instance in place, in a fixed order: pipeline split
(`meshkd.parallel.stages.ModelStage`, by the model's pipeline plan), then tensor parallel (the model's own
plan; with ep_size = tp_size whole experts spread over the tp ranks, as the model's expert plan says), then
context parallel (head-tail shards, gathered K/V). Pipeline stages pass activations point to point, shape
metadata first (sequence lengths may change per batch). Every stage builds the attention masks itself
(`meshkd.core.masks.layer_masks`) from NEAT document indices (or an ordinary 0/1 mask), so the teacher
needs no `configure_packing`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshkd.core.logits import materialize_teacher_logits
from meshkd.core.masks import attention_windows, layer_masks, positions_and_documents, takes_block_masks
from meshkd.core.topology import DistributedSetup, member_mesh
from meshkd.parallel.context_parallel import enable_cp_attention, pad_and_shard, padded_length
from meshkd.parallel.sharded_loading import is_empty
from meshkd.parallel.stages import ModelStage
from meshkd.parallel.tensor_parallel import apply_tensor_parallel

# Dtypes a pipeline activation may have; the index travels in the shape metadata.
_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Metadata sent before each activation: ok flag, batch, local sequence, hidden, padded sequence,
# unpadded sequence, dtype index.
_META_LENGTH = 7


class TeacherRunner:
    """Forward-only teacher over its `DistributedSetup`: pipeline split, TP, CP; full logits out.

    Construction changes `model` in place (the pipeline split of `meshkd.parallel.stages.ModelStage`, TP by the
    model's own plan, the CP attention selected) and puts it in eval mode. The model's own forward runs on
    every stage. `logits(batch)` must be called by every rank of the teacher replica with the same batch
    (on pipeline stages after the first the batch is not read and may be None: inputs travel with the
    activations).

    Batch: `input_ids` [batch, sequence]; optional `position_ids` [batch, sequence] (restarting per
    document for NEAT packing; default 0..sequence-1) and `attention_mask` [batch, sequence] (1-based
    document index, 0 = padding; an ordinary 0/1 mask is the one-document case). Other keys are ignored.

    The model must use sdpa, eager or flex attention (the runner hands the model prepared masks, one per
    attention kind of its layers: 4D additive tensors, or BlockMasks for flex; under CP the gathered-K/V
    attention calls the model's own attention).
    Teacher weights are replicated across dp: no FSDP here. `is_first` / `is_last` tell whether this rank
    holds the first / last pipeline stage.
    """

    def __init__(self, model: nn.Module, setup: DistributedSetup, *, device: torch.device | str):

        mesh = member_mesh(setup)
        self.setup = setup
        self.device = torch.device(device)
        self.mesh = mesh
        self.windows = attention_windows(model.config, model)
        self.block = takes_block_masks(model.config)  # read before context parallel renames the attention

        self.pp_size = setup.pp_size
        self.pp_rank = mesh.get_local_rank("pp")
        self.pp_group = mesh.get_group("pp") if self.pp_size > 1 else None
        self.cp_size = setup.cp_size
        self.cp_rank = mesh.get_local_rank("cp")
        # Pipeline split first, so TP only touches what this stage keeps.
        self.stage = ModelStage(model, pp_size=self.pp_size, pp_rank=self.pp_rank)
        self.is_first, self.is_last = self.stage.is_first, self.stage.is_last
        if not is_empty(model):  # else `load_shards` gives it storage on the device once laid out
            model.to(self.device)
        if setup.expert_axis == "dp_shard":
            raise ValueError(f"ep_size({setup.ep_size}) over the data-parallel ranks is not supported for the "
                             "teacher (its replicas do not run forward in step); use ep_size equal to tp_size")
        if setup.tp_size > 1:
            apply_tensor_parallel(model, mesh["tp"], expert_parallel=setup.expert_axis == "tp")
        if self.cp_size > 1:
            enable_cp_attention(model, mesh.get_group("cp"))
        model.eval()
        self.model = model
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())

    # -- inputs ----------------------------------------------------------------------------------------

    def _prepare(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(local input_ids, local position_ids, padded documents [batch, padded_sequence], sequence length)."""
        input_ids = batch["input_ids"].to(self.device)
        length = input_ids.shape[1]
        position_ids, documents = positions_and_documents(batch, input_ids)
        position_ids, documents = position_ids.to(self.device).long(), documents.to(self.device).long()
        if self.cp_size > 1:
            # Head-tail sharding needs 2 * cp equal chunks; padding is document 0, so nothing attends to it.
            shard = dict(cp_size=self.cp_size, cp_rank=self.cp_rank)
            input_ids, position_ids = pad_and_shard(input_ids, **shard), pad_and_shard(position_ids, **shard)
            documents = nn.functional.pad(documents, (0, padded_length(length, self.cp_size) - length))
        return input_ids, position_ids, documents, length

    # -- pipeline transport ----------------------------------------------------------------------------

    def _send(self, meta: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        peer = self.pp_rank + 1
        dist.send(meta, group_dst=peer, group=self.pp_group)
        for tensor in tensors:
            dist.send(tensor.contiguous(), group_dst=peer, group=self.pp_group)

    def _send_error(self) -> None:
        self._send(torch.zeros(_META_LENGTH, dtype=torch.int64, device=self.device), [])

    def _receive(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(hidden, local position_ids, padded documents, sequence length) from the previous stage.

        The shapes come first on every call: sequence lengths may change from batch to batch.
        """
        peer = self.pp_rank - 1
        meta = torch.empty(_META_LENGTH, dtype=torch.int64, device=self.device)
        dist.recv(meta, group_src=peer, group=self.pp_group)
        ok, batch_size, local_length, hidden_size, padded_length, length, dtype_index = meta.tolist()
        if not ok:
            if not self.is_last:
                self._send_error()  # pass the failure down so later stages do not wait forever
            raise RuntimeError(f"pipeline stage {peer} failed on this batch; see its error")
        hidden = torch.empty(batch_size, local_length, hidden_size, dtype=_WIRE_DTYPES[dtype_index], device=self.device)
        position_ids = torch.empty(batch_size, local_length, dtype=torch.int64, device=self.device)
        documents = torch.empty(batch_size, padded_length, dtype=torch.int64, device=self.device)
        for tensor in (hidden, position_ids, documents):
            dist.recv(tensor, group_src=peer, group=self.pp_group)
        return hidden, position_ids, documents, length

    # -- forward ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, batch: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        """Full teacher logits [batch, sequence, vocab] on every rank of the last stage; None elsewhere.

        The result is identical on all tp and cp ranks of the last stage (gathered over both).
        """
        return self.outputs(batch)[0]

    @torch.no_grad()
    def outputs(self, batch: dict[str, torch.Tensor] | None, *, logits: bool = True,
                hidden: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(`logits` [batch, sequence, vocab], `hidden` the last hidden states [batch, sequence, H], what the
        output layer takes) as asked, else None, on every rank of the last stage, whole; (None, None) elsewhere.
        The last hidden states alone skip the output layer's work (`ModelStage.run`'s `hidden_states`)."""
        taken: list[torch.Tensor] = []
        handle = None
        if hidden and logits and self.is_last:  # one forward for both: the output layer's input is kept
            handle = self.model.get_output_embeddings().register_forward_pre_hook(
                lambda module, args: taken.append(args[0]))
        try:
            if self.is_first:
                if batch is None:
                    raise ValueError("TeacherRunner.logits needs the batch on the first pipeline stage")
                inputs, position_ids, documents, length = self._prepare(batch)
            else:
                inputs, position_ids, documents, length = self._receive()
            masks = layer_masks(documents, self.windows, dtype=self.dtype, cp_size=self.cp_size,
                                cp_rank=self.cp_rank, block=self.block)
            output = self.stage.run(inputs, attention_mask=masks, position_ids=position_ids,
                                    hidden_states=hidden and not logits)
        except BaseException:
            if not self.is_last:
                self._send_error()
            raise
        finally:
            if handle is not None:
                handle.remove()
        if not self.is_last:
            meta = torch.tensor(
                [1, *output.shape, documents.shape[1], length, _WIRE_DTYPES.index(output.dtype)],
                dtype=torch.int64,
                device=self.device,
            )
            self._send(meta, [output, position_ids, documents])
            return None, None
        if not logits:
            return None, materialize_teacher_logits(output, self.mesh, length)
        whole = materialize_teacher_logits(output, self.mesh, length)
        return whole, materialize_teacher_logits(taken[-1], self.mesh, length) if hidden else None
