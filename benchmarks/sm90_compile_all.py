"""Every Triton launch form the CPU tests make, compiled for sm_90 without a GPU: the tests run
kernels under the interpreter (Python, not the compiler), so a kernel that would not compile
for the GPU passes them all. Two stages:

  record   run pytest (on the given test paths) with each interpreted launch recorded: the
           kernel (module and name), each argument's Triton type (a tensor's pointer dtype,
           i32 / i64 / fp32 scalars), the constexpr values, num_warps and num_stages;
  compile  in a fresh process (no interpreter), each distinct form compiled for sm_90 with
           Triton's bundled ptxas (benchmarks/sm90_compile_check.compile_for_sm90), the
           interpreter-only constexprs (DOT_FP32, EMULATE) set as a GPU launch sets them;
           the failures are listed and the exit status is 1 if there is one.

    python benchmarks/sm90_compile_all.py [tests/kernels ...]   # both stages (minutes)
    python benchmarks/sm90_compile_all.py --compile FORMS.json  # the second only

A dev tool for before a device session (CI runs the hand-picked cases of
sm90_compile_check.py instead: this one takes minutes)."""
from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD_ENV = "TLLM_RECORD_TRITON_LAUNCHES"
TL_DTYPE = "__tl_dtype__"
INTERPRETER_ONLY = ("DOT_FP32", "EMULATE")
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64",
           "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5", "int64": "i64", "int32": "i32",
           "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def _arg_type(value) -> str | None:
    import torch
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES.get(str(value.dtype).replace("torch.", ""), "u8")
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def _is_constexpr(parameter: inspect.Parameter) -> bool:
    return "constexpr" in str(parameter.annotation)


def _constexpr_value(value):
    """A recorded constexpr as the compiler takes it (a Triton dtype from its name)."""
    import triton.language as tl
    if isinstance(value, dict) and TL_DTYPE in value:
        return tl.dtype(value[TL_DTYPE])
    return value


def launch_form(fn, args: tuple, kwargs: dict) -> dict | None:
    """The compile-relevant form of one launch of the Python kernel `fn`; None: an argument
    this tool cannot type (it is then left out). (Triton is imported here, not with this
    module: pytest loads it as a plugin before the tests switch the interpreter on.)"""
    import triton.language as tl
    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip([p.name for p in params], args))
    bound.update({k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")})
    signature, constexprs = {}, {}
    for p in params:
        if p.name not in bound:
            if p.default is inspect.Parameter.empty:
                return None
            value = p.default
        else:
            value = bound[p.name]
        if _is_constexpr(p):
            if isinstance(value, tl.dtype):
                value = {TL_DTYPE: value.name}
            elif not isinstance(value, (bool, int, float, str, type(None))):
                return None          # a constexpr this tool cannot write down
            constexprs[p.name] = value
            continue
        kind = _arg_type(value)
        if kind is None:
            return None
        signature[p.name] = kind
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature,
            "constexprs": constexprs, "num_warps": kwargs.get("num_warps", 4),
            "num_stages": kwargs.get("num_stages", 3)}


def install_recorder(path: str) -> None:
    """Wrap the interpreter's launch so that each launch's form is appended to `path`."""
    from triton.runtime.interpreter import InterpretedFunction
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        form = launch_form(self.fn, args, kwargs)
        if form is not None:
            with open(path, "a") as out:
                out.write(json.dumps(form, default=str) + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    InterpretedFunction.run = recording_run


def record(test_paths: list[str], path: str) -> None:
    env = dict(os.environ, **{RECORD_ENV: path})
    plugin = "sm90_compile_all"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                    "-p", plugin, *test_paths], cwd=ROOT, env=dict(
                        env, PYTHONPATH=f"{ROOT / 'benchmarks'}:{ROOT}"), check=False)


def distinct_forms(path: str) -> list[dict]:
    seen, forms = set(), []
    for line in Path(path).read_text().splitlines():
        key = line.strip()
        if key and key not in seen:
            seen.add(key)
            forms.append(json.loads(key))
    return forms


def compile_forms(forms: list[dict]) -> int:
    """Compile each form (this process must not run the interpreter); exit status."""
    import triton
    from sm90_compile_check import compile_for_sm90, toolchain_works
    if not toolchain_works():
        return 3
    failed = skipped = 0
    for form in forms:
        try:
            kernel = getattr(importlib.import_module(form["module"]), form["name"])
        except (ImportError, AttributeError):  # a test file's own kernel: not ours
            skipped += 1
            continue
        if not isinstance(kernel, triton.runtime.JITFunction):
            skipped += 1
            continue
        constexprs = {k: _constexpr_value(v) for k, v in form["constexprs"].items()}
        # the interpreter-only choices (launch.needs_fp32_dot, fp8_quant.emulates_fp8_cast)
        # are False wherever the kernel is compiled
        constexprs.update({k: False for k in INTERPRETER_ONLY if k in constexprs})
        pointers = {k: v for k, v in form["signature"].items() if v.startswith("*")}
        floats = tuple(k for k, v in form["signature"].items() if v == "fp32")
        try:
            compile_for_sm90(kernel, pointers, floats, constexprs, form["num_warps"],
                             form["num_stages"])
        except Exception as exc:  # the point: list and go on
            failed += 1
            print(f"FAILED {form['module']}.{form['name']} {form['constexprs']}: "
                  f"{type(exc).__name__}: {str(exc)[:400]}")
    print(f"{len(forms) - skipped} launch forms compiled for sm_90, {failed} failed "
          f"({skipped} of test files' own kernels left out)")
    return 1 if failed else 0


def pytest_configure(config) -> None:  # the recording stage's pytest plugin
    path = os.environ.get(RECORD_ENV)
    if path:
        install_recorder(path)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compile"]:
        os.environ.pop("TRITON_INTERPRET", None)
        return compile_forms(distinct_forms(argv[1]))
    path = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
    record(argv or ["tests/kernels"], path)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, __file__, "--compile", path], env=env).returncode


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.exit(main(sys.argv[1:]))
