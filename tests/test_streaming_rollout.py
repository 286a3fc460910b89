"""Partial rollouts on a real vLLM engine (tiny random Qwen2, fp32): a draw streamed one engine
step at a time is interrupted by a weight update (weights A -> B) halfway, and every response
token's recorded version and log-prob are checked against HF transformers run with that
version's weights. "continue" yields responses of both versions, "restart" only of B; without an
interruption the stream samples exactly what engine.generate samples."""

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megarl.rollout.completion import Completion
from megarl.rollout.engine import SamplingConfig
from megarl.rollout.prompts import Prompt
from megarl.rollout.turns import TurnDriver

PROMPTS = [[5, 17, 33, 2], [8, 9, 10, 11, 12, 13], [40, 41]]
AS_PROMPTS = [Prompt("", ids, None) for ids in PROMPTS]
SAMPLING = SamplingConfig(n=2, temperature=1.0, max_new_tokens=24, seed=11)
STEPS_BEFORE_UPDATE = 9


@pytest.fixture(scope="module")
def two_versions(hf_models, tmp_path_factory):
    """Version 0's and version 1's HF folders (1 = 0 with every weight moved by N(0, 0.05))."""
    first = hf_models["qwen2"]
    second = str(tmp_path_factory.mktemp("qwen2_b"))
    model = transformers.AutoModelForCausalLM.from_pretrained(first, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    model.save_pretrained(second)
    return first, second


@pytest.fixture(scope="module")
def engine(two_versions):
    from megarl.rollout.vllm.engine import VLLMEngine

    engine = VLLMEngine(two_versions[0], load_format="auto", max_model_len=64)
    yield engine
    engine.shutdown()


def _hf_logprobs(hf_dir: str, tokens: list) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1, by HF transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def _load(engine, hf_dir: str) -> None:
    (path,) = [f"{hf_dir}/model.safetensors"]
    report = engine.load_hf_weights(load_file(path).items())
    assert not report.missing and not report.unexpected


def _stream(engine, two_versions, interrupt: str):
    """The draw with an update to version 1 after STEPS_BEFORE_UPDATE engine steps."""
    _load(engine, two_versions[0])
    driver, completion = TurnDriver(engine, interrupt, version=0), Completion()
    completion.start(driver, 1, AS_PROMPTS, SAMPLING)
    for _ in range(STEPS_BEFORE_UPDATE):
        completion.step(driver)
    driver.pause()
    _load(engine, two_versions[1])
    driver.weights_updated(1)
    while completion.busy():
        completion.step(driver)
    return driver, completion.finished(driver, 1)


def _check_logprobs(samples, two_versions):
    checked = {0: 0, 1: 0}
    for sample in samples:
        tokens = sample.prompt_ids + sample.response_ids
        assert sample.versions.shape == sample.logprobs.shape == (len(sample.response_ids),)
        for version, hf_dir in enumerate(two_versions):
            reference = _hf_logprobs(hf_dir, tokens)[len(sample.prompt_ids) - 1:]
            mine = sample.versions == version
            torch.testing.assert_close(sample.logprobs[mine], reference[mine], atol=1e-4, rtol=0)
            # The other version's weights give other log-probs: the check tells versions apart.
            other = sample.versions == 1 - version
            if other.any():
                assert (sample.logprobs[other] - reference[other]).abs().max() > 1e-3
            checked[version] += int(mine.sum())
    return checked


def test_continued_requests_keep_their_tokens_and_each_tokens_version(engine, two_versions):
    stream, samples = _stream(engine, two_versions, "continue")
    assert len(samples) == len(PROMPTS) * SAMPLING.n
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    mixed = [s for s in samples if len(set(s.versions.tolist())) == 2]
    assert mixed and stream.interrupted == len(mixed)
    for s in mixed:  # version 0 first, then version 1, never back
        assert s.versions.tolist() == sorted(s.versions.tolist())
        assert int((s.versions == 0).sum()) == STEPS_BEFORE_UPDATE
    checked = _check_logprobs(samples, two_versions)
    assert checked[0] >= STEPS_BEFORE_UPDATE and checked[1] > 0


def test_restarted_requests_are_sampled_by_the_new_weights_only(engine, two_versions):
    stream, samples = _stream(engine, two_versions, "restart")
    restarted = [s for s in samples if bool((s.versions == 1).all())]
    assert restarted and stream.interrupted == len(restarted)
    assert stream.discarded_tokens == STEPS_BEFORE_UPDATE * len(restarted)
    assert all(len(set(s.versions.tolist())) == 1 for s in samples)
    _check_logprobs(samples, two_versions)


def test_an_uninterrupted_stream_samples_what_generate_samples(engine, two_versions):
    _load(engine, two_versions[0])
    driver, completion = TurnDriver(engine, version=0), Completion()
    completion.start(driver, 3, AS_PROMPTS, SAMPLING)
    while completion.busy():
        completion.step(driver)
    streamed = completion.finished(driver, 3)
    generated = engine.generate(PROMPTS, SAMPLING)
    assert [s.response_ids for s in streamed] == [s.response_ids for s in generated]
    for s, g in zip(streamed, generated):
        torch.testing.assert_close(s.logprobs, g.logprobs, atol=1e-6, rtol=0)
        assert s.versions.tolist() == [0] * len(s.response_ids)
