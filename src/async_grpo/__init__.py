"""async-grpo: asynchronous GRPO post-training of LLMs with vLLM rollouts, launched by Kubeflow."""

__version__ = "0.1.0"
