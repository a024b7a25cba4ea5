"""Trainer -> inference weight transport: vLLM's native control plane with an NCCL or gloo data plane."""
