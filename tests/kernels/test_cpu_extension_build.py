"""The C++ extension's build cache (hf_aoq/kernels/build_cache.py, cpu_ext.py), in subprocesses.

One real build, into a temporary cache: the module fixture first kills a build while it compiles
(the state a killed first use leaves), then starts two processes at once, of which one must
build and the other wait for it. Every other test loads that build, with a compiler wrapper that
counts compilations, and checks that nothing is compiled again.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_aoq.kernels import build_cache, cpu_ext

CXX = shutil.which("c++") or shutil.which("g++")
NINJA = shutil.which("ninja")
pytestmark = pytest.mark.skipif(
    CXX is None or NINJA is None or sys.platform == "win32", reason="needs a C++ compiler and ninja (POSIX)"
)
ANNOUNCE = "hf_aoq: compiling its C++ CPU kernels"

# Loads the extension (import hf_aoq, then a quantized forward, as a user's first use does) and
# reports what it got on its last line.
LOAD = """
import json
import torch
import hf_aoq
from hf_aoq import Int8WeightOnlyConfig, quantize_
from hf_aoq.kernels import cpu_ext
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32))
x = torch.randn(3, 64)
ref = model(x)
quantize_(model, Int8WeightOnlyConfig())
with torch.no_grad():
    y = model(x)
m = cpu_ext.load()
out = {"loaded": m is not None, "forward_close": bool(torch.allclose(y, ref, atol=0.05))}
if m is not None:
    out["functions"] = sorted(n for n in dir(m) if not n.startswith("_"))
    out["file"] = m.__file__
print("RESULT " + json.dumps(out))
"""

# A compiler that logs every compilation or link (not version queries) and then runs the real
# one; with HF_AOQ_TEST_HANG set it hangs instead, as a long compile does.
WRAPPER = """#!/bin/sh
for a in "$@"; do
  case "$a" in
    -c|-shared) echo "$*" >> "${{HF_AOQ_TEST_LOG:-{log}}}"
      [ -n "$HF_AOQ_TEST_HANG" ] && echo $$ >> "{log}.hung" && exec sleep 600 ;;
  esac
done
exec "{real}" "$@"
"""


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


class Env:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.root = tmp / "cache"
        self.compile_log = tmp / "compiles.log"
        (tmp / "bin").mkdir()
        # Named g++ so that torch's compiler check accepts it by name.
        self.cxx = _script(tmp / "bin" / "g++", WRAPPER.format(log=self.compile_log, real=CXX))

    def env(self, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_AOQ_NO_CPU_EXT", "HF_AOQ_TEST_HANG")}
        # TORCH_EXTENSIONS_DIR too: what torch's own cache would use (hf_aoq must not share its lock).
        env.update(HF_AOQ_EXTENSION_DIR=str(self.root), TORCH_EXTENSIONS_DIR=str(self.tmp / "torch_ext"),
                   CXX=str(self.cxx))
        env.update(extra)
        return env

    def compiles(self) -> int:
        return len(self.compile_log.read_text().splitlines()) if self.compile_log.exists() else 0

    def start(self, script=LOAD, **extra) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", script], env=self.env(**extra), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    @staticmethod
    def finish(p: subprocess.Popen, timeout=900) -> tuple[dict, str]:
        try:
            out, err = p.communicate(timeout=timeout)
        finally:
            p.kill()
        assert p.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1].removeprefix("RESULT ")), err

    def run(self, timeout=900, script=LOAD, **extra) -> tuple[dict, str]:
        return self.finish(self.start(script, **extra), timeout)


def _leftovers(root: Path) -> list[Path]:
    return sorted(root.glob(".*.tmp-*"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("ext"))
    # A first use killed (SIGKILL, its whole process group) while the compiler runs.
    err = open(e.tmp / "killed.stderr", "w")
    killed = subprocess.Popen([sys.executable, "-c", LOAD], env=e.env(HF_AOQ_TEST_HANG="1"), stdout=subprocess.DEVNULL,
                              stderr=err, start_new_session=True)
    deadline = time.monotonic() + 300
    while e.compiles() == 0:
        assert killed.poll() is None, (e.tmp / "killed.stderr").read_text()[-3000:]
        assert time.monotonic() < deadline, "the build never reached the compiler"
        time.sleep(0.5)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    # ninja runs each compiler in a process group of its own: the hung ones outlive the kill.
    time.sleep(1)  # any compiler ninja was starting has written its pid
    for pid in Path(f"{e.compile_log}.hung").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    err.close()
    left = {str(d): (d / "lock").exists() for d in _leftovers(e.root)}  # each with torch's lock file?
    e.compile_log.unlink()
    # The next two processes, at once: one must build (it cannot wait on the dead one), the other
    # wait for it and load its build.
    logs = [e.tmp / "compiles_first.log", e.tmp / "compiles_second.log"]
    procs = [e.start(HF_AOQ_TEST_LOG=str(log)) for log in logs]
    runs = [e.finish(p, timeout=900) for p in procs]
    compiles = [len(log.read_text().splitlines()) if log.exists() else 0 for log in logs]
    builder = 0 if compiles[0] else 1
    return {"env": e, "left_by_killed": left, "result": runs[builder][0], "stderr": runs[builder][1],
            "compiles": compiles[builder], "other": runs[1 - builder], "other_compiles": compiles[1 - builder],
            "killed_stderr": (e.tmp / "killed.stderr").read_text()}


@pytest.fixture
def env(built):
    e = built["env"]
    if e.compile_log.exists():
        e.compile_log.unlink()
    return e


def test_killed_build_does_not_block_the_next_process(built):
    # The killed build left its temporary directory with torch's lock file in it (which, in torch's
    # shared build directory, made every later process wait forever).
    assert ANNOUNCE in built["killed_stderr"]
    assert built["left_by_killed"] and all(built["left_by_killed"].values()), built["left_by_killed"]
    assert built["result"]["loaded"] and built["result"]["forward_close"], built["stderr"][-3000:]
    assert built["compiles"] > 0
    assert built["stderr"].count(ANNOUNCE) == 1, built["stderr"][-3000:]  # announced, once, when building
    assert _leftovers(built["env"].root) == []  # the killed build's leftovers are gone
    assert sorted(built["result"]["functions"]) == sorted(cpu_ext.FUNCTIONS)


def test_concurrent_first_uses_build_once(built):
    # Started together with the builder: it waited (saying so) and loaded the finished build.
    result, stderr = built["other"]
    assert result["loaded"] and result["forward_close"], stderr[-3000:]
    assert built["other_compiles"] == 0
    assert ANNOUNCE not in stderr
    assert Path(result["file"]).parent.parent == built["env"].root


def test_second_process_loads_the_build_without_compiling(env, built):
    result, stderr = env.run()
    assert result["loaded"] and result["forward_close"]
    assert env.compiles() == 0
    assert ANNOUNCE not in stderr  # announced exactly when building
    where = Path(result["file"]).parent
    assert where.parent == env.root and not where.name.startswith(".")  # the finished build, in place


def test_another_ninja_first_on_path_does_not_rebuild(env):
    # The venv's pip ninja against /usr/bin/ninja: which one runs a build is no part of the binary.
    ninja_log = env.tmp / "ninja.log"
    other = env.tmp / "other_ninja"
    other.mkdir(exist_ok=True)
    _script(other / "ninja", f'#!/bin/sh\necho "$*" >> "{ninja_log}"\nexec "{NINJA}" "$@"\n')
    result, stderr = env.run(PATH=f"{other}{os.pathsep}{os.environ.get('PATH', '')}",
                             VIRTUAL_ENV=str(env.tmp / "another_venv"))
    assert result["loaded"]
    assert env.compiles() == 0 and not ninja_log.exists()
    assert ANNOUNCE not in stderr


def test_without_a_compiler_the_cached_build_loads(env):
    result, stderr = env.run(CXX=str(env.tmp / "no" / "such" / "g++"))
    assert result["loaded"] and result["forward_close"]
    assert ANNOUNCE not in stderr


CPU_LACKING_A_FLAG = """
import json, warnings
from hf_aoq.kernels import build_cache, cpu_ext
isa, missing = {isa!r}, {missing!r}
cpu_ext.chosen_isa = lambda: isa  # as if the cache had been filled on a machine with this ISA
build_cache.cpu_features = lambda: frozenset(cpu_ext.ISAS[isa][1]) - {{missing}}  # and this CPU lacked one flag
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    m = cpu_ext.load()
print("RESULT " + json.dumps({{"loaded": m is not None, "warnings": [str(x.message) for x in w]}}))
"""


def test_a_build_for_other_cpu_features_is_never_loaded(env):
    isa = cpu_ext.chosen_isa()
    if isa == "generic":
        pytest.skip("the cached build here needs no CPU features")
    missing = cpu_ext.ISAS[isa][1][-1]  # avx512: avx512_bf16; avx2: fma
    result, _ = env.run(script=CPU_LACKING_A_FLAG.format(isa=isa, missing=missing), CXX=str(env.tmp / "no" / "such" / "g++"))
    assert not result["loaded"]
    assert any(f"CPU features this CPU lacks: {missing}" in w for w in result["warnings"]), result


def test_a_live_builder_is_waited_for_then_given_up_on(env, monkeypatch, tmp_path):
    # Another process holds the build lock of this very binary (still compiling, or stopped): the
    # waiter says so, and after HF_AOQ_EXTENSION_WAIT seconds uses the reference kernels.
    import fcntl

    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setenv("CXX", str(env.cxx))
    lock = root / f"{cpu_ext.extension().dirname}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"pid 12345 on testhost\n")
        result, stderr = env.run(timeout=300, HF_AOQ_EXTENSION_DIR=str(root), HF_AOQ_EXTENSION_WAIT="2")
    finally:
        os.close(fd)
    assert not result["loaded"] and result["forward_close"]  # the fallback runs
    assert "waiting for pid 12345 on testhost" in stderr
    assert "waited 2 s" in stderr
    assert env.compiles() == 0


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    for var in ("HF_AOQ_EXTENSION_DIR", "TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build_cache.cache_root() == tmp_path / "home" / ".cache" / "hf_aoq" / "extensions"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build_cache.cache_root() == tmp_path / "xdg" / "hf_aoq" / "extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch"))
    assert build_cache.cache_root() == tmp_path / "torch" / "hf_aoq"
    monkeypatch.setenv("HF_AOQ_EXTENSION_DIR", str(tmp_path / "mine"))
    assert build_cache.cache_root() == tmp_path / "mine"


def test_the_key_holds_what_the_binary_depends_on_and_nothing_else(monkeypatch, tmp_path):
    ext = cpu_ext.extension()
    text = json.dumps(ext.key())
    assert sys.prefix not in text and "include" not in text  # no venv or include path
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("VIRTUAL_ENV", str(tmp_path))
    assert cpu_ext.extension().dirname == ext.dirname
    changed_source = dict(ext.files)
    changed_source["int8.cpp"] += b"\n"
    others = [
        dataclasses.replace(ext, files=tuple(changed_source.items())),
        dataclasses.replace(ext, cflags=ext.cflags + ("-DX",)),
        dataclasses.replace(ext, isa="generic", cpu_features=()),
        dataclasses.replace(ext, functions=ext.functions[:-1]),
        dataclasses.replace(ext, compiler="another compiler 1.0"),
    ]
    assert len({ext.dirname} | {o.dirname for o in others}) == len(others) + 1
    assert others[-1].base == ext.base  # a build by any compiler is found when none is here
