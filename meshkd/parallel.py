"""Parallelize: lay a transformers causal LM out over its role's DeviceMesh, one function per role.

Design (torchtitan style). Model code knows nothing of parallelism; these functions take an ordinary
transformers decoder-only LM (Llama family: `model.model.{embed_tokens, layers, norm, rotary_emb}` and
`model.lm_head`) and a `DistributedSetup`, and change the instance in place, in a fixed order:
pipeline split (teacher only), then tensor parallel, then data parallel (student only).

- `parallelize_student`: TP over the `tp` axis (attention and MLP colwise/rowwise, vocab-sharded
  embedding, lm_head colwise with its output left as a DTensor Shard(-1) so the loss sees vocab-sharded
  logits), then FSDP2 per decoder layer and on the root over `dp_shard` (HSDP over (dp_replicate,
  dp_shard) when dp_replicate > 1), or DDP over `dp` with strategy "ddp".
- `TeacherRunner`: forward only. TP as above; context parallel by head-tail sharding the sequence and an
  attention function (registered with transformers' `AttentionInterface`, selected on this instance's
  config only) that all-gathers K/V over `cp` and applies a mask built from global positions, so it runs
  on the CPU where torch's ring attention does not; pipeline parallel by contiguous layer stages that
  pass activations point to point, shape metadata first. The runner builds the 4D attention mask itself
  from NEAT document indices (or an ordinary 0/1 mask), so the teacher needs no `configure_packing`.
- `gather_full_state_dict`: the unsharded state dict for export.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from meshkd.logits import cp_shard, materialize_teacher_logits
from meshkd.topology import DistributedSetup

CP_ATTENTION = "meshkd_cp"
"""Name under which the context-parallel attention function is registered with transformers."""

# Attribute on each attention module holding its cp process group; the registered attention function is
# global to transformers, so the group travels with the module instance instead.
_CP_GROUP_ATTR = "_meshkd_cp_group"
# Dtypes a pipeline activation may have; the index travels in the shape metadata.
_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Metadata sent before each activation: ok flag, batch, local sequence, hidden, padded sequence,
# unpadded sequence, dtype index.
_META_LENGTH = 7


# ---------------------------------------------------------------------------------------------------------
# Tensor parallel


def _decoder(model: nn.Module) -> nn.Module:
    """The inner decoder (`model.model`) of a transformers causal LM; ValueError for other layouts."""
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(model, "lm_head"):
        raise ValueError(
            f"{type(model).__name__} does not have the Llama-family layout (model.model.layers, model.lm_head) "
            f"that meshkd.parallel knows how to split"
        )
    return decoder


def _is_tied(model: nn.Module) -> bool:
    embed = getattr(_decoder(model), "embed_tokens", None)
    return embed is not None and model.lm_head is not None and model.lm_head.weight is embed.weight


def _check_tp_sizes(config: Any, tp_size: int) -> None:
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, key, None)
        if value is not None and value % tp_size:
            raise ValueError(f"tp_size({tp_size}) must divide {key}({value}): attention heads are split whole")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Apply the Llama-family TP plan over the 1-D `tp_mesh` in place.

    Attention q/k/v and MLP gate/up are colwise (each rank holds whole heads / a slice of the intermediate
    dim), o_proj and down_proj rowwise (their outputs are all-reduced back to replicated activations).
    The embedding is rowwise (vocab-sharded weight, replicated output). lm_head is colwise with its output
    kept as a DTensor sharded on the vocab dim: logits are never gathered here. Tied embeddings stay tied:
    both layers shard the weight as Shard(0), so the lm_head is pointed back at the embedding's DTensor.
    Modules absent on a pipeline stage (None) are skipped.
    """
    decoder = _decoder(model)
    tp_size = tp_mesh.size()
    _check_tp_sizes(model.config, tp_size)
    tied = _is_tied(model)
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in decoder.layers:
        parallelize_module(layer, tp_mesh, layer_plan)
        # Attention reshapes with -1 heads in current transformers, but some model families still read
        # per-module head counts; those must describe the local heads.
        attention = layer.self_attn
        for key in ("num_heads", "num_key_value_heads"):
            if isinstance(getattr(attention, key, None), int):
                setattr(attention, key, getattr(attention, key) // tp_size)
    if decoder.embed_tokens is not None:
        parallelize_module(
            decoder.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        )
    if model.lm_head is not None:
        parallelize_module(
            model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        )
        if tied and decoder.embed_tokens is not None:
            model.lm_head.weight = decoder.embed_tokens.weight


# ---------------------------------------------------------------------------------------------------------
# Student


def parallelize_student(model: nn.Module, setup: DistributedSetup) -> nn.Module:
    """Lay the student out over `setup`: TP, then FSDP2 (or DDP); returns the model to train.

    Args:
        model: a transformers causal LM on its device, identical on every rank of the role.
        setup: the student's `DistributedSetup` (this rank must be a member).

    Returns:
        `model` itself for strategy "fsdp2" (changed in place; its logits are a DTensor Shard(-1) on the
        `tp` axis when tp_size > 1), or a `DistributedDataParallel` wrapper for strategy "ddp".

    Raises:
        ValueError: for layouts the student does not support (pp, cp, sequence parallel, TP with DDP) or
            head counts the tp size does not divide.
    """
    mesh = _member_mesh(setup)
    if setup.pp_size > 1 or setup.cp_size > 1 or setup.sequence_parallel:
        raise ValueError(
            f"parallelize_student supports tp, dp_replicate and dp_shard only; got pp_size({setup.pp_size}), "
            f"cp_size({setup.cp_size}), sequence_parallel({setup.sequence_parallel})"
        )
    if setup.strategy == "ddp" and setup.tp_size > 1:
        raise ValueError(f"strategy 'ddp' with tp_size({setup.tp_size}) > 1 is not supported; use fsdp2")
    if setup.tp_size > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if setup.dp_size == 1:
        return model
    if setup.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        with warnings.catch_warnings():
            # torch warns about slicing a flattened axis from the root mesh; topology keeps `dp` there.
            warnings.simplefilter("ignore")
            dp_group = mesh["dp"].get_group()
        return DistributedDataParallel(model, process_group=dp_group)

    from torch.distributed.fsdp import fully_shard

    # HSDP when replicated: shard within dp_shard, replicate across dp_replicate (a 2-D mesh).
    dp_mesh = mesh["dp_replicate", "dp_shard"] if setup.dp_replicate_size > 1 else mesh["dp_shard"]
    # Per-layer groups first, then the root (embedding, norm, lm_head), so each layer's parameters are
    # gathered just before it runs and freed after.
    for layer in _decoder(model).layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def gather_full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded across TP and FSDP) state dict on the CPU, for export with HF names.

    Every rank of the model must call (the gather is collective). With `rank0_only` the tensors are
    kept on global rank 0 only and other ranks get an empty dict, which bounds host memory.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload=True is torch's "rank 0 only" switch for full state dicts.
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_model_state_dict(model, options=options)
    return {key: value.detach().cpu() for key, value in state.items()}


def _member_mesh(setup: DistributedSetup) -> DeviceMesh:
    if setup.device_mesh is None or not setup.is_member:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of this setup (ranks {setup.ranks}); call on its ranks only"
        )
    return setup.device_mesh


# ---------------------------------------------------------------------------------------------------------
# Context-parallel attention


def _cp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """sdpa over this rank's queries and ALL cp ranks' keys/values (gathered in cp-rank order).

    query [batch, heads, local_sequence, head_dim], key/value [batch, kv_heads, local_sequence, head_dim].
    `attention_mask` [batch, 1, local_sequence, cp * local_sequence] is additive, its keys in the
    gathered order; it already encodes causality and document boundaries in global positions. The gather
    carries no gradient: this path is forward-only (the teacher).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    group = getattr(module, _CP_GROUP_ATTR, None)
    if group is None:
        raise RuntimeError(f"attention {CP_ATTENTION!r} used on a module without a cp group; use TeacherRunner")
    if attention_mask is None:
        raise RuntimeError(f"attention {CP_ATTENTION!r} needs the global-position mask built by TeacherRunner")
    cp_size = dist.get_world_size(group)
    gathered = []
    for tensor in (key, value):
        shards = [torch.empty_like(tensor) for _ in range(cp_size)]
        dist.all_gather(shards, tensor.contiguous(), group=group)
        gathered.append(torch.cat(shards, dim=2))
    return sdpa_attention_forward(
        module, query, gathered[0], gathered[1], attention_mask, dropout=dropout, scaling=scaling, is_causal=False
    )


def _enable_cp_attention(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Select the gathered-K/V attention on this instance only (its config), with `group` on its modules."""
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, _cp_attention)
    for layer in _decoder(model).layers:
        setattr(layer.self_attn, _CP_GROUP_ATTR, group)
    try:
        model.set_attn_implementation(CP_ATTENTION)
    except (ValueError, AttributeError, KeyError):
        # Older releases validate the name against their own list; the config field is what attention reads.
        model.config._attn_implementation = CP_ATTENTION


def _additive_mask(
    documents: torch.Tensor,
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    *,
    dtype: torch.dtype,
    sliding_window: int | None,
) -> torch.Tensor:
    """Additive mask [batch, 1, query, key] for queries/keys at the given GLOBAL sequence indices.

    documents [batch, padded_sequence]: 1-based document index per global position, 0 = padding. Same
    rule as `meshkd.packing.indexed_to_additive_mask`: same nonzero document and key not after the query
    (within the sliding window when set); a query always sees itself, so no row is fully masked.
    """
    query_documents = documents[:, query_index, None]  # [batch, query, 1]
    key_documents = documents[:, None, key_index]  # [batch, 1, key]
    distance = query_index[:, None] - key_index[None, :]  # [query, key]
    visible = distance >= 0
    if sliding_window is not None:
        visible &= distance < sliding_window
    allowed = (query_documents == key_documents) & (query_documents != 0) & visible
    allowed |= distance == 0
    additive = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=documents.device)
    return additive.masked_fill_(allowed, 0.0)[:, None]


# ---------------------------------------------------------------------------------------------------------
# Teacher


def _stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Contiguous decoder layers of one stage; the first `num_layers % pp_size` stages take one extra."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


class TeacherRunner:
    """Forward-only teacher over its `DistributedSetup`: pipeline split, TP, CP; full logits out.

    Construction changes `model` in place (layers of other stages are dropped, TP applied, the CP
    attention selected) and puts it in eval mode. `logits(batch)` must be called by every rank of the
    teacher replica with the same batch (on pipeline stages after the first the batch is not read and may
    be None: inputs travel with the activations).

    Batch: `input_ids` [batch, sequence]; optional `position_ids` [batch, sequence] (restarting per
    document for NEAT packing; default 0..sequence-1) and `attention_mask` [batch, sequence] (1-based
    document index, 0 = padding; an ordinary 0/1 mask is the one-document case). Other keys are ignored.

    The model must use sdpa or eager attention (the runner hands its layers a prepared 4D mask; under CP
    the gathered-K/V attention calls sdpa). Teacher weights are replicated across dp: no FSDP here.
    `is_first` / `is_last` tell whether this rank holds the first / last pipeline stage.
    """

    def __init__(self, model: nn.Module, setup: DistributedSetup, *, device: torch.device | str):
        mesh = _member_mesh(setup)
        from meshkd.packing import _sliding_window  # the same validation the packed student path applies

        self.setup = setup
        self.device = torch.device(device)
        self.mesh = mesh
        decoder = _decoder(model)
        config = model.config
        implementation = getattr(config, "_attn_implementation", None)
        self.sliding_window = _sliding_window(config, model) if implementation != CP_ATTENTION else None

        self.pp_size = setup.pp_size
        self.pp_rank = mesh.get_local_rank("pp")
        self.pp_group = mesh.get_group("pp") if self.pp_size > 1 else None
        self.cp_size = setup.cp_size
        self.cp_rank = mesh.get_local_rank("cp")
        self.is_first = self.pp_rank == 0
        self.is_last = self.pp_rank == self.pp_size - 1

        # Pipeline split first, so TP only touches what this stage keeps.
        if self.pp_size > 1:
            owned = _stage_layers(len(decoder.layers), self.pp_size, self.pp_rank)
            if not len(owned):
                num_layers = len(decoder.layers)
                raise ValueError(f"pp_size({self.pp_size}) exceeds the number of decoder layers ({num_layers})")
            decoder.layers = nn.ModuleList(decoder.layers[i] for i in owned)
            if not self.is_first:
                decoder.embed_tokens = None
            if not self.is_last:
                decoder.norm = None
                model.lm_head = None
        model.to(self.device)
        if setup.tp_size > 1:
            apply_tensor_parallel(model, mesh["tp"])
        if self.cp_size > 1:
            _enable_cp_attention(model, mesh.get_group("cp"))
        model.eval()
        self.model = model
        self.decoder = decoder
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())

    # -- inputs ----------------------------------------------------------------------------------------

    def _prepare(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(local input_ids, local position_ids, padded documents [batch, padded_sequence], sequence length)."""
        input_ids = batch["input_ids"].to(self.device)
        batch_size, length = input_ids.shape
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(length, device=self.device).expand(batch_size, length)
        documents = batch.get("attention_mask")
        if documents is None:
            documents = torch.ones_like(input_ids)
        position_ids, documents = position_ids.to(self.device).long(), documents.to(self.device).long()
        if self.cp_size > 1:
            # Head-tail sharding needs 2 * cp equal chunks; padding is document 0, so nothing attends to it.
            padded = math.ceil(length / (2 * self.cp_size)) * (2 * self.cp_size)
            pad = (0, padded - length)
            input_ids = nn.functional.pad(input_ids, pad)
            position_ids = nn.functional.pad(position_ids, pad)
            documents = nn.functional.pad(documents, pad)
            shard = dict(cp_size=self.cp_size, cp_rank=self.cp_rank, dim=1)
            input_ids, position_ids = cp_shard(input_ids, **shard), cp_shard(position_ids, **shard)
        return input_ids, position_ids, documents, length

    def _mask(self, documents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        index = torch.arange(documents.shape[1], device=documents.device)
        if self.cp_size == 1:
            query_index = key_index = index
        else:
            # Keys arrive in cp-rank order of the gathered shards, so the key axis follows that order.
            query_index = cp_shard(index, cp_size=self.cp_size, cp_rank=self.cp_rank, dim=0)
            shards = [cp_shard(index, cp_size=self.cp_size, cp_rank=r, dim=0) for r in range(self.cp_size)]
            key_index = torch.cat(shards)
        return _additive_mask(documents, query_index, key_index, dtype=dtype, sliding_window=self.sliding_window)

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
        if self.is_first:
            try:
                if batch is None:
                    raise ValueError("TeacherRunner.logits needs the batch on the first pipeline stage")
                input_ids, position_ids, documents, length = self._prepare(batch)
                hidden = self.decoder.embed_tokens(input_ids)
            except BaseException:
                if not self.is_last:
                    self._send_error()
                raise
        else:
            hidden, position_ids, documents, length = self._receive()
        try:
            mask = self._mask(documents, hidden.dtype)
            position_embeddings = self.decoder.rotary_emb(hidden, position_ids=position_ids)
            for layer in self.decoder.layers:
                hidden = layer(
                    hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings
                )
        except BaseException:
            if not self.is_last:
                self._send_error()
            raise
        if not self.is_last:
            meta = torch.tensor(
                [1, *hidden.shape, documents.shape[1], length, _WIRE_DTYPES.index(hidden.dtype)],
                dtype=torch.int64,
                device=self.device,
            )
            self._send(meta, [hidden, position_ids, documents])
            return None
        logits = self.model.lm_head(self.decoder.norm(hidden))
        return materialize_teacher_logits(logits, self.mesh, length)
