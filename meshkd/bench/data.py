"""Data at scale: the token store's tokenization throughput, a rank's resident memory, and its start.

    meshkd bench --only data [--quick] [--json OUT]

Corpora of about 0.1, 0.5 and 2 GB of text (0.02 and 0.1 GB with --quick) are made by repeating the standard
library's sources (about 31 MB, outside site-packages), each copy's lines prefixed with the copy's number so no
two documents are equal, as JSONL `text` rows in files of about 64 MB. The tokenizer is the demo model's
(SmolLM2, a 49152-token BPE) when installed, else meshkd's byte tokenizer; sequence length 1024.

For each size:
- tokenization: what `meshkd prepare-data` does (reading, tokenizing, writing the store and its packing plan)
  against the tokenizer's own batch encoding of the same documents in the same chunks (reading included,
  nothing written), each in a fresh process timed after the tokenizer loads, both on all cores; the figure is
  the ratio of their throughputs (target >= 0.8);
- a rank's start: a fresh process opens the prepared store as a training rank does and draws step 0's batch;
  its peak resident memory (VmHWM) and the seconds from opening to the batch (after imports and the tokenizer).
  Targets: peak within 10% from the smallest to the largest size; at most 5 s to the first batch at the largest.

Then a run that sets no data key (the store in a fresh $MESHKD_CACHE), at 8 and 64 MB of text: the same
figures of its first run, which writes the store, and of its second, which reads it back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import yaml

_FILE_BYTES = 64 << 20
NO_KEY_TEXT_BYTES = (8_000_000, 64_000_000)
"""Text of the corpora of the runs that set no data key."""


def make_corpus(directory: Path, target_bytes: int) -> int:
    """JSONL files of stdlib sources repeated with variation up to about `target_bytes` of text; bytes written."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = [path.read_text(encoding="utf-8", errors="replace") for path in sorted(root.rglob("*.py"))
               if "site-packages" not in path.parts]
    directory.mkdir(parents=True, exist_ok=True)
    written, copy, index = 0, 0, 0
    sink = None
    while written < target_bytes:
        for text in sources:
            if sink is None or sink.tell() > _FILE_BYTES:
                if sink is not None:
                    sink.close()
                sink = open(directory / f"part{index:04d}.jsonl", "w")
                index += 1
            varied = "".join(f"{copy}|{line}\n" for line in text.splitlines())
            sink.write(json.dumps({"text": varied}) + "\n")
            written += len(varied.encode())
            if written >= target_bytes:
                break
        copy += 1
    sink.close()
    return written


def _config(corpus: Path, tokenizer: dict, store: Path | None = None) -> dict:
    """A run's config on `corpus`, its token store under `store`; None sets no data key (the cache directory's)."""
    dataset = {"paths": [str(corpus / "*.jsonl")], "val_fraction": 0.001}
    if store is not None:
        dataset["token_store"] = str(store)
    return {"model": tokenizer, "teacher_model": tokenizer, "dataset": dataset,
            "step_scheduler": {"global_batch_size": 8, "local_batch_size": 1, "sequence_length": 1024}}


_BASELINE = """
import sys, time, json
from meshkd.recipe.settings.config_loading import load_config
from meshkd.recipe.corpus import documents
from meshkd.recipe.modeling.loaders import load_section_tokenizer
from meshkd.recipe.corpus.corpus_store import _chunks
config = load_config(sys.argv[1])
tokenizer = load_section_tokenizer(config.model)
arguments = {k: v for k, v in documents.reading_arguments(config.dataset, tokenizer).items() if k != "val_fraction"}
started, tokens = time.perf_counter(), 0
for chunk in _chunks(documents.corpus_documents(**arguments, encoding_errors="replace")):
    tokens += sum(len(ids) for ids in tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"])
print(json.dumps({"seconds": time.perf_counter() - started, "tokens": tokens}))
"""

# A rank opening its rows and drawing step 0's batch; run where there is no store yet, it first does what
# `meshkd prepare-data` does (the store and its packing plan written).
_RANK = """
import sys, time, json
from meshkd.recipe.settings.config_loading import load_config
from meshkd.recipe.corpus import data
from meshkd.recipe.corpus.batches import iterate_batches
from meshkd.recipe.modeling.loaders import load_section_tokenizer
config = load_config(sys.argv[1])
tokenizer = load_section_tokenizer(config.model)
started = time.perf_counter()
train, _ = data.build_run_datasets(tokenizer, config.dataset, sequence_length=config.step_scheduler.sequence_length)
batch = next(iterate_batches(train, global_batch_size=8, dp_rank=0, dp_size=1, seed=0))
seconds = time.perf_counter() - started
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"seconds": seconds, "peak_mib": peak / 1024, "rows": len(train)}))
"""


def _python(code: str, *args: str, env: dict | None = None) -> dict:
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False,
                            env=env)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_section(quick: bool) -> dict:
    from meshkd.recipe.modeling import models

    try:
        tokenizer, name = models.demo_teacher_source(), "SmolLM2 BPE (49152)"
    except ImportError:  # without the demo model the byte tokenizer stands in
        tokenizer, name = {"tokenizer": "byte", "random_init": {"model_type": "llama"}}, "byte (258)"
    sizes = (0.02, 0.1) if quick else (0.1, 0.5, 2.0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshkd-bench-data-") as tmp:
        root = Path(tmp)
        for size in sizes:
            corpus, store = root / f"corpus{size}", root / f"store{size}"
            text_bytes = make_corpus(corpus, int(size * 1e9))
            config = root / f"config{size}.yaml"
            config.write_text(yaml.safe_dump(_config(corpus, tokenizer, store)))
            prepare = _python(_RANK, str(config))
            prepare_s = prepare["seconds"]
            baseline = _python(_BASELINE, str(config))
            manifest = json.loads(next(store.glob("*/manifest.json")).read_text())
            rank = _python(_RANK, str(config))
            row = {"text_gb": text_bytes / 1e9, "tokens": manifest["tokens"],
                   "store_mib": sum(f["bytes"] for f in manifest["files"].values()) / 2**20,
                   "prepare_s": prepare_s, "prepare_peak_mib": prepare["peak_mib"], "baseline_s": baseline["seconds"],
                   "throughput_ratio": baseline["seconds"] / prepare_s,
                   "rank_peak_mib": rank["peak_mib"], "first_batch_s": rank["seconds"], "rows": rank["rows"]}
            rows.append(row)
            print(f"meshkd bench data: {json.dumps(row)}", flush=True)
            for path in corpus.iterdir():
                path.unlink()
        no_key = no_key_runs(root, tokenizer)
    result = {"tokenizer": name, "rows": rows, "no_key": no_key,
              "peak_growth": rows[-1]["rank_peak_mib"] / rows[0]["rank_peak_mib"]}
    print(report(result))
    return {"data": result}


def no_key_runs(root: Path, tokenizer: dict) -> list[dict]:
    """Per `NO_KEY_TEXT_BYTES`, two runs that set no data key, so their store is kept in $MESHKD_CACHE (a fresh
    one): the first writes it, the second reads it back; each one's peak and seconds to its first batch."""
    rows = []
    for target in NO_KEY_TEXT_BYTES:
        corpus = root / f"no-key{target}"
        text_bytes = make_corpus(corpus, target)
        config = root / f"no-key{target}.yaml"
        config.write_text(yaml.safe_dump(_config(corpus, tokenizer)))
        env = {**os.environ, "MESHKD_CACHE": str(root / f"cache{target}")}
        first, second = (_python(_RANK, str(config), env=env) for _ in range(2))
        row = {"text_mb": text_bytes / 1e6, "first_peak_mib": first["peak_mib"], "first_s": first["seconds"],
               "second_peak_mib": second["peak_mib"], "second_s": second["seconds"]}
        rows.append(row)
        print(f"meshkd bench data (no data key): {json.dumps(row)}", flush=True)
    return rows


def report(result: dict) -> str:
    from meshkd.bench.transport import _table

    no_key = _table(
        "(data) no data key set (the store in $MESHKD_CACHE): a run's peak and seconds to its first batch, the "
        "first run writing the store, the second reading it",
        ["text MB", "1st run peak MiB", "1st run s", "2nd run peak MiB", "2nd run s"],
        [[r["text_mb"], r["first_peak_mib"], r["first_s"], r["second_peak_mib"], r["second_s"]]
         for r in result["no_key"]])
    return _table(
        f"(data) token store, tokenizer {result['tokenizer']}, sequence 1024; throughput ratio = baseline time / "
        f"prepare time (the packing plan included); a rank's peak and time to its first batch from the prepared "
        f"store",
        ["text GB", "tokens", "store MiB", "prepare s", "baseline s", "ratio", "rank peak MiB", "first batch s"],
        [[r["text_gb"], r["tokens"], r["store_mib"], r["prepare_s"], r["baseline_s"], r["throughput_ratio"],
          r["rank_peak_mib"], r["first_batch_s"]] for r in result["rows"]]) + "\n" + no_key
