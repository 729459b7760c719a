"""Fast-Slow Training as a mode of the loop (``mode=fast_slow``; issue 18 item 1).

FST (Khatri et al., "Learning, Fast and Slow: Towards LLMs That Adapt Continually", arXiv
2605.12484; our source is the public review ``../shared/docs/seed-fast-slow-review.txt``) keeps
the model's parameters as slow weights, trained by RL from the scalar reward, and a pool of
optimised textual contexts as fast weights, updated "via reflective optimization, additionally
consuming the rollout's full text including thoughts, tool calls, errors, and rich feedback",
the pool "maintained as a Pareto-frontier population" (review, Figure 1); the fast loop is GEPA
(review, Appendix A: "We optimize the fast weights with GEPA"). The ablations the review lists
(Figure 9) are the pool size K (a), the advantage baseline per prompt or per problem (b), the
cycle length T (c) and a light vs full GEPA recipe (d); the RL side samples G = 8 rollouts per
problem (Appendix, training details).

Here, step by step (the trainer calls the mode's hooks, ``fast_slow/mode.py``, at each point):

1. rollout: each problem's prompt carries one context of the pool, drawn uniformly with a seed
   of (run seed, step, position) (:meth:`ContextPool.draw`), at the end of the task's system
   message (:func:`contexts.with_context`); the G rollouts of that problem share it, and the
   train batch's student prompt is that same prompt (the weights are updated on what the
   policy saw while sampling);
2. slow weights: the GRPO loss on those prompts (the mode's default loss, ``fast_slow/mode.py``);
3. memory: updated from the rollouts as in pmd (fast_slow is a memory mode);
4. fast weights, after every ``fast_slow.update_every``-th step (:meth:`ContextPool.update`):
   new candidates are renderings of the memory's insight and behavior levels
   (``fast_slow.memory_candidates``; :func:`contexts.render_memory`) and GEPA-style reflective
   rewrites of a pool context by the policy from this step's rollouts, rewards and feedback
   (``fast_slow.rewrite_candidates``; the parent drawn by how many validation problems it is
   best on, GEPA's rule); each new candidate is scored by sampling each of ``fast_slow.val_size``
   validation problems (TRAIN split, none an evaluation problem, held out of the training stream
   unless ``fast_slow.val_in_train``) with it in the prompt; the pool becomes the Pareto front of
   the per-problem rewards (:func:`pareto.pareto_front`), cut to ``fast_slow.pool_size``;
5. evaluation: ``accuracy`` is the weights alone (memory-free, as every mode) and
   ``accuracy_deployed`` the weights with the pool's best context (mean validation reward) in
   the prompt;
6. checkpoint: the pool (contexts, scores, recent draws) is the checkpoint's ``mode_state`` slot;
   a resumed run continues with the same pool.

Where ours differs from FST (as far as the review says; each a config value where it can be):
- candidates also come from the memory's renderings (``fast_slow.memory_candidates``; 0 =
  FST's GEPA rewrites alone), and the reflection LM is the policy itself (the review does not
  name FST's);
- one context per problem: the G rollouts of a problem share it, so the GRPO baseline is both
  per prompt and per problem; FST's Figure 9b compares the two with several contexts per
  problem (not a knob here: our sampler draws G samples of one prompt);
- T (``fast_slow.update_every``), K (``fast_slow.pool_size``, default 4) and the validation
  slice (``fast_slow.val_size``, ``val_samples``) are ours: the review gives no headline values;
- a context keeps the scores it was given when it entered the pool (GEPA's rule;
  ``fast_slow.rescore_pool=True`` scores the pool again with the current weights each update);
- a full front is cut to K by the number of problems a context is best on, then mean reward;
- single-process runs only (config validation says so); a rewrite prompt past the sampler's
  context shows fewer attempts, then is skipped and counted (``fast_slow_rewrite_too_long``).
"""

from pmd_jax.modes.fast_slow.pareto import dominates, pareto_front

__all__ = ["dominates", "pareto_front"]
