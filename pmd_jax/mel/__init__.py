"""Meta-Experience Learning as a mode of the loop (``mode=mel``; issue 18 item 2).

MEL (Huang et al., "Internalizing Meta-Experience into Memory for Guided Reinforcement
Learning in Large Language Models", arXiv 2602.10224, Sec. 3 "Method"), as far as it is public:
after the GRPO rollouts are verified, each problem with a right and a wrong rollout gives
contrastive pairs (y+, y-); the policy itself locates the bifurcation point where y- goes
wrong, diagnoses it (critique) and abstracts a reusable meta-experience (here: the lesson);
a lesson is validated empirically by replaying the problem with it; the kept lessons are
internalised by a token-averaged NLL term added to the GRPO objective. No memory is used at
inference: evaluation is memory-free, as for grpo.

Here, step by step (``lessons.run_step``, called by the trainer after verification):

1. pairs: ``lessons.find_pairs`` (``mel.max_pairs_per_problem``, ``mel.max_pairs``);
2. reflection: one structured call per pair through the run's sampler (the policy;
   JSON schema ``memory/schemas.mel_reflection_schema`` in ``SamplingParams.json_schema``):
   ``split_point`` (a quoted span of the wrong rollout), ``critique``, ``lesson``; a
   malformed reply is counted (``mel_malformed``) and skipped; a split point that is not a
   span of the wrong rollout is counted (``mel_quote_missing``) and dropped (or kept,
   ``mel.keep_unquoted``);
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
the NLL target given the problem's prompt alone (the paper's exact conditioning context is not
in the public summary we read), the reflection prompt wording, and the quote check of the
split point. The paper's NLL weight is taken as 1 (``mel.nll_weight``).
"""
