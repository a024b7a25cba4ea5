"""Orchestrator role: generate groups on vLLM, score them, stamp policy versions, fill the rollout queue."""
