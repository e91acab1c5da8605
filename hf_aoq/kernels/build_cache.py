"""A once-per-machine cache of compiled torch C++ extensions, safe under concurrent and killed builds.

A build lives in `<cache root>/<name>/`, a directory named by a digest of everything the binary
depends on (its sources, flags, torch and Python versions, instruction set, compiler), holding
the library and a `manifest.json` that repeats that key. Nothing else enters the key: not PATH
(which `ninja` runs the build), not the virtual environment (whose include path the build file
names). So a second process, another venv with the same torch, or a shell with another PATH
loads the finished library without building.

A build is compiled in a private temporary directory and renamed into place whole, so a reader
sees a complete build or none. Builders of one key take turns on an flock'd lock file: the
kernel releases it when its holder dies, so a build killed half way never blocks the next one
(torch's own lock file, which did, stays inside the private directory); the next builder removes
the killed build's leftovers. A waiter gives up after `wait_s` seconds with an error the caller
turns into the fallback.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.compile_cache import digest_files

logger = logging.getLogger("hf_aoq")

MANIFEST = "manifest.json"
CACHE_FORMAT = 1  # of the directory layout and manifest; part of every key


def cache_root() -> Path:
    """HF_AOQ_EXTENSION_DIR, else TORCH_EXTENSIONS_DIR/hf_aoq, else $XDG_CACHE_HOME (~/.cache)/hf_aoq/extensions."""
    if os.environ.get("HF_AOQ_EXTENSION_DIR"):
        return Path(os.environ["HF_AOQ_EXTENSION_DIR"]).expanduser()
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]).expanduser() / "hf_aoq"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf_aoq" / "extensions"


def compiler_identity() -> str | None:
    """The C++ compiler torch would run (CXX, else c++) as its `--version` text without the program
    name, or None when it cannot be run: the same compiler reached by two paths is one identity."""
    cxx = os.environ.get("CXX", "cl" if sys.platform == "win32" else "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[:1]
    return first[0].split(maxsplit=1)[-1] if first else None


class BuildUnavailable(RuntimeError):
    """No usable build here, and none can be made (no compiler, a build failed, a wait timed out)."""


@dataclass(frozen=True)
class Extension:
    """What one extension binary is made of. `files`: every source and header by name (compiled in
    one flat directory); `sources`: the names compiled, each its own translation unit; `functions`:
    the names the module exports, declared in `header`; `cpu_features`: the CPU flags (as
    /proc/cpuinfo names them) that `cflags` let the compiler use."""

    prefix: str
    files: tuple[tuple[str, bytes], ...]
    sources: tuple[str, ...]
    functions: tuple[str, ...]
    header: str
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    isa: str
    cpu_features: tuple[str, ...]
    compiler: str | None

    def key(self) -> dict:
        """Everything the binary depends on, the compiler aside (see `dirname`)."""
        return {
            "format": CACHE_FORMAT,
            "sources": digest_files(self.files),
            "compiled": list(self.sources),
            "functions": list(self.functions),
            "header": self.header,
            "cflags": list(self.cflags),
            "ldflags": list(self.ldflags),
            "isa": self.isa,
            "cpu_features": list(self.cpu_features),
            "torch": [torch.__version__, torch.version.git_version],
            "python": [sys.implementation.cache_tag, sysconfig.get_config_var("SOABI")],
            "platform": [sys.platform, platform.machine()],
        }

    @property
    def base(self) -> str:
        """`<prefix>_<isa>_<digest of key()>`: the name of every build of this key by any compiler."""
        return f"{self.prefix}_{self.isa}_{digest_files([('key', json.dumps(self.key(), sort_keys=True).encode())])[:16]}"

    @property
    def dirname(self) -> str:
        return f"{self.base}_{digest_files([('compiler', str(self.compiler).encode())])[:8]}"


def cpu_features() -> frozenset[str]:
    """The running CPU's feature flags: /proc/cpuinfo's where there is one, else what torch reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    cap = torch.backends.cpu.get_cpu_capability()
    return frozenset({"avx2", "fma"} if cap in ("AVX2", "AVX512") else ())


def _library_digest(path: Path) -> str:
    return digest_files([("library", path.read_bytes())])


def _import_library(module: str, path: Path):
    if module in sys.modules:
        return sys.modules[module]
    spec = importlib.util.spec_from_file_location(module, path)
    if spec is None or spec.loader is None:
        raise BuildUnavailable(f"{path} is not a loadable extension module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[module] = mod
    return mod


def _check_build(directory: Path, ext: Extension, any_compiler: bool) -> dict:
    """The manifest of the finished build in `directory` if it is one of `ext` that this CPU can run;
    else BuildUnavailable saying why."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        library = directory / manifest["library"]
        if manifest["key"] != ext.key() or (not any_compiler and manifest["compiler"] != ext.compiler):
            raise BuildUnavailable(f"{directory} holds a build of other sources or settings")
        if _library_digest(library) != manifest["library_sha256"]:
            raise BuildUnavailable(f"{library} does not match its manifest (truncated or altered)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BuildUnavailable(f"{directory} holds no complete build ({type(e).__name__}: {e})") from e
    # A binary compiled for one CPU must never run on another (a shared home directory, a copied cache).
    missing = sorted(set(manifest["key"]["cpu_features"]) - cpu_features())
    if missing:
        raise BuildUnavailable(f"{directory} was built for CPU features this CPU lacks: {', '.join(missing)}")
    return manifest


def _load_finished(directory: Path, ext: Extension, any_compiler: bool = False):
    manifest = _check_build(directory, ext, any_compiler)
    return _import_library(manifest["module"], directory / manifest["library"])


@contextlib.contextmanager
def _turn(lock_path: Path, wait_s: float):
    """Hold the builders' lock of one key (an flock, released by the kernel if its holder dies)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): builders may overlap, the atomic rename keeps them apart
        yield
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = lock_path.read_text(errors="replace").strip() or "another process"
                if not waited:
                    logger.warning("hf_aoq: waiting for %s, which is compiling hf_aoq's CPU kernels into %s",
                                   holder, lock_path.parent)
                    waited = True
                if time.monotonic() > deadline:
                    raise BuildUnavailable(
                        f"waited {wait_s:.0f} s for {holder} to finish compiling (lock {lock_path}); "
                        "set HF_AOQ_EXTENSION_WAIT to wait longer") from None
                time.sleep(0.2)
            except OSError:  # a file system without locks: as without flock
                break
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        yield
    finally:
        os.close(fd)


def _build(root: Path, ext: Extension, announce: str):
    final = root / ext.dirname
    tmp = Path(tempfile.mkdtemp(prefix=f".{ext.dirname}.tmp-", dir=root))
    try:
        src = tmp / "src"
        src.mkdir()
        for name, content in ext.files:
            (src / name).write_bytes(content)
        (src / "bindings.cpp").write_text(binding_source(ext))
        logger.warning("%s", announce)
        start = time.monotonic()
        from torch.utils import cpp_extension

        mod = cpp_extension.load(
            name=ext.dirname,
            sources=[str(src / s) for s in (*ext.sources, "bindings.cpp")],
            extra_cflags=list(ext.cflags),
            extra_ldflags=list(ext.ldflags),
            build_directory=str(tmp),
            verbose=False,
        )
        library = Path(mod.__file__).resolve().relative_to(tmp.resolve())
        manifest = {"key": ext.key(), "compiler": ext.compiler, "module": mod.__name__, "library": str(library),
                    "library_sha256": _library_digest(tmp / library)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        tmp.chmod(0o755)  # mkdtemp made it private; the finished build is as readable as the cache
        if final.exists():  # an unusable build (the caller found it so): out of the way first
            trash = Path(tempfile.mkdtemp(prefix=f".{ext.dirname}.tmp-", dir=root))
            os.replace(final, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            # Another builder (without flock) finished first: keep its build, use this process's module.
        logger.info("hf_aoq: compiled its CPU kernels in %.0f s into %s", time.monotonic() - start, final)
        return mod
    finally:
        _remove_leftovers(root, ext, tmp)


def _remove_leftovers(root: Path, ext: Extension, only: Path | None = None) -> None:
    """Temporary directories of this key's builds (all of them while the lock is held: no one else is
    building it, so they are a killed build's), or only the one given."""
    for d in [only] if only is not None else root.glob(f".{ext.dirname}.tmp-*"):
        shutil.rmtree(d, ignore_errors=True)


def binding_source(ext: Extension) -> str:
    """The Python binding of `ext.functions` (declared in `ext.header`), as load_inline would write it."""
    defs = "".join(f'  m.def("{f}", torch::wrap_pybind_function({f}), "{f}");\n' for f in ext.functions)
    return f'#include <torch/extension.h>\n#include "{ext.header}"\n\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{defs}}}\n'


def load_or_build(ext: Extension, *, announce: str, wait_s: float, root: Path | None = None):
    """The extension module of `ext`: a finished build from the cache, else built now (announced)."""
    root = cache_root() if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    final = root / ext.dirname
    with contextlib.suppress(BuildUnavailable):
        return _load_finished(final, ext)
    if ext.compiler is None:
        # No compiler here: a build of the same key by any compiler will do, newest first.
        reasons = []
        builds = [d for d in root.glob(ext.base + "_*") if d.is_dir()]
        for d in sorted(builds, key=lambda p: p.stat().st_mtime, reverse=True):
            try:
                return _load_finished(d, ext, any_compiler=True)
            except BuildUnavailable as e:
                reasons.append(str(e))
        raise BuildUnavailable("no C++ compiler to build hf_aoq's CPU kernels (set CXX, or install g++), and no "
                               f"usable build of them in {root}" + "".join(f"; {r}" for r in reasons))
    with _turn(root / f"{ext.dirname}.lock", wait_s):
        try:
            return _load_finished(final, ext)  # finished while this process waited
        except BuildUnavailable:
            pass
        _remove_leftovers(root, ext)
        return _build(root, ext, announce)
