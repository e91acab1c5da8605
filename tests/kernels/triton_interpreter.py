"""Shared by the Triton test modules beside test_triton.py: Triton's interpreter switched on before
triton is first imported (triton.jit makes a kernel interpreted or compiled when it is decorated,
and triton.language's own @jit functions are made at import), and the same tests run in a
process of their own where something imported triton first without it (torch.compile does, in
a full run)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SETS_INTERPRET = "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ
if SETS_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
ROOT = Path(__file__).resolve().parents[2]


def interpreter_for_the_module():
    """A module-scoped fixture's body: TRITON_INTERPRET=1 while the module's tests run where the
    kernels are interpreted (they read it at launch: test_triton.py may have dropped it), and
    afterwards the environment as it was before any of these modules set it."""
    before = os.environ.get("TRITON_INTERPRET")
    if is_interpreted():
        os.environ["TRITON_INTERPRET"] = "1"
    yield
    if SETS_INTERPRET or before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = before


def is_interpreted() -> bool:
    """Whether hf_aoq's Triton kernels were made by the interpreter in this process."""
    from triton.runtime.interpreter import InterpretedFunction

    from hf_aoq.kernels import triton_jit

    return isinstance(triton_jit.int4_gemv_kernel, InterpretedFunction)


def require_interpreted_kernels() -> None:
    if not is_interpreted():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 in this process")


def run_interpreted(test_file: str, selection: str) -> None:
    """Run `selection` (-k) of `test_file` under the interpreter in a new process; assert it passed
    and skipped nothing."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", selection],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0 and " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-3000:]


def compile_in_a_process(script: str) -> None:
    """Run `script` (which compiles kernels for sm90 and prints "ok") without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.stdout[-2000:], done.stderr[-3000:])


# Run inside a compile script: the registers and spilled bytes of a compiled kernel, from the
# cuobjdump that triton ships (None where it is missing). ptxas reports spills as STACK (the
# local-memory frame; LOCAL stays 0): a 128x256 tile on 2 warps gets REG:32 STACK:18264.
RESOURCE_USAGE = '''
import os, re, subprocess, tempfile
import triton

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(compiled):
    """(registers, spilled bytes) per thread of a compiled kernel, or None without cuobjdump."""
    if not os.access(CUOBJDUMP, os.X_OK):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run([CUOBJDUMP, "-res-usage", path], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\\d+) STACK:(\\d+).*?LOCAL:(\\d+)", out)
    assert found, out
    return int(found.group(1)), int(found.group(2)) + int(found.group(3))


def check_fits(compiled, what):
    """No shared-memory overflow (H200: 227 KiB a block), no register spills."""
    assert "cubin" in compiled.asm, what
    assert compiled.metadata.shared <= 227 * 1024, (what, compiled.metadata.shared)
    usage = resources(compiled)
    if usage is not None:
        regs, spilled = usage
        assert regs <= 255 and spilled == 0, (what, regs, spilled)
'''
