"""TrainState: a checkpoint round trip restores the learner, the optimizer, the sampler, the batch-shaping state,
the counters and the RNG streams bit for bit, and a half-written checkpoint never looks complete."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from async_grpo.config import GRPOConfig
from async_grpo.data import PromptItem, PromptSampler
from async_grpo.orchestrator.batch_shaping import ReplayBuffer, RerollQueue
from async_grpo.orchestrator.orchestrator import Orchestrator
from async_grpo.orchestrator.producer import ProducerConfig, VLLMProducer
from async_grpo.orchestrator.rollout import SamplingSettings
from async_grpo.runner.builders import build_local_learner
from async_grpo.runner.recipe import GRPORecipe
from async_grpo.runner.state import STATE_FILE, TrainState, load_checkpoint, save_checkpoint
from async_grpo.tiny_model import build_tiny_tokenizer
from async_grpo.trainer.distributed import DistInfo
from async_grpo.trainer.protocol import Learner
from async_grpo.transports.drops import DropCounter
from async_grpo.transports.messages import RolloutGroup, TrainBatch
from async_grpo.transports.policy_version import PolicyVersion
from async_grpo.transports.queue import RolloutQueue

PAD = 256


def group(prompt: int, rewards: list[float], advantages: list[float]) -> RolloutGroup:
    comps = [[30 + prompt, 31 + i] for i in range(len(rewards))]
    return RolloutGroup(
        prompt_ids=[prompt, prompt + 1],
        completion_ids=comps,
        sampling_logprobs=[[-0.7, -0.9] for _ in comps],
        truncated=[False] * len(comps),
        completions=["ab"] * len(comps),
        prompt=f"p{prompt}",
        columns={},
        policy_version=0,
        rewards_per_func=[[r] for r in rewards],
        rewards=rewards,
        advantages=advantages,
    )


def recipe_with_roles(tiny_model, config: GRPOConfig, seed: int) -> GRPORecipe:
    """A recipe whose roles are built by hand (no vLLM, no MLflow): what `state()` / `restore()` read and write.
    Its producer is the builtin one (an orchestrator with a replay buffer and a re-roll FIFO, never started)."""
    recipe = GRPORecipe(config, DistInfo())
    recipe.tokenizer = build_tiny_tokenizer()
    recipe.learner = build_local_learner(config, tiny_model, PAD)
    items = [PromptItem(f"p{i}", [i], {}) for i in range(5)]
    version, drops = PolicyVersion(0), DropCounter()
    queue = RolloutQueue(maxsize=2, max_staleness=1, drops=drops)
    orchestrator = Orchestrator(
        client_factory=lambda: None, prompts=PromptSampler(items, seed), rollout=None,
        sampling=SamplingSettings(num_generations=2, max_completion_length=4, temperature=1.0),
        reward_names=["r"], reward_weights=[1.0], scale_rewards="group", groups_per_step=2, max_staleness=1,
        vllm_sync_interval=1, max_inflight_groups=2, queue=queue, version=version, drops=drops,
        replay=ReplayBuffer(3, random.Random(seed)), reroll=RerollQueue(start_step=2, max_per_batch=1),
    )  # fmt: skip
    recipe.producer = VLLMProducer(orchestrator, queue, version, ProducerConfig())
    return recipe


def test_checkpoint_round_trip_is_bit_identical(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    config = GRPOConfig(per_device_train_batch_size=4, num_generations=2, learning_rate=1e-3, seed=3)
    load = lambda: AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)  # noqa: E731
    original = recipe_with_roles(load(), config, seed=3)
    assert isinstance(original.learner, Learner)
    batch = TrainBatch(groups=[group(1, [1.0, 0.0], [0.7, -0.7]), group(2, [0.5, 0.0], [0.7, -0.7])])
    original.learner.step(batch)  # AdamW now has moments and a step count
    orch = original.producer.orchestrator
    drawn = [next(orch.prompts) for _ in range(7)]  # mid second epoch
    original.producer.mark_trained([dataclasses.replace(batch.groups[0], prompt_ids=i.prompt_ids) for i in drawn])
    orch.replay.add(group(3, [1.0, 0.0], [0.7, -0.7]))
    orch.reroll.offer(PromptItem("zero", [9], {}), [[0.0], [0.0]], [1.0])
    original.step, original.generation_rounds = 1, 1
    original.version.reset(1)
    original.drops.add("stale", 4)
    torch.manual_seed(11), random.seed(12), np.random.seed(13)

    path = original.save_checkpoint(tmp_path / "ckpt")
    expected_draws = (torch.rand(3), random.random(), np.random.rand())
    expected_prompts = [next(orch.prompts).prompt for _ in range(9)]
    expected_replay = orch.replay.sample(4)

    resumed = recipe_with_roles(load(), config, seed=99)  # a different seed: everything must come from the file
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    resumed.load_checkpoint(path)

    for (name, a), (_, b) in zip(
        original.learner.model.state_dict().items(), resumed.learner.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    opt_a, opt_b = original.learner.optimizer.state_dict(), resumed.learner.optimizer.state_dict()
    assert opt_a["param_groups"] == opt_b["param_groups"]
    for key in opt_a["state"]:
        for field_name, value in opt_a["state"][key].items():
            assert torch.equal(value, opt_b["state"][key][field_name]), (key, field_name)
    assert (resumed.step, resumed.generation_rounds, resumed.version.value) == (1, 1, 1)
    assert resumed.drops.snapshot() == {"stale": 4}
    # the orchestrator paces from the rollouts trained; the stale drops were launched before the resume
    r_orch = resumed.producer.orchestrator
    assert resumed.producer.launched_total == 4 and r_orch._paced_launches() == 1 * 2  # 1 rollout of 2 groups
    draws = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], expected_draws[0]) and draws[1:] == expected_draws[1:]
    assert [next(r_orch.prompts).prompt for _ in range(9)] == expected_prompts
    assert [g.prompt for g in r_orch.replay.sample(4)] == [g.prompt for g in expected_replay]
    assert r_orch.reroll.take(step=2, batch_index=0).prompt == "zero"
    # the same next step from both: identical updates
    nxt = TrainBatch(groups=[group(4, [1.0, 0.0], [0.7, -0.7])])
    original.learner.step(nxt), resumed.learner.step(nxt)
    for a, b in zip(original.learner.model.parameters(), resumed.learner.model.parameters(), strict=True):
        assert torch.equal(a, b)
    # the model folder inside the checkpoint is a loadable Hugging Face model
    reloaded = AutoModelForCausalLM.from_pretrained(path / "model", dtype=torch.float32)
    saved = load_checkpoint(path).learner["model"]
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


def test_a_failed_write_leaves_no_checkpoint(tmp_path):
    def broken_model_writer(folder):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(TrainState(step=5), tmp_path / "ckpt", write_model=broken_model_writer)
    assert list(tmp_path.iterdir()) == []  # neither the checkpoint nor its temporary folder
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        load_checkpoint(tmp_path / "ckpt")
    save_checkpoint(TrainState(step=5), tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / STATE_FILE).is_file() and load_checkpoint(tmp_path / "ckpt").step == 5


def _rewrite_state(folder, edit) -> None:
    """Load the folder's train_state.pt as a plain dict, apply `edit` to it, and write it back."""
    data = torch.load(folder / STATE_FILE, weights_only=False)
    edit(data)
    torch.save(data, folder / STATE_FILE)


def test_a_checkpoint_carries_its_format_version_and_one_of_another_version_is_refused(tmp_path):
    """Issue 49: train_state.pt and meta.json name the format version; another version is refused when loaded and,
    from meta.json alone, by preflight before anything starts, each naming the version and the fix."""
    import json

    from async_grpo.checkpoint_layout import FORMAT_VERSION, META_FILE, format_mismatch
    from async_grpo.config import load_config
    from async_grpo.preflight.static import check_resume_checkpoint
    from async_grpo.runner.state import CheckpointFormatError

    path = save_checkpoint(TrainState(step=3), tmp_path / "checkpoint-3")
    assert json.loads((path / META_FILE).read_text())["format_version"] == FORMAT_VERSION
    assert torch.load(path / STATE_FILE, weights_only=False)["format_version"] == FORMAT_VERSION
    assert format_mismatch(path) is None and load_checkpoint(path).step == 3

    _rewrite_state(path, lambda d: d.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(
        CheckpointFormatError, match=rf"format version {FORMAT_VERSION + 1}; .*reads versions 1-{FORMAT_VERSION}\. Fix:"
    ):
        load_checkpoint(path)
    meta = json.loads((path / META_FILE).read_text())
    (path / META_FILE).write_text(json.dumps({**meta, "format_version": FORMAT_VERSION + 1}))
    config = load_config(None, [f"output_dir={tmp_path}", f"resume_from_checkpoint={path}"])
    (problem,) = check_resume_checkpoint(config)
    assert problem.field == "checkpoint.resume_from_checkpoint" and f"version {FORMAT_VERSION + 1}" in problem.message


def test_a_version_1_checkpoint_resumes_with_its_rollouts_counted_as_generation_rounds(tmp_path):
    """Format version 2 renamed `rollouts` (the `produce` calls trained, axolotl's name) to `generation_rounds`: a
    version-1 checkpoint, written before the rename, is carried forward by `UPGRADES` and passes preflight."""
    import json

    from async_grpo.checkpoint_layout import META_FILE, format_mismatch

    path = save_checkpoint(TrainState(step=6, generation_rounds=3, num_tokens=90), tmp_path / "checkpoint-6")
    _rewrite_state(path, lambda d: (d.update(format_version=1), d.update(rollouts=d.pop("generation_rounds"))))
    (path / META_FILE).write_text(json.dumps({**json.loads((path / META_FILE).read_text()), "format_version": 1}))
    assert format_mismatch(path) is None
    restored = load_checkpoint(path)
    assert (restored.step, restored.generation_rounds, restored.num_tokens) == (6, 3, 90)


def test_a_checkpoint_with_other_keys_or_damaged_is_refused_and_an_unversioned_one_with_these_keys_resumes(tmp_path):
    """A checkpoint written before versioning resumes when its keys are this version's fields; missing or unknown
    keys, a field of the wrong type and a truncated file are refused before anything is restored, naming them."""
    from async_grpo.runner.state import CheckpointFormatError

    path = save_checkpoint(TrainState(step=4, policy_version=4, generation_rounds=2), tmp_path / "checkpoint-4")
    _rewrite_state(path, lambda d: (d.pop("format_version"), d.update(rollouts=d.pop("generation_rounds"))))
    assert (load_checkpoint(path).policy_version, load_checkpoint(path).generation_rounds) == (4, 2)  # version 1

    _rewrite_state(path, lambda d: (d.pop("schedule"), d.update(sampler_v2={})))
    with pytest.raises(
        CheckpointFormatError, match=r"no format version.*missing \['schedule'\], unknown \['sampler_v2'\]"
    ):
        load_checkpoint(path)

    path = save_checkpoint(TrainState(step=4), tmp_path / "checkpoint-5")
    _rewrite_state(path, lambda d: d.update(step=-1))
    with pytest.raises(CheckpointFormatError, match=r"step=-1 is not a non-negative integer"):
        load_checkpoint(path)

    path = save_checkpoint(TrainState(step=4), tmp_path / "checkpoint-6")
    data = (path / STATE_FILE).read_bytes()
    (path / STATE_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFormatError, match=r"cannot be read .*damaged.* Fix: resume from an earlier"):
        load_checkpoint(path)
