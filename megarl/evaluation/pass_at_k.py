"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code"): of n samples of a prompt, c correct, the chance that k drawn without replacement hold at
least one correct one, 1 - C(n-c, k) / C(n, k)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k)/C(n, k) as the product 1 - prod_{i=n-c+1}^{n} (1 - k/i): the binomials of a
    few hundred samples overflow a float, the product's terms all lie in [0, 1]."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n} samples, c={c} correct, "
                         f"k={k}: draw at least k samples per prompt (eval.samples >= every eval.pass_k)")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product
