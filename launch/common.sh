# shellcheck shell=bash
# Shared by gpu.sh and tpu_pod.sh (sourced after they set PRINT, PY and die).

# Print (--print) or run one command; the printed line is shell-quoted and can be pasted.
run() {
  if ((PRINT)); then
    printf '%q ' "$@" | sed 's/ $//'
    echo
  else
    "$@"
  fi
}

# Shell-quote arguments into one line (for commands run on a remote host).
q() { printf '%q ' "$@" | sed 's/ $//'; }

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "$PY is not a Python 3.11+ interpreter (set PYTHON to one)"
