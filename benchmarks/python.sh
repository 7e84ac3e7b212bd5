# Sourced by the benchmark drivers (run.sh, run_auto.sh) from the repository root: sets PYTHON to
# an interpreter that has deepspeed (the one on PATH, else .venv's), unless the caller set it.
if [[ -z ${PYTHON:-} ]]; then
    if command -v python >/dev/null && python -c 'import deepspeed' >/dev/null 2>&1; then PYTHON=python
    elif [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python
    else PYTHON=python3; fi
fi
