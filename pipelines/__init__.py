"""KFP pipelines of async-grpo: `grpo_pipeline.py` (source) and its compiled IR YAML (committed)."""
