"""The cross-field rules of a `GRPOConfig`, in one table (`RULES`).

A field's own range and type are its section's (pydantic `Field`s); what only two or more fields together can say
is a rule here: a short function that reads a validated config and returns the problem, with its "Fix: ...", or
None. `GRPOConfig`'s validator runs them in order and raises the first problem as a ValueError, which `load_config`
turns into a `ConfigError`. Each rule names the flat fields it reads (`Rule.fields`), so a test can check that they
exist and the docs can say which fields a rule ties together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from async_grpo.config.sections.peft import vllm_max_lora_rank
from async_grpo.config.sections.rewards import MAX_GUIDED_JUDGE_SCORE
from async_grpo.config.sections.tools import PYTHON_TOOL

if TYPE_CHECKING:
    from async_grpo.config.model import GRPOConfig


@dataclass(frozen=True)
class Rule:
    """One cross-field rule.

    Attributes:
        fields: the flat field names it reads.
        check: returns the problem (one message ending with its "Fix: ...") or None.
    """

    fields: tuple[str, ...]
    check: Callable[[GRPOConfig], str | None]

    @property
    def name(self) -> str:
        """The check's function name (what a test or a log names the rule by)."""
        return self.check.__name__


def whole_groups_per_step(c: GRPOConfig) -> str | None:
    """Every step holds whole groups (TRL's generation_batch_size rule)."""
    completions = c.batch.per_device_train_batch_size * c.batch.gradient_accumulation_steps
    g = c.sampling.num_generations
    if completions % g:
        return (
            f"per_device_train_batch_size x gradient_accumulation_steps = {completions} completions per step "
            f"is not a multiple of num_generations={g}; every step must hold whole "
            f"groups. Fix: set per_device_train_batch_size to a multiple of {g}."
        )
    return None


def one_weight_per_reward(c: GRPOConfig) -> str | None:
    """reward_weights, when given, has one entry per reward function (TRL)."""
    weights, funcs = c.rewards.reward_weights, c.rewards.reward_funcs
    if weights is not None and len(weights) != len(funcs):
        return (
            f"reward_weights has {len(weights)} entries but reward_funcs has "
            f"{len(funcs)}. Fix: give one weight per reward function, or drop reward_weights."
        )
    return None


def judge_is_reachable(c: GRPOConfig) -> str | None:
    """builtin:llm_judge needs a judge: a served one (judge_url) or one the launcher serves, not both."""
    r = c.rewards
    if "builtin:llm_judge" in r.reward_funcs and not (r.judge_url or r.judge_model_name_or_path):
        return (
            "reward_funcs has builtin:llm_judge but judge_url is not set. Fix: set judge_url to the judge's "
            "OpenAI-compatible base URL, e.g. http://127.0.0.1:8001/v1, or judge_model_name_or_path to a model "
            "the launcher serves as the judge."
        )
    if r.judge_url and r.judge_model_name_or_path:
        return (
            "judge_url and judge_model_name_or_path are both set. Fix: give judge_url for a judge that is "
            "already served, or judge_model_name_or_path for one the launcher serves, not both."
        )
    return None


def judge_rubric_and_scale(c: GRPOConfig) -> str | None:
    """The judge's rubric holds both placeholders; a guided score needs whole numbers up to MAX_GUIDED_JUDGE_SCORE."""
    r = c.rewards
    if "builtin:llm_judge" not in r.reward_funcs:
        return None
    missing = [p for p in ("{prompt}", "{completion}") if p not in r.judge_rubric]
    if missing:
        return f"judge_rubric has no {' or '.join(missing)}. Fix: put both placeholders in the rubric."
    if r.judge_guided_score and (
        r.judge_max_score != int(r.judge_max_score) or r.judge_max_score > MAX_GUIDED_JUDGE_SCORE
    ):
        return (
            f"judge_max_score={r.judge_max_score:g} with judge_guided_score: the scale must be whole "
            f"numbers up to {MAX_GUIDED_JUDGE_SCORE}. Fix: set judge_max_score to an integer, or judge_guided_score: "
            "false."
        )
    return None


def is_clip_below_cap(c: GRPOConfig) -> str | None:
    """The IS correction's lower clip lies below its cap."""
    off = c.off_policy
    if off.vllm_importance_sampling_clip_min is not None and (
        off.vllm_importance_sampling_clip_min >= off.vllm_importance_sampling_cap
    ):
        return (
            "vllm_importance_sampling_clip_min must be below vllm_importance_sampling_cap. "
            "Fix: lower clip_min or raise the cap."
        )
    return None


def liger_supports_the_loss(c: GRPOConfig) -> str | None:
    """liger-kernel 0.8.5 has no sequence-level importance sampling for cispo or sapo."""
    loss = c.loss
    if loss.use_liger_kernel and loss.importance_sampling_level == "sequence" and loss.loss_type in ("cispo", "sapo"):
        return (
            f"use_liger_kernel: liger-kernel 0.8.5 has no sequence-level importance sampling for "
            f"loss_type={loss.loss_type}. Fix: set use_liger_kernel=false or importance_sampling_level=token."
        )
    return None


def fsdp_runs_the_same_passes(c: GRPOConfig) -> str | None:
    """FSDP shards the LM head and runs the same passes on every rank."""
    compute = c.compute
    if compute.fsdp and (
        compute.logprob_chunk_size is not None or c.loss.use_liger_kernel or compute.skip_zero_advantage_batches
    ):
        return (
            "fsdp shards the LM head and runs the same passes on every rank, so it cannot combine with "
            "logprob_chunk_size, use_liger_kernel or skip_zero_advantage_batches. Fix: unset those, or set "
            "fsdp=false."
        )
    return None


def prompt_sharing_layout(c: GRPOConfig) -> str | None:
    """share_prompt_prefix=true needs the plain padded micro-batch layout without checkpointing or fsdp (auto falls
    back to the padded layout there)."""
    compute = c.compute
    if compute.share_prompt_prefix is not True:
        return None
    named = (("gradient_checkpointing", compute.gradient_checkpointing), ("batch_flattening", compute.batch_flattening),
             ("fsdp", compute.fsdp))  # fmt: skip
    clashes = [name for name, on in named if on]
    if clashes:
        return (
            f"share_prompt_prefix cannot combine with {', '.join(clashes)} (transformers drops the shared "
            "prompt's KV cache inside checkpointed layers; flattening is another micro-batch layout; fsdp is "
            f"not supported with it yet). Fix: set share_prompt_prefix=false, or {', '.join(clashes)}=false."
        )
    return None


def cispo_caps_above_one(c: GRPOConfig) -> str | None:
    """CISPO's cap epsilon_high must exceed 1 (ScaleRL, arXiv 2510.13786)."""
    if c.loss.loss_type == "cispo" and c.epsilon_high_value < 1.0:
        return (
            f"loss_type=cispo caps the importance ratio itself at epsilon_high (epsilon_max of ScaleRL, "
            f"arXiv 2510.13786), but epsilon_high is {c.epsilon_high_value}: every on-policy ratio of 1 would "
            "be clamped, which only shrinks the learning rate. Fix: set epsilon_high, e.g. 5.0 (ScaleRL's and "
            "TRL's recommendation)."
        )
    return None


def skipping_keeps_the_kl(c: GRPOConfig) -> str | None:
    """A skipped zero-advantage micro-batch would lose its KL term."""
    if c.compute.skip_zero_advantage_batches and c.loss.beta > 0:
        return (
            "skip_zero_advantage_batches needs beta=0: a skipped micro-batch would lose its KL term. "
            "Fix: set beta=0 or skip_zero_advantage_batches=false."
        )
    return None


def replay_has_work(c: GRPOConfig) -> str | None:
    """Dynamic sampling lets no zero-std group in, so a replay buffer would replace nothing."""
    if c.batch_shaping.replay_buffer_size > 0 and c.batch_shaping.dynamic_sampling:
        return (
            "replay_buffer_size > 0 has no effect with dynamic_sampling=true: dynamic sampling never lets a "
            "zero-std group into a batch, so there is nothing to replace. Fix: set replay_buffer_size=0 or "
            "dynamic_sampling=false."
        )
    return None


def streaming_chunks_fit(c: GRPOConfig) -> str | None:
    """streaming_min_groups divides the step into chunks of whole micro-batches, with group scaling and no reuse."""
    k = c.producer.streaming_min_groups
    if k is None:
        return None
    problems = []
    if c.groups_per_step % k:
        problems.append(f"groups_per_step={c.groups_per_step} is not a multiple of it")
    if (k * c.sampling.num_generations) % c.batch.per_device_train_batch_size:
        problems.append(
            f"a chunk of {k * c.sampling.num_generations} completions is not a multiple of per_device_train_batch_size="
            f"{c.batch.per_device_train_batch_size} (micro-batches would straddle chunks)"
        )
    if c.rewards.scale_rewards == "batch":
        problems.append("scale_rewards=batch needs the whole step's rewards before any advantage")
    if c.rewards.multi_objective_aggregation == "normalize_then_sum":
        problems.append("normalize_then_sum z-scores across the whole step")
    if c.rollout_reuse > 1:
        problems.append("steps_per_generation/mini_epochs/num_iterations > 1 reuse a complete rollout")
    if problems:
        return (
            f"streaming_min_groups={k}: " + "; ".join(problems) + ". Fix: pick a divisor of groups_per_step "
            "whose completions fill whole micro-batches, and group scaling without reuse, or unset "
            "streaming_min_groups."
        )
    return None


def streaming_overlaps_generation(c: GRPOConfig) -> str | None:
    """Streaming overlaps training with generation; time_slice pauses generation while the trainer computes."""
    if c.producer.streaming_min_groups is not None and c.inference.resource_sharing == "time_slice":
        return (
            "streaming_min_groups overlaps training with generation, and resource_sharing=time_slice "
            "pauses generation while the trainer computes. Fix: set resource_sharing: overlap (or "
            "auto), or unset streaming_min_groups."
        )
    return None


def user_producer_replaces_the_orchestrator(c: GRPOConfig) -> str | None:
    """A user data_producer replaces the builtin orchestrator and its rollouts: batch shaping, streaming, tools and
    environments live there."""
    if c.producer.data_producer is None:
        return None
    s = c.batch_shaping
    if s.dynamic_sampling or s.replay_buffer_size or s.reroll_start_fraction < 1.0 or c.producer.streaming_min_groups:
        return (
            "data_producer replaces the builtin orchestrator, which is where dynamic_sampling, "
            "replay_buffer_size, reroll_start_fraction and streaming_min_groups live. Fix: turn those off or "
            "implement them in your producer."
        )
    if c.tools.tools:
        return (
            "tools run inside the builtin multi-turn rollout, which data_producer replaces. Fix: unset "
            "data_producer, or run the tools in your own producer and unset tools."
        )
    if c.environments.environment is not None:
        return (
            "environment runs inside the builtin environment rollout, which data_producer replaces. Fix: unset "
            "data_producer, or drive the environment in your own producer and unset environment."
        )
    return None


def one_agent_drives_the_episodes(c: GRPOConfig) -> str | None:
    """An agent (`agent` or `agent_command`) runs each episode itself against the model endpoint: one agent per run,
    and no environment, tools or user data_producer beside it (their rollouts, and a producer's, would replace it)."""
    a = c.agents
    if a.agent is not None and a.agent_command is not None:
        return (
            "agent and agent_command are both set; a run trains one agent. Fix: keep agent (a Python function) or "
            "agent_command (a program), and unset the other."
        )
    field = "agent" if a.agent is not None else "agent_command" if a.agent_command is not None else None
    if field is None:
        return None
    if c.environments.environment is not None:
        return (
            f"{field} and environment are both set; the agent runs its own episodes against the model endpoint, so no "
            f"environment rollout would run. Fix: unset environment (the agent drives its own environment), or unset "
            f"{field}."
        )
    if c.tools.tools:
        return (
            f"{field} and tools are both set; the agent runs its own episodes, sending its own tool definitions with "
            f"its model calls and running the tools itself. Fix: unset tools (give the tools to the agent), or unset "
            f"{field}."
        )
    if c.producer.data_producer is not None:
        return (
            f"{field} and data_producer are both set; data_producer replaces the builtin orchestrator, which is what "
            f"runs the agent's episodes. Fix: unset data_producer, or unset {field}."
        )
    return None


def determinism_launches_by_schedule(c: GRPOConfig) -> str | None:
    """Under full_determinism the schedule, not the outcome of earlier groups, picks the next launch."""
    s = c.batch_shaping
    if c.full_determinism and (s.dynamic_sampling or s.reroll_start_fraction < 1.0):
        return (
            "full_determinism with dynamic_sampling or reroll_start_fraction < 1: which prompt is launched next "
            "would depend on when earlier groups finished scoring. Fix: set dynamic_sampling=false and "
            "reroll_start_fraction=1.0, or full_determinism=false."
        )
    return None


def one_warmup_knob(c: GRPOConfig) -> str | None:
    """warmup_ratio (transformers 4) and warmup_steps (5) are two spellings of one setting."""
    if c.optim.warmup_ratio and c.optim.warmup_steps:
        return (
            f"warmup_ratio={c.optim.warmup_ratio} and warmup_steps={c.optim.warmup_steps} are both "
            "set. Fix: keep one (warmup_steps below 1 is a fraction of max_steps)."
        )
    return None


def overlong_penalty_has_its_buffer(c: GRPOConfig) -> str | None:
    """DAPO's soft overlong punishment: the reward and its buffer go together, the buffer below the length."""
    r = c.rewards
    overlong = "builtin:soft_overlong_penalty" in r.reward_funcs
    if overlong != (r.overlong_buffer_len is not None):
        return (
            "builtin:soft_overlong_penalty and overlong_buffer_len go together (DAPO's soft overlong "
            "punishment). Fix: set both, or neither."
        )
    if overlong and r.overlong_buffer_len >= c.sampling.max_completion_length:
        return (
            f"overlong_buffer_len={r.overlong_buffer_len} must be below max_completion_length="
            f"{c.sampling.max_completion_length}. Fix: e.g. a quarter of max_completion_length."
        )
    return None


def room_for_a_prompt(c: GRPOConfig) -> str | None:
    """vLLM's context holds a prompt beside the longest completion."""
    if c.sampling.max_completion_length + 8 > c.inference.vllm_max_model_len:
        return (
            f"max_completion_length={c.sampling.max_completion_length} leaves no room for a prompt within "
            f"vllm_max_model_len={c.inference.vllm_max_model_len}. Fix: raise vllm_max_model_len."
        )
    return None


def rollback_has_a_checkpoint(c: GRPOConfig) -> str | None:
    """on_collapse=rollback goes back to a checkpoint, and not into the same schedule."""
    if c.checkpoint.on_collapse != "rollback":
        return None
    if not c.checkpoint.save_steps:
        return (
            "on_collapse=rollback goes back to a checkpoint, but save_steps is 0 (none is written). Fix: set "
            "save_steps (e.g. the eval_steps), or on_collapse: stop."
        )
    if c.full_determinism:
        return (
            "on_collapse=rollback with full_determinism: the restored run would replay the same schedule into the "
            "same collapse. Fix: on_collapse: stop (and look at the collapsing schedule), or full_determinism: false."
        )
    return None


def python_tool_reports_its_timeout(c: GRPOConfig) -> str | None:
    """builtin:python stops its sandbox before the tool worker's own limit, so it can report the timeout."""
    t = c.tools
    if PYTHON_TOOL in t.tools and t.python_tool_timeout_s >= t.tool_timeout_s:
        return (
            f"python_tool_timeout_s={t.python_tool_timeout_s:g} must be below tool_timeout_s={t.tool_timeout_s:g}: "
            "builtin:python stops its sandbox at python_tool_timeout_s and needs time to report it before the "
            "worker's own limit. Fix: e.g. tool_timeout_s: python_tool_timeout_s + 2."
        )
    return None


def lora_sync_has_an_adapter(c: GRPOConfig) -> str | None:
    """vllm_lora_sync pushes a LoRA adapter that vLLM can load; LoRA runs without fsdp."""
    p = c.peft
    if p.vllm_lora_sync and not p.use_peft:
        return (
            "peft.vllm_lora_sync pushes a LoRA adapter, but use_peft is false, so there is none. Fix: "
            "set use_peft: true, or remove vllm_lora_sync."
        )
    if p.use_peft and c.compute.fsdp:
        return (
            "peft.use_peft with fsdp is not supported (the adapter is small: every rank holds a full "
            "replica). Fix: set fsdp: false, or use_peft: false."
        )
    if p.vllm_lora_sync:
        try:
            vllm_max_lora_rank(p.lora_r)
        except ValueError as err:
            return str(err)
    return None


def distillation_has_one_teacher(c: GRPOConfig) -> str | None:
    """On-policy distillation (the `distillation` section) needs one teacher, temperature 1 (the teacher's logprobs
    are vLLM prompt logprobs, which vLLM computes at temperature 1 whatever the request's temperature: measured on
    vLLM 0.32), the unfused loss (its advantage is per token), and the builtin orchestrator (it asks the teacher)."""
    d = c.distillation
    if d.teacher_url and d.teacher_model_name_or_path:
        return (
            "teacher_url and teacher_model_name_or_path are both set. Fix: give teacher_url for a teacher that is "
            "already served, or teacher_model_name_or_path for one the launcher serves, not both."
        )
    if not d.enabled:
        if d.distillation_only:
            return (
                "distillation_only is true but no teacher is given. Fix: set teacher_model_name_or_path (a model the "
                "launcher serves) or teacher_url (a served teacher), or distillation_only: false."
            )
        return None
    if c.sampling.temperature != 1.0:
        return (
            f"temperature={c.sampling.temperature:g} with a teacher: the teacher's logprobs are vLLM prompt "
            "logprobs, which vLLM computes at temperature 1, so the reverse KL would compare distributions at two "
            "temperatures. Fix: set temperature: 1.0 for distillation."
        )
    if c.loss.use_liger_kernel:
        return (
            "use_liger_kernel with a teacher: the fused loss takes one advantage per completion, and distillation "
            "gives one per token. Fix: set use_liger_kernel: false."
        )
    if c.producer.data_producer:
        return (
            "data_producer with a teacher: a user producer replaces the orchestrator that asks the teacher. Fix: "
            "drop data_producer, or the teacher fields."
        )
    if d.distillation_only and (c.batch_shaping.dynamic_sampling or c.batch_shaping.replay_buffer_size):
        return (
            "distillation_only with dynamic_sampling or replay_buffer_size: both replace groups whose rewards tie, "
            "which distillation alone still learns from (every token carries the teacher's signal). Fix: set "
            "dynamic_sampling: false and replay_buffer_size: 0."
        )
    return None


RULES: tuple[Rule, ...] = (
    Rule(("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations"), whole_groups_per_step),
    Rule(("reward_weights", "reward_funcs"), one_weight_per_reward),
    Rule(("reward_funcs", "judge_url", "judge_model_name_or_path"), judge_is_reachable),
    Rule(("reward_funcs", "judge_rubric", "judge_guided_score", "judge_max_score"), judge_rubric_and_scale),
    Rule(("vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap"), is_clip_below_cap),
    Rule(("use_liger_kernel", "importance_sampling_level", "loss_type"), liger_supports_the_loss),
    Rule(("fsdp", "logprob_chunk_size", "use_liger_kernel", "skip_zero_advantage_batches"), fsdp_runs_the_same_passes),
    Rule(("share_prompt_prefix", "gradient_checkpointing", "batch_flattening", "fsdp"), prompt_sharing_layout),
    Rule(("loss_type", "epsilon_high"), cispo_caps_above_one),
    Rule(("skip_zero_advantage_batches", "beta"), skipping_keeps_the_kl),
    Rule(("replay_buffer_size", "dynamic_sampling"), replay_has_work),
    Rule(
        (
            "streaming_min_groups",
            "per_device_train_batch_size",
            "num_generations",
            "scale_rewards",
            "multi_objective_aggregation",
            "steps_per_generation",
            "mini_epochs",
            "num_iterations",
        ),
        streaming_chunks_fit,
    ),  # fmt: skip
    Rule(("streaming_min_groups", "resource_sharing"), streaming_overlaps_generation),
    Rule(
        (
            "data_producer",
            "dynamic_sampling",
            "replay_buffer_size",
            "reroll_start_fraction",
            "streaming_min_groups",
            "tools",
            "environment",
        ),
        user_producer_replaces_the_orchestrator,
    ),  # fmt: skip
    Rule(("agent", "agent_command", "environment", "tools", "data_producer"), one_agent_drives_the_episodes),
    Rule(("full_determinism", "dynamic_sampling", "reroll_start_fraction"), determinism_launches_by_schedule),
    Rule(("warmup_ratio", "warmup_steps"), one_warmup_knob),
    Rule(("reward_funcs", "overlong_buffer_len", "max_completion_length"), overlong_penalty_has_its_buffer),
    Rule(("max_completion_length", "vllm_max_model_len"), room_for_a_prompt),
    Rule(("on_collapse", "save_steps", "full_determinism"), rollback_has_a_checkpoint),
    Rule(("tools", "python_tool_timeout_s", "tool_timeout_s"), python_tool_reports_its_timeout),
    Rule(("vllm_lora_sync", "use_peft", "fsdp", "lora_r"), lora_sync_has_an_adapter),
    Rule(
        (
            "teacher_url",
            "teacher_model_name_or_path",
            "distillation_only",
            "temperature",
            "use_liger_kernel",
            "data_producer",
            "dynamic_sampling",
            "replay_buffer_size",
        ),
        distillation_has_one_teacher,
    ),  # fmt: skip
)


def check_rules(config: GRPOConfig) -> None:
    """Run `RULES` in order.

    Raises:
        ValueError: the first rule's problem (its message names the fields and the fix).
    """
    for rule in RULES:
        problem = rule.check(config)
        if problem is not None:
            raise ValueError(problem)
