"""The optional extras: tllm's text commands run without matplotlib, diffusers, pillow and
compressed-tensors, and the features that need them say which extra to install, in one line. Each test runs Python in
a subprocess where those modules cannot be imported (`sys.modules[name] = None`)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OPTIONAL = ("matplotlib", "diffusers", "PIL", "compressed_tensors")
VISUAL_MESSAGE = "needs diffusers: pip install 'tllm[visual]'"


def run_without(code: str, missing=OPTIONAL, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter in which the modules `missing` cannot be imported."""
    block = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in missing)
    proc = subprocess.run([sys.executable, "-c", block + code], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_the_text_commands_import_and_parse_without_the_extras():
    proc = run_without(
        "import tllm, tllm.cli\n"
        "from tllm import LLM, VisualGen, VisualGenParams\n"  # naming them imports no extra
        "from tllm.cli import main\n"
        "for command in (['generate', '--help'], ['serve', '--help'], ['bench', 'serve', '--help']):\n"
        "    try:\n"
        "        main(command)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, command\n"
        "print('ok')\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("ok") and "--max-tokens" in proc.stdout


def test_importing_the_cli_imports_no_optional_module():
    """Even where they are installed (where they are, transformers may import pillow itself)."""
    proc = run_without(
        "import tllm.cli, tllm.serve.http.app, tllm.bench.serve_cli\n"
        f"print(sorted(m for m in {OPTIONAL!r} if m in sys.modules))\n", missing=())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("missing, message", [
    (OPTIONAL, VISUAL_MESSAGE),
    (("diffusers",), VISUAL_MESSAGE),
    (("PIL",), "needs pillow: pip install 'tllm[visual]'")])
def test_visual_gen_raises_naming_the_extra(missing, message):
    proc = run_without(
        "from tllm import VisualGen\n"
        "from tllm.extras import MissingExtraError\n"
        "try:\n"
        "    VisualGen('dummy:qwen-image')\n"
        "except MissingExtraError as exc:\n"
        "    assert isinstance(exc, ImportError)\n"
        "    print(exc)\n", missing=missing)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"visual generation {message}"


@pytest.mark.parametrize("command", [
    ["visual", "--model", "dummy:qwen-image", "--prompt", "a fox"],
    ["serve", "dummy:qwen-image"]])
def test_visual_commands_print_one_line_naming_the_extra(command):
    proc = run_without(f"from tllm.cli import main\nsys.exit(main({command!r}))\n")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and VISUAL_MESSAGE in lines[0]


def test_bench_serve_without_matplotlib_skips_the_plot_in_one_line(tmp_path):
    plot = tmp_path / "plot.png"
    proc = run_without(
        "from tllm.cli import main\n"
        "from tllm.serve.context import ServerConfig\n"
        "from tllm.serve.http.app import build_app\n"
        "from tllm.serve.testing import FakeLLM, ServerThread\n"
        "with ServerThread(build_app(FakeLLM(), ServerConfig(model='fake'))) as server:\n"
        "    code = main(['bench', 'serve', '--base-url', server.base_url, '--num-prompts', '2',\n"
        "                 '--isl', '4', '--osl', '2', '--random-vocab-size', '64',\n"
        f"                 '--result-file', '', '--plot-file', {str(plot)!r}])\n"
        "sys.exit(code)\n", missing=("matplotlib",))
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    assert "no plot: --plot-file needs matplotlib: pip install 'tllm[bench]'" in proc.stderr
    assert proc.stderr.count("matplotlib") == 1 and not plot.exists()


@pytest.mark.slow
def test_generate_runs_without_the_extras():
    proc = run_without("from tllm.cli import main\n"
                       "sys.exit(main(['generate', '-p', 'What is 2+2?', '--max-tokens', '4']))\n",
                       timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "1 prompt, " in proc.stderr


def test_a_compressed_tensors_checkpoint_names_the_quant_extra(monkeypatch):
    import types

    from tllm.extras import MissingExtraError
    from tllm.loader.quantization import checkpoint_quant_config
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)   # as if not installed
    config = types.SimpleNamespace(quantization_config={
        "quant_method": "compressed-tensors", "format": "float-quantized"})
    with pytest.raises(MissingExtraError) as info:
        checkpoint_quant_config(None, config)
    assert str(info.value) == ("a compressed-tensors checkpoint needs compressed-tensors: "
                               "pip install 'tllm[quant]'")
