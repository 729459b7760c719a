"""pmd_jax code that runs inside a vLLM server (``--worker-extension-cls``).

Importable without jax: it needs only what the vLLM venv has plus tensorstore and numpy.
"""
