"""Inference role: launch a real `vllm serve` and talk to it over HTTP (generation and control plane)."""
