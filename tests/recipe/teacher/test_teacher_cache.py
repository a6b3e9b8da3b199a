"""The offline teacher: `meshkd cache-teacher` writes the teacher's answers once, `meshkd train` reads them.

A run from the cache follows the live teacher's curve with the same transport (fp32, within 1e-6) for a
dp 1 and a dp 2 student, from caches written by a dp 1, a dp 2 and a tp 2 teacher; a cache that does not
fit the run is refused at preflight naming the field; a damaged shard is refused naming the file; a
killed writer continues from its complete shards; a full disk leaves no shard that looks complete.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from meshkd.recipe.common.files import file_sha256, write_atomically
from meshkd.recipe.common.metrics import read_metrics
from meshkd.recipe.corpus import data
from meshkd.recipe.corpus.batches import training_rows
from meshkd.recipe.lifecycle.preflight import preflight
from meshkd.recipe.settings.config import ConfigError
from meshkd.recipe.settings.config_loading import config_from_dict
from meshkd.recipe.teacher.teacher_cache import MANIFEST, CachedTeacher, rows_asked
from tests.recipe.lifecycle.test_recipe import TrainRun
from tests.tiny import base_config, tiny_llama, with_layout
from tests.world import run_world

TOPK = {"logits_transport": "topk", "topk": 8, "topk_tail_samples": 4}
COMPACT = {**TOPK, "topk_encoding": "compact", "teacher_cache_coding": "fixed"}
CODED = {**COMPACT, "teacher_cache_coding": "entropy"}
HIDDEN = {"logits_transport": "hidden", "divergence": "jsd"}


class WriteCache:
    """A check that writes the teacher cache of `config` in the world it runs in (picklable)."""

    def __init__(self, config: dict, name: str) -> None:
        self.config, self.__name__ = config, name

    def __call__(self) -> None:
        from meshkd.recipe.lifecycle.cache_writer import cache_teacher

        config = config_from_dict(self.config)
        cache_teacher(config, config.teacher_named(), shard_rows=3)


def variant(base: dict, tmp_path: Path, name: str, *, student: dict, teacher: dict | None = None,
            kd: dict | None = None, cache: str | None = None) -> dict:
    config = with_layout(base, student, teacher)
    config["kd"].update(kd or {})
    config["kd"]["teacher_cache"] = cache
    config["logging"]["run_dir"] = str(tmp_path / name)
    return config


def train_records(config: dict) -> list[dict]:
    timing = ("teacher_wait_s", "step_time_s", "tokens_per_s")
    return [{key: value for key, value in record.items() if key not in timing}
            for record in read_metrics(config["logging"]["run_dir"])]


FROM_THE_DISTRIBUTION = ("val_kl", "val_top1_agreement", "val_acceptance")
"""Held-out figures that need the teacher's distribution, which a cache does not hold for validation rows (the last
one its whole distribution)."""


def assert_same_curve(records: list[dict], expected: list[dict]) -> None:
    """`records` of a run from a cache equal the live run's `expected`, but for `FROM_THE_DISTRIBUTION`."""
    assert [(r["kind"], r["step"]) for r in records] == [(r["kind"], r["step"]) for r in expected]
    for record, reference in zip(records, expected):
        if record["kind"] == "eval":
            assert not set(FROM_THE_DISTRIBUTION) & set(record), record
            assert set(FROM_THE_DISTRIBUTION[:2]) <= set(reference), reference
        for key, value in reference.items():
            if key in FROM_THE_DISTRIBUTION:
                continue
            if isinstance(value, float):
                # A perplexity is exp(loss): the losses' 1e-6 is a relative 1e-6 on it.
                close = dict(abs=0, rel=1e-6) if key.endswith("perplexity") else dict(abs=1e-6, rel=0)
                assert record[key] == pytest.approx(value, **close), (key, record, reference)


def run_all(world_size: int, runs: dict[str, dict]) -> dict[str, dict]:
    """Run every config of `runs` in one world, in order: "write_*" ones write their cache, the others train."""
    checks = []
    for name, config in runs.items():
        check = WriteCache(config, name) if name.startswith("write") else TrainRun(config)
        check.__name__ = name
        checks.append(check)
    results = run_world(world_size, checks, timeout_s=60, deadline_s=300)
    for name in runs:
        results.check(name)
    return runs


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    """One rank: caches written by a dp 1 teacher (top-k with tail samples: exact, compact, compact entropy coded;
    full_bf16; hidden, with the JSD), live and cached runs."""
    tmp = tmp_path_factory.mktemp("one_rank")
    base = base_config(tmp)
    runs = {}
    modes = (("topk", TOPK), ("compact", COMPACT), ("coded", CODED), ("bf16", {"logits_transport": "full_bf16"}),
             ("hidden", HIDDEN))
    for mode, kd in modes:
        cache = str(tmp / f"cache_{mode}")
        if mode != "coded":  # the live run of compact answers is the coded cache's too
            runs[f"live_{mode}"] = variant(base, tmp, f"live_{mode}", student={"dp_size": 1}, kd=kd)
        runs[f"write_{mode}"] = variant(base, tmp, f"write_{mode}", student={"dp_size": 1}, kd=kd, cache=cache)
        runs[f"cached_{mode}"] = variant(base, tmp, f"cached_{mode}", student={"dp_size": 1}, kd=kd, cache=cache)
    return run_all(1, runs)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """Two ranks: caches written by a dp 2 and a tp 2 teacher read by a dp 2 student, and the live dp 2 run."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    base = base_config(tmp)
    runs = {"live": variant(base, tmp, "live", student={"dp_size": 2}, kd=TOPK)}
    for name, teacher in (("dp2", {"dp_size": 2}), ("tp2", {"dp_size": 1, "tp_size": 2})):
        cache = str(tmp / f"cache_{name}")
        runs[f"write_{name}"] = variant(base, tmp, f"write_{name}", student={"dp_size": 2}, teacher=teacher, kd=TOPK,
                                        cache=cache)
        runs[f"cached_{name}"] = variant(base, tmp, f"cached_{name}", student={"dp_size": 2}, teacher=teacher,
                                         kd=TOPK, cache=cache)
    return run_all(2, runs)


pytestmark = pytest.mark.world


@pytest.mark.parametrize("mode", ["topk", "compact", "coded", "bf16", "hidden"])
def test_a_run_from_the_cache_follows_the_live_teacher(one_rank, mode):
    live = train_records(one_rank[f"live_{'compact' if mode == 'coded' else mode}"])
    assert_same_curve(train_records(one_rank[f"cached_{mode}"]), live)
    assert any(record.get("kd_loss", 0) > 0 for record in live)
    assert "teacher_val_loss" in live[0] and "teacher_val_bits_per_byte" in live[0]


@pytest.mark.parametrize("writer", ["dp2", "tp2"])
def test_a_dp2_student_from_a_dp2_or_tp2_teachers_cache_follows_the_live_teacher(two_ranks, writer):
    assert_same_curve(train_records(two_ranks[f"cached_{writer}"]), train_records(two_ranks["live"]))


def test_the_cache_holds_the_rows_the_run_asks_about(one_rank):
    config = config_from_dict(one_rank["cached_topk"])
    manifest = json.loads(Path(config.kd.teacher_cache, MANIFEST).read_text())
    checked = preflight(config)
    train, val = data.build_run_datasets(checked.tokenizer, config.dataset, sequence_length=32)
    steps = config.step_scheduler
    assert manifest["splits"]["train"]["rows"] == training_rows(
        train, global_batch_size=steps.global_batch_size, seed=config.dataset.seed, num_steps=steps.max_steps)
    assert manifest["splits"]["validation"]["rows"] == list(range(min(len(val), 2 * steps.global_batch_size)))
    # top-8 with 4 tail samples: 8 * 8 + 4 + 8 * 4 = 100 bytes a position, plus each shard's header
    assert 100 <= manifest["summary"]["train_bytes_per_position"] < 120


def test_compact_answers_take_under_a_third_of_the_bytes_and_train_near_the_exact_curve(one_rank):
    """`kd.topk_encoding: compact` (8 + 4 indices in 12 bytes, 8 value bytes and two float32: 28 bytes a position at
    V = 262, against 100) writes a cache under a third the size, and its run stays within the documented
    tolerance of the exact answers' run: every loss and held-out loss within 2e-4 nats a token."""
    sizes = {mode: json.loads(Path(one_rank[f"cached_{mode}"]["kd"]["teacher_cache"], MANIFEST).read_text())[
        "summary"]["train_bytes_per_position"] for mode in ("topk", "compact")}
    assert 28 <= sizes["compact"] < 38 and sizes["compact"] < sizes["topk"] / 3
    exact, compact = train_records(one_rank["live_topk"]), train_records(one_rank["live_compact"])
    assert [(r["kind"], r["step"]) for r in compact] == [(r["kind"], r["step"]) for r in exact]
    differences = {}
    for record, reference in zip(compact, exact):
        for key in ("loss", "kd_loss", "ce_loss", "val_loss", "val_kd_loss"):
            if key in reference:
                differences[key] = max(differences.get(key, 0.0), abs(record[key] - reference[key]))
    print(f"compact against exact top-k answers, largest differences: {differences}")
    assert differences and max(differences.values()) <= 2e-4, differences


# ---------------------------------------------------------------------------------------------------------
# A cache that does not fit the run, and damaged caches


def copied(one_rank: dict, tmp_path: Path) -> dict:
    """The cached top-k run's config on a copy of its cache, to damage at will."""
    config = copy.deepcopy(one_rank["cached_topk"])
    shutil.copytree(config["kd"]["teacher_cache"], tmp_path / "cache")
    config["kd"]["teacher_cache"] = str(tmp_path / "cache")
    return config


def refused(config: dict) -> str:
    with pytest.raises(ConfigError) as raised:
        preflight(config_from_dict(config))
    return str(raised.value)


def test_a_copy_of_the_cache_fits_its_run(one_rank, tmp_path):
    checked = preflight(config_from_dict(copied(one_rank, tmp_path)))
    assert checked.source.name == "cache" and checked.teacher_vocab_rows == 262


@pytest.mark.parametrize("change, field", [
    (lambda c: c["step_scheduler"].update(sequence_length=64), "step_scheduler.sequence_length"),
    (lambda c: c["dataset"].update(packing=False), "dataset.packing"),
    (lambda c: c["dataset"].update(val_fraction=0.3), "dataset.val_fraction"),
    (lambda c: c["kd"].update(logits_transport="full"), "kd.logits_transport"),
    (lambda c: c["kd"].update(topk=16), "kd.topk"),
    (lambda c: c["kd"].update(temperature=1.0), "kd.temperature"),
    (lambda c: c["kd"].update(topk_encoding="compact"), "kd.topk_encoding"),
    (lambda c: c["model"]["random_init"].update(vocab_size=260), "vocabulary"),
    (lambda c: c["teacher_model"].update(seed=7), "teacher_model.seed"),
], ids=["sequence_length", "packing", "val_fraction", "transport", "topk", "temperature", "compact", "vocabulary",
        "teacher"])
def test_a_cache_written_for_another_run_is_refused_naming_the_field(one_rank, tmp_path, change, field):
    config = copied(one_rank, tmp_path)
    change(config)
    message = refused(config)
    assert message.startswith(f"kd.teacher_cache: {tmp_path / 'cache'} does not fit this run: {field}:"), message


def test_a_compact_cache_of_another_layout_is_refused_naming_it(one_rank, tmp_path):
    """Packed answers of another layout would be misread: the key records the compact encoding's layout."""
    config = copy.deepcopy(one_rank["cached_compact"])
    shutil.copytree(config["kd"]["teacher_cache"], tmp_path / "cache")
    config["kd"]["teacher_cache"] = str(tmp_path / "cache")
    manifest = json.loads((tmp_path / "cache" / MANIFEST).read_text())
    manifest["key"]["topk_compact layout"] = "ceil(log2 V)-bit indices"
    (tmp_path / "cache" / MANIFEST).write_text(json.dumps(manifest))
    assert "does not fit this run: topk_compact layout:" in refused(config)


def copied_coded(one_rank: dict, tmp_path: Path) -> tuple[dict, dict]:
    """The coded cache's run config on a copy of its cache, and the copy's manifest."""
    config = copy.deepcopy(one_rank["cached_coded"])
    shutil.copytree(config["kd"]["teacher_cache"], tmp_path / "cache")
    config["kd"]["teacher_cache"] = str(tmp_path / "cache")
    return config, json.loads((tmp_path / "cache" / MANIFEST).read_text())


def test_a_coded_cache_is_refused_by_a_run_of_another_layout_naming_the_field(one_rank, tmp_path):
    config, manifest = copied_coded(one_rank, tmp_path)
    assert manifest["key"]["kd.teacher_cache_coding"].startswith("entropy (rans-22 v1")
    assert "coding" in manifest and all("coding" in shard for shard in manifest["shards"] if shard["split"] == "train")
    fixed = copy.deepcopy(config)
    fixed["kd"]["teacher_cache_coding"] = "fixed"
    assert "does not fit this run: kd.teacher_cache_coding: the cache was written with 'entropy (" in refused(fixed)
    manifest["key"]["kd.teacher_cache_coding"] = "entropy (rans-16 v0)"
    (tmp_path / "cache" / MANIFEST).write_text(json.dumps(manifest))
    assert "does not fit this run: kd.teacher_cache_coding: the cache was written with 'entropy (rans-16" \
        in refused(config)


def test_the_coded_cache_answers_as_the_fixed_width_compact_cache(one_rank):
    coded, train = cached_teacher(one_rank["cached_coded"])
    fixed, _ = cached_teacher(one_rank["cached_compact"])
    sizes = {name: json.loads(Path(one_rank[f"cached_{name}"]["kd"]["teacher_cache"], MANIFEST).read_text())["summary"]
             for name in ("coded", "compact")}
    assert sizes["coded"]["rows"] == sizes["compact"]["rows"]
    held = json.loads(Path(one_rank["cached_coded"]["kd"]["teacher_cache"], MANIFEST).read_text())["splits"]["train"]
    for rows in (held["rows"][:1], held["rows"][1:4], held["rows"][::3]):  # rows of one shard and of several
        batch = train[torch.tensor(rows)]
        answer, expected = coded.request(batch, "topk"), fixed.request(batch, "topk")
        assert set(answer) == set(expected) and answer["mode"] == "topk_compact"
        for key, value in expected.items():
            assert torch.equal(answer[key], value) if isinstance(value, torch.Tensor) else answer[key] == value, key


def _rewrite_shard(directory: Path, manifest: dict, number: int, change) -> Path:
    """Shard `number` with `change` applied to its tensors, its size and sha256 in the manifest updated (so that
    only the reader's own checks can find the damage)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = directory / manifest["shards"][number]["file"]
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata=metadata)
    manifest["shards"][number].update(bytes=path.stat().st_size, sha256=file_sha256(path))
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return path


@pytest.mark.parametrize("damage, message", [
    (lambda t: t["row_offsets"].__setitem__(1, t["row_offsets"][1] + 1), "offset index does not fit"),
    (lambda t: t["long_offsets"].__setitem__(-1, 5), "offset index does not fit"),
    (lambda t: t["lengths"].__setitem__((0, 0), t["lengths"][0, 0] + 1), "offset index does not fit"),
    (lambda t: t["coded"].__setitem__(slice(0, 4), 0), "is damaged: .* coded streams do not decode"),
], ids=["row_offsets", "long_offsets", "lengths", "streams"])
def test_a_damaged_coded_shard_or_offset_index_is_refused_naming_the_file(one_rank, tmp_path, damage, message):
    config, manifest = copied_coded(one_rank, tmp_path)
    path = _rewrite_shard(tmp_path / "cache", manifest, 0, damage)
    teacher, train = cached_teacher(config)
    with pytest.raises(ValueError, match=f"shard {path} {'is damaged' if 'offset' in message else ''}.*{message}"):
        teacher.request(train[manifest["splits"]["train"]["rows"][:1]], "topk")


def test_a_teacher_left_out_of_the_config_is_the_caches(one_rank, tmp_path):
    config = copied(one_rank, tmp_path)
    config["teacher_model"] = {}
    assert preflight(config_from_dict(config)).teacher.report is not None


def test_other_data_is_refused_naming_the_file(one_rank, tmp_path):
    config = copied(one_rank, tmp_path)
    corpus = Path(config["dataset"]["paths"][0]).parent
    shutil.copytree(corpus, tmp_path / "corpus")
    config["dataset"]["paths"] = [str(tmp_path / "corpus" / "*.txt")]
    assert "dataset.paths: " + str(tmp_path / "corpus" / "doc00.txt") + " is not among" in refused(config)
    config["dataset"]["paths"] = one_rank["cached_topk"]["dataset"]["paths"]
    edited = corpus / "doc03.txt"
    original = edited.read_text()
    try:
        edited.write_text(original.replace("w", "v"))  # same size, other content
        assert f"dataset.paths: {edited} changed since the cache was written" in refused(config)
    finally:
        edited.write_text(original)


def test_another_tokenizer_is_refused(one_rank, tmp_path):
    from meshkd.recipe.modeling.models import byte_tokenizer, load_causal_lm, save_hf_model

    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(["<extra>"])  # one more token: another tokenizer with the same bytes
    config = copied(one_rank, tmp_path)
    model = load_causal_lm(random_init=config["model"]["random_init"], seed=1)
    save_hf_model(model, tokenizer, tmp_path / "student")  # a model directory with this tokenizer
    config["model"]["tokenizer"] = str(tmp_path / "student")
    assert "does not fit this run: model.tokenizer:" in refused(config)


def test_missing_truncated_and_unfinished_caches_are_refused_naming_the_file(one_rank, tmp_path):
    config = copied(one_rank, tmp_path)
    cache = Path(config["kd"]["teacher_cache"])
    shard = cache / "train-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert f"shard {shard} has" in refused(config) and "the manifest says" in refused(config)
    shard.unlink()
    assert f"shard {shard} is missing" in refused(config)
    (cache / MANIFEST).unlink()
    assert "is not a complete teacher cache (manifest.json not found)" in refused(config)
    (cache / MANIFEST).write_text("{not json")
    assert f"{cache / MANIFEST}: not a readable cache manifest" in refused(config)


def cached_teacher(config: dict) -> tuple[CachedTeacher, object]:
    recipe = config_from_dict(config)
    checked = preflight(recipe)
    train, val = data.build_run_datasets(checked.tokenizer, recipe.dataset, sequence_length=32)
    datasets = {"train": train, "validation": val}
    teacher = CachedTeacher(recipe.kd.teacher_cache, checked.teacher.report, datasets,
                            asked=rows_asked(recipe, datasets, dp_size=1), device=torch.device("cpu"))
    return teacher, train


def test_a_corrupted_shard_is_refused_when_first_read(one_rank, tmp_path):
    config = copied(one_rank, tmp_path)
    manifest = json.loads(Path(config["kd"]["teacher_cache"], MANIFEST).read_text())
    shard = Path(config["kd"]["teacher_cache"], manifest["shards"][0]["file"])
    corrupted = bytearray(shard.read_bytes())
    corrupted[-40:-20] = bytes(20)  # inside the tensors: same size, the header still reads
    shard.write_bytes(bytes(corrupted))
    teacher, train = cached_teacher(config)  # preflight sees the right size: it does not read the shards
    row = manifest["splits"]["train"]["rows"][0]
    with pytest.raises(ValueError, match=f"shard {shard} is corrupted"):
        teacher.request(train[row], "topk")


def test_the_cached_answer_is_the_live_teachers_encoding(one_rank, tmp_path):
    from meshkd.recipe.modeling.models import load_causal_lm
    from meshkd.recipe.settings.config import KDConfig
    from meshkd.recipe.teacher.teacher_worker import TeacherForward

    config = copied(one_rank, tmp_path)
    teacher, train = cached_teacher(config)
    # Rows holding one document from position 0: the model's own causal mask is theirs, as the runner's.
    rows_of = train[:]
    single = (rows_of["attention_mask"] == 1).all(dim=1) & (rows_of["position_ids"] == torch.arange(32)).all(dim=1)
    held = set(json.loads(Path(config["kd"]["teacher_cache"], MANIFEST).read_text())["splits"]["train"]["rows"])
    rows = [row for row in single.nonzero()[:, 0].tolist() if row in held][:2]
    assert len(rows) == 2
    batch = train[torch.tensor(rows)]
    cached = teacher.request(batch, "topk")
    section = config["teacher_model"]
    model = load_causal_lm(random_init=section["random_init"], seed=section["seed"]).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    live = TeacherForward(None, vocab_size=262, kd=KDConfig(**{**config["kd"], "teacher_cache": None}),
                          seed=0).encode(logits, batch, "topk")
    assert cached["mode"] == live["mode"] and cached["temperature"] == live["temperature"]
    assert set(cached) == set(live)
    for key in ("indices", "tail_indices"):
        assert torch.equal(cached[key], live[key]), key
    for key in ("log_probs", "tail_log_prob", "tail_log_probs"):
        torch.testing.assert_close(cached[key], live[key], atol=1e-5, rtol=0)


def test_a_run_visiting_rows_the_cache_does_not_hold_is_refused(one_rank, tmp_path):
    config = copied(one_rank, tmp_path)
    config["step_scheduler"]["max_steps"] = 40
    with pytest.raises(ValueError, match="visits .* training rows the cache does not hold"):
        cached_teacher(config)


# ---------------------------------------------------------------------------------------------------------
# Writing: a full disk, a killed writer


def test_a_full_disk_leaves_no_shard_that_looks_complete(small_disk):
    target = small_disk / "train-00000.safetensors"
    with pytest.raises(OSError, match=f"{target}: could not be written"):
        write_atomically(target, bytes(1 << 20))
    assert list(small_disk.iterdir()) == []


def test_a_killed_writer_continues_from_its_complete_shards(tmp_path):
    import psutil

    config = base_config(tmp_path)
    teacher = tiny_llama(4, seed=2)
    teacher["random_init"].update(hidden_size=256, intermediate_size=1024, max_position_embeddings=512)
    config = with_layout(config, {"dp_size": 1}, {"dp_size": 1})
    config["teacher_model"] = teacher
    config["kd"].update(TOPK, teacher_cache=str(tmp_path / "cache"))
    config["step_scheduler"].update(sequence_length=256, max_steps=40)
    config["dataset"]["val_fraction"] = 0.05
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "meshkd", "cache-teacher", str(path), "--shard-rows", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    writer = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cache = tmp_path / "cache"
    deadline = time.monotonic() + 120
    while len(list(cache.glob("*.json"))) < 3 and writer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert writer.poll() is None, writer.communicate()[0]
    processes = [writer.pid, *[child.pid for child in psutil.Process(writer.pid).children(recursive=True)]]
    for pid in processes:
        os.kill(pid, signal.SIGKILL)
    writer.wait()
    psutil.wait_procs([psutil.Process(pid) for pid in processes if psutil.pid_exists(pid)], timeout=10)
    assert not (cache / MANIFEST).exists()
    kept = {sidecar.name: sidecar.stat().st_mtime_ns for sidecar in cache.glob("*.json")}
    assert len(kept) >= 3

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"({len(kept)} kept from an earlier run)" in rerun.stderr + rerun.stdout
    for name, mtime in kept.items():
        assert (cache / name).stat().st_mtime_ns == mtime, f"{name} was written again"
    manifest = json.loads((cache / MANIFEST).read_text())
    assert len(manifest["shards"]) == sum(len(split["rows"]) for split in manifest["splits"].values())
    train = copy.deepcopy(config)
    assert preflight(config_from_dict(train)).teacher.report["shards"] == manifest["shards"]


def test_cache_teacher_without_a_cache_directory_is_one_line(tmp_path):
    config = with_layout(base_config(tmp_path), {"dp_size": 1}, None)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "meshkd", "cache-teacher", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("meshkd: error: kd.teacher_cache: set it to the directory to write the cache to "
                                     "(e.g. --set kd.teacher_cache=runs/teacher_cache)")
