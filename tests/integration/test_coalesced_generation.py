"""Coalesced generation against the real vLLM server: groups sent within one window travel as one multi-prompt
`/v1/completions` call, and each group gets exactly the completions it would have got alone (greedy decoding, so
the comparison is exact), with its own sampling logprobs; a prompt vLLM refuses fails only its own group."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from async_grpo.inference.client import AsyncVLLMClient, RejectedRequestError

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

PROMPTS = [[ord(c) for c in f"reverse: {word}\n"] for word in ("abc", "hello", "kfp", "vllm", "torch", "zq")]


def test_coalesced_groups_get_the_completions_they_get_alone(vllm_server, tiny_model_dir):
    async def main():
        alone = AsyncVLLMClient(vllm_server.url, str(tiny_model_dir))
        shared = AsyncVLLMClient(vllm_server.url, str(tiny_model_dir), coalesce_window_s=0.2)
        try:
            one_by_one = [await alone.generate(p, n=1, max_tokens=8, temperature=0.0) for p in PROMPTS]
            together = await asyncio.gather(*(shared.generate(p, n=1, max_tokens=8, temperature=0.0) for p in PROMPTS))
            return one_by_one, together, shared.coalescer.stats()
        finally:
            await alone.aclose()
            await shared.aclose()

    one_by_one, together, stats = asyncio.run(main())
    assert stats == {"requests": len(PROMPTS), "batches": 1, "split_batches": 0}
    for single, batched in zip(one_by_one, together, strict=True):
        assert [c.token_ids for c in batched] == [c.token_ids for c in single]
        assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in batched)
        for a, b in zip(single, batched, strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)


def test_a_prompt_longer_than_the_context_fails_only_its_own_group(vllm_server, tiny_model_dir):
    too_long = [ord("a")] * 600  # the server's --max-model-len is 512

    async def main():
        client = AsyncVLLMClient(vllm_server.url, str(tiny_model_dir), coalesce_window_s=0.2)
        try:
            results = await asyncio.gather(
                *(client.generate(p, n=2, max_tokens=4, temperature=1.0) for p in (PROMPTS[0], too_long, PROMPTS[1])),
                return_exceptions=True,
            )
            return results, client.coalescer.stats()
        finally:
            await client.aclose()

    results, stats = asyncio.run(main())
    assert isinstance(results[1], RejectedRequestError), results[1]
    assert [len(r) for r in (results[0], results[2])] == [2, 2]
    assert stats["split_batches"] == 1


def test_the_coalescing_benchmark_measures_both_modes_on_the_real_server(vllm_server, tiny_model_dir, capsys):
    """benchmarks/coalescing.py in a reduced size on the session's server (CI does not start a second one): both
    modes get every group back, and the report prints the ratio it exists for (the numbers are not checked)."""
    spec = importlib.util.spec_from_file_location("coalescing_benchmark", ROOT / "benchmarks" / "coalescing.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sets = bench.prompt_sets(tokenizer, count=3, prompts=4)
    result = asyncio.run(
        bench.measure(vllm_server.url, str(tiny_model_dir), sets, n=2, max_tokens=4, warmup=1, window_s=0.005)
    )
    assert all(len(result[mode]["seconds"]) == 2 and min(result[mode]["tokens"]) >= 4 * 2 for mode in bench.MODES)
    summary = bench.report(result, bench.argparse.Namespace(prompts=4, generations=2, max_tokens=4, reps=2))
    assert "ratio coalesced / alone" in capsys.readouterr().out and summary["ratio_coalesced_over_alone"] > 0
