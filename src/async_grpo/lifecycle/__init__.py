"""The model's life across runs: the registry and its champion (`registry`), the promotion gate (`promotion`), the
tags a registered version carries (`lineage`), a run started from a registered version (`registry_start`: a
`models:/` model downloaded before anything starts; not the supervised warm start, `warmup_sft_steps`), and one MLflow
parent run per pipeline run (`pipeline_tracking`)."""
