"""The training loop's new inputs on the real CPU stack (real vLLM, reward workers, MLflow store):
streaming group scoring, a user DataProducer with rollout reuse, and two trainer ranks under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import psutil
import pytest
import torch
import yaml

from async_grpo.config import GRPOConfig
from async_grpo.inference.server import free_port
from async_grpo.launch.local import run_local

pytestmark = pytest.mark.integration

TORCHRUN_TIMEOUT_S = 600

BASE = {
    "dataset": "builtin:reverse", "reward_funcs": ["builtin:reverse_format"], "reward_num_workers": 1,
    "num_generations": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
    "max_completion_length": 8, "torch_num_threads": 1, "learning_rate": 1e-4, "save_model": False,
    "log_completions_steps": 1000, "eval_num_prompts": 4, "num_generations_eval": 2,
}  # fmt: skip


def history(summary, key: str) -> list[float]:
    mlflow.set_tracking_uri(summary.tracking_uri)
    client = mlflow.tracking.MlflowClient()
    assert client.get_run(summary.run_id).info.status == "FINISHED"
    return [m.value for m in sorted(client.get_metric_history(summary.run_id, key), key=lambda m: m.step)]


def test_streaming_run_trains_on_chunks(vllm_server, tiny_model_dir, tmp_path):
    """2 groups per step streamed one group at a time: every step is two chunks."""
    config = GRPOConfig(
        **BASE,
        model_name_or_path=str(tiny_model_dir),
        vllm_url=vllm_server.url,
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        streaming_min_groups=1,
    )
    summary = run_local(config, progress=False)
    assert summary.steps == 3
    assert history(summary, "streaming/chunks") == [2.0, 2.0, 2.0]
    assert len(history(summary, "loss")) == 3
    assert all(v > 0 for v in history(summary, "num_tokens"))


PRODUCER_PY = '''
"""A user rollout source: samples with the trainer's own HF model (model.generate), not vLLM."""
import json
from pathlib import Path

import torch

from async_grpo.data import encode_prompt
from async_grpo.orchestrator import make_train_batch
from async_grpo.orchestrator.producer import BaseDataProducer, ProducerConfig
from async_grpo.transports.messages import RolloutGroup

WORDS = ["abc", "hello", "tiny", "queue"]


class HFGenerateProducer(BaseDataProducer):
    def __init__(self, config, tokenizer):
        super().__init__(ProducerConfig.from_config(config))
        self.tokenizer, self.cfg, self.next = tokenizer, config, 0
        self.log = Path(config.output_dir) / "producer_calls.json"
        self.calls = []

    def on_rollout_begin(self, global_step):
        self.calls.append(["begin", global_step])

    def on_rollout_end(self, rollout, global_step):
        self.calls.append(["end", global_step, len(rollout)])
        self.log.write_text(json.dumps(self.calls))

    @torch.no_grad()
    def produce(self, model, global_step, **kwargs):
        out = []
        for _ in range(self.config.steps_per_generation):
            groups = []
            for _ in range(self.cfg.groups_per_step):
                word = WORDS[self.next % len(WORDS)]
                self.next += 1
                ids = encode_prompt(self.tokenizer, f"reverse: {word}\\n")
                gen = model.generate(torch.tensor([ids]), do_sample=True, num_return_sequences=self.cfg.sampling.num_generations,
                                     max_new_tokens=self.cfg.sampling.max_completion_length, output_scores=True,
                                     return_dict_in_generate=True, pad_token_id=self.tokenizer.pad_token_id)
                scores = model.compute_transition_scores(gen.sequences, gen.scores, normalize_logits=True)
                comps, lps = [], []
                for seq, sc in zip(gen.sequences[:, len(ids):].tolist(), scores.tolist()):
                    n = seq.index(self.tokenizer.eos_token_id) + 1 if self.tokenizer.eos_token_id in seq else len(seq)
                    comps.append(seq[:n])
                    lps.append(sc[:n])
                texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in comps]
                rewards = [[sum(a == b for a, b in zip(t, word[::-1])) / len(word)] for t in texts]
                groups.append(RolloutGroup(prompt_ids=ids, completion_ids=comps, sampling_logprobs=lps,
                                           truncated=[len(c) >= self.cfg.sampling.max_completion_length for c in comps],
                                           completions=texts, prompt=word, columns={}, policy_version=0,
                                           rewards_per_func=rewards))
            out.append(make_train_batch(groups, ["chars"], [1.0], "group"))
        return out


def factory(config, tokenizer):
    return HFGenerateProducer(config, tokenizer)
'''


def test_user_data_producer_with_rollout_reuse_and_max_rollouts(vllm_server, tiny_model_dir, tmp_path):
    """steps_per_generation=2 x num_iterations=2: 4 optimizer steps per rollout; max_rollouts=2 ends the run
    after 8 steps although max_steps is 100. The hooks bracket every produce call."""
    producer = tmp_path / "my_producer.py"
    producer.write_text(PRODUCER_PY)
    out = tmp_path / "run"
    config = GRPOConfig(
        **BASE,
        model_name_or_path=str(tiny_model_dir),
        vllm_url=vllm_server.url,
        output_dir=str(out),
        max_steps=100,
        data_producer=f"{producer}:factory",
        steps_per_generation=2,
        num_iterations=2,
        max_rollouts=2,
    )
    summary = run_local(config, progress=False)
    assert summary.steps == 8
    assert json.loads((out / "producer_calls.json").read_text()) == [
        ["begin", 0],
        ["end", 0, 2],
        ["begin", 4],
        ["end", 4, 2],
    ]
    assert history(summary, "generation_rounds") == [1.0] * 4 + [2.0] * 4
    clipped = history(summary, "clip_ratio/region_mean")
    assert clipped[0] == 0.0  # first update of a rollout: pi_theta == pi_old
    assert history(summary, "policy_version")[-1] == 8.0  # every step pushed to vLLM
    assert summary.eval_after  # vLLM served the final weights for the held-out evaluation


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicas", "fsdp"])
def test_two_trainer_ranks_under_torchrun(vllm_server, tiny_model_dir, tmp_path, child_pids, fsdp):
    """torchrun --nproc-per-node 2: rank 0 drives vLLM, rewards and MLflow; both ranks train; each step uses
    2 ranks x 8 completions = 4 groups. With fsdp the ranks hold shards, join every weight push's all-gathers,
    and the saved final model is the gathered, loadable checkpoint."""
    before = child_pids()
    out = tmp_path / "run"
    cfg = {
        **BASE,
        "model_name_or_path": str(tiny_model_dir),
        "vllm_url": vllm_server.url,
        "output_dir": str(out),
        "max_steps": 3,
        "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "fsdp": fsdp,
        "save_model": fsdp,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "--module",
            "async_grpo.cli",
            "train",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=TORCHRUN_TIMEOUT_S,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    mlflow.set_tracking_uri(cfg["mlflow_tracking_uri"])
    client = mlflow.tracking.MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("async-grpo").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # only rank 0 tracks
    run_id = runs[0].info.run_id
    assert [m.value for m in client.get_metric_history(run_id, "trainer/ranks")] == [2.0] * 3
    assert [m.value for m in client.get_metric_history(run_id, "groups")] == [4.0] * 3  # 2 per rank
    assert len(client.get_metric_history(run_id, "num_tokens")) == 3
    assert [m.value for m in client.get_metric_history(run_id, "policy_version")] == [1.0, 2.0, 3.0]
    if fsdp:
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(out / "final-model")
        assert saved.config.architectures == ["Qwen2ForCausalLM"]
        initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert any(not torch.equal(a, b) for a, b in zip(saved.parameters(), initial.parameters(), strict=True))
    assert child_pids() == before


def test_run_scores_through_the_reward_service(vllm_server, tiny_model_dir, tmp_path, child_pids):
    """reward_url: every group is scored by a real `python -m async_grpo.rewards.server` (as the reward
    Deployment runs it), and the run's reward metrics come from it."""
    import signal
    import time

    import httpx

    before = child_pids()
    cfg = {
        **BASE,
        "model_name_or_path": str(tiny_model_dir),
        "vllm_url": vllm_server.url,
        "output_dir": str(tmp_path / "run"),
        "max_steps": 2,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "reward.log").open("w") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "async_grpo.rewards.server",
                "--config",
                str(path),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num-workers",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180  # ready once its workers are warm
        while True:
            assert server.poll() is None, (tmp_path / "reward.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "reward service did not come up"
            time.sleep(0.2)
        summary = run_local(GRPOConfig(**cfg, reward_url=url), progress=False)
        assert history(summary, "rewards/reverse_format/mean")  # scored remotely, logged per step
        assert summary.eval_before and summary.eval_after
        assert not summary.dropped_groups.get("reward_error")
        # the service's worker pool starts on its first /v1/score request: it did the scoring
        assert psutil.Process(server.pid).children(recursive=True)
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    assert child_pids() == before
