"""pagedllm's C++ CPU kernels (``torch.ops.pagedllm``), compiled on first use and cached.

The sources in ``csrc/`` are built at run time on the machine that runs them (``-O3
-march=native``, so the code fits this CPU: a CI machine or a user's laptop builds its own), with
the compiler and paths ``torch.utils.cpp_extension`` uses (``CXX`` overrides the compiler), into
one shared library that registers its ops with the dispatcher. The library is cached under
``$PAGEDLLM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/pagedllm`` or ``~/.cache/pagedllm``), in
``kernels/<key>/`` where key hashes the sources, the flags, the torch version, the compiler and
the CPU: a second process (or a second run) loads it without compiling; a build is serialised
across processes by a file lock and published by an atomic rename.

Where there is no compiler or the build fails, ``available()`` is False and callers take their
pure-torch path; one warning says why and how to fix it. ``PAGEDLLM_CPU_KERNELS=0`` switches the
kernels off (no build is attempted).

``PAGEDLLM_ISA`` picks the instruction set the kernels are built for: ``auto`` (default: this
CPU's best, ``-march=native``), ``avx512`` (the same, refused on a CPU without AVX-512F) or
``avx2`` (``-march=haswell``: AVX2, FMA and F16C, no AVX-512, so a machine with AVX-512 runs and
tests the code an AVX2-only CPU runs). Each ISA's build has its own cache key (the flags are in
it); the ISA in use is named in the engine's start-up line and read by ``isa()``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm._cpu import cpu_flags, cpu_model
from pagedllm.logging_utils import init_logger

logger = init_logger(__name__)

# Sources and their own flags; elementwise.cpp rounds where torch's unfused ops round (no
# multiply-add contraction).
SOURCES: dict[str, tuple[str, ...]] = {
    "paged_attention.cpp": (),
    "elementwise.cpp": ("-ffp-contract=off",),
    "decoder_layer.cpp": (),
    "gemm.cpp": (),
    "gemm_bf16.cpp": (),
    "gemm_w16.cpp": (),
    "argmax.cpp": (),
}
_CSRC = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-fopenmp", "-std=c++20", "-fPIC", "-fno-math-errno",
         "-fno-trapping-math", "-w")

# PAGEDLLM_ISA's values: the CPU flags each needs and its -march flags ("auto" is one of these)
ISA_NEEDS: dict[str, tuple[str, ...]] = {"avx512": ("avx512f", "avx2", "fma", "f16c"),
                                         "avx2": ("avx2", "fma", "f16c"), "generic": ()}
ISA_MARCH: dict[str, tuple[str, ...]] = {"avx512": ("-march=native",),
                                         "avx2": ("-march=haswell", "-mtune=native"),
                                         "generic": ("-march=native",)}

_state: dict[str, object] = {}  # "loaded": bool, "error": str | None, "path": Path, "isa": str


def cache_dir() -> Path:
    root = envs.get("PAGEDLLM_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "pagedllm" if xdg else Path.home() / ".cache" / "pagedllm"


def _cpu_id() -> str:
    """What -march=native depends on: the machine and its CPU's model and feature flags."""
    return f"{platform.machine()}|{cpu_model()}|{' '.join(sorted(cpu_flags()))}"


def choose_isa(setting: str, flags: frozenset[str]) -> str:
    """The ISA to build for: ``setting`` is PAGEDLLM_ISA's value (auto, avx512, avx2), ``flags``
    the CPU's. A ValueError naming the variable for an unknown value or one this CPU cannot run."""
    setting = setting.strip().lower() or "auto"
    if setting == "auto":
        return next(isa for isa, needs in ISA_NEEDS.items() if set(needs) <= flags)
    if setting not in ISA_NEEDS or setting == "generic":
        raise ValueError(f"PAGEDLLM_ISA={setting!r}: use auto, avx512 or avx2")
    missing = [f for f in ISA_NEEDS[setting] if f not in flags]
    if missing:
        runs = [i for i, n in ISA_NEEDS.items() if i != "generic" and set(n) <= flags]
        raise ValueError(f"PAGEDLLM_ISA={setting}: this CPU ({cpu_model()}) lacks "
                         f"{', '.join(missing)}; unset PAGEDLLM_ISA (auto) or set it to "
                         f"{' or '.join(runs) or 'auto'}")
    return setting


def _isa() -> str:
    return choose_isa(envs.get("PAGEDLLM_ISA") or "auto", cpu_flags())


def _flags() -> tuple[str, ...]:
    return (*FLAGS[:1], *ISA_MARCH[_isa()], *FLAGS[1:])


def _commands(out: Path) -> tuple[list[list[str]], list[str]]:
    """One compile command per source (objects next to ``out``), then the link command."""
    from torch.utils import cpp_extension

    cxx = cpp_extension.get_cxx_compiler()
    abi = int(torch.compiled_with_cxx11_abi())
    common = [cxx, *_flags(), f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    common += [f"-I{p}" for p in cpp_extension.include_paths()]
    objs = [out.with_suffix(f".{i}.o") for i in range(len(SOURCES))]
    compiles = [[*common, *extra, "-c", str(_CSRC / src), "-o", str(obj)]
                for (src, extra), obj in zip(SOURCES.items(), objs)]
    link = [cxx, "-shared", "-fopenmp", *map(str, objs)]
    link += [f"-L{p}" for p in cpp_extension.library_paths()]
    link += ["-lc10", "-ltorch_cpu", "-o", str(out)]
    return compiles, link


def _key() -> str:
    h = hashlib.sha256()
    for name in sorted(p.name for p in _CSRC.iterdir()):
        h.update(name.encode() + b"\0" + (_CSRC / name).read_bytes())
    from torch.utils import cpp_extension

    h.update(" ".join([*_flags(), repr(SOURCES), cpp_extension.get_cxx_compiler(), torch.__version__,
                       _cpu_id()]).encode())
    return h.hexdigest()[:16]


def _finish(cmd: list[str], proc: subprocess.Popen[str]) -> None:
    output, _ = proc.communicate()
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{tail}")


def _build(lib: Path) -> None:
    """Compile into ``lib`` unless another process already did; raises on failure. Logs a start
    line, one line per compiled source and "done in X s" (a first start waits on it)."""
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.parent / "lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # one builder at a time; the others wait, then load
            logger.info("waiting for another process to finish compiling pagedllm CPU kernels")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return
        fd, name = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        tmp = Path(name)
        compiles, link = _commands(tmp)
        t0 = time.monotonic()
        logger.info("compiling pagedllm CPU kernels (%d sources in parallel, once per machine; "
                    "a minute or more) into %s", len(compiles), lib.parent)

        def start(cmd: list[str]) -> subprocess.Popen[str]:
            return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)

        try:
            # the sources in parallel, each reported as it finishes
            with ThreadPoolExecutor(len(compiles)) as pool:
                done = {pool.submit(_finish, c, start(c)): src for c, src in zip(compiles, SOURCES)}
                for i, fut in enumerate(as_completed(done), 1):
                    fut.result()
                    logger.info("compiling pagedllm CPU kernels: %d/%d %s (%.0f s)", i,
                                len(done), done[fut], time.monotonic() - t0)
            _finish(link, start(link))
            os.replace(tmp, lib)
        except OSError as e:  # the compiler itself is missing
            raise RuntimeError(f"{compiles[0][0]}: {e}") from e
        finally:
            for f in tmp.parent.glob(tmp.stem + ".*"):  # objects, and the library if not moved
                f.unlink()
        logger.info("compiled pagedllm CPU kernels: done in %.1f s", time.monotonic() - t0)


def available() -> bool:
    """True once ``torch.ops.pagedllm`` holds the kernels (built or loaded on the first call)."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    _state["loaded"], _state["error"] = False, None
    if not envs.is_on("PAGEDLLM_CPU_KERNELS"):
        _state["error"] = "switched off by PAGEDLLM_CPU_KERNELS=0"
        return False
    isa_ = _state["isa"] = _isa()  # a bad PAGEDLLM_ISA raises here, before any build
    lib = cache_dir() / "kernels" / _key() / "pagedllm_kernels.so"
    try:
        if not lib.exists():
            _build(lib)
        torch.ops.load_library(str(lib))
    except Exception as e:  # no compiler, a failed build, a library that does not load
        _state["error"] = str(e)
        warnings.warn(
            f"pagedllm CPU kernels unavailable, using the slower pure-torch paths: {e}\n"
            "Install a C++ compiler (g++) or point CXX at one; PAGEDLLM_CPU_KERNELS=0 skips "
            "this attempt.", RuntimeWarning, stacklevel=2)
        return False
    _state["loaded"], _state["path"] = True, lib
    logger.debug("pagedllm CPU kernels: %s (PAGEDLLM_ISA=%s, CPU %s)", isa_,
                envs.get("PAGEDLLM_ISA"), cpu_model())
    return True


def isa() -> str | None:
    """The ISA the loaded kernels were built for ("avx512", "avx2", "generic"); None without
    them."""
    return _state.get("isa") if available() else None  # type: ignore[return-value]


def fused(*tensors: torch.Tensor) -> bool:
    """Whether the fused CPU ops may take these tensors: the kernels are built, every tensor is
    on CPU with a contiguous last dim, and autograd is off (the ops have no backward)."""
    return (not torch.is_grad_enabled()
            and all(t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
            and available())


def set_fused_ops(model: torch.nn.Module, on: bool, switch: str = "fused") -> int:
    """Let (or stop) the modules of ``model`` that have a ``fused`` switch (RMSNorm, SiluAndMul,
    the attention's rotary, the decoder layer) run the fused ops; returns how many modules it
    set. ``switch="fused_layer"``: the decoder layers' two-op path alone."""
    mods = [m for m in model.modules() if isinstance(getattr(type(m), switch, None), bool)]
    for m in mods:
        setattr(m, switch, on)  # a class attribute, not a submodule
    return len(mods)


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None before the first call or when loaded)."""
    return _state.get("error")  # type: ignore[return-value]
