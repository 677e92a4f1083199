#!/usr/bin/env bash
# One entry point that sets up a fresh machine and runs the demo or the tests.
#   bash scripts/dev.sh demo    # install what is missing, train a short demo
#   bash scripts/dev.sh test    # install what is missing, run the test suite
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

ensure_torch() {
    if "$PY" -c "import torch" 2>/dev/null; then return; fi
    # A plain `pip install torch` on a machine without a GPU pulls several GB of CUDA
    # packages; ask for the CPU build there. GEMINI_TORCH_SPEC overrides the choice.
    local spec=${GEMINI_TORCH_SPEC:-}
    if [ -z "$spec" ]; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            spec="torch"
        else
            spec="torch==2.13.0"
        fi
    fi
    echo "[dev.sh] installing $spec"
    "$PY" -m pip install -q "$spec"
}

ensure_project() {
    if "$PY" -c "import gemini, chunks, offload, tracer, psutil, aiofiles, pynvml, pytest" 2>/dev/null \
        && "$PY" -c "import gemini, os, sys; sys.exit(0 if os.path.dirname(os.path.dirname(gemini.__file__)) == os.getcwd() else 1)" 2>/dev/null; then
        return
    fi
    echo "[dev.sh] installing gemini-offload (editable) with test extras"
    "$PY" -m pip install -q -e ".[test]"
}

cmd=${1:-}
shift || true
case "$cmd" in
    demo)
        ensure_torch; ensure_project
        exec "$PY" -m gemini demo "$@" ;;
    test)
        ensure_torch; ensure_project
        exec "$PY" -m pytest -q "$@" ;;
    *)
        echo "usage: bash scripts/dev.sh {demo|test} [args...]" >&2; exit 2 ;;
esac
