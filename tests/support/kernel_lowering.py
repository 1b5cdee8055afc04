"""Triton kernels launched under the CPU interpreter, lowered to Triton IR for an H100/H200.

The interpreter runs a kernel's body as Python, so what only Triton's compiler front end rejects
(a jitted helper returning ``None``, a value whose type changes across a branch, an unsupported
construct) passes there and fails on the first GPU launch. ``record_launches`` notes every
interpreted launch with the signature and constexpr values the GPU's launcher would compile it
for (Triton's own binder decides: ``tl.constexpr`` parameters, defaults, ``None`` arguments,
integers equal to 1 unless ``do_not_specialize``); ``lower_recorded`` then lowers each distinct
(kernel, signature, constexprs) to TTIR for sm_90, without a GPU, and returns what failed.

Launches through ``triton.autotune`` / ``triton.heuristics`` reach the same entry point with the
chosen configuration's values, so they are recorded too. Launch options (``num_warps``, ...) and
pointer alignment hints (where a CPU allocation lands) do not change the lowering to TTIR and are
left out, which keeps the set of variants the same from run to run.

The lowering runs in a child process without ``TRITON_INTERPRET``: there ``@triton.jit`` gives
the real compiler's functions (the interpreter's process holds interpreter stand-ins for the
kernels' jitted helpers, which the compiler cannot call).
"""
from __future__ import annotations

import functools
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass

TARGET = ("cuda", 90, 32)  # backend, compute capability (sm_90: H100 / H200), warp size


@dataclass(frozen=True)
class Launch:
    """One kernel variant: the kernel by module and name, the type of each parameter (``*bf16``,
    ``i32``, ``fp32``, ``constexpr``, ...) and the constexpr values by parameter path."""
    module: str
    name: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[tuple[int, ...], object], ...]

    @property
    def kernel(self) -> str:
        return f"{self.module}.{self.name}"

    def describe(self) -> str:
        """The constexpr values, as ``name=value, ...``."""
        return ", ".join(f"{self.signature[path[0]][0]}={value!r}" for path, value in self.constexprs)


_recorded: dict[tuple, Launch] = {}


def recorded() -> list[Launch]:
    """The distinct launches noted so far, in the order first seen."""
    return list(_recorded.values())


@functools.cache
def _backend():
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend(GPUTarget(*TARGET))


@functools.cache
def _binder(kernel):
    """Triton's argument binder for an interpreted kernel: the function the GPU launcher runs to
    turn a launch's arguments into (bound arguments, per-parameter specialization)."""
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = JITFunction(kernel.fn, **kernel.kwargs)
    return jit, create_function_from_signature(jit.signature, jit.params, _backend())


def launch_of(kernel, args: tuple, kwargs: dict) -> Launch:
    """The variant that ``kernel[grid](*args, **kwargs)`` compiles (an interpreted kernel)."""
    from triton._utils import find_paths_if, get_iterable_path

    jit, binder = _binder(kernel)
    bound, specialization, _options = binder(*args, **kwargs)
    types = [spec[0] for spec in specialization]
    paths = find_paths_if(types, lambda _, ty: ty == "constexpr")
    values = list(bound.values())
    return Launch(kernel.fn.__module__, kernel.fn.__qualname__,
                  tuple((p.name, ty) for p, ty in zip(jit.params, types)),
                  tuple((path, get_iterable_path(values, path)) for path in paths))


def record_launches() -> None:
    """From now on, note each launch of an interpreted kernel (``kernel[grid](...)``) before it
    runs."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    if getattr(run, "records_launches", False):
        return

    def recording_run(self, *args, grid, warmup, **kwargs):
        launch = launch_of(self, args, kwargs)
        _recorded.setdefault((launch.module, launch.name, launch.signature, repr(launch.constexprs)), launch)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recording_run.records_launches = True
    InterpretedFunction.run = recording_run


@dataclass(frozen=True)
class Failure:
    """A launch the compiler's front end rejected: the kernel's file and line, its message."""
    launch: Launch
    file: str
    message: str

def report(failures: list[Failure]) -> str:
    """The failures by kernel and message: the kernel, its file, the constexprs of each variant
    that failed that way, and the compiler's message once."""
    groups: dict[tuple[str, str, str], list[Launch]] = {}
    for failure in failures:
        groups.setdefault((failure.launch.kernel, failure.file, failure.message), []).append(failure.launch)
    return "\n\n".join(f"{kernel} ({file}), {len(launches)} variant(s):\n"
                        + "".join(f"  ({launch.describe()})\n" for launch in launches) + message
                        for (kernel, file, message), launches in groups.items())


def lower_recorded(launches: list[Launch] | None = None, timeout: float = 120.0) -> list[Failure]:
    """Lower each launch (default: all recorded) to TTIR for sm_90 in a child process; the ones
    the compiler's front end rejects, with the file of the kernel and the compiler's message."""
    launches = recorded() if launches is None else launches
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory(prefix="ninfer-lowering-") as folder:
        todo, found = os.path.join(folder, "launches.pickle"), os.path.join(folder, "failures.pickle")
        with open(todo, "wb") as f:  # plain tuples: the child runs this file as a script, not as support
            pickle.dump((sys.path, [(l.module, l.name, l.signature, l.constexprs) for l in launches]), f)
        done = subprocess.run([sys.executable, os.path.abspath(__file__), todo, found], capture_output=True,
                              env=env, timeout=timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the lowering process failed ({done.returncode}):\n{done.stderr.decode()}")
        with open(found, "rb") as f:
            return [Failure(launches[i], file, message) for i, file, message in pickle.load(f)]


def _message(error: BaseException) -> str:
    """The compiler's message with its causes: a failure inside a jitted helper is reported at the
    kernel's call, then at the helper's line, then as the Python error the front end hit."""
    parts = []
    while error is not None:
        parts.append(f"{type(error).__name__}: {error}".rstrip())
        error = error.__cause__
    return "\n  caused by ".join(parts)


def _lower_all(launches: list[tuple]) -> list[tuple[int, str, str]]:
    """In the child process: lower each (module, name, signature, constexprs) with the real
    compiler's front end; (index, kernel's file, message) of each that fails."""
    from triton._C.libtriton import ir
    from triton.compiler import ASTSource

    backend = _backend()
    options = backend.parse_options({})
    codegen, module_map = backend.get_codegen_implementation(options), backend.get_module_map()
    failures = []
    for i, (module, name, signature, constexprs) in enumerate(launches):
        file = module
        try:
            kernel = importlib.import_module(module)
            for part in name.split("."):
                kernel = getattr(kernel, part)
            while not hasattr(kernel.fn, "__code__"):  # under triton.autotune / triton.heuristics
                kernel = kernel.fn
            file = f"{kernel.fn.__code__.co_filename}:{kernel.fn.__code__.co_firstlineno}"
            context = ir.context()
            ir.load_dialects(context)
            backend.load_dialects(context)
            source = ASTSource(kernel, dict(signature), constexprs=dict(constexprs))
            source.make_ir(backend.target, options, codegen, module_map, context)
        except Exception as e:  # noqa: BLE001 - every compiler error is the finding
            failures.append((i, file, _message(e)))
    return failures


if __name__ == "__main__":  # the child process of lower_recorded: python kernel_lowering.py IN OUT
    with open(sys.argv[1], "rb") as f:
        path, todo = pickle.load(f)
    sys.path[:0] = path  # the kernels' modules import as in the tests' process
    result = _lower_all(todo)
    with open(sys.argv[2], "wb") as f:
        pickle.dump(result, f)
