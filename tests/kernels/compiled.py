"""Compile a launcher's Triton kernels for a GPU that is not here.

Triton's interpreter (``TRITON_INTERPRET=1``, the CPU kernel tests) checks neither types nor
layouts, so a kernel it runs may still be one the compiler refuses. Triton ships its NVIDIA
toolchain (``ptxas``) and compiles for a named target without a device. What is compiled is
what a launcher really launches: `recorded_launches` runs the launcher on CPU tensors with each
kernel's launch replaced by a record of its arguments, and `compile_launch` derives the
signature, the constexprs, the specialization (pointer alignment, integers divisible by 16 or
equal to 1) and the options from those arguments with Triton's own binder, as a launch on the
device does, then compiles. No signature is written by hand, so none can drift from the
launcher.

Used by the compile tests (``tests/kernels/test_compiled.py``) and by
``benchmarks/speed.py quantize --sass``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

#: shared memory one program may use, by compute capability (CUDA's opt-in maximum per
#: block: 227 KiB on H100 / H200, 163 KiB on A100); a kernel needing more compiles but
#: fails at launch
SHARED_BYTES = {90: 232448, 80: 166912}


class Launch(NamedTuple):
    """One recorded launch: the kernel, its grid, and the arguments the launcher passed."""

    kernel: Any  #: the ``@triton.jit`` function
    grid: Any
    args: tuple
    kwargs: dict

    def constexprs(self) -> dict[str, Any]:
        """The constexpr arguments by name (for reading and naming a launch)."""
        names = [p.name for p in self.kernel.params]
        bound = dict(zip(names, self.args))
        bound.update(self.kwargs)
        return {p.name: bound[p.name] for p in self.kernel.params if p.is_constexpr}


def toolchain_missing(capability: int = 90) -> str | None:
    """Why nothing can be compiled for ``sm_<capability>`` here, or None if it can: Triton
    absent, running interpreted, or no NVIDIA backend / ``ptxas`` in this Triton."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1: the kernels are interpreted functions, not compilable ones"
    try:
        import triton
        from triton.backends import backends
    except ImportError as err:
        return f"no Triton: {err}"
    if "nvidia" not in backends:
        return f"Triton {triton.__version__} has no NVIDIA backend"
    import subprocess

    try:
        from triton.backends.nvidia.compiler import get_ptxas_version

        get_ptxas_version(capability)
    except (ImportError, OSError, RuntimeError, subprocess.CalledProcessError) as err:
        return f"Triton {triton.__version__} runs no ptxas: {type(err).__name__}: {err}"
    return None


@contextlib.contextmanager
def recorded_launches(*kernels) -> Iterator[list[Launch]]:
    """Within the block, launching any of ``kernels`` records a `Launch` and runs nothing
    (the outputs stay as the launcher allocated them)."""
    launches: list[Launch] = []
    for kernel in kernels:
        if "run" in vars(kernel):
            raise RuntimeError(f"{kernel} is recorded already")

        def record(*args, grid, warmup, _kernel=kernel, **kwargs):
            launches.append(Launch(_kernel, grid, args, kwargs))

        kernel.run = record  # `kernel[grid](...)` calls `self.run` at launch
    try:
        yield launches
    finally:
        for kernel in kernels:
            del kernel.run


def compile_launch(launch: Launch, capability: int = 90):
    """Compile ``launch``'s kernel for ``sm_<capability>`` as Triton would compile it on that
    device for these arguments (Triton's launch binder derives the signature, constexprs,
    specialization and options); returns the compiled kernel (``.asm["ptx"]``,
    ``.asm["cubin"]``). The binder is the one ``JITFunction.run`` calls
    (``create_function_from_signature``, ``_pack_args``: the same in Triton 3.6 and 3.9); a
    Triton that changes them fails here loudly, rather than compiling something else."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def check_compiled(launch: Launch, capability: int = 90):
    """`compile_launch`, and that the result can launch on that device: a cubin, and no more
    shared memory than a program may have there (which Triton checks only at launch)."""
    compiled = compile_launch(launch, capability)
    assert compiled.asm["cubin"], launch.constexprs()
    shared, limit = compiled.metadata.shared, SHARED_BYTES[capability]
    assert shared <= limit, f"{shared} bytes of shared memory > {limit}: {launch.constexprs()}"
    return compiled
