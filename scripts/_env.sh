# Sourced by scripts/demo and scripts/test. Finds a Python >= 3.12 by itself, creates or
# reuses a virtual environment ($1: its folder name in the repository, unless RINGFLASH_VENV
# names one) and installs ringflash into it (editable) with the extras named in $2.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RINGFLASH_VENV:-$ROOT/$1}"
EXTRAS="${2:-}"

_py_ok() {
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

_find_python() {
  local c r
  for c in "${RINGFLASH_PYTHON:-}" python3.13 python3.12 python3.14 python3 python; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && _py_ok "$c"; then command -v "$c"; return 0; fi
  done
  # Interpreters installed but not on PATH (pyenv versions not selected, other prefixes).
  local roots=("${PYENV_ROOT:-$HOME/.pyenv}")
  if command -v pyenv >/dev/null 2>&1; then roots+=("$(pyenv root)"); fi
  for r in "${roots[@]}"; do
    for c in $(ls -d "$r"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -rV); do
      if _py_ok "$c"; then echo "$c"; return 0; fi
    done
  done
  for c in /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9] /opt/homebrew/bin/python3.1[2-9]; do
    if [ -x "$c" ] && _py_ok "$c"; then echo "$c"; return 0; fi
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ] || ! _py_ok "$VENV/bin/python"; then
  PY="$(_find_python)" || {
    echo "ringflash: no Python >= 3.12 found (tried python3.13, python3.12, python3, pyenv" \
         "versions); set RINGFLASH_PYTHON=/path/to/python3.12" >&2
    exit 1
  }
  echo "ringflash: creating $VENV with $PY ($("$PY" --version 2>&1))" >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi

# Reinstall only when pyproject.toml or the extras changed.
STAMP="$VENV/.ringflash-installed-$(echo "$EXTRAS" | tr ',' '-')"
WANT="$(cat "$ROOT/pyproject.toml" | cksum)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "ringflash: installing ringflash${EXTRAS:+[$EXTRAS]} into $VENV" >&2
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT${EXTRAS:+[$EXTRAS]}" >&2
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
