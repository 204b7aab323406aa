"""Builds the native extension vllm_dflash._C against the installed torch.

    pip install --no-build-isolation --no-deps -e .   # editable install
    python setup.py build_ext --inplace               # rebuild in place

The extension is built with CMake (CMakeLists.txt) through torch's CMake
package; builds are incremental in build/cmake-<python>-<cpu|cuda>/. When
torch has CUDA, csrc/cuda/*.cu and csrc/cuda_bindings.cpp are built too.

Environment:
    VLLM_DFLASH_CUDA=0             build CPU kernels only, even with CUDA torch
    TORCH_CUDA_ARCH_LIST           e.g. "9.0"; default: the visible GPU, else "8.0;9.0"
    MAX_JOBS                       parallel compile jobs (default: CPU count)
    VLLM_DFLASH_BUILD_BACKEND      "cmake" (default when cmake is installed) or
                                   "torch" (torch.utils.cpp_extension, same sources)
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
EXT_NAME = "vllm_dflash._C"


def _load_envs():
    """vllm_dflash/envs.py (the reader of every VLLM_DFLASH_* variable), loaded
    by path: the package itself cannot be imported before it is built."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_vllm_dflash_envs", ROOT / "vllm_dflash" / "envs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


envs = _load_envs()


def _tool(name: str) -> str | None:
    """A tool from this interpreter's environment first (pip's cmake/ninja)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def _want_cuda(torch) -> bool:
    return torch.version.cuda is not None and envs.VLLM_DFLASH_CUDA


def _cuda_arch_list(torch) -> str:
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return "8.0;9.0"


def _cuda_home() -> Path | None:
    """The toolkit torch's extension builder would use (CUDA_HOME, nvcc on PATH, /usr/local/cuda)."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return Path(CUDA_HOME)
    return None


def _sources(cuda: bool) -> list[str]:
    """Same globs as CMakeLists.txt, relative to ROOT."""

    def glob(pattern):
        return sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))

    srcs = [s for s in glob("csrc/*.cpp") + glob("csrc/cpu/*.cpp") if not s.endswith("cuda_bindings.cpp")]
    if cuda:
        srcs += glob("csrc/cuda/*.cu") + glob("csrc/cuda/*.cpp") + ["csrc/cuda_bindings.cpp"]
    return srcs


def _drop_stale_cache(build_dir: Path, generator: str) -> None:
    """A CMake cache made from another checkout path or generator cannot be reused."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return
    text = cache.read_text(errors="replace")
    if f"CMAKE_HOME_DIRECTORY:INTERNAL={ROOT}\n" not in text or f"CMAKE_GENERATOR:INTERNAL={generator}\n" not in text:
        shutil.rmtree(build_dir)


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import torch

        cmake, ninja = _tool("cmake"), _tool("ninja")
        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        cuda = _want_cuda(torch)
        build_dir = ROOT / "build" / f"cmake-{sys.implementation.cache_tag}-{'cuda' if cuda else 'cpu'}"
        generator = "Ninja" if ninja else "Unix Makefiles"
        _drop_stale_cache(build_dir, generator)
        configure = [
            cmake, "-S", str(ROOT), "-B", str(build_dir), "-G", generator,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DVLLM_DFLASH_CUDA={'ON' if cuda else 'OFF'}",
            f"-DVLLM_DFLASH_OUTPUT_DIR={out.parent}",
            f"-DVLLM_DFLASH_EXT_SUFFIX={out.name[len('_C'):]}",
        ]  # fmt: skip
        if ninja:
            configure.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
        env = dict(os.environ)
        if cuda:
            env["TORCH_CUDA_ARCH_LIST"] = _cuda_arch_list(torch)
            cuda_home = _cuda_home()
            if cuda_home is not None:  # pin the toolkit for torch's FindCUDA and CMake's CUDA language
                configure += [f"-DCMAKE_CUDA_COMPILER={cuda_home / 'bin' / 'nvcc'}",
                              f"-DCUDA_TOOLKIT_ROOT_DIR={cuda_home}", f"-DCUDAToolkit_ROOT={cuda_home}"]
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run(configure, check=True, env=env)
        subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], check=True, env=env)
        if not out.exists():
            raise RuntimeError(f"CMake finished but {out} was not produced")


def _extension_and_command():
    backend = envs.VLLM_DFLASH_BUILD_BACKEND or ("cmake" if _tool("cmake") else "torch")
    if backend == "cmake":
        return Extension(EXT_NAME, sources=[]), CMakeBuild
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cuda = _want_cuda(torch)
    if cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = _cuda_arch_list(torch)
    make = CUDAExtension if cuda else CppExtension
    ext = make(
        EXT_NAME,
        _sources(cuda),
        include_dirs=[str(ROOT / "csrc")],
        define_macros=[("VLLM_DFLASH_WITH_CUDA", "1")] if cuda else [],
        extra_compile_args={"cxx": ["-O3", "-fopenmp"], "nvcc": ["-O3"]},
        extra_link_args=["-fopenmp"],
    )
    return ext, BuildExtension.with_options(use_ninja=_tool("ninja") is not None)


_ext, _build_ext = _extension_and_command()
setup(ext_modules=[_ext], cmdclass={"build_ext": _build_ext})
