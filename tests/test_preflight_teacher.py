"""Preflight of the distillation teacher (issue 52, `preflight.teacher`): a teacher whose tokenizer is not the
student's (vocabulary or special tokens), an unreachable `teacher_url`, one too short for a whole sequence, or one
that tokenizes otherwise exits 2 before any vLLM server starts, naming the field and the fix.

A served teacher is played here by an in-process transport answering `/v1/models` and `/tokenize` with a real
tokenizer, in vLLM 0.32's shapes; the same checks against a real vLLM server are in
tests/integration/test_teacher_server.py. A teacher outside the platform policy is refused by `check_run`
(tests/launch/test_k8s_teacher.py)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from async_grpo import cli
from async_grpo.config import GRPOConfig
from async_grpo.inference.server import VLLMServer, free_port
from async_grpo.preflight import CHECKS, LOCAL_ONLY, PreflightError, preflight
from async_grpo.preflight.teacher import (
    MODEL_FIELD,
    TOPK_FIELD,
    URL_FIELD,
    check_teacher_model,
    check_teacher_url,
    probe_text,
    server_root,
    tokenizer_mismatch,
)
from async_grpo.tiny_model import IM_END_TOKEN, build_tiny_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
TEACHER_URL = "http://teacher.test:8002/v1"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    for key in ("MLFLOW_TRACKING_URI", "ASYNC_GRPO_REWARD_URL", "ASYNC_GRPO_TEACHER_API_KEY"):
        monkeypatch.delenv(key, raising=False)


def _save(folder: Path, tokenizer) -> Path:
    folder.mkdir(parents=True)
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return folder


@pytest.fixture(scope="module")
def teachers(tmp_path_factory) -> dict[str, Path]:
    """Teacher folders (config.json + tokenizer): the student's own tokenizer, one with an extra token, one whose
    eos is another token."""
    root = tmp_path_factory.mktemp("teachers")
    extra = build_tiny_tokenizer()
    extra.add_tokens(["<|tool|>"], special_tokens=True)
    other_eos = build_tiny_tokenizer()
    other_eos.eos_token = IM_END_TOKEN
    return {
        "same": _save(root / "same", build_tiny_tokenizer()),
        "extra_token": _save(root / "extra", extra),
        "other_eos": _save(root / "eos", other_eos),
    }


def _config(tmp_path, **teacher) -> GRPOConfig:
    return GRPOConfig(model_name_or_path="builtin:tiny", output_dir=str(tmp_path / "run"), **teacher)


# ------------------------------------------------------------------------------------------------ tokenizers
def test_the_same_tokenizer_passes(teachers, tmp_path):
    report = preflight(_config(tmp_path, teacher_model_name_or_path=str(teachers["same"])))
    assert report.ok, report.problems
    assert {"teacher", "teacher_url"} <= set(report.checked)


def test_a_teacher_with_another_vocabulary_exits_2_naming_the_field_and_token(teachers, tmp_path, capsys):
    config = _config(tmp_path, teacher_model_name_or_path=str(teachers["extra_token"]))
    (problem,) = preflight(config).problems
    assert problem.field == MODEL_FIELD == "distillation.teacher_model_name_or_path"
    text = str(problem)
    assert (
        "vocabulary differs" in text and "260 against 259" in text and "'<|tool|>' is absent in the student's" in text
    )
    assert "Fix: use a teacher of the student's model family" in text
    overrides = ["model_name_or_path=builtin:tiny", f"teacher_model_name_or_path={teachers['extra_token']}"]
    assert cli.main(["validate", "examples/tiny_cpu.yaml", *overrides, f"output_dir={tmp_path}"]) == 2
    assert "error: distillation.teacher_model_name_or_path:" in capsys.readouterr().err


def test_a_teacher_with_other_special_tokens_is_refused(teachers, tmp_path):
    (problem,) = preflight(_config(tmp_path, teacher_model_name_or_path=str(teachers["other_eos"]))).problems
    assert problem.field == MODEL_FIELD
    assert "special tokens differ" in str(problem) and "eos: '<|endoftext|>' in the student's, '<|im_end|>'" in str(
        problem
    )


def test_the_comparison_ignores_pad_and_finds_each_difference():
    student = build_tiny_tokenizer()
    assert tokenizer_mismatch(student, build_tiny_tokenizer()) is None
    padded = build_tiny_tokenizer()
    padded.pad_token = IM_END_TOKEN  # padding is masked, never scored
    assert tokenizer_mismatch(student, padded) is None
    shuffled = build_tiny_tokenizer()
    assert tokenizer_mismatch(student, _swapped(shuffled)) is not None


def _swapped(tokenizer):
    """A tokenizer whose vocabulary maps two tokens to each other's ids (same size, same tokens)."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab = dict(tokenizer.get_vocab())
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    return Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token=None,
                          additional_special_tokens=["<|im_start|>", "<|im_end|>"])  # fmt: skip


@pytest.mark.parametrize(
    "name, message",
    [
        ("builtin:tiny", "names no model folder"),
        ("models:/teacher/1", "names no model folder"),
        ("/nonexistent/teacher", "does not exist"),
        ("tests", "is not a Hugging Face model folder (no config.json)"),
    ],
)
def test_a_teacher_that_is_no_saved_model_is_refused(name, message, tmp_path):
    problems, _ = check_teacher_model(_config(tmp_path, teacher_model_name_or_path=name), local=True)
    (problem,) = problems
    assert problem.field == MODEL_FIELD and message in str(problem) and "Fix:" in str(problem)


def test_what_cannot_be_compared_here_is_said_not_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problems, notes = check_teacher_model(_config(tmp_path, teacher_model_name_or_path="acme/teacher-7b"), True)
    assert problems == [] and "hub id not in the HF cache" in notes[0]
    on_volume = _config(tmp_path, teacher_model_name_or_path="/workspace/models/teacher")
    problems, notes = check_teacher_model(on_volume, local=False)
    assert problems == [] and "checked where it runs" in notes[0]
    report = preflight(on_volume, target="cluster")
    assert report.ok and "teacher" in report.checked


# ------------------------------------------------------------------------------------------------ a served teacher
class FakeVLLM:
    """Answers /v1/models, /tokenize and /v1/completions (prompt logprobs) as vLLM 0.32 does, with `tokenizer` and a
    --max-logprobs of `max_logprobs` (a larger prompt_logprobs: HTTP 400, vLLM's message); records the requests.
    `topk_width` overrides the entries a position answers (a server that is not vLLM's top-k)."""

    def __init__(
        self,
        tokenizer,
        max_model_len: int = 4096,
        model: str = "/models/teacher",
        max_logprobs: int = 20,
        topk_width: int | None = None,
    ):
        self.tokenizer, self.max_model_len, self.model = tokenizer, max_model_len, model
        self.max_logprobs, self.topk_width = max_logprobs, topk_width
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path == "/v1/models":
            card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        if request.url.path == "/tokenize":
            body = json.loads(request.content)
            ids = self.tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
            strs = self.tokenizer.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
            return httpx.Response(
                200, json={"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}
            )
        if request.url.path == "/v1/completions":
            body = json.loads(request.content)
            k = body.get("prompt_logprobs") or 0
            if k > self.max_logprobs:
                message = f"Requested prompt logprobs of {k}, which is greater than max allowed: {self.max_logprobs}"
                return httpx.Response(400, json={"error": {"message": message, "type": "BadRequestError"}})
            ids = self.tokenizer.encode(body["prompt"], add_special_tokens=False)
            width = k if self.topk_width is None else self.topk_width
            entries = [None] + [
                {str(top): {"logprob": -0.1 * rank, "rank": rank} for rank, top in enumerate(range(width), start=1)}
                for _ in ids[1:]
            ]
            choice = {"index": 0, "text": "x", "prompt_logprobs": entries, "finish_reason": "length"}
            return httpx.Response(200, json={"choices": [choice]})
        return httpx.Response(404, json={"error": "not found"})

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self))


def test_a_served_teacher_of_the_same_tokenizer_passes_and_gets_the_token(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNC_GRPO_TEACHER_API_KEY", "t0ken")
    fake = FakeVLLM(build_tiny_tokenizer())
    problems, notes = check_teacher_url(_config(tmp_path, teacher_url=TEACHER_URL), client=fake.client())
    assert problems == [] and notes == []
    models, tokenize = fake.requests
    assert str(models.url) == f"{TEACHER_URL}/models" and str(tokenize.url) == "http://teacher.test:8002/tokenize"
    assert all(r.headers["authorization"] == "Bearer t0ken" for r in fake.requests)
    body = json.loads(tokenize.content)
    assert body["model"] == "/models/teacher" and body["add_special_tokens"] is False
    assert "<|im_start|>" in body["prompt"] and "<|endoftext|>" in body["prompt"]


def test_a_served_teacher_of_another_tokenizer_is_refused(tmp_path):
    fake = FakeVLLM(_swapped(build_tiny_tokenizer()))
    (problem,) = check_teacher_url(_config(tmp_path, teacher_url=TEACHER_URL), client=fake.client())[0]
    assert problem.field == URL_FIELD == "distillation.teacher_url"
    assert "does not tokenize as the student does" in str(problem) and "Fix: use a teacher" in str(problem)


def test_a_served_teacher_too_short_for_a_whole_sequence_is_refused(tmp_path):
    config = _config(tmp_path, teacher_url=TEACHER_URL, vllm_max_model_len=512)
    ok = FakeVLLM(build_tiny_tokenizer(), max_model_len=512)
    assert check_teacher_url(config, client=ok.client())[0] == []
    short = FakeVLLM(build_tiny_tokenizer(), max_model_len=511)
    (problem,) = check_teacher_url(config, client=short.client())[0]
    assert problem.field == URL_FIELD and "max_model_len=511" in str(problem)
    assert "Fix: serve the teacher with --max-model-len 512 or more" in str(problem)


def test_a_top_k_teacher_url_must_answer_prompt_logprobs_of_k(tmp_path):
    """With forward_kl, one /completions request asks prompt_logprobs=distillation_topk: vLLM refuses a K above its
    --max-logprobs (HTTP 400), and preflight says so, naming distillation_topk and the fix; reverse_kl asks nothing."""
    plain = _config(tmp_path, teacher_url=TEACHER_URL)
    fake = FakeVLLM(build_tiny_tokenizer())
    assert check_teacher_url(plain, client=fake.client()) == ([], [])
    assert [r.url.path for r in fake.requests] == ["/v1/models", "/tokenize"]  # no top-k request without top-k
    topk = _config(tmp_path, teacher_url=TEACHER_URL, distillation_loss="forward_kl", distillation_topk=20)
    fake = FakeVLLM(build_tiny_tokenizer())
    assert check_teacher_url(topk, client=fake.client()) == ([], [])
    (completions,) = [r for r in fake.requests if r.url.path == "/v1/completions"]
    body = json.loads(completions.content)
    assert body["prompt_logprobs"] == 20 and body["max_tokens"] == 1 and body["model"] == "/models/teacher"
    wide = topk.model_copy(update={"distillation_topk": 32})
    (problem,) = check_teacher_url(wide, client=FakeVLLM(build_tiny_tokenizer()).client())[0]
    assert problem.field == TOPK_FIELD == "distillation.distillation_topk"
    assert f"at {TEACHER_URL} (teacher_url) refused the top-k request of distillation_topk=32" in str(problem)
    assert "greater than max allowed: 20" in str(problem)
    assert "Fix: serve the teacher with --max-logprobs 32 (or more), or lower distillation_topk" in str(problem)
    served = FakeVLLM(build_tiny_tokenizer(), max_logprobs=32)  # served with --max-logprobs 32
    assert check_teacher_url(wide, client=served.client()) == ([], [])
    (problem,) = check_teacher_url(topk, client=FakeVLLM(build_tiny_tokenizer(), topk_width=1).client())[0]
    assert problem.field == TOPK_FIELD and "entries per position, not the top 20" in str(problem)


def test_the_launched_teacher_gets_max_logprobs_only_above_vllms_default(tmp_path):
    assert _config(tmp_path, teacher_url=TEACHER_URL).distillation.teacher_serve_args == []
    forward = _config(tmp_path, teacher_url=TEACHER_URL, distillation_loss="forward_kl", distillation_topk=20)
    assert forward.distillation.teacher_serve_args == []
    assert forward.model_copy(update={"distillation_topk": 64}).distillation.teacher_serve_args == [
        "--max-logprobs",
        "64",
    ]
    reverse = forward.model_copy(update={"distillation_loss": "reverse_kl", "distillation_topk": 64})
    assert reverse.distillation.teacher_serve_args == []  # reverse_kl asks no top-k


def test_a_teacher_model_the_server_does_not_serve_is_refused(tmp_path):
    config = _config(tmp_path, teacher_url=TEACHER_URL, teacher_model="other")
    (problem,) = check_teacher_url(config, client=FakeVLLM(build_tiny_tokenizer()).client())[0]
    assert problem.field == "distillation.teacher_model" and "'other' is not served" in str(problem)


def test_an_unreachable_teacher_url_exits_2_before_anything_starts(tmp_path, monkeypatch, capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    config = _config(tmp_path, teacher_url=url)
    (problem,) = preflight(config).problems
    assert problem.field == URL_FIELD and f"the teacher at {url} did not answer GET /models" in str(problem)
    assert "Fix: start the teacher's vLLM server" in str(problem)
    overrides = ["model_name_or_path=builtin:tiny", f"teacher_url={url}", f"output_dir={tmp_path}"]
    assert cli.main(["validate", "examples/tiny_cpu.yaml", *overrides]) == 2
    assert "error: distillation.teacher_url:" in capsys.readouterr().err
    # run_local refuses it before any process starts
    from async_grpo.launch import local

    launched = []
    monkeypatch.setattr(VLLMServer, "launch", lambda self: launched.append(self))
    with pytest.raises(PreflightError, match="distillation.teacher_url"):
        local.run_local(config)
    assert launched == []


def test_the_cluster_target_leaves_teacher_url_to_the_trainer(tmp_path):
    assert "teacher_url" in LOCAL_ONLY and {"teacher", "teacher_url"} <= set(CHECKS)
    report = preflight(_config(tmp_path, teacher_url=f"http://127.0.0.1:{free_port()}/v1"), target="cluster")
    assert report.ok and "teacher_url" not in report.checked


def test_the_probe_and_the_root():
    assert server_root("http://h:1/v1") == server_root("http://h:1/v1/") == "http://h:1"
    assert server_root("http://h:1") == "http://h:1"
    tokenizer = build_tiny_tokenizer()
    text = probe_text(tokenizer)
    assert all(token in text for token in tokenizer.all_special_tokens)
    assert len(tokenizer.encode(text, add_special_tokens=False)) < 1000  # well inside any teacher's context
