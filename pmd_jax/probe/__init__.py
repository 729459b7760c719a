"""The memory content probe (issue 48): does a memory's text help the model that reads it?

Training-free. Given a memory (a run's ``memory.jsonl``), a model and a task (a run config),
the probe measures solve rates with memory text in the prompt against arms that differ in one
thing each (probe/arms.py), with paired sampling keys, problems screened to those solved
sometimes, intervals that resample problems and the minimum detectable difference beside
every contrast (probe/stats.py), and positive controls that must show an effect if the probe
can see one. ``python -m pmd_jax.probe --help``.
"""
