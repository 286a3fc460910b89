"""The `teacher:` section: a second, different model that gives each sampled token its log-prob for
on-policy distillation (algo.distill). Validated before any process starts; the teacher itself is
built by megarl/teacher/build.py.

Two kinds, exactly one per run with a teacher:
- colocated (`hf_dir`): an HF checkpoint of any supported family loaded on the training ranks at a
  layout of its own (tp, pp, ep; the rest of the world is its data parallel), in its own dtype,
  its weights on the host between uses (offload);
- served (`url`, or `serve: true` to start vLLM's OpenAI-compatible server on `hf_dir` from the
  run): asked for the sampled tokens' log-probs (`prompt_logprobs`).
"""

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class TeacherConfig:
    hf_dir: str = ""  # HF checkpoint of the teacher ("" and no url: no teacher)
    # An OpenAI-compatible endpoint serving the teacher (vLLM's: /v1/completions with
    # prompt_logprobs), e.g. http://host:8000/v1; "" with serve=false: colocated on the trainer.
    url: str = ""
    serve: bool = False  # start vLLM's server on hf_dir for the run (a served teacher without url)
    # The colocated teacher's layout inside the trainer's world (its data parallel is the rest).
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dtype: str = "auto"  # the teacher's compute dtype; auto: its checkpoint's torch_dtype
    offload: bool = True  # colocated: its weights on the host between uses (on a GPU)
    timeout_s: float = 300.0  # served: one request's limit before the step fails

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"teacher.dtype={self.dtype!r}; choose one of {DTYPES}")
        if self.url and self.serve:
            raise ValueError(f"teacher.url={self.url!r} with teacher.serve=true: give the URL of a "
                             "server that runs, or serve=true to start one on teacher.hf_dir, not both")
        if self.serve and not self.hf_dir:
            raise ValueError("teacher.serve=true needs teacher.hf_dir, the checkpoint to serve")
        if min(self.tp, self.pp, self.ep) < 1:
            raise ValueError(f"teacher.tp={self.tp}, teacher.pp={self.pp}, teacher.ep={self.ep} must "
                             "each be >= 1")
        if self.timeout_s <= 0:
            raise ValueError(f"teacher.timeout_s={self.timeout_s} must be > 0 (seconds)")

    @property
    def active(self) -> bool:
        return bool(self.hf_dir or self.url)

    @property
    def served(self) -> bool:
        return bool(self.url) or self.serve


@dataclass(frozen=True)
class DistillConfig:
    """algo.distill: the per-token reverse-KL term of on-policy distillation (megarl/algos/distill.py)."""
    # 0: off; > 0 adds -coeff * (log pi_student - log pi_teacher) to each response token's advantage
    coeff: float = 0.0

    def __post_init__(self):
        if self.coeff < 0:
            raise ValueError(f"algo.distill.coeff={self.coeff} must be >= 0 (0 turns distillation off)")
