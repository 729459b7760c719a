"""Meta-Experience Learning as a mode of the loop (``mode=mel``; issue 18 item 2).

MEL (Huang et al., "Internalizing Meta-Experience into Memory for Guided Reinforcement
Learning in Large Language Models", arXiv 2602.10224, the method section), as far as its
public text says: "Explorative Rollout and Verifiable Feedback": G rollouts per query, a
rule-based verifier splits them into correct (Y+) and incorrect (Y-) ones; "Meta-Experience
Construction": for the contrastive pairs P_x = {(y+, y-)}, the policy itself, under a
structured instruction, "locates the bifurcation point" s* where y- diverges into an erroneous
path, then ("Deep Diagnosis and Abstraction") writes a critique C (error attribution, the
strategic gap to y+, the corrective principle) and abstracts it into a reusable
meta-experience (here: the lesson); the meta-experience is validated empirically by replaying
the query with it, and the kept ones are internalised into the weights by a token-averaged
negative log-likelihood term beside the GRPO objective. No memory is used at inference:
evaluation is memory-free, as for grpo. (The section numbers, the exact NLL conditioning and
weights were not in the public text we could read; what we chose is listed below.)

Here, step by step (``lessons.run_step``, called by the trainer after verification):

1. pairs: ``lessons.find_pairs`` (``mel.max_pairs_per_problem``, ``mel.max_pairs``);
2. reflection: one structured call per pair through the run's sampler (the policy;
   JSON schema ``memory/schemas.mel_reflection_schema`` in ``SamplingParams.json_schema``):
   ``split_point`` (a quoted span of the wrong rollout), ``critique``, ``lesson``; a
   malformed reply is counted (``mel_malformed``) and skipped; a split point that is not a
   span of the wrong rollout is counted (``mel_quote_missing``) and still replayed (the
   paper's filter is the replay), or dropped with ``mel.keep_unquoted=False`` (ours);
3. replay: ``mel.replays`` samples of the problem with the lesson in its prompt, verified by
   the task's verifier; the lesson is kept if one is right;
4. loss: the lesson rows (``distill.batch.make_lesson_rows``: the problem's chat prompt, the
   lesson as the response) join the train batch; the ``mel`` loss of
   ``distill/objectives.py`` is GRPO, and the train step adds ``mel.nll_weight`` x their
   token-mean NLL in the same jitted step (``distill.loss_fn.make_lesson_nll_fn``).

Where ours differs from the paper (each a config value, the paper's setting available):
pairs per problem and per step are capped (``mel.max_pairs_per_problem=0`` and
``mel.max_pairs=0``: all pairs, as the paper); ``mel.replays=0`` keeps lessons without
validation (an ablation). Ours, not the paper's, as far as its public text says: the lesson is
the NLL target given the problem's prompt alone, the critique and split point are not trained
on (issue 18 asks for the lesson's NLL; the paper's exact conditioning context and target were
not in the public text we read), the reflection prompt wording, the optional quote check of
the split point (``mel.keep_unquoted=False``), and the context-length guards
(``mel_reflect_too_long`` / ``mel_replay_too_long``).
The paper's NLL weight is taken as 1 (``mel.nll_weight``).
"""
