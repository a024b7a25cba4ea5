"""Trainer role: recompute logprobs, correct for stale rollouts, optimize, and push weights to vLLM."""
