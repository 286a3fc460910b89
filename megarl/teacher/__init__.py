"""On-policy distillation's teacher: a second model, different from the actor, that gives the
tokens the student sampled their log-probs (the loop's "teacher_logprobs" phase).

config.py: the `teacher:` section; build.py: the teacher a resolved run names; colocated.py: one
on the training ranks. Every teacher has `logprobs(batch) -> batch` (teacher_logprobs and
teacher_top1 [N, L] filled on every trainer rank, collective over them) and `shutdown()`.
"""
