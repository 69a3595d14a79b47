"""The tutorials: each notebook matches its py:percent source, carries no outputs, and runs.

Every tutorial is executed top to bottom on the CPU in a fresh kernel (the interpreter running
pytest, with the checkout first on ``PYTHONPATH`` and ``MPLBACKEND=Agg``); any cell error fails
the test.  The tutorials assert the quantitative claims of their prose in the cells next to
them, so a claim that stops being true fails here; the kernel excerpts they print are cut at
named markers in ``cuda_src/``, which a test requires to exist.  GPU cells branch on
``pat_core.cuda_backend.is_available()`` inside the notebooks.  Prose must sit in markdown
cells (a lost ``# %% [markdown]`` marker fails), and tutorial 5 on a CPU must read the current
measured set, draw a few figures of screen size, and stop loudly when it finds no set.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
TUT = ROOT / "tutorials"
SOURCES = sorted(TUT.glob("[0-9][0-9]_*.py"))
KERNEL = "pat-tutorials-test"
CELL_TIMEOUT_S = 600


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_tutorials_exist():
    assert len(SOURCES) >= 5, f"expected five tutorials in {TUT}, found {SOURCES}"
    for src in SOURCES:
        assert src.with_suffix(".ipynb").is_file(), f"{src.name} has no paired notebook"


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_notebook_in_sync_and_stripped(src):
    """Same cells (type and source) in the .py and the .ipynb; no outputs in the .ipynb."""
    from_py = jupytext.read(src)
    nb = nbformat.read(src.with_suffix(".ipynb"), as_version=4)
    assert _cells(nb) == _cells(from_py), (
        f"{src.with_suffix('.ipynb').name} is out of sync with {src.name}; run "
        f"`jupytext --sync tutorials/{src.name}`")
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs"), f"{src.stem}: a code cell has stored outputs"
            assert cell.get("execution_count") is None, f"{src.stem}: execution count stored"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "What you will learn" in first.source, (
        f"{src.stem} must open with what the reader will learn")


# A code cell may carry short comments; prose belongs in markdown cells.  A code cell whose
# source has a full-line comment that is a markdown heading ("# ## Title"), an empty comment
# line ("#", a paragraph break), or a run of more than PROSE_COMMENT_RUN consecutive full-line
# comments is prose that lost its "# %% [markdown]" marker: it would render as a comment.
PROSE_COMMENT_RUN = 5


def prose_in_code_cells(source: Path) -> list[str]:
    """Where ``source`` (a py:percent tutorial) has prose inside code cells, as messages."""
    import re
    found = []
    for i, cell in enumerate(jupytext.read(source).cells):
        if cell.cell_type != "code":
            continue
        run = []
        for line in cell.source.splitlines() + [""]:
            if line.startswith("#"):
                run.append(line)
                continue
            text = " / ".join(s[1:].strip() for s in run)[:70]
            if any(re.fullmatch(r"#\s*", s) or re.match(r"#\s*#{1,6}\s", s) for s in run):
                found.append(f"cell {i}: a heading or paragraph break in comments: {text!r}")
            elif len(run) > PROSE_COMMENT_RUN:
                found.append(f"cell {i}: {len(run)} comment lines in a row: {text!r}")
            run = []
    return found


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_prose_renders_as_markdown(src):
    """No markdown section sits as comments inside a code cell (a missing ``# %% [markdown]``
    marker)."""
    found = prose_in_code_cells(src)
    assert not found, (f"{src.name}: prose inside code cells (add a `# %% [markdown]` line "
                       f"before it): " + "; ".join(found))


def test_prose_rule_catches_a_lost_marker(tmp_path):
    """The rule above flags a markdown section whose marker is missing, and not short code
    comments."""
    good = ("# %% [markdown]\n# # Title\n#\n# Some prose.\n\n"
            "# %%\n# a short comment\n# on two lines\nx = 1\n")
    lost = good + "# %% [markdown]\n# ## Next section\n#\n# More prose.\n\n# %%\ny = 2\n"
    lost = lost.replace("# %% [markdown]\n# ## Next", "# ## Next")
    long_run = good + "".join(f"# line {k} of a long comment\n" for k in range(8)) + "z = 3\n"
    for name, text, bad in (("good", good, False), ("lost", lost, True),
                            ("long", long_run, True)):
        f = tmp_path / f"{name}.py"
        f.write_text(text)
        assert bool(prose_in_code_cells(f)) == bad, (name, prose_in_code_cells(f))


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_prose_names_exist(src):
    """What a tutorial names is there: every `pat_core.x` / `sim.x` name resolves, every
    ``Tuning(knob=...)`` is a field of ``pat_core.Tuning``, every file path it cites under
    ``bench/``, ``cuda_src/``, ``pat_core/`` or ``sim/`` exists; and it tells no history
    (round numbers of the lab journal)."""
    import dataclasses
    import importlib
    import re
    sys.path.insert(0, str(ROOT))
    import pat_core
    text = src.read_text()
    missing = []
    for name in sorted(set(re.findall(r"`((?:pat_core|sim)(?:\.[A-Za-z_]\w*)+)", text))):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                missing.append(name)
                break
            obj = getattr(obj, attr)
    fields = {f.name for f in dataclasses.fields(pat_core.Tuning)}
    missing += [f"Tuning({k}=...)" for k in re.findall(r"Tuning\((\w+)=", text)
                if k not in fields]
    missing += [path for path in re.findall(r"`((?:bench|cuda_src|pat_core|sim)/[\w./-]*)`",
                                            text) if not (ROOT / path).exists()]
    assert not missing, f"{src.name} names what does not exist: {missing}"
    history = re.findall(r"\bround \d+|NOTES\.md", text)
    assert not history, f"{src.name} tells the lab's history: {history}"


def test_kernel_excerpt_markers_exist():
    """Every kernel excerpt a tutorial prints (``excerpt("NAME")`` / ``show("NAME")``) has one
    ``// <tutorial:NAME>`` line and one ``// </tutorial:NAME>`` line after it in one header of
    ``cuda_src/``, with code between them; tutorial 2 shows at least the five passages its prose
    walks through."""
    import re
    headers = {f.name: f.read_text().splitlines()
               for f in sorted((ROOT / "cuda_src").glob("*.cuh"))}
    used = set()
    for src in SOURCES:
        used |= set(re.findall(r'(?:excerpt|show)\("([a-z0-9-]+)"\)', src.read_text()))
    assert {"prologue", "loop-top", "online-softmax", "loop-end", "gather"} <= used
    for name in sorted(used):
        found = [(f, lines, i) for f, lines in headers.items() for i, s in enumerate(lines)
                 if s.strip() == f"// <tutorial:{name}>"]
        closes = [(f, i) for f, lines in headers.items() for i, s in enumerate(lines)
                  if s.strip() == f"// </tutorial:{name}>"]
        assert len(found) == 1 and len(closes) == 1 and found[0][0] == closes[0][0], (
            f"cuda_src: tutorial excerpt {name!r} needs exactly one opening and one closing "
            f"marker in one header, found {len(found)} and {len(closes)}")
        (_, kernel, o), (_, c) = found[0], closes[0]
        body = [s for s in kernel[o + 1:c] if s.strip()]
        assert o < c and body, f"excerpt {name!r} is empty or reversed"


@pytest.fixture(scope="session")
def kernel_env(tmp_path_factory):
    """A kernelspec that runs this interpreter (not whatever ``python`` is on PATH), the
    checkout importable, and a non-interactive Matplotlib backend."""
    d = tmp_path_factory.mktemp("jupyter")
    spec = d / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "pat tutorials (test)", "language": "python"}))
    env = {
        "JUPYTER_PATH": os.pathsep.join([str(d), os.environ.get("JUPYTER_PATH", "")]),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "MPLBACKEND": "Agg",
    }
    return env


def _execute(src: Path, env: dict, monkeypatch, extra_env: dict | None = None):
    for k, v in {**env, **(extra_env or {})}.items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(src.with_suffix(".ipynb"), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL,
                                     resources={"metadata": {"path": str(TUT)}})
    client.execute()
    return nb


def _text_outputs(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                out.append(o.get("text", ""))
            elif "data" in o and "text/plain" in o["data"]:
                out.append(o["data"]["text/plain"])
    return "\n".join(out)


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_tutorial_executes(src, kernel_env, monkeypatch):
    nb = _execute(src, kernel_env, monkeypatch)      # raises CellExecutionError on any error
    assert "Traceback" not in _text_outputs(nb)


def _tutorial5():
    src = next((p for p in SOURCES if p.stem.startswith("05_")), None)
    if src is None:
        pytest.skip("tutorial 5 not present")
    return src


def test_benchmark_plot_path(kernel_env, monkeypatch, tmp_path):
    """Tutorial 5 without a GPU plots the measured set it is pointed at; feed it a small one
    (the layout bench/compare.py writes: device and git sha on top, one row per measurement)."""
    src = _tutorial5()
    rows = []
    for wl, floor, times in (("1,4,16_128,256,1024", 24.0, (35.0, 38.0)),
                             ("1,16_2048,128", 10.0, (30.0, 60.0)),
                             ("8_4096", 45.0, (55.0, 57.0))):
        for m, t in zip(("pat", "fi-decode"), times):
            rows.append({"workload": wl, "heads": [32, 8], "page_size": 16, "method": m,
                         "latency_us": t, "floor_us": floor, "correct": True})
    rows.append({"workload": "8_4096", "heads": [32, 8], "page_size": 16, "method": "fasttree",
                 "floor_us": 45.0, "skipped": "8 roots: single-root trees only"})
    result = {"benchmark": "compare", "device": "Example GPU (test fixture)",
              "git_sha": "0" * 40, "head_dim": 128, "l2_flush": "clean", "rows": rows}
    (tmp_path / "example.json").write_text(json.dumps(result))
    nb = _execute(src, kernel_env, monkeypatch,
                  {"PAT_BENCH_RESULTS": str(tmp_path), "PAT_TUTORIAL_FORCE_CPU": "1"})
    text = _text_outputs(nb)
    assert "Example GPU (test fixture)" in text
    assert "statements not checked" in text          # the prose is about the committed set


def test_no_gpu_and_no_results_fails_loudly(kernel_env, monkeypatch, tmp_path):
    """Tutorial 5 with neither a GPU nor a measured set stops with an error naming what is
    missing, instead of checking nothing and passing."""
    src = _tutorial5()
    with pytest.raises(nbclient.exceptions.CellExecutionError) as err:
        _execute(src, kernel_env, monkeypatch,
                 {"PAT_BENCH_RESULTS": str(tmp_path), "PAT_TUTORIAL_FORCE_CPU": "1"})
    assert "No measured set found" in str(err.value) and "PAT_BENCH_RESULTS" in str(err.value)


def test_tutorial5_uses_the_current_set(kernel_env, monkeypatch):
    """Run from the checkout on a CPU, tutorial 5 reads the current H100 set and checks its
    statements on it (at least one figure, at most a few, none wider than a screen)."""
    src = _tutorial5()
    nb = _execute(src, kernel_env, monkeypatch,        # figures as notebook outputs
                  {"PAT_TUTORIAL_FORCE_CPU": "1",
                   "MPLBACKEND": "module://matplotlib_inline.backend_inline"})
    text = _text_outputs(nb)
    assert "one_path_h100/baselines.json" in text and "statements not checked" not in text
    images = [o["data"]["image/png"] for c in nb.cells for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert 1 <= len(images) <= 4, f"tutorial 5 drew {len(images)} figures on a CPU"
    import base64
    import struct
    for png in images:
        width, height = struct.unpack(">II", base64.b64decode(png)[16:24])
        assert width <= 1600 and height <= 1200, (width, height)
