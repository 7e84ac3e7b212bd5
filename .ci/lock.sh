#!/usr/bin/env bash
# Writes constraints.txt and constraints-torch.txt from the packages of a venv's python
# (make lock passes .venv-latest's). torch itself is never pinned here: TORCH_SPEC picks it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=$1
torch_deps='^(filelock|fsspec|jinja2|markupsafe|mpmath|networkx|sympy|typing[-_]extensions)=='
freeze=$("$python" -m pip freeze --exclude-editable | grep -viE '^(torch|ds[-_]vshape)[=@ ]' )
{
  echo "# Exact versions \`make test\` and CI run with (everything but torch and what torch itself"
  echo "# requires, which constraints-torch.txt pins for the default CPU build). Regenerate with"
  echo "# \`make lock\` after changing a dependency; \`make test-latest\` tries the newest allowed versions."
  grep -viE "$torch_deps" <<<"$freeze"
} > constraints.txt
{
  echo "# torch's own requirements as tested with the default TORCH_SPEC (torch==2.13.0, CPU build)."
  echo "# Applied only when TORCH_SPEC is left at its default: another torch build brings its own."
  grep -iE "$torch_deps" <<<"$freeze"
} > constraints-torch.txt
git --no-pager diff --stat -- constraints.txt constraints-torch.txt
