"""The `distillation` section: on-policy distillation from a served teacher (Thinking Machines' "On-Policy
Distillation", 2025; TRL's GKD with ``lmbda=1``, the student's own samples; prime-rl, NeMo RL, verl, AReaL).

The student samples as in GRPO; a teacher model, served by vLLM, scores every sampled token (its prompt logprobs of
prompt + completion); each trained token's advantage gains ``distillation_weight x (log p_teacher - log p_student)``,
the negative per-token reverse KL (`algorithms.distillation`). Distillation is on when a teacher is given
(`teacher_url` or `teacher_model_name_or_path`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import policy_list, tenant, volume_path

TEACHER_API_KEY_ENV = "ASYNC_GRPO_TEACHER_API_KEY"  # the teacher's bearer token, when its server wants one
VLLM_DEFAULT_MAX_LOGPROBS = 20  # vLLM 0.32's --max-logprobs default (ModelConfig.max_logprobs): the largest K it serves


class DistillationConfig(Section):
    """On-policy distillation: the teacher that scores the student's sampled tokens, and the loss it adds."""

    teacher_model_name_or_path: str | None = Field(
        None,
        description="A model for the launcher to serve as the teacher on its own vLLM server (locally: another vLLM "
        "process, started before the run and stopped after it; on Kubernetes: the `<run>-teacher` Deployment); "
        "teacher_url then points at it. Give this or teacher_url, not both. The teacher must share the student's "
        "tokenizer (vocabulary and special tokens), checked before vLLM starts.",
        json_schema_extra=volume_path(),
    )
    teacher_url: str | None = Field(
        None,
        description="OpenAI-compatible base URL of a teacher that is already served by vLLM (e.g. "
        "http://127.0.0.1:8002/v1): it must answer `/completions` with `prompt_logprobs`. Its bearer token, if any, "
        f"comes from the env {TEACHER_API_KEY_ENV}.",
        json_schema_extra=policy_list("teacher_urls"),
    )
    teacher_model: str | None = Field(
        None,
        description="The teacher's served model id; None: the server's first model (GET /models).",
        json_schema_extra=tenant(),
    )
    distillation_loss: Literal["reverse_kl", "forward_kl"] = Field(
        "reverse_kl",
        description="The divergence the student minimizes on its own samples. reverse_kl: KL(student || teacher) "
        "estimated per sampled token as log p_student - log p_teacher and given to that token as an advantage "
        "(Thinking Machines' on-policy distillation; TRL GKD with lmbda=1, beta=1). forward_kl: KL(teacher || student) "
        "at every trained position over the teacher's distillation_topk most likely tokens (renormalized), added to the "
        "loss as TRL adds its KL term: dense, every position moves the student toward the teacher's whole top-k "
        "(NeMo RL's top-k distillation, kl_type=forward; TRL GKD with lmbda=1, beta=0, on the top-k).",
        json_schema_extra=tenant(),
    )
    distillation_topk: int = Field(
        20,
        ge=1,
        le=256,
        description="With distillation_loss: forward_kl, how many of the teacher's most likely tokens each position "
        "is compared on (vLLM prompt_logprobs=k; NeMo RL's topk_logits_k). A launched teacher is served with "
        "--max-logprobs of at least this; a teacher_url must allow it (vLLM's default is 20). The rollout queue holds 2 x k more numbers per completion "
        "token.",
        json_schema_extra=tenant(),
    )
    distillation_weight: float = Field(
        1.0,
        gt=0.0,
        description="Weight of the per-token distillation advantage, distillation_weight x (log p_teacher - "
        "log p_student) (Tinker's `kl_penalty_coef`), added to the GRPO advantage of each trained token (nats).",
        json_schema_extra=tenant(),
    )
    distillation_baseline: Literal["leave_one_out", "none"] = Field(
        "leave_one_out",
        description="What each token's distillation advantage is measured against: leave_one_out subtracts the mean "
        "per-token log p_teacher - log p_sampler of the other completions of its group (RLOO's baseline: it leaves the "
        "gradient's expectation unchanged and lowers its variance; algorithms/distillation.py); none keeps Tinker's "
        "plain log p_teacher - log p_student.",
        json_schema_extra=tenant(),
    )
    distillation_only: bool = Field(
        False,
        description="Train on the teacher's signal alone: the GRPO advantage is left out of the loss. Rewards are "
        "still computed, logged and evaluated, and groups whose rewards are all equal are still trained.",
        json_schema_extra=tenant(),
    )
    teacher_timeout_s: float = Field(
        60.0, gt=0.0, description="Timeout of one teacher request (seconds).", json_schema_extra=tenant()
    )
    teacher_max_retries: int = Field(
        2,
        ge=0,
        description="Retries of a teacher request after a connection error, a timeout or a 5xx answer; a group still "
        "unscored is dropped and counted (`drops/teacher_error`, `drops/teacher_timeout`) as a reward failure is.",
        json_schema_extra=tenant(),
    )
    teacher_max_concurrency: int = Field(
        8,
        ge=1,
        description="Teacher requests in flight at once (one request scores one whole group).",
        json_schema_extra=tenant(),
    )

    @property
    def topk(self) -> int:
        """The teacher's top-k logprobs each request asks for: `distillation_topk` with forward_kl, else 0 (only the
        sampled token's logprob, prompt_logprobs=0)."""
        return self.distillation_topk if self.distillation_loss == "forward_kl" else 0

    @property
    def teacher_serve_args(self) -> list[str]:
        """Flags a teacher the launcher serves needs beyond the launcher's own (as `GRPOConfig.vllm_serve_args` for
        the policy; locally `launch.local.start_teacher_server`, on Kubernetes `launch.k8s_teacher.teacher_command`):
        ``--max-logprobs K`` when the run asks for the teacher's K = `topk` most likely tokens and K is above vLLM's
        default of VLLM_DEFAULT_MAX_LOGPROBS (vLLM refuses a larger ``prompt_logprobs`` with HTTP 400); none
        otherwise."""
        return ["--max-logprobs", str(self.topk)] if self.topk > VLLM_DEFAULT_MAX_LOGPROBS else []

    @property
    def enabled(self) -> bool:
        """True when the run distills: a teacher is given (`teacher_url` or `teacher_model_name_or_path`)."""
        return bool(self.teacher_url or self.teacher_model_name_or_path)
