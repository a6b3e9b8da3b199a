"""Part of the transport bench's `modes` section: the teacher cache's forms of top-k answers on the demo teacher's
real logits, in bytes a token, KL error and write / read speed.

The demo teacher (SmolLM2-135M-Instruct) reads 8 x 512 tokens of standard-library source; the coding tables
(`meshkd.core.cache_coding`) are fitted on the first 2,048 tokens' answers (what a cache's first shard is to it) and
every figure is of the other 2,048 tokens. Rows: k = 50 and 64, with the rest bucket alone and with 32 tail
samples; forms: exact top-k, compact (fixed width), compact entropy coded. KL error: the decoded answer's KL to
the exact top-k answer, nats a token (mean, largest). Speeds, tokens a second on one thread: write = the answers
from the teacher's logits to a shard's bytes (safetensors); read = a shard's bytes back to the answers the cache
hands out (the compact ones, for both compact forms).
"""

from __future__ import annotations

import time

import torch

from meshkd.bench.corpora import stdlib_token_rows

SIZES = ((50, 0), (64, 0), (50, 32), (64, 32))
FIT_TOKENS = 2048


def _timed(function, repeats: int = 3):
    best, value = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        value = function()
        best = min(best, time.perf_counter() - started)
    return value, best


def measure(teacher, tokenizer) -> dict:
    """{"fit_tokens", "tokens", "rows": [...]} (see the module docstring)."""
    from safetensors.torch import load, save

    from meshkd.core import cache_coding
    from meshkd.core.answers import encode_teacher_logits
    from meshkd.core.answers.compact import unpack_topk
    from meshkd.recipe.teacher.teacher_cache import CODED, coded_tensors

    samples = stdlib_token_rows(tokenizer, 1, 512, 2 * FIT_TOKENS // 512)
    with torch.no_grad():
        logits = torch.cat([teacher(input_ids=ids[:, :-1]).logits.float() for ids in samples], dim=1)
    fit, test = logits[:, :FIT_TOKENS], logits[:, FIT_TOKENS:]
    tokens, vocab = test.shape[1], test.shape[-1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for k, m in SIZES:
            options = {"k": k, "temperature": 1.0, "tail_samples": m, "seed": 0}
            exact = encode_teacher_logits(test, "topk", **options)
            tables = cache_coding.CodingTables.fit(encode_teacher_logits(fit, "topk_compact", **options))

            def write_exact(options=options):
                return save({key: value for key, value in encode_teacher_logits(test, "topk", **options).items()
                             if isinstance(value, torch.Tensor)})

            def write_fixed(options=options):
                return save({"packed": encode_teacher_logits(test, "topk_compact", **options)["packed"]})

            def write_coded(options=options, tables=tables):
                answer = encode_teacher_logits(test, "topk_compact", **options)
                fields = {key: value for key, value in answer.items() if key != "packed"}
                return save(coded_tensors(answer["packed"], fields, tables))

            def read_coded(data, tables=tables, k=k, m=m):
                parts = load(data)
                assert set(parts) == set(CODED)
                coded = cache_coding.CodedAnswers(
                    parts["coded"], cache_coding.CodedAnswers.lengths_of(parts["lengths"], parts["long_lengths"]),
                    parts["rest_high"].flatten(), parts["tail_mean"].flatten())
                return cache_coding.decode(coded, tables, k=k, tail_samples=m, vocab=vocab, temperature=1.0)

            forms = {"exact topk": (write_exact, lambda data: load(data)),
                     "compact (fixed)": (write_fixed, lambda data: load(data)),
                     "compact (entropy coded)": (write_coded, read_coded)}
            fixed_packed = None
            for form, (write, read) in forms.items():
                data, write_s = _timed(write)
                answer, read_s = _timed(lambda: read(data))  # noqa: B023 (called at once)
                row = {"k": k, "tail_samples": m, "form": form, "bytes_per_token": len(data) / tokens,
                       "write_tokens_per_s": tokens / write_s, "read_tokens_per_s": tokens / read_s}
                if form != "exact topk":
                    packed = answer["packed"].reshape(tokens, -1)
                    if fixed_packed is None:
                        fixed_packed = packed
                    row["same_as_fixed"] = bool(torch.equal(packed, fixed_packed))
                    decoded = unpack_topk({"mode": "topk_compact", "temperature": 1.0, "k": k,
                                                        "tail_samples": m, "vocab": vocab, "packed": packed})
                    reference = exact["log_probs"].reshape(tokens, k)
                    # The same top-1 first; the others in the order of the decoded values: compare by index.
                    order = exact["indices"].reshape(tokens, k).long()
                    values = torch.full((tokens, vocab), -torch.inf).scatter_(1, decoded["indices"].long(),
                                                                               decoded["log_probs"])
                    kl = (reference.exp() * (reference - values.gather(1, order))).sum(-1)
                    row.update(kl_mean=float(kl.mean()), kl_max=float(kl.max()))
                rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return {"fit_tokens": FIT_TOKENS, "tokens": tokens, "vocab": vocab, "rows": rows}
