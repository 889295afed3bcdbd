# Sourced by scripts/*: put this checkout's virtual environment (made by scripts/setup) first on PATH.
DGR_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VIRTUAL_ENV="$DGR_ROOT/.venv" PATH="$DGR_ROOT/.venv/bin:$PATH"
