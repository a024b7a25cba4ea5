"""The LLM judge (`builtin:llm_judge`, issue 26) against a real vLLM CPU server: the session's tiny-model server
plays the judge. Its answers are nonsense unless constrained, which makes it a good adversary for the parser: free
answers are parse failures (None, counted), guided answers always parse; repeated completions come from the cache;
a judge that is gone raises after its retries (the run's reward-failure rules take it from there); and a whole
`async-grpo train` run scores every group with the judge and logs its metrics to MLflow."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
import pytest

from async_grpo.inference.server import free_port
from async_grpo.rewards import judge
from async_grpo.rewards.contract import RewardLog

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["reverse: abc\n", "reverse: hello\n", "reverse: kiwi\n"]
COMPLETIONS = ["cba", "olleh", "iwik"]


def _vllm_servers(run: subprocess.Popen) -> set[psutil.Process]:
    """The vLLM API servers among the descendants of `run` (never a server of another test or run on this machine,
    so the check holds beside parallel test workers)."""
    try:
        descendants = psutil.Process(run.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for proc in descendants:
        try:
            if "vllm.entrypoints.openai.api_server" in " ".join(proc.cmdline()):
                found.add(proc)
        except psutil.Error:  # gone meanwhile
            continue
    return found


def _alive(procs: set[psutil.Process]) -> set[psutil.Process]:
    """Those of `procs` still running (not zombies); `is_running` also tells a reused PID from the original."""
    alive = set()
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.add(proc)
        except psutil.Error:
            continue
    return alive


def _wait_watching(run: subprocess.Popen, started: set[psutil.Process], timeout_s: float = 600) -> int:
    """Wait for `run` to exit (its return code), adding to `started` every vLLM server among its descendants, every
    0.5 s (a server lives far longer than that)."""
    deadline = time.monotonic() + timeout_s
    while run.poll() is None:
        started |= _vllm_servers(run)
        assert time.monotonic() < deadline, f"the run did not finish within {timeout_s:.0f} s"
        time.sleep(0.5)
    return run.returncode


def _judge(url: str, log: RewardLog, **kw):
    return judge.llm_judge(
        PROMPTS, COMPLETIONS, judge_url=f"{url}/v1", judge_max_tokens=8, log_metric=log.log_metric, **kw
    )


def test_guided_answers_parse_and_repeat_from_the_cache(vllm_server):
    judge.clear_cache()
    log = RewardLog()
    scores = _judge(vllm_server.url, log, judge_guided_score=True)
    assert all(s is not None and 0.0 <= s <= 1.0 for s in scores), scores
    assert log.metrics["judge/parse_failures"] == [0.0]
    assert log.metrics["judge/requests"] == [1.0] and log.metrics["judge/cache_hits"] == [0.0]
    assert 0.0 < log.metrics["judge/seconds"][0] < 60.0
    again = RewardLog()
    assert _judge(vllm_server.url, again, judge_guided_score=True) == scores  # greedy answers, cached
    assert again.metrics["judge/cache_hits"] == [1.0] and "judge/seconds" not in again.metrics


def test_free_answers_without_a_score_are_counted_not_fatal(vllm_server):
    judge.clear_cache()
    log = RewardLog()
    scores = _judge(vllm_server.url, log, judge_max_score=10.0)
    parsed = [judge.parse_score(a, 10.0) for a in ("Score: 7", "score = **3**", "Score: 11", "no score")]
    assert parsed == [0.7, 0.3, None, None]
    failures = sum(s is None for s in scores)
    assert log.metrics["judge/parse_failures"] == [failures / len(scores)]
    assert failures >= 1  # the tiny byte model does not write "Score: <n>" by itself


def test_a_judge_that_is_gone_raises_after_its_retries():
    judge.clear_cache()
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(judge.JudgeUnavailable, match="did not answer after 1 retries.*Fix: check the judge"):
        judge.llm_judge(PROMPTS, COMPLETIONS, judge_url=url, judge_model="m", judge_max_retries=1, judge_timeout_s=5)
    assert time.monotonic() - t0 < 30.0


def test_a_run_scores_every_group_with_the_judge(vllm_server, tiny_model_dir, tmp_path):
    """The policy's server doubles as the judge here (one vLLM start-up less in CI; the judge only reads). A judge
    the launcher serves itself (`judge_model_name_or_path`) is tests/launch/test_judge_server.py, and was run end
    to end with its server killed mid-run (docs/rewards.md)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "async_grpo.cli", "train", str(REPO / "examples" / "tiny_cpu.yaml"),
           f"output_dir={out}", f"model_name_or_path={tiny_model_dir}", "warmup_sft_steps=0",
           f"vllm_url={vllm_server.url}", "max_steps=3", "eval_num_prompts=4", "eval_strategy=no",
           "per_device_train_batch_size=16", "gradient_accumulation_steps=1", "max_inflight_groups=4",
           "reward_funcs=[builtin:reverse_exact_match, builtin:llm_judge]", "reward_weights=[1.0, 0.5]",
           f"judge_url={vllm_server.url}/v1", "judge_guided_score=true", "judge_max_tokens=10",
           "skip_zero_advantage_batches=false", "vllm_sync_interval=100"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    started: set[psutil.Process] = set()  # vLLM servers the run started
    with open(tmp_path / "run.log", "wb") as run_log:
        run = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=run_log, stderr=subprocess.STDOUT)
        try:
            _wait_watching(run, started)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait(timeout=60)
    assert run.returncode == 0, (tmp_path / "run.log").read_text(errors="replace")[-3000:]
    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("async-grpo").experiment_id])[0]
    metrics = run.data.metrics
    assert metrics["summary/prompts_lost"] == 0
    assert 0.0 <= metrics["rewards/llm_judge/mean"] <= 1.0
    assert metrics["judge/parse_failures"] == 0.0 and metrics["judge/requests"] > 0.0
    assert "rewards/reverse_exact_match/correlation/llm_judge" in metrics or metrics["rewards/llm_judge/std"] == 0
    assert started == set()  # nothing started for the judge (the policy's server is the session's)


@pytest.mark.slow(seconds=75)
def test_a_launched_judge_killed_mid_run_is_restarted_and_the_run_finishes(vllm_server, tiny_model_dir, tmp_path):
    """Issue 26: the judge the launcher serves (`judge_model_name_or_path`, its own vLLM server) gets `kill -9`
    after its first answers. The launcher's watchdog starts it again; groups that could not be scored meanwhile are
    dropped and counted (`dropped_groups/reward_error`, the reward-failure rules); the run finishes every step with
    no prompt lost and leaves no vLLM process behind."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "async_grpo.cli", "train", str(REPO / "examples" / "tiny_cpu.yaml"),
           f"output_dir={out}", f"model_name_or_path={tiny_model_dir}", "warmup_sft_steps=0",
           f"vllm_url={vllm_server.url}", "max_steps=12", "eval_strategy=no", "eval_num_prompts=4",
           "per_device_train_batch_size=16", "gradient_accumulation_steps=1", "max_inflight_groups=4",
           "reward_funcs=[builtin:reverse_exact_match, builtin:llm_judge]", "reward_weights=[1.0, 0.5]",
           f"judge_model_name_or_path={tiny_model_dir}", "judge_guided_score=true", "judge_max_tokens=10",
           "judge_max_retries=1", "judge_timeout_s=10", "reward_failure_timeout_s=300",
           "skip_zero_advantage_batches=false", "vllm_sync_interval=100"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    judge_log = out / "vllm-judge.log"
    started: set[psutil.Process] = set()  # both lives of the judge's server (the policy's server is the session's)
    with open(tmp_path / "run.log", "wb") as run_log:
        run = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=run_log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            # kill it once training has started and the judge answered: a kill during the held-out evaluation
            # before training (slow under load) leaves that evaluation's groups out of eval/reward and no
            # training group ever meets the dead judge
            while '"POST /v1/chat/completions' not in (
                judge_log.read_text(errors="replace") if judge_log.exists() else ""
            ) or "GRPO:" not in (tmp_path / "run.log").read_text(errors="replace"):
                assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the launched judge never answered"
                time.sleep(0.5)
            (judge,) = _vllm_servers(run)  # the judge's API server: the policy's server is the session's
            started.add(judge)
            judge.kill()
            code = _wait_watching(run, started)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait(timeout=60)
    text = (tmp_path / "run.log").read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "the LLM judge's vLLM server is back (restart 1)" in text
    assert judge_log.read_text(errors="replace").count("Application startup complete") == 2
    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run_info = client.search_runs([client.get_experiment_by_name("async-grpo").experiment_id])[0]
    metrics = run_info.data.metrics
    assert metrics["summary/prompts_lost"] == 0
    assert metrics["dropped_groups/reward_error"] >= 1  # groups that met the dead judge: dropped, counted
    assert [m.step for m in client.get_metric_history(run_info.info.run_id, "loss")] == list(range(1, 13))
    judged = client.get_metric_history(run_info.info.run_id, "rewards/llm_judge/mean")
    assert max(m.step for m in judged) == 12  # scored by the judge's second life
    assert all(0.0 <= m.value <= 1.0 for m in judged)
    assert len(started) == 2 and _alive(started) == set()  # the judge (both of its lives) stopped with the run
