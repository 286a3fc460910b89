"""The disk room the suite needs under its temporary folder, checked before the first test: on a
full disk every test that asks for tmp_path errors at its setup, and the run ends in hundreds of
errors that name no cause (a CI run did, 2026-11-29: docs/testing.md, "Disk")."""

import shutil

# The most the suite holds at once under its base temporary folder, its Ray sessions and its
# launches' files, with room to spare (measured: docs/testing.md, "Disk").
SUITE_GIB = 6.0


def shortfall(folder: str, need_gib: float) -> str:
    """Why `folder`'s disk cannot hold `need_gib` more, or "" when it can."""
    free_gib = shutil.disk_usage(folder).free / 2**30
    if free_gib >= need_gib:
        return ""
    return (f"{folder} has {free_gib:.1f} GiB free; the suite writes up to {need_gib:.1f} GiB there "
            f"(tests/disk_room.py). Free some room, or point TMPDIR (or pytest's --basetemp) at a "
            f"disk that has it")
