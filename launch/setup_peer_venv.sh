#!/usr/bin/env bash
# Create the venv that runs the peer SDPO trainer, sdpo-rl (SDPO for TRL), for
# benchmarks/bench_sdpo_peer.py (issue 53).
#
# The venv adds TRL and sdpo-rl (and what TRL needs that the trainer's environment lacks:
# datasets, ...) and sees the trainer's environment (torch, transformers, pmd_jax) through a
# .pth file, so the peer runs the same torch and transformers as our torch references and
# grades with our verifier. Its own packages come first on sys.path. Idempotent.
#
# Usage: launch/setup_peer_venv.sh      (venv at $PMD_PEER_VENV, default ~/.cache/pmd_jax/venv-sdpo-rl)
# Env:   PMD_PEER_VENV   venv path
#        PYTHON          the trainer environment's interpreter (default: python3)
set -euo pipefail

VENV="${PMD_PEER_VENV:-${HOME}/.cache/pmd_jax/venv-sdpo-rl}"
PY="${PYTHON:-python3}"
TRL_VERSION=1.16.0
SDPO_RL_VERSION=0.0.3

check() {
  [ -x "${VENV}/bin/python" ] || return 1
  "${VENV}/bin/python" - "$TRL_VERSION" "$SDPO_RL_VERSION" <<'PYEOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
assert version("trl") == sys.argv[1] and version("sdpo-rl") == sys.argv[2]
import sdpo_rl, pmd_jax, torch  # noqa: F401
PYEOF
}

if check; then
  echo "sdpo-rl venv ready: ${VENV} (trl ${TRL_VERSION}, sdpo-rl ${SDPO_RL_VERSION})"
  exit 0
fi
echo "creating the sdpo-rl venv at ${VENV}"
[ -x "${VENV}/bin/python" ] || "${PY}" -m venv "${VENV}"
site=$("${VENV}/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
# the trainer environment's site-packages (and pmd_jax, installed there, editable or not)
"${PY}" - > "${site}/pmd_trainer_env.pth" <<'PYEOF'
import site, sysconfig
paths = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *site.getsitepackages()]
import pmd_jax, os
paths.append(os.path.dirname(os.path.dirname(pmd_jax.__file__)))
seen = []
for p in paths:
    if p not in seen:
        seen.append(p)
print("\n".join(seen))
PYEOF
"${VENV}/bin/python" -m pip install --quiet --disable-pip-version-check \
  "trl==${TRL_VERSION}" "sdpo-rl==${SDPO_RL_VERSION}"
check || { echo "ERROR: the sdpo-rl venv at ${VENV} does not import trl, sdpo_rl, pmd_jax and torch" >&2; exit 1; }
echo "sdpo-rl venv ready: ${VENV}"
