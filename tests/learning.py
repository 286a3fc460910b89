"""The checks that a demo run learned, shared by the learning tests of the demos."""

from typing import List, Optional


def assert_learned(steps: List[dict], count: int, last: int, min_rise: float,
                   min_kl: Optional[float] = None) -> None:
    """The run has `count` steps; the mean reward of its `last` steps beats its first 5 steps' by
    `min_rise`; with `min_kl`, the actor's mean KL to the reference over those last steps is at
    least that: a frozen policy's reward can rise by chance, but it does not move."""
    rewards = [s["reward/mean"] for s in steps]
    assert len(rewards) == count
    first, final = sum(rewards[:5]) / 5, sum(rewards[-last:]) / last
    assert final - first >= min_rise, \
        f"reward {first:.3f} (steps 1-5) -> {final:.3f} (steps {count - last + 1}-{count}): {rewards}"
    if min_kl is not None:
        kl = [s["kl/actor_to_reference"] for s in steps]
        assert sum(kl[-last:]) / last >= min_kl, f"the actor hardly moved from the reference: {kl}"


def assert_heldout_rises(rows: List[dict], count: int, min_rise: float, name: str = "heldout") -> None:
    """The accuracy on held-out set `name` (its prompts are in no training prompt, so recalling
    the trained ones does not raise it) after the run's last step, `count`, beats the at-start
    evaluation's (step 0) by `min_rise`."""
    key = f"eval/{name}/all/accuracy"
    evaluated = {row["step"]: row[key] for row in rows if key in row}
    assert {0, count} <= set(evaluated), f"no held-out evaluation at step 0 and step {count}: {evaluated}"
    assert evaluated[count] - evaluated[0] >= min_rise, \
        f"held-out accuracy {evaluated[0]:.3f} (step 0) -> {evaluated[count]:.3f} (step {count}): {evaluated}"


def greedy_accuracy(model_dir: str, records: List[dict], max_new_tokens: int = 3) -> float:
    """The fraction of `records` ({"prompt", "answer"}) that the HF checkpoint in model_dir answers
    right, greedy, in transformers (not vLLM): the chat template as the run renders it, the math
    reward as the run scores it."""
    import torch
    import transformers

    from megarl.rewards.builtin import math_reward

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    right = 0.0
    for record in records:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}],
                                               tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        right += math_reward(answer, record["answer"])
    return right / len(records)


def assert_distilled(rows: List[dict], count: int, teacher: float, min_rise: float, min_closed: float,
                     min_kl_fall: float, window: int = 5) -> None:
    """The student of a `count`-step distillation run learned from its teacher: its held-out
    accuracy (set `heldout`) after the last step beats the at-start one by `min_rise` and by at
    least `min_closed` of its gap to the `teacher`'s accuracy, and the mean reverse KL to the
    teacher of its last `window` steps is at most its first `window` steps' / `min_kl_fall` (one
    step's KL swings with its prompts: a window's mean)."""
    key = "eval/heldout/all/accuracy"
    evaluated = {row["step"]: row[key] for row in rows if key in row}
    assert {0, count} <= set(evaluated), f"no held-out evaluation at step 0 and step {count}: {evaluated}"
    start, end = evaluated[0], evaluated[count]
    assert end - start >= min_rise, \
        f"held-out accuracy {start:.3f} -> {end:.3f} (teacher {teacher:.3f}): {evaluated}"
    assert end - start >= min_closed * (teacher - start), \
        f"held-out accuracy {start:.3f} -> {end:.3f} closed under {min_closed} of the gap to the teacher's " \
        f"{teacher:.3f}: {evaluated}"
    kl = [row["distill/reverse_kl"] for row in rows if "distill/reverse_kl" in row]
    assert len(kl) == count
    first, last = sum(kl[:window]) / window, sum(kl[-window:]) / window
    assert first >= min_kl_fall * last, \
        f"reverse KL {first:.3f} (steps 1-{window}) -> {last:.3f} (steps {count - window + 1}-{count}): {kl}"
