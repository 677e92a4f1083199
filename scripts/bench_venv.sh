#!/usr/bin/env bash
# A virtual environment for the benchmarks' peers on a CPU machine: this project plus
# DeepSpeed, whose CPU Adam (its AVX kernel, JIT-built with g++ on first use) is the
# "DeepSpeed CPUAdam" row of benchmarks/bench_step.py.
#   bash scripts/bench_venv.sh [DIR]      # default DIR: ./.bench-venv (ignored by git)
#   DIR/bin/python benchmarks/bench_step.py
#
# torch is installed first and pinned: DeepSpeed asks only for torch>=2.0, and building it
# without isolation keeps pip from fetching another torch (a CUDA build of several GB) into
# its build environment. The op is built once here, into DIR/torch_extensions, so the first
# benchmark run does not spend a minute compiling (TORCH_EXTENSIONS_DIR must then point there).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.bench-venv}
TORCH_SPEC=${GEMINI_TORCH_SPEC:-torch==2.13.0}
[ -x "$DIR/bin/python" ] || python3 -m venv "$DIR"
PY="$DIR/bin/python"
"$PY" -m pip install -q $TORCH_SPEC
"$PY" -m pip install -q psutil nvidia-ml-py aiofiles pytest
"$PY" -m pip install -q --no-deps -e .
"$PY" -m pip install -q --no-build-isolation deepspeed
"$PY" -c 'import torch; assert not torch.version.cuda or torch.cuda.is_available(), torch.__version__'
export DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$(cd "$DIR" && pwd)/torch_extensions"
"$PY" -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()'
echo "ready: DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR $PY benchmarks/bench_step.py"
