"""Launch backends: `local` runs every role on this machine (vLLM subprocess, reward pool, trainer)."""
