"""Full-size compiles on abstract arrays, no weights (``python -m pmd_jax.main --dry_run``).

* ``entry``: the entry point from a run config (``dry_run_from_config``); ``distill_step``:
  the model's forward + backward and the config's real distillation step on a simulated mesh.
* ``forward_backward``: forward + backward + AdamW of a model preset (next-token loss);
  ``python -m pmd_jax.dry_run`` runs it from the command line.
* ``target``: ``--config.dry_run.target=NAME``: does the step fit that hardware, and a
  roofline step time; ``hardware``: the targets' figures and the fit / roofline maths.
* ``gpu_compile``: a GPU target's train step compiled by XLA:GPU without a GPU (the CUDA
  plugin, compile-only devices from a target description), else lowered to CUDA StableHLO;
  ``gpu_facts``: what the program shows (vocabulary sorts, cuDNN attention and ``dbias``,
  GEMM dtypes, per-layer saved tensors), read from its text.

Nothing is imported here: ``forward_backward`` sets the fake device count before JAX starts a
backend (importing a module of the package starts none).
"""
