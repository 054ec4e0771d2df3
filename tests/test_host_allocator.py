"""A CPU rank's heap keeps what a step frees (costmodel.host_allocator), unless
the user set glibc's allocator themselves."""

import os
import subprocess
import sys

import pytest

from costmodel.host_allocator import MALLOC_ENVIRONMENT, glibc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Allocates, touches and frees a block of 64 MiB (over glibc's largest moving
# mmap threshold) ten times after keep_freed_host_memory(); prints whether it
# set the allocator and the page faults of the last nine rounds.
_ROUNDS = """
import resource, sys
from costmodel.host_allocator import keep_freed_host_memory
kept = keep_freed_host_memory()
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = bytearray(64 << 20)
    block[::4096] = b"x" * len(block[::4096])
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, sum(faults[1:]))
"""


def _rounds(extra_env: dict[str, str]) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENVIRONMENT}
    env.update(extra_env, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", _ROUNDS], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=60).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(glibc() is None, reason="the C library is not glibc")
def test_freed_blocks_are_reused_without_new_pages():
    kept, faults = _rounds({})
    assert kept
    # 9 rounds of 16,384 pages each had the block been mapped afresh every time
    assert faults < 1000


@pytest.mark.skipif(glibc() is None, reason="the C library is not glibc")
def test_an_allocator_the_user_set_is_left_alone():
    kept, faults = _rounds({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert not kept
    assert faults > 9 * 16_000  # the user's 1 MiB threshold: every block mapped afresh
