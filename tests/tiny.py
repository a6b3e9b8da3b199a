"""Tiny models and recipe configs: random-init Llamas, the byte tokenizer and a small generated corpus."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

STEPS = 5


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (collective over its mesh); a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def tiny_llama(layers: int, seed: int) -> dict:
    return {
        "random_init": {
            "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 262, "max_position_embeddings": 256,
        },
        "tokenizer": "byte",
        "seed": seed,
    }


def write_corpus(directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(24):
        words = " ".join(f"w{(index * 7 + j * 3) % 23}" for j in range(5 + (index * 5) % 17))
        (directory / f"doc{index:02d}.txt").write_text(f"def f{index}():\n    return '{words}'\n")
    return str(directory / "*.txt")


def base_config(tmp_path: Path) -> dict:
    return {
        "model": tiny_llama(2, seed=1),
        "teacher_model": tiny_llama(3, seed=2),
        "kd": {"kd_ratio": 0.5, "temperature": 2.0},
        "dataset": {"paths": [write_corpus(tmp_path / "corpus")], "val_fraction": 0.2, "seed": 3},
        "step_scheduler": {"max_steps": STEPS, "global_batch_size": 4, "local_batch_size": 1, "sequence_length": 32,
                           "val_batches": 2},
        "optimizer": {"lr": 1e-2, "max_grad_norm": 1.0},
        "lr_scheduler": {"warmup_steps": 1},
        "checkpoint": {"enabled": False},
        "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False},
        "collective_timeout_s": 60,
    }


def with_layout(config: dict, student: dict, teacher: dict | None) -> dict:
    config = copy.deepcopy(config)
    config["distributed"] = student
    if teacher is not None:
        config["separate_meshes"] = True
        config["teacher_distributed"] = teacher
    return config


def tiny_llama_model(
    *, vocab: int, layers: int = 2, seed: int = 0, tie: bool = False, attn: str = "sdpa", max_positions: int = 128,
    head_dim: int = 8,
) -> torch.nn.Module:
    """A random-init LlamaForCausalLM (hidden 32, 4 heads of `head_dim`, 2 KV heads) that runs in milliseconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config)


def neat_layout(document_lengths: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention_mask, position_ids) of NEAT rows: documents back to back with 1-based document indices and
    positions restarting per document, padding 0."""
    mask = torch.zeros(len(document_lengths), length, dtype=torch.int64)
    positions = torch.zeros_like(mask)
    for row, lengths in enumerate(document_lengths):
        start = 0
        for index, size in enumerate(lengths, start=1):
            mask[row, start : start + size] = index
            positions[row, start : start + size] = torch.arange(size)
            start += size
    return mask, positions


def packed_llama_batch(document_lengths: list[list[int]], length: int, *, vocab: int, seed: int) -> dict:
    """NEAT rows of random tokens (`neat_layout`); no target for the last token of a document or for padding."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(document_lengths)
    input_ids = torch.randint(0, vocab, (rows, length), generator=generator)
    labels = torch.randint(0, vocab, (rows, length), generator=generator)
    mask, positions = neat_layout(document_lengths, length)
    # A document's last token: the next position holds another document, padding, or is past the row's end.
    last_tokens = (mask != 0) & (mask != torch.nn.functional.pad(mask[:, 1:], (0, 1)))
    labels[last_tokens | (mask == 0)] = -100
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions, "attention_mask": mask}
