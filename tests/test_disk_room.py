"""The suite's disk check names the folder, its free room, the room needed and the fix."""

import shutil

from tests import disk_room


def test_a_full_disk_is_named_with_its_room_and_the_fix(tmp_path):
    free_gib = shutil.disk_usage(tmp_path).free / 2**30
    assert disk_room.shortfall(str(tmp_path), free_gib / 2) == ""
    why = disk_room.shortfall(str(tmp_path), free_gib + 100)
    assert why.startswith(f"{tmp_path} has ") and "GiB free" in why
    assert f"up to {free_gib + 100:.1f} GiB" in why and "TMPDIR" in why
