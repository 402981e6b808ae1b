"""Where the process kubelet points a pod's paths: into its volumes, unless the host file
a value names exists (a process node shares the host's files)."""

from __future__ import annotations

from pathlib import Path

from refit_operator.local.kubelet import _remap


def test_a_path_inside_a_mount_goes_to_the_pods_volume(tmp_path: Path) -> None:
    mounts = {"/tmp": tmp_path / "volumes" / "tmp", "/var/run/refit": tmp_path / "signal"}
    assert _remap("/tmp", mounts) == str(tmp_path / "volumes" / "tmp")
    assert _remap("/var/run/refit/pids", mounts) == str(tmp_path / "signal" / "pids")
    assert _remap("/tmp/no-such-dir-here/x", mounts) == str(
        tmp_path / "volumes" / "tmp" / "no-such-dir-here" / "x"
    )
    assert _remap("/etc/hostname", mounts) == "/etc/hostname"  # outside every mount


def test_a_host_file_below_a_mount_stays_the_hosts(tmp_path: Path) -> None:
    # A checkout under /tmp (CI's clone, say) whose script a pod runs by path.
    script = tmp_path / "examples" / "policy.py"
    script.parent.mkdir(parents=True)
    script.write_text("")
    mounts = {str(tmp_path): tmp_path / "pod" / "volumes" / "tmp"}
    assert _remap(str(script), mounts) == str(script)
    assert _remap(str(tmp_path / "examples" / "gone.py"), mounts) == str(
        tmp_path / "pod" / "volumes" / "tmp" / "examples" / "gone.py"
    )
    # A path list (the examples' PYTHONPATH into the checkout): entry by entry.
    listed = f"{script.parent}:{tmp_path / 'gone'}:/usr/lib"
    assert _remap(listed, mounts) == (
        f"{script.parent}:{tmp_path / 'pod' / 'volumes' / 'tmp' / 'gone'}:/usr/lib"
    )
