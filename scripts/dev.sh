#!/usr/bin/env bash
# One entry point that sets up a fresh clone and runs the demo or the tests.
#   bash scripts/dev.sh demo [args...]   # install what is missing, train a short demo
#   bash scripts/dev.sh test [args...]   # install what is missing, run the test suite (pytest args)
#
# Where it installs: into the active virtual environment when there is one (VIRTUAL_ENV set,
# or the interpreter runs inside a venv); otherwise into this clone's own `.venv` (ignored by
# git), created on the first run. It never pip-installs into a system Python, which Debian 12,
# Ubuntu 24.04 and others refuse (PEP 668, "externally-managed-environment").
#
# Environment:
#   PYTHON             the interpreter (default python3): used as is when it runs in a virtual
#                      environment, else the base from which .venv is created. Delete .venv to
#                      rebuild it from another Python.
#   GEMINI_TORCH_SPEC  what to pip-install when torch is missing, e.g. "torch==2.5.1" or
#                      "torch --index-url <a PyTorch wheel index>" (split on spaces).
#   GEMINI_TORCH_INDEX on Linux without a GPU: PyTorch's CPU wheel index, to take the CPU build
#                      of torch 2.13.0 (PyPI's Linux wheel is the CUDA build, several GB).
set -euo pipefail
case "${PYTHON:-}" in  # a relative path names a file from where we were called, not the root
    */*) if dir=$(cd "$(dirname "$PYTHON")" 2>/dev/null && pwd); then PYTHON="$dir/$(basename "$PYTHON")"; fi ;;
esac
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"

say() { echo "[dev.sh] $*" >&2; }
die() { say "$*"; exit 1; }

in_venv() {  # is interpreter $1 running inside a virtual environment?
    "$1" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' 2>/dev/null
}

check_version() {  # pyproject.toml: requires-python >= 3.10
    "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null \
        || die "$1 is Python $("$1" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo '?'); gemini-offload needs 3.10 or newer: set PYTHON=python3.X"
}

venv_help() {  # what to do when `python -m venv` cannot work
    local base=$1 ver
    ver=$("$base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null || echo 3)
    say "could not create the virtual environment $VENV with $base (Python $ver):"
    say "its 'venv' or 'ensurepip' module is missing. Install it, then run this again:"
    say "  Debian / Ubuntu:  sudo apt install python3-venv   (or python$ver-venv)"
    say "  other systems:    install your distribution's venv package for Python $ver, or use a python.org / pyenv / conda Python"
    say "Or activate a virtual environment of your own (VIRTUAL_ENV) and run this again: dev.sh then installs into it."
    exit 1
}

usable_venv() {  # is .venv a virtual environment whose Python runs, with pip?
    [ -x "$VENV/bin/python" ] && in_venv "$VENV/bin/python" && "$VENV/bin/python" -m pip --version >/dev/null 2>&1
}

make_venv() {
    local base=$1
    check_version "$base"
    if [ -e "$VENV" ]; then
        say "$VENV is not a working virtual environment (no Python or no pip in it): recreating it"
        rm -rf "$VENV"
    fi
    "$base" -c 'import venv, ensurepip' >/dev/null 2>&1 || venv_help "$base"
    say "creating the virtual environment $VENV with $base"
    if ! "$base" -m venv "$VENV" || ! usable_venv; then
        rm -rf "$VENV"  # a half-made .venv (no pip) would only confuse the next run
        venv_help "$base"
    fi
    # Editable installs from pyproject.toml (PEP 660) need pip >= 21.3; very old bundled pips upgrade.
    if ! "$VENV/bin/python" -c 'import sys, pip; sys.exit(0 if tuple(map(int, pip.__version__.split(".")[:2])) >= (21, 3) else 1)' 2>/dev/null; then
        say "upgrading pip in $VENV"
        "$VENV/bin/python" -m pip install -q --upgrade pip
    fi
}

choose_python() {  # sets PY: the interpreter everything below installs into and runs with
    if [ -n "${PYTHON:-}" ]; then
        command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON: no such interpreter"
        if in_venv "$PYTHON"; then PY=$PYTHON; check_version "$PY"; return; fi
        BASE=$PYTHON
    else
        if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
            PY="$VIRTUAL_ENV/bin/python"; check_version "$PY"; return
        fi
        command -v python3 >/dev/null 2>&1 || die "no python3 on PATH: install Python 3.10+ or set PYTHON"
        if in_venv python3; then PY=python3; check_version "$PY"; return; fi
        BASE=python3
    fi
    usable_venv || make_venv "$BASE"
    PY="$VENV/bin/python"
}

pip_install() {
    "$PY" -m pip --version >/dev/null 2>&1 || "$PY" -m ensurepip -q >/dev/null 2>&1 \
        || die "$PY has no pip (and ensurepip could not add it): install pip into that environment, or deactivate it so that dev.sh uses its own .venv"
    "$PY" -m pip install -q "$@"
}

has_modules() {  # are these modules installed in $PY's environment? (found, not imported: fast)
    "$PY" -I - "$@" 2>/dev/null <<'EOF'
import sys
from importlib.util import find_spec
sys.exit(0 if all(find_spec(m) is not None for m in sys.argv[1:]) else 1)
EOF
}

ensure_torch() {
    if has_modules torch; then return; fi
    local spec=()
    if [ -n "${GEMINI_TORCH_SPEC:-}" ]; then
        read -ra spec <<< "$GEMINI_TORCH_SPEC"
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        spec=(torch)
    elif [ "$(uname -s)" != Linux ]; then
        spec=(torch==2.13.0)  # macOS and Windows wheels on PyPI are CPU builds already
    elif [ -n "${GEMINI_TORCH_INDEX:-}" ]; then
        # PyPI's Linux wheel of torch is the CUDA build: with its dependencies, several GB of
        # CUDA packages. GEMINI_TORCH_INDEX names PyTorch's CPU wheel index (its 2.13.0+cpu
        # ranks above PyPI's 2.13.0); the other dependencies still come from PyPI. No index is
        # contacted unless asked: CI and offline machines install from pip's configuration.
        spec=(torch==2.13.0 --extra-index-url "$GEMINI_TORCH_INDEX")
    else
        spec=(torch==2.13.0)
    fi
    say "installing ${spec[*]} into $("$PY" -c 'import sys; print(sys.prefix)')"
    pip_install "${spec[@]}"
}

ensure_project() {
    # Fast path: every package is there, and `gemini` is this clone's (an editable install of
    # it). -I: the current folder is not on sys.path, so the clone itself does not count.
    if has_modules chunks offload tracer psutil aiofiles pynvml pytest matplotlib transformers safetensors accelerate \
        && "$PY" -I - "$ROOT" 2>/dev/null <<'EOF'
import os, sys
from importlib.util import find_spec
spec = find_spec("gemini")
here = spec is not None and os.path.dirname(os.path.dirname(os.path.realpath(spec.origin)))
sys.exit(0 if here == os.path.realpath(sys.argv[1]) else 1)
EOF
    then
        return
    fi
    say "installing gemini-offload (editable) with its test extra into $("$PY" -c 'import sys; print(sys.prefix)')"
    # torch is already there and satisfies every requirement (accelerate: torch>=2.0), so pip
    # keeps it: no other torch build and no CUDA packages are pulled here.
    pip_install -e ".[test]"
}

cmd=${1:-}
shift || true
case "$cmd" in
    demo)
        choose_python; ensure_torch; ensure_project
        exec "$PY" -m gemini demo "$@" ;;
    test)
        choose_python; ensure_torch; ensure_project
        exec "$PY" -m pytest -q "$@" ;;
    *)
        echo "usage: bash scripts/dev.sh {demo|test} [args...]" >&2; exit 2 ;;
esac
