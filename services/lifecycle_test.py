import platform

from services.lifecycle import reuse_large_buffers


def test_large_buffers_setting_takes_on_glibc() -> None:
    # mallopt answers 1 for a value it accepts; off glibc nothing is changed.
    assert reuse_large_buffers() is (platform.libc_ver()[0] == "glibc")
