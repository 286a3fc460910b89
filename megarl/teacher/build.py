"""The teacher a resolved run names (teacher: section), built on every trainer rank, and the checks
that refuse a teacher before anything is built: its checkpoint, its vocabulary and tokenizer.

Owns choosing the kind and its architecture; the kinds own the rest."""

import os
from dataclasses import replace
from typing import Optional

from megarl.models.hf.config import ModelArch, arch_from_hf_config, load_hf_config
from megarl.models.hf.tokenizer_files import has_tokenizer
from megarl.parallel_state.dims import ParallelDims
from megarl.teacher.config import TeacherConfig


def teacher_arch(teacher: TeacherConfig, student: ModelArch, student_dir: str) -> ModelArch:
    """The teacher checkpoint's architecture in the teacher's dtype, refused (naming both) when its
    vocabulary is not the student's (checkpoint `student_dir`): the teacher scores the student's
    token ids as they are."""
    if not os.path.isdir(teacher.hf_dir):
        raise ValueError(f"teacher.hf_dir={teacher.hf_dir!r} is not a folder: give the teacher's HF "
                         "checkpoint folder (config.json and safetensors)")
    arch = arch_from_hf_config(load_hf_config(teacher.hf_dir))
    if arch.vocab_size != student.vocab_size:
        raise ValueError(f"the teacher's vocabulary ({teacher.hf_dir!r}: vocab_size {arch.vocab_size}) is "
                         f"not the student's ({student_dir!r}: vocab_size {student.vocab_size}): a "
                         "teacher must share the student's tokenizer and vocabulary")
    return replace(arch, dtype=teacher.dtype) if teacher.dtype != "auto" else arch


def teacher_dims(teacher: TeacherConfig, world_size: int) -> ParallelDims:
    """The colocated teacher's layout in the trainer's world of `world_size` ranks: its tp, pp and
    ep, cp 1, the rest its data parallel; refused naming teacher.* where it does not divide."""
    try:
        return ParallelDims(world_size=world_size, tp=teacher.tp, pp=teacher.pp, ep=teacher.ep)
    except ValueError as error:
        raise ValueError(f"teacher.tp={teacher.tp}, teacher.pp={teacher.pp}, teacher.ep={teacher.ep} in "
                         f"the trainer's world of {world_size} ranks: {error}; choose teacher sizes whose "
                         f"product divides {world_size}") from None


def check_same_tokenizer(teacher_dir: str, student_dir: str) -> None:
    """Refuse a teacher whose tokenizer maps any token differently from the student's (the same
    vocab_size is not enough: the ids would mean other text). A teacher folder without tokenizer
    files is taken to share the student's."""
    if not has_tokenizer(teacher_dir):
        return
    import transformers

    teacher = transformers.AutoTokenizer.from_pretrained(teacher_dir).get_vocab()
    student = transformers.AutoTokenizer.from_pretrained(student_dir).get_vocab()
    if teacher != student:
        differ = sorted(set(teacher.items()) ^ set(student.items()))[:3]
        raise ValueError(f"the teacher's tokenizer ({teacher_dir!r}, {len(teacher)} tokens) is not the "
                         f"student's ({student_dir!r}, {len(student)} tokens); e.g. {differ} differ: "
                         "distill from a teacher with the student's tokenizer")


def build_teacher(resolved, **transformer_overrides) -> Optional[object]:
    """The run's teacher on this trainer rank, or None without one. Collective."""
    config = resolved.config
    teacher = config.teacher
    if not teacher.active:
        return None
    if teacher.served:
        from megarl.teacher.served import ServedTeacher

        # the longest sequence a run scores, as its rollout engine's context (rollout/builder.py)
        args = (resolved.arch.vocab_size, config.data.max_prompt_len + config.generation.max_new_tokens,
                teacher.timeout_s)
        if teacher.url:
            return ServedTeacher(teacher.url, *args)
        return ServedTeacher.serve(teacher.hf_dir, resolved.teacher_arch.dtype, *args,
                                   log_path=os.path.join(config.run_dir, "teacher_server.log"))
    from megarl.teacher.colocated import ColocatedTeacher

    return ColocatedTeacher(teacher.hf_dir, resolved.teacher_arch, resolved.teacher_dims,
                            config.actor.batching, teacher.offload, config.collective_timeout_s,
                            **transformer_overrides)
