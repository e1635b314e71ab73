"""What this CPU's vector units can do, read once, and the path the engine's bfloat16 products take on it.

The flags come from /proc/cpuinfo (the kernel's own cpuid reading; elsewhere none are assumed, so the engine takes
its most portable path). serving/kernels.c compiles every path and runs the one `bf16_path` names, so the library
loads on any AVX2 CPU and a test can run each path this CPU supports. AMX needs one thing more than its flags: Linux
gives a process the tiles' state only when it asks (`amx_granted`); without it the first tile instruction kills it.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

# /proc/cpuinfo's names of the flags the kernels care about
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
# bfloat16 product paths, fastest first, and the flags each needs (kernels.c: BF16_AMX, BF16_DOT, BF16_WIDENED)
BF16_PATHS = {"amx": ("amx_tile", "amx_bf16"), "avx512_bf16": ("avx512f", "avx512_bf16"), "widened": ("avx2", "fma")}
BF16_PATH_ENV = "DRAFTHEADS_BF16_PATH"  # auto (default), or one of BF16_PATHS to choose it
# Linux's arch_prctl: its number on x86-64, the request for an extended state's permission, AMX's tile data state
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18


@dataclass(frozen=True)
class CpuFeatures:
    model: str
    flags: frozenset[str]

    def has(self, *flags: str) -> bool:
        return all(flag in self.flags for flag in flags)

    def supports(self, path: str) -> bool:
        return self.has(*BF16_PATHS[path])

    def summary(self) -> str:
        """One line for a bench header: the CPU, the flags it has and the bfloat16 compute path."""
        have = [flag for flag in FLAGS if flag in self.flags]
        return f"{self.model}; {' '.join(have) or 'none of ' + ' '.join(FLAGS)}; bfloat16 products: {bf16_path()}"


def parse_cpuinfo(text: str) -> CpuFeatures:
    """The first processor's model name and flags in /proc/cpuinfo's text."""
    model, flags = "unknown CPU", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuFeatures(model, flags)


@functools.cache
def cpu_features() -> CpuFeatures:
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return CpuFeatures("unknown CPU", frozenset())


@functools.cache
def amx_granted() -> bool:
    """Whether Linux lets this process use AMX's tiles: asked once (the grant holds for every thread of the process),
    false off Linux x86-64 and where the kernel refuses (one older than 5.16, or a CPU without AMX)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def usable(features: CpuFeatures, path: str) -> bool:
    return features.supports(path) and (path != "amx" or amx_granted())


def bf16_path() -> str:
    """The path of the bfloat16 compute mode's products here: AMX tiles where the CPU has them and Linux grants them,
    else vdpbf16ps where it has AVX512-BF16, else bfloat16 widened to float32 on FMAs (BF16_PATH_ENV chooses one,
    e.g. to compare them)."""
    chosen = os.environ.get(BF16_PATH_ENV, "auto")
    features = cpu_features()
    if chosen == "auto":
        return next(path for path in BF16_PATHS if usable(features, path) or path == "widened")
    if chosen not in BF16_PATHS:
        raise ValueError(f"{BF16_PATH_ENV}={chosen!r}: choose auto or one of {', '.join(BF16_PATHS)}")
    if not features.supports(chosen):
        raise ValueError(f"{BF16_PATH_ENV}={chosen} needs {' and '.join(BF16_PATHS[chosen])}, which this CPU "
                         f"({features.model}) lacks: unset it or choose widened")
    if not usable(features, chosen):
        raise ValueError(f"{BF16_PATH_ENV}={chosen}: Linux did not grant this process AMX's tile state (arch_prctl "
                         "ARCH_REQ_XCOMP_PERM; a kernel of 5.16 or later grants it): unset it or choose avx512_bf16")
    return chosen
