"""Config checks of `kd` as each teacher answers it (`KDRecipeConfig.kd_of`): the loss mix and the transport, the
on-policy keys (`kd.mode`, `kd.generation`), `kd.cross_tokenizer`, `kd.hidden_states`, and what a served teacher
(`teacher_model.url`) can answer. `meshkd.recipe.settings.config_checks.validate` runs them for each teacher; every
check raises `ConfigError` naming the key.
"""

from __future__ import annotations

import math

from meshkd.core.answers import choices, selected, selected_kind
from meshkd.core.answers.labels import ESTIMATORS
from meshkd.core.combinations import combination_named
from meshkd.core.loss import check_divergence
from meshkd.recipe.settings.config import DistributedConfig, KDConfig, KDRecipeConfig, ModelConfig
from meshkd.recipe.settings.typed_yaml import ConfigError

LOSSES = ("mse", "cosine")
"""The losses `kd.hidden_states.loss` takes."""


def check_kd(config: KDRecipeConfig, kd: KDConfig) -> None:
    """`kd` as a teacher answers it (`KDRecipeConfig.kd_of`): the loss mix, the transport, the non-finite policy,
    then on-policy, cross-tokenizer and the router."""
    if not 0.0 <= kd.kd_ratio <= 1.0:
        raise ConfigError(f"kd.kd_ratio must be in [0, 1], got {kd.kd_ratio}")
    if not (kd.temperature > 0 and math.isfinite(kd.temperature)):
        raise ConfigError(f"kd.temperature must be a finite number > 0, got {kd.temperature}")
    for key in ("logits_transport", "topk_encoding"):  # the values the registered answer encodings take
        if getattr(kd, key) not in choices(key):
            raise ConfigError(f"kd.{key} must be {' or '.join(choices(key))}, got {getattr(kd, key)!r}")
    if kd.topk < 1 or kd.topk_tail_samples < 0:
        raise ConfigError(f"kd.topk must be >= 1 and kd.topk_tail_samples >= 0, got {kd.topk}, {kd.topk_tail_samples}")
    if kd.topk_encoding == "compact" and kd.logits_transport != "topk":
        raise ConfigError(f"kd.topk_encoding: compact packs top-k answers; set kd.logits_transport: topk (got "
                          f"{kd.logits_transport!r})")
    if selected_kind(kd).reads_hidden and kd.cross_tokenizer is not None:
        raise ConfigError(f"kd.logits_transport {kd.logits_transport}: a teacher of another tokenizer "
                          "(kd.cross_tokenizer) answers its distribution projected onto the student's vocabulary, "
                          "which its output layer does not make from its hidden states; use full, full_bf16 or topk")
    if kd.teacher_cache_coding not in ("entropy", "fixed"):
        raise ConfigError(f"kd.teacher_cache_coding must be entropy or fixed, got {kd.teacher_cache_coding!r}")
    if kd.on_nonfinite not in ("stop", "skip_step"):
        raise ConfigError(f"kd.on_nonfinite must be stop or skip_step, got {kd.on_nonfinite!r}")
    if kd.max_skipped_steps < 0:
        raise ConfigError(f"kd.max_skipped_steps must be >= 0, got {kd.max_skipped_steps}")
    check_on_policy(config, kd)
    check_cross_tokenizer(kd, config.distributed)
    check_hidden_states(config)
    router = kd.router_aux_loss_coef
    if router is not None and not (router >= 0 and math.isfinite(router)):
        raise ConfigError(f"kd.router_aux_loss_coef must be a finite number >= 0 or null, got {router}")
    if kd.chunk_size is not None and kd.chunk_size < 1:
        raise ConfigError(f"kd.chunk_size must be >= 1, got {kd.chunk_size}")


def check_on_policy(config: KDRecipeConfig, kd: KDConfig) -> None:
    """The divergence, `kd.mode` and `kd.generation`: completions that fit a row, a live teacher to score them."""
    generation = kd.generation
    if kd.samples_the_divergence:
        check_sampled_divergence(config, kd)
    else:
        try:
            check_divergence(kd.divergence, kd.jsd_beta, skew_alpha=kd.skew_alpha)
            selected(logits_transport=kd.logits_transport, topk_encoding=kd.topk_encoding).check_divergence(
                kd.divergence)
        except ValueError as error:
            raise ConfigError(f"kd.divergence / kd.jsd_beta / kd.skew_alpha / kd.logits_transport: {error}") from None
    if kd.mode not in ("off_policy", "on_policy"):
        raise ConfigError(f"kd.mode must be off_policy or on_policy, got {kd.mode!r}")
    if not 0.0 <= kd.on_policy_fraction <= 1.0:
        raise ConfigError(f"kd.on_policy_fraction must be in [0, 1], got {kd.on_policy_fraction}")
    if generation.max_new_tokens < 1 or generation.prompt_tokens < 1:
        raise ConfigError(f"kd.generation.max_new_tokens and prompt_tokens must be >= 1 (a prompt is never empty), "
                          f"got {generation.max_new_tokens}, {generation.prompt_tokens}")
    if not (generation.temperature >= 0 and math.isfinite(generation.temperature)):
        raise ConfigError(f"kd.generation.temperature must be a finite number >= 0, got {generation.temperature}")
    if not 0.0 < generation.top_p <= 1.0:
        raise ConfigError(f"kd.generation.top_p must be in (0, 1], got {generation.top_p}")
    if any(token < 0 for token in generation.stop_tokens or ()):
        raise ConfigError(f"kd.generation.stop_tokens must be token ids >= 0, got {generation.stop_tokens}")
    sequence_length = config.step_scheduler.sequence_length
    longest = (1 if config.dataset.whole_prompts else generation.prompt_tokens) + generation.max_new_tokens
    if kd.mode == "on_policy" and longest > sequence_length:
        raise ConfigError(f"kd.generation.prompt_tokens ({generation.prompt_tokens}) + max_new_tokens "
                          f"({generation.max_new_tokens}) exceed step_scheduler.sequence_length ({sequence_length})"
                          if not config.dataset.whole_prompts else
                          f"kd.generation.max_new_tokens ({generation.max_new_tokens}) leaves no room for a prompt "
                          f"in step_scheduler.sequence_length ({sequence_length})")
    check_rollout_engine(kd)
    if kd.mode != "on_policy" and not generation.evaluate:
        return
    if kd.teacher_cache is not None:
        raise ConfigError("kd.mode on_policy and kd.generation.evaluate need a live teacher to score the "
                          "student's completions; kd.teacher_cache holds logits of dataset text only")
    if kd.kd_ratio == 0 and kd.mode == "on_policy":
        raise ConfigError("kd.mode on_policy with kd.kd_ratio 0 trains on the student's own samples without "
                          "a teacher; set kd.kd_ratio > 0 (1 is GKD's pure divergence)")
    student = config.distributed
    if student.pp_size > 1 or student.cp_size > 1:
        raise ConfigError(f"kd.mode on_policy / kd.generation.evaluate: the student generates with its whole "
                          f"model on each rank's own prompts, which pipeline and context parallel students do not "
                          f"hold; got distributed.pp_size {student.pp_size}, cp_size {student.cp_size} (use dp and tp)")


def check_sampled_divergence(config: KDRecipeConfig, kd: KDConfig) -> None:
    """`kd.divergence: sampled_reverse_kl`: the reverse KL estimated on the student's own sampled tokens, against each
    label's log-probability, so on-policy rows alone, teachers of the student's tokenizer: one, or several routed
    per prompt (`kd.combine: route`, each row's log-probabilities its own teacher's)."""
    if kd.mode != "on_policy" or kd.on_policy_fraction < 1.0:
        raise ConfigError(f"kd.divergence {kd.divergence} estimates the reverse KL on the student's own sampled "
                          f"tokens: it needs kd.mode on_policy with kd.on_policy_fraction 1 (every micro-batch "
                          f"sampled), got kd.mode {kd.mode!r}, kd.on_policy_fraction {kd.on_policy_fraction}")
    if kd.sampled_estimator not in ESTIMATORS:
        raise ConfigError(f"kd.sampled_estimator must be {' or '.join(ESTIMATORS)}, got {kd.sampled_estimator!r}")
    if kd.cross_tokenizer is not None or kd.hidden_states is not None:
        raise ConfigError(f"kd.divergence {kd.divergence} takes teachers of the student's tokenizer and no "
                          "kd.hidden_states (its answers are each label's log-probability only); unset "
                          "kd.cross_tokenizer or kd.hidden_states")
    if len(config.teacher_list()) > 1 and not combination_named(kd.combine).routes_rows:
        # A mixture needs whole distributions; a sum of estimates is left out until a run needs it.
        raise ConfigError(f"kd.divergence {kd.divergence} with several teachers takes kd.combine route (each row's "
                          f"label log-probabilities from its own teacher), got kd.combine {kd.combine}")


def check_rollout_engine(kd: KDConfig) -> None:
    """`kd.generation.engine`: a server address, how often its weights follow the student's and how stale they may be.

    With max_staleness 0 every completion comes from the current weights, so the weights go every step; with
    max_staleness s >= 1 the next step's completions are drawn while a step trains (one step behind), and a sync
    every `sync_every` steps adds up to sync_every - 1 more: sync_every <= s."""
    engine = kd.generation.engine
    if engine is None:
        return
    if kd.mode != "on_policy":
        raise ConfigError(f"kd.generation.engine draws the training completions of kd.mode on_policy; got kd.mode "
                          f"{kd.mode!r} (evaluations use the student's own generate)")
    if not engine.url.startswith(("http://", "https://")):
        raise ConfigError(f"kd.generation.engine.url must be http(s)://host:port of a vLLM server, got {engine.url!r}")
    if engine.sync_every < 1 or engine.max_staleness < 0:
        raise ConfigError(f"kd.generation.engine.sync_every must be >= 1 and max_staleness >= 0, got "
                          f"{engine.sync_every}, {engine.max_staleness}")
    lag = engine.sync_every - 1 + (1 if engine.max_staleness > 0 else 0)
    if lag > engine.max_staleness:
        raise ConfigError(f"kd.generation.engine.sync_every {engine.sync_every} lets the sampling weights lag "
                          f"{lag} step(s), more than max_staleness {engine.max_staleness} (with max_staleness 0: "
                          f"sync_every 1; else sync_every <= max_staleness)")
    if engine.dtype not in (None, "float32", "bfloat16", "float16"):
        raise ConfigError(f"kd.generation.engine.dtype must be float32, bfloat16, float16 or null, got "
                          f"{engine.dtype!r}")
    if engine.max_concurrent_requests < 1 or not engine.timeout_s > 0:
        raise ConfigError(f"kd.generation.engine.max_concurrent_requests must be >= 1 and timeout_s > 0, got "
                          f"{engine.max_concurrent_requests}, {engine.timeout_s}")


def check_cross_tokenizer(kd: KDConfig, student: DistributedConfig) -> None:
    """`kd.cross_tokenizer`: the loss, what each loss needs of the transport and divergence, the student layout."""
    cross = kd.cross_tokenizer
    if cross is None:
        return
    if cross.loss not in ("projection", "uld", "gold"):
        raise ConfigError(f"kd.cross_tokenizer.loss must be projection, uld or gold, got {cross.loss!r}")
    if cross.loss != "projection":  # the teacher sends each group's whole distribution over its own vocabulary
        needs = {"kd.logits_transport": ("full", kd.logits_transport), "kd.teacher_cache": (None, kd.teacher_cache),
                 "distributed.tp_size": (1, student.tp_size)}
        for key, (needed, value) in needs.items():
            if value != needed:
                raise ConfigError(f"kd.cross_tokenizer.loss {cross.loss} needs {key} {needed}, got {value!r} (the "
                                  "teacher answers each group's whole distribution over its own vocabulary)")
        divergences = ("forward_kl",) if cross.loss == "uld" else ("forward_kl", "reverse_kl")
        if kd.divergence not in divergences:
            raise ConfigError(f"kd.divergence {kd.divergence} with kd.cross_tokenizer.loss {cross.loss}: it takes "
                              f"{' or '.join(divergences)}" + (" (ULD is a distance of its own: leave the key at "
                                                              "forward_kl)" if cross.loss == "uld" else ""))
    if cross.teacher_sequence_length is not None and cross.teacher_sequence_length < 2:
        raise ConfigError(f"kd.cross_tokenizer.teacher_sequence_length must be >= 2 or null, "
                          f"got {cross.teacher_sequence_length}")
    if kd.divergence == "reverse_kl" and cross.loss == "projection":
        raise ConfigError("kd.divergence reverse_kl with kd.cross_tokenizer: the projected teacher gives no "
                          "probability to student tokens no teacher token maps to (an infinite reverse KL); use "
                          "forward_kl or jsd")
    unsupported = {f"distributed.pp_size {student.pp_size}": student.pp_size > 1,
                   f"distributed.cp_size {student.cp_size}": student.cp_size > 1}
    refused = [name for name, used in unsupported.items() if used]
    if refused:
        raise ConfigError(f"kd.cross_tokenizer does not yet work with {', '.join(refused)}: the student's rows carry "
                          "the teacher's tokenization whole (students use dp and tp)")


def pairs_of(hidden_states, keep_layers) -> list[tuple[int, int]]:
    """The (student layer, teacher layer) pairs of a `kd.hidden_states` section: as given, or with `kept`
    each kept layer of `model.keep_layers` (a list) with the teacher layer it came from.

    Raises:
        ValueError: `kept` without a list of kept layers, or a pair that is not two integers.
    """
    if hidden_states.pairs == "kept":
        if not isinstance(keep_layers, list):
            raise ValueError("kd.hidden_states.pairs: kept pairs the layers model.keep_layers kept with the teacher "
                             "layers they came from; without model.keep_layers give the pairs, e.g. [[0, 0], [1, 2]]")
        return list(enumerate(keep_layers))
    if isinstance(hidden_states.pairs, str):
        raise ValueError(f"kd.hidden_states.pairs must be kept or a list of [student layer, teacher layer], "
                         f"got {hidden_states.pairs!r}")
    if not hidden_states.pairs or any(len(pair) != 2 for pair in hidden_states.pairs):
        raise ValueError(f"kd.hidden_states.pairs must be a non-empty list of [student layer, teacher layer], "
                         f"got {hidden_states.pairs!r}")
    return [tuple(pair) for pair in hidden_states.pairs]


def check_hidden_states(config: KDRecipeConfig) -> None:
    """`kd.hidden_states`: its pairs, loss and weight, and the layouts and teachers that can send its answer."""

    hidden_states = config.kd.hidden_states
    if hidden_states is None:
        return
    selected_later = hidden_states.pairs == "kept" and isinstance(config.model.keep_layers, dict)  # {auto: N}
    try:
        if not selected_later:
            pairs_of(hidden_states, config.model.keep_layers)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if hidden_states.loss not in LOSSES:
        raise ConfigError(f"kd.hidden_states.loss must be mse or cosine, got {hidden_states.loss!r}")
    if not (hidden_states.weight >= 0 and math.isfinite(hidden_states.weight)):
        raise ConfigError(f"kd.hidden_states.weight must be a finite number >= 0, got {hidden_states.weight}")
    if config.kd.cross_tokenizer is not None:
        raise ConfigError("kd.hidden_states with kd.cross_tokenizer: the teacher's positions are its own tokens, "
                          "not the student's; pair hidden states with a teacher of the student's tokenizer")
    if config.distributed.pp_size > 1:
        raise ConfigError(f"kd.hidden_states with distributed.pp_size({config.distributed.pp_size}) > 1 is not "
                          "supported: the student's pipeline computes its loss on the last stage, which holds only "
                          "some of the paired layers; use dp, tp or cp for the student")


def check_served_teacher(model: ModelConfig, kd: KDConfig) -> None:
    """A teacher at `model.url` (`teacher_model.url`), `kd` as it answers it: an address, and what a served
    teacher answers. Its other keys may describe it (their identity is checked against the server's at
    preflight), its layout keys are the server's (`meshkd serve-teacher` reads them, training does not), and with
    a cache it is what `meshkd cache-teacher` asks, training reading the cache."""
    url = model.url
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"teacher_model.url must be an http:// or https:// address, got {url!r}")
    if model.api not in ("meshkd", "completions"):
        raise ConfigError(f"teacher_model.api must be meshkd or completions, got {model.api!r}")
    if model.api == "completions":  # top-k log-probabilities at temperature 1, nothing sampled
        needs = {"kd.logits_transport": ("topk", kd.logits_transport),
                 "kd.topk_tail_samples": (0, kd.topk_tail_samples), "kd.temperature": (1.0, kd.temperature),
                 "kd.topk_encoding": ("exact", kd.topk_encoding)}
        for key, (needed, given) in needs.items():
            if given != needed:
                raise ConfigError(f"{key}: a completions server's prompt_logprobs give the top k log-probabilities "
                                  f"at temperature 1 and no tail samples, as JSON; set {key}: {needed} (got "
                                  f"{given!r})")
    if kd.cross_tokenizer is not None and kd.cross_tokenizer.loss == "projection":
        raise ConfigError("kd.cross_tokenizer.loss projection does not yet work with a served teacher "
                          "(teacher_model.url): its projection needs the student's tokenizer on the server; use uld "
                          "or gold (per aligned group), or run the teacher on ranks of this run")
