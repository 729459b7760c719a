"""The ``mel`` section of the run config (``mode=mel``, :mod:`pmd_jax.modes.mel`): every knob once,
with its help. The paper's setting is named in the help wherever ours differs from it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pmd_jax.config.schema import Section, knob, section
from pmd_jax.memory.config import MemorySampling
from pmd_jax.memory.schemas import mel_reflection_schema, reply_token_bound


def _reflection_sampling() -> MemorySampling:
    return MemorySampling(temperature=0.7, top_p=1.0, top_k=0, max_tokens=640, seed=0)


@dataclasses.dataclass(frozen=True)
class MelConfig(Section):
    """Meta-Experience Learning (arXiv 2602.10224): contrastive reflections on a right and a
    wrong rollout of the same problem, lessons kept by replay, an NLL term beside GRPO."""

    nll_weight: float = knob(1.0, "Weight of the lessons' token-mean NLL added to the GRPO "
                             "loss (0 = measure it only: the update is plain GRPO). The paper "
                             "sums the two terms (weight 1).")
    replays: int = knob(4, "Samples of the problem with the lesson in its prompt; the lesson "
                        "is kept if at least one is right (verified like a rollout). 0 = keep "
                        "every well-formed lesson unreplayed (an ablation; the paper "
                        "validates).")
    max_pairs: int = knob(16, "Contrastive pairs (one reflection each) per step, drawn in "
                          "problem order; 0 = all (the paper reflects on every pair).")
    max_pairs_per_problem: int = knob(1, "Pairs per problem with right and wrong rollouts "
                                      "(its first right x first wrong, then the next ones); "
                                      "0 = every right x wrong pair (the paper's P_x).")
    reflection: MemorySampling = section(MemorySampling, "Sampling of the reflection call "
                                         "(the policy writes it; seed offset by the step).",
                                         factory=_reflection_sampling)
    structured_output: bool = knob(True, "Send the reflection's JSON schema to the sampler "
                                   "(SamplingParams.json_schema), as the memory does.")
    max_attempt_chars: int = knob(4000, "Each attempt shown to the reflection is cut to this "
                                  "many characters.")
    split_point_max_chars: int = knob(300, "Bound of the schema's split_point: the quoted "
                                      "span of the wrong rollout where it goes wrong (the "
                                      "paper's bifurcation point).")
    critique_max_chars: int = knob(600, "Bound of the schema's critique.")
    lesson_min_chars: int = knob(20, "Shortest lesson kept (characters, after sanitising).")
    lesson_max_chars: int = knob(400, "Bound of the schema's lesson.")
    keep_unquoted: bool = knob(True, "Keep (and replay) a lesson whose split_point is not a "
                               "span of the wrong rollout (whitespace-normalised match); it is "
                               "counted as mel_quote_missing either way. True is the paper "
                               "(the replay validates a lesson); False drops it (ours: in a "
                               "SciQ grid cell of SmolLM2-135M it dropped 14 of the 15 "
                               "lessons that parsed, before any replay).")
    replay_temperature: float = knob(1.0, "Sampling temperature of the replays (the "
                                     "rollouts' own by default).")
    replay_max_tokens: int = knob(0, "Response budget of a replay; 0 = rollout.max_tokens.")
    lesson_max_tokens: int = knob(128, "A kept lesson's tokens in its NLL row are cut to "
                                  "this many.")

    def errors(self) -> list[str]:
        m = self
        errs: list[str] = []

        def need(cond: bool, msg: str) -> None:
            if not cond:
                errs.append(msg)

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        w = m.nll_weight
        need(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
             and w >= 0, f"mel.nll_weight must be a finite number >= 0, got {w!r}")
        for name in ("replays", "max_pairs", "max_pairs_per_problem", "replay_max_tokens"):
            v = getattr(m, name)
            need(is_int(v) and v >= 0, f"mel.{name} must be an int >= 0, got {v!r}")
        for name in ("max_attempt_chars", "split_point_max_chars", "critique_max_chars",
                     "lesson_min_chars", "lesson_max_chars", "lesson_max_tokens"):
            v = getattr(m, name)
            need(is_int(v) and v >= 1, f"mel.{name} must be an int >= 1, got {v!r}")
        if is_int(m.lesson_min_chars) and is_int(m.lesson_max_chars):
            need(m.lesson_min_chars <= m.lesson_max_chars,
                 f"mel.lesson_min_chars={m.lesson_min_chars} exceeds mel.lesson_max_chars="
                 f"{m.lesson_max_chars}")
        t = m.replay_temperature
        need(isinstance(t, (int, float)) and t >= 0,
             f"mel.replay_temperature must be >= 0, got {t!r}")
        r = m.reflection
        need(isinstance(r.temperature, (int, float)) and r.temperature >= 0,
             f"mel.reflection.temperature must be >= 0, got {r.temperature!r}")
        need(isinstance(r.top_p, (int, float)) and 0 < r.top_p <= 1,
             f"mel.reflection.top_p must be in (0, 1], got {r.top_p!r}")
        need(is_int(r.top_k) and r.top_k >= 0, f"mel.reflection.top_k must be >= 0, got "
             f"{r.top_k!r}")
        need(is_int(r.max_tokens) and r.max_tokens >= 1,
             f"mel.reflection.max_tokens must be >= 1, got {r.max_tokens!r}")
        if not errs and m.structured_output:
            bound = reply_token_bound(mel_reflection_schema(m))
            need(r.max_tokens >= bound,
                 f"mel.reflection.max_tokens={r.max_tokens} is below the reflection schema's "
                 f"worst case ({bound} tokens, memory/schemas.reply_token_bound): a reply "
                 "filling its bounds would be cut and counted malformed; raise it or lower "
                 "mel.split_point_max_chars / critique_max_chars / lesson_max_chars")
        return errs
