"""A reward module written for verl (custom_reward_function.path), used by megarl unchanged:
tests/test_loop.py trains with it on a parquet laid out as verl's gsm8k preprocessing writes it."""

CALLS = {"seen": 0}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source != "openai/gsm8k" or not isinstance(extra_info, dict) or "index" not in extra_info:
        raise ValueError(f"not verl's gsm8k record: {data_source!r}, {extra_info!r}")
    correct = solution_str.strip() == ground_truth
    return {"score": float(correct), "acc": correct, "format": float(solution_str.strip().isdigit()),
            "pred": solution_str}
