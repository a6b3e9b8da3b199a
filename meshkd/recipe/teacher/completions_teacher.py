"""A teacher behind an OpenAI-compatible completions endpoint with vLLM's `prompt_logprobs`
(`teacher_model.api: completions`): a student's `TeacherSource`, with `ServedTeacher`'s retries.

vLLM's protocol (its `entrypoints/openai` completion protocol): a `CompletionRequest` takes `prompt` as token
ids (a list of lists, one prompt each), `max_tokens`, `prompt_logprobs: k` (vLLM's extension; a vLLM server caps
k at its `max_logprobs`, 20 by default) and `return_tokens_as_token_ids`; each `CompletionResponseChoice` (its
`index` the prompt's) carries `prompt_logprobs: list[dict[int, Logprob] | None]`, JSON keys the token ids as
strings, a `Logprob` {logprob, rank, decoded_token}: entry j is the distribution of prompt token j given the
tokens before it (the first is null), holding the top k (ranks 1..k) and the prompt token itself.

A packed row holds several documents (`attention_mask`: each token's document), and each is a prompt of its own,
so a document's position j gets the entries of its prompt_logprobs[j + 1]. The answer is meshkd's top-k encoding
(`meshkd.core.answers.topk`) at temperature 1 without tail samples (the tail is one rest bucket, log(1 - the top
k's mass)); each label's log-probability is its prompt token's entry. A position that predicts no token of its
own document (a document's last, padding) gets a placeholder that no loss counts.

A micro-batch with no prompt (no rows, as a data-parallel rank's share of a short held-out batch can be, or
padding only) is answered here, all placeholders, without a request: vLLM refuses a request with no prompt (400
"You must pass at least one prompt").
"""

from __future__ import annotations

import concurrent.futures
import json
import math

import torch

from meshkd.core import wire
from meshkd.core.answers import LABEL_LOG_PROBS
from meshkd.core.answers.topk import TopK
from meshkd.core.teacher_protocol import Encoded, TeacherRequest
from meshkd.recipe.teacher.served_teacher import ServedTeacher, ServedTeacherError, host_rows

COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"


def completions_request(prompts: list[list[int]], k: int, model: str | None) -> dict:
    """The JSON body asking for the top `k` of every position of each prompt (and one token generated, which
    vLLM requires and the answer ignores)."""
    body = {"prompt": prompts, "max_tokens": 1, "prompt_logprobs": k, "return_tokens_as_token_ids": True,
            "temperature": 0.0}
    return body if model is None else {"model": model, **body}


def documents(row: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """(first, end) columns of each document of a packed row, in order (padding left out)."""
    mask = row["attention_mask"].tolist()
    spans, start = [], 0
    for column in range(1, len(mask) + 1):
        if column == len(mask) or mask[column] != mask[start]:
            if mask[start] != 0:
                spans.append((start, column))
            start = column
    return spans


class CompletionsTeacher(ServedTeacher):
    """`ServedTeacher` speaking the completions API: `settings["topk"]` entries a position, no tail samples."""

    def __init__(self, *args, model: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model = model

    def _ask(self, request: TeacherRequest) -> concurrent.futures.Future:
        batch = host_rows(request)
        spans = [documents({key: value[row] for key, value in batch.items()}) for row in range(len(batch["input_ids"]))]
        prompts = [batch["input_ids"][row, first:end].tolist() for row, row_spans in enumerate(spans)
                   for first, end in row_spans]
        answer = concurrent.futures.Future()
        if not prompts:
            answer.set_result(self._decoded([], batch, spans, request))
            return answer
        body = completions_request(prompts, self.settings["topk"], self.model)
        posted = self._submit(self._post(COMPLETIONS_PATH, json_body=body))

        def decode(done: concurrent.futures.Future) -> None:
            try:
                answer.set_result(self._decoded(self._choices(done.result()), batch, spans, request))
            except BaseException as error:  # noqa: BLE001 - raised where the answer is read
                answer.set_exception(error)

        posted.add_done_callback(decode)
        return answer

    def _answer(self, future: concurrent.futures.Future) -> Encoded:
        """The answer decoded on the host, on `device` in one copy (`wire.to_device`)."""
        return wire.to_device(future.result(), self.device)

    def _choices(self, body: bytes) -> list[dict]:
        """The completions of a response's `body`, in the order of their prompts."""
        try:
            return sorted(json.loads(body)["choices"], key=lambda choice: choice["index"])
        except (ValueError, KeyError, TypeError) as error:
            raise ServedTeacherError(f"{self.label}: {self.url} answered no completions ({error})") from None

    def _decoded(self, choices: list[dict], batch: dict, spans: list[list[tuple[int, int]]],
                 request: TeacherRequest) -> Encoded:
        """The top-k answer (and label log-probabilities, as `request` asks) of `choices`, one per span of
        `spans` in order; placeholders elsewhere."""
        k, ignore = self.settings["topk"], self.settings["ignore_index"]
        rows, length = batch["input_ids"].shape
        # Placeholders where no loss reads: k equally likely entries and an equal rest.
        log_probs = torch.full((rows, length, k), -math.log(k + 1))
        indices = torch.arange(k, dtype=torch.int32).expand(rows, length, k).clone()
        tail = torch.full((rows, length), -math.log(k + 1))
        labels = torch.zeros(rows, length)
        choice = iter(choices)
        for row, row_spans in enumerate(spans):
            row_labels = batch["labels"][row].tolist()
            for first, end in row_spans:
                entries = next(choice, {}).get("prompt_logprobs")
                if not isinstance(entries, list) or len(entries) != end - first:
                    raise ServedTeacherError(f"{self.label}: {self.url} answered no prompt_logprobs for a prompt of "
                                             f"{end - first} tokens (an OpenAI-compatible server with vLLM's "
                                             "prompt_logprobs is needed)")
                # The JSON is read position by position; the tensors are written once per prompt.
                tops, label_columns, label_values = [], [], []
                for column, entry in enumerate(entries[1:], start=first):
                    top = sorted((value["rank"], int(token), value["logprob"]) for token, value in entry.items()
                                 if value.get("rank") is not None and value["rank"] <= k)
                    if len(top) != k:
                        raise ServedTeacherError(f"{self.label}: {self.url} answered {len(top)} of the top {k} "
                                                 "(kd.topk) entries a position; a vLLM server gives at most its "
                                                 "--max-logprobs")
                    tops.append([(token, value) for _, token, value in top])
                    label = row_labels[column]
                    if label != ignore:
                        if str(label) not in entry:
                            raise ServedTeacherError(f"{self.label}: {self.url} answered no log-probability of the "
                                                     f"prompt's own token {label}")
                        label_columns.append(column)
                        label_values.append(entry[str(label)]["logprob"])
                labels[row, label_columns] = torch.tensor(label_values, dtype=labels.dtype)
                if tops:
                    columns = slice(first, first + len(tops))
                    block = torch.tensor(tops, dtype=torch.float64)  # [positions, k, (token, log-prob)]: ids exact
                    indices[row, columns] = block[..., 0].to(torch.int32)
                    log_probs[row, columns] = block[..., 1].float()
                    mass = torch.logsumexp(log_probs[row, columns], -1).clamp(max=0)  # rounding may pass 1
                    tail[row, columns] = torch.log(-torch.expm1(mass))
        if request.logits_transport == LABEL_LOG_PROBS:
            return {"mode": LABEL_LOG_PROBS, "log_probs": labels}
        answer = {"mode": TopK.name, "temperature": 1.0, "log_probs": log_probs, "indices": indices,
                  "tail_log_prob": tail}
        return answer | ({LABEL_LOG_PROBS: labels} if request.with_label_log_probs else {})
