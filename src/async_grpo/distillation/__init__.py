"""On-policy distillation's side of the rollout (issue 52): a served teacher scores every token the student sampled.

`teacher.TeacherClient` asks a vLLM teacher for the prompt logprobs of prompt + completion (one batched
`/completions` request per group, retried and timed out; failures are `RewardError`s, so the orchestrator drops and
counts them as it does a failed reward). `rollout.TeacherRollout` wraps the run's training rollout: after each group is
generated and scored it fills `RolloutGroup.teacher_logprobs` and `teacher_seconds`; `rollout.with_teacher` builds it
from the `distillation` config section (the builders wrap only the orchestrator's rollout: held-out evaluation never
asks the teacher). The per-token advantage the teacher's logprobs feed is the trainer's (`algorithms`).
"""
