"""LoRA (use_peft) on the tiny model: only the adapter trains, the merged push equals peft's merge_and_unload, the
KL reference is the base model, the learner state round-trips, and the final model is a plain merged HF folder."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from async_grpo.algorithms import LossSettings
from async_grpo.config import GRPOConfig
from async_grpo.runner import peft_setup
from async_grpo.runner.builders import build_local_learner
from async_grpo.trainer.peft import ADAPTER_FOLDER, MergedLoRASource, PeftLearner, wrap_with_lora
from async_grpo.transports.weights.lora import adapter_name
from tests.trainer.test_trainer import PAD, on_policy_batch

TARGETS = ["q_proj", "v_proj", "gate_proj"]


def lora_learner(model, lr=1e-2, **loss_kw) -> PeftLearner:
    wrapped = wrap_with_lora(model, r=4, alpha=8, dropout=0.0, target_modules=TARGETS)
    return PeftLearner(
        wrapped,
        learning_rate=lr,
        weight_decay=0.0,
        max_grad_norm=1.0,
        micro_batch_size=2,
        loss=LossSettings(**loss_kw),
        pad_token_id=PAD,
    )


def test_only_adapter_parameters_train(tiny_model):
    base = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    learner = lora_learner(tiny_model)
    trainable = learner.trainable_parameters()
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimized = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in trainable.values()}  # AdamW holds the adapter only
    before = {n: p.detach().clone() for n, p in trainable.items()}
    batch = on_policy_batch(tiny_model)
    for _ in range(2):
        learner.step(batch)
    assert any(not torch.equal(before[n], p) for n, p in trainable.items())  # the adapter moved
    for name, param in learner.model.get_base_model().named_parameters():
        if ".lora_" not in name:
            assert torch.equal(param, base[name.replace(".base_layer.", ".")]), name  # the base did not


def test_merged_push_equals_merge_and_unload_and_leaves_training_weights(tiny_model):
    learner = lora_learner(tiny_model)
    with torch.no_grad():  # a non-zero adapter (B starts at 0)
        for param in learner.trainable_parameters().values():
            param.normal_(0, 0.1)
    snapshot = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    source = learner.named_parameters_for_push()
    pushed = dict(iter(source))
    reference = copy.deepcopy(learner.model).merge_and_unload()
    expected = dict(reference.named_parameters())
    assert list(pushed) == [m.name for m in source.metadata()] == list(expected)  # base (HF) names, same order
    for name, tensor in pushed.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
    base = learner.model.get_base_model()
    for name in [n for n in pushed if n.endswith((".q_proj.weight", ".gate_proj.weight"))]:
        assert not torch.equal(pushed[name], base.get_parameter(name.replace(".weight", ".base_layer.weight")))
    for name, param in learner.model.named_parameters():
        assert torch.equal(param, snapshot[name]), name  # merging on the fly changed nothing
    assert source.nbytes() == sum(t.numel() * t.element_size() for t in pushed.values())


def test_kl_reference_is_the_base_model_with_adapters_off(tiny_model):
    learner = lora_learner(tiny_model, beta=0.1)
    assert sum(p.numel() for p in learner.ref_model.parameters()) == 0  # no copy of the weights
    batch = on_policy_batch(tiny_model)
    first = learner.step(batch)
    second = learner.step(batch)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # B = 0: the policy is the base model
    assert second["kl"] > 0.0


def test_learner_state_round_trip_restores_adapter_and_adamw(tiny_model_path, tmp_path):
    def fresh():
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        torch.manual_seed(0)
        return lora_learner(model)

    a = fresh()
    batch = on_policy_batch(a.model.get_base_model())
    a.step(batch)
    torch.save(a.state_dict(), tmp_path / "learner.pt")  # as runner.state.save_checkpoint writes it
    state = torch.load(tmp_path / "learner.pt", weights_only=False)
    b = fresh()
    torch.manual_seed(1)  # a different adapter init than the saved one
    with torch.no_grad():
        for p in b.trainable_parameters().values():
            p.normal_()
    b.load_state_dict(state)
    for name, p in a.trainable_parameters().items():
        assert torch.equal(p, b.trainable_parameters()[name])
    ma, mb = a.step(batch), b.step(batch)  # same AdamW moments -> the same next step
    assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-7)
    for name, p in a.trainable_parameters().items():
        torch.testing.assert_close(p, b.trainable_parameters()[name], rtol=0, atol=1e-7)


def test_save_pretrained_writes_merged_hf_model_and_adapter(tiny_model, tmp_path):
    learner = lora_learner(tiny_model)
    with torch.no_grad():
        for p in learner.trainable_parameters().values():
            p.normal_(0, 0.1)
    learner.save_pretrained(tmp_path / "final-model")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "final-model", dtype=torch.float32)
    assert not any("lora" in n for n, _ in plain.named_parameters())
    merged = dict(MergedLoRASource(learner.model))
    for name, param in plain.named_parameters():
        torch.testing.assert_close(param, merged[name], rtol=0, atol=0)
    adapter = tmp_path / "final-model" / ADAPTER_FOLDER
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert learner.save_adapter(tmp_path / "a") < 0.2 * sum(p.numel() * 4 for p in plain.parameters())


def test_the_adapter_push_sends_the_base_alone_and_a_full_fine_tune_has_none(tiny_model, tmp_path):
    """`Learner.adapter_for_push` (vllm_lora_sync): the base weights under HF names without the adapter, and the
    adapter's files; a learner without LoRA refuses, naming the fix."""
    from async_grpo.trainer.trainer import GRPOLearner

    plain_model = copy.deepcopy(tiny_model)
    learner = lora_learner(tiny_model)
    with torch.no_grad():
        for p in learner.trainable_parameters().values():
            p.normal_(0, 0.1)
    adapter = learner.adapter_for_push()
    base = dict(adapter.base)
    assert base.keys() == dict(plain_model.named_parameters()).keys()
    for name, param in plain_model.named_parameters():
        torch.testing.assert_close(base[name], param, rtol=0, atol=0)  # B != 0 now, and W is still the base
    assert adapter.save_adapter(tmp_path / "a") == sum(f.stat().st_size for f in (tmp_path / "a").iterdir())
    full = GRPOLearner(plain_model, learning_rate=1e-3, weight_decay=0.0, max_grad_norm=1.0, micro_batch_size=2,
                       loss=LossSettings(), pad_token_id=PAD)  # fmt: skip
    with pytest.raises(TypeError, match="use_peft: true"):
        full.adapter_for_push()


def test_target_modules_that_match_nothing_name_the_field_and_the_modules(tiny_model):
    with pytest.raises(ValueError, match=r"lora_target_modules=\['qkv'\].*q_proj.*Fix"):
        wrap_with_lora(tiny_model, r=4, alpha=8, dropout=0.0, target_modules=["qkv"])


def test_build_local_learner_with_use_peft(tiny_model, tmp_path):
    config = GRPOConfig(
        use_peft=True,
        lora_r=4,
        lora_alpha=8,
        lora_target_modules="all-linear",
        max_steps=2,
        per_device_train_batch_size=2,
        num_generations=2,
        output_dir=str(tmp_path),
    )
    learner = build_local_learner(config, tiny_model, PAD)
    assert isinstance(learner, PeftLearner)
    assert learner.model.peft_config["default"].r == 4
    assert learner.model.peft_config["default"].lora_dropout == 0.05
    targets = {n.split(".")[-1] for n in learner.model.peft_config["default"].target_modules}
    assert {"q_proj", "down_proj"} <= targets and "lm_head" not in targets


def test_request_model_names_the_adapter_of_the_current_version(tmp_path):
    from async_grpo.transports.policy_version import PolicyVersion

    version = PolicyVersion(3)
    plain = GRPOConfig(output_dir=str(tmp_path))
    assert peft_setup.request_model(plain, version, "/m") == "/m"
    lora = GRPOConfig(use_peft=True, vllm_lora_sync=True, output_dir=str(tmp_path))
    name = peft_setup.request_model(lora, version, "/m")
    assert name() == adapter_name(3) == "policy-v3"
    version.bump()
    assert name() == "policy-v4"
    assert peft_setup.lora_sync_folder(lora) == Path(tmp_path).resolve() / "lora_sync"


def test_the_lora_example_loads():
    from async_grpo.config import load_config

    config = load_config(Path(__file__).resolve().parents[2] / "examples" / "lora_cpu.yaml")
    assert config.peft.use_peft and config.peft.vllm_lora_sync and config.peft.lora_r == 8
