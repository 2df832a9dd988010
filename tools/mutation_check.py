"""Mutation check: does the CPU test suite notice small, meaningful bugs in jax_cgx?

    python tools/mutation_check.py                         # every mutation, this checkout's tests
    python tools/mutation_check.py --repo /tmp/old_tree    # jax_cgx/ and tests/ of another tree
    python tools/mutation_check.py --only requant-nearest --json
    python tools/mutation_check.py --list

Each mutation replaces one exact string (found exactly once, else the tool stops: a refactor
must fail loudly here, not silently test nothing) in a fresh COPY of ``<repo>/jax_cgx``, made
with ``<repo>/tests`` and ``<repo>/pyproject.toml`` in a temporary folder, and runs pytest
there with the copy first on ``PYTHONPATH``. The editable install's import hook (it sends
``import jax_cgx`` to the source tree) is switched off in that folder by a ``sitecustomize``,
the compiled extensions are copied next to the copy, and every run checks afterwards that
each ``jax_cgx`` module the tests imported came from the copy, the mutated one included.

An unmutated baseline runs first and must pass. Per mutation: ``caught`` (tests failed),
``caught (error)`` (collection error, internal error, crash or timeout: counted as caught,
shown apart), ``survived`` (the suite passed), ``inconclusive`` (pytest exited 1 with no
failed test, e.g. conftest's stray-process check tripped by someone else's run).
Exit status: 0 all caught, 1 some survived or were inconclusive, 2 the tool itself failed.
Not run by CI (minutes per mutation); docs/mutations.md has the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A chosen subset, small enough for a full run in about 20 minutes on 2 cores: the xla backend's
# sums against the oracle and bound, the sharded collectives, the codec's whole range, the wire
# count. Paths missing from --repo (tests added later) are left out with a note, so one command
# serves older trees too.
DEFAULT_TESTS = (
    "tests/codec/test_numpy_oracle.py",
    "tests/collectives/test_oracle_collectives.py",
    "tests/collectives/test_unbiased.py",
    "tests/collectives/test_allreduce.py",
    "tests/collectives/test_sharded.py",
    "tests/exchange/test_hierarchical.py::test_bytes_on_wire",
    "tests/exchange/test_padding.py::test_the_issue_example",
    "tests/codec/test_range.py",
)
# The xla backend on virtual CPU devices: no second process (tcp, jax.distributed), no GPU.
DEFAULT_MARKERS = "not multiprocess and not slow and not gpu"
# The CUDA kernels under emulation: nvcc and the cuda/ sources, not the Python package.
DEFAULT_IGNORE = ("tests/codec/test_cuda_emulated.py",)


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    description: str


MUTATIONS = (
    Mutation(
        "requant-nearest", "jax_cgx/_src/codec/rows.py",
        "stochastic=stochastic, m=m, dtype=np.dtype(dtype))",
        "stochastic=False, m=m, dtype=np.dtype(dtype))",
        "the owner's re-quantization of the sum rounds to nearest under stochastic rounding "
        "(dequantize_sum_requantize_rows ignores stochastic=True)"),
    Mutation(
        "same-buffer-stream", "jax_cgx/_src/collectives/psum.py",
        "jax.random.fold_in(rank_key, buffer_index)",
        "jax.random.fold_in(rank_key, 0)",
        "every fusion buffer of compressed_psum draws buffer 0's random stream"),
    Mutation(
        "same-rank-stream", "jax_cgx/_src/collectives/psum.py",
        "else jax.random.fold_in(key, lax.axis_index(axes))",
        "else key",
        "compressed_psum no longer folds the rank into the key: every rank rounds alike"),
    Mutation(
        "chunk-valid-plus-one", "jax_cgx/_src/exchange/chunks.py",
        "valid[:, None].astype(jnp.int32) - starts, 0, chunk)",
        "valid[:, None].astype(jnp.int32) - starts + 1, 0, chunk)",
        "chunk padding: one padding value per chunk counted as real (it may widen a bucket)"),
    Mutation(
        "own-chunk-quantized", "jax_cgx/_src/exchange/sra.py",
        "sent_real = jnp.where(jnp.arange(w) == me, 0, real)",
        "sent_real = real",
        "SRA: the owner's own chunk is also sent encoded, so it enters its sum twice"),
    Mutation(
        "scatter-wrong-block", "jax_cgx/_src/exchange/reduce_scatter.py",
        "own = lax.dynamic_index_in_dim(padded, me, axis=1, keepdims=False)",
        "own = lax.dynamic_index_in_dim(padded, (me + 1) % w, axis=1, keepdims=False)",
        "compressed_psum_scatter: the owner adds its next neighbour's block instead of its own"),
    Mutation(
        "pmean-world-minus-one", "jax_cgx/_src/collectives/psum.py",
        'divisor = world if api == "compressed_pmean" else None',
        'divisor = world - 1 if api == "compressed_pmean" else None',
        "compressed_pmean divides the sum by W - 1"),
    Mutation(
        "skipped-tail-unsummed", "jax_cgx/_src/collectives/psum.py",
        "parts.append(_divided(lax.psum(tail, axes), divisor))",
        "parts.append(_divided(tail, divisor))",
        "skip_incomplete_buckets: the uncompressed tail is this rank's own values, not their sum"),
    Mutation(
        "wire-meta-bytes", "jax_cgx/_src/exchange/chunks.py",
        "num_buckets(c, bucket_size) * META_BYTES",
        "num_buckets(c, bucket_size) * (META_BYTES - 4)",
        "bytes_on_wire counts 4 metadata bytes per bucket instead of 8"),
    Mutation(
        "reference-flush", "jax_cgx/_src/codec/reference.py",
        "return jnp.where(jnp.abs(x) < MIN_NORMAL, _F32(0), x)",
        "return jnp.where(jnp.abs(x) < MIN_NORMAL / 2, _F32(0), x)",
        "the pure-JAX reference flushes only subnormals below 2^-127 to zero (the kernels all of them)"),
)

# Switches off the editable install's import hook in the runs' interpreters (children too:
# the folder is on their PYTHONPATH), so `import jax_cgx` finds the copy on sys.path.
_SITECUSTOMIZE = '''\
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
'''

# A pytest plugin that records, at the end of the session, where each jax_cgx module came from.
_GUARD = '''\
import json, os, sys


def pytest_sessionfinish(session, exitstatus):
    files = {name: getattr(mod, "__file__", None) for name, mod in list(sys.modules.items())
             if name == "jax_cgx" or name.startswith("jax_cgx.")}
    with open(os.environ["JAX_CGX_MUTATION_MODULES"], "w") as f:
        json.dump(files, f)
'''


_STRAYS = "stray processes left by the tests:"


class ToolError(Exception):
    """The tool cannot do what it was asked (not a test result)."""


def mutated_text(mutation: Mutation, root: pathlib.Path) -> str:
    """``root / mutation.path`` with the mutation applied; the old string must occur exactly once."""
    path = root / mutation.path
    if not path.is_file():
        raise ToolError(f"{mutation.name}: {mutation.path} does not exist in {root}")
    text = path.read_text()
    found = text.count(mutation.old)
    if found != 1:
        raise ToolError(f"{mutation.name}: {mutation.path} holds {found} copies of {mutation.old!r} "
                        "(expected exactly 1): update the mutation to the code")
    return text.replace(mutation.old, mutation.new)


def extension_modules() -> list[pathlib.Path]:
    """The compiled ``jax_cgx._*`` modules the installed package loads (next to the sources, or
    in the editable install's folder), found without importing jax_cgx."""
    spec = importlib.util.find_spec("jax_cgx")
    if spec is None or not spec.submodule_search_locations:
        raise ToolError("jax_cgx is not importable here: activate the environment it is installed in")
    found: dict[str, pathlib.Path] = {}
    for folder in spec.submodule_search_locations:
        for so in sorted(pathlib.Path(folder).glob("_*.so")) + sorted(pathlib.Path(folder).glob("_*.pyd")):
            found.setdefault(so.name.split(".")[0], so)
    if "_cpu" not in found:
        raise ToolError(f"no compiled jax_cgx._cpu found in {list(spec.submodule_search_locations)}: build first")
    return list(found.values())


def make_copy(repo: pathlib.Path, extensions: list[pathlib.Path], mutation: Mutation | None) -> pathlib.Path:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="jax_cgx_mutation_"))
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", ".hypothesis", ".pytest_cache")
    shutil.copytree(repo / "jax_cgx", tmp / "jax_cgx", ignore=ignore)
    shutil.copytree(repo / "tests", tmp / "tests", ignore=ignore)
    shutil.copy2(repo / "pyproject.toml", tmp / "pyproject.toml")  # pytest's markers and options
    for so in extensions:
        shutil.copy2(so, tmp / "jax_cgx" / so.name)
    (tmp / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    (tmp / "_mutation_guard.py").write_text(_GUARD)
    if mutation is not None:
        (tmp / mutation.path).write_text(mutated_text(mutation, tmp))
    return tmp


def run_env(tmp: pathlib.Path, cache: pathlib.Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tmp)
    env["JAX_CGX_MUTATION_MODULES"] = str(tmp / "modules.json")
    env.pop("PYTHONSTARTUP", None)
    if cache:  # XLA compiles each unchanged program once per invocation, not once per run
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def smoke_check(tmp: pathlib.Path) -> None:
    """Fails loudly unless ``import jax_cgx`` (and its extension) in the copy's folder is the copy."""
    code = "import jax_cgx, jax_cgx._cpu as c; print(jax_cgx.__file__); print(c.__file__)"
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp, env=run_env(tmp),
                          capture_output=True, text=True)
    files = proc.stdout.split()
    if proc.returncode or len(files) != 2 or not all(pathlib.Path(f).is_relative_to(tmp) for f in files):
        raise ToolError(f"the copy in {tmp} is not what `import jax_cgx` loads there: {files or proc.stderr[-2000:]}")


@dataclasses.dataclass
class Result:
    name: str
    description: str
    outcome: str  # caught, caught (error), survived, inconclusive
    detail: str
    seconds: float
    returncode: int | None
    failed: list[str] = dataclasses.field(default_factory=list)


def _junit(path: pathlib.Path) -> tuple[dict[str, int], list[str]]:
    if not path.is_file():
        return {}, []
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [_node_id(case.get("classname") or "", case.get("name") or "") for case in root.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return counts, failed


def _node_id(classname: str, name: str) -> str:
    """pytest's node id from junit's dotted classname: tests/<folder>/test_<name>.py::Class::test_c[param]."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        if parts[i - 1].startswith("test"):
            return "::".join(["/".join(parts[:i]) + ".py", *parts[i:], name])
    return f"{classname}::{name}"


def run_one(repo, extensions, mutation: Mutation | None, args) -> Result:
    name = mutation.name if mutation else "baseline"
    tmp = make_copy(repo, extensions, mutation)
    try:
        smoke_check(tmp)
        junit = tmp / "junit.xml"
        ignore = [f"--ignore={path}" for path in args.ignore]
        cmd = [sys.executable, "-P", "-m", "pytest", *args.tests, *ignore, "-m", args.markers, "-x", "-q",
               "-p", "no:cacheprovider", "-p", "_mutation_guard", "-o", "addopts=", f"--junitxml={junit}"]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=tmp, env=run_env(tmp, args.compilation_cache), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
            rc, output = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as e:  # its output is bytes, even with text=True
            out = e.stdout or b""
            rc, output = None, out.decode(errors="replace") if isinstance(out, bytes) else out
        seconds = time.monotonic() - start
        (args.log_dir / f"{name}.log").write_text(output)
        counts, failed = _junit(junit)
        _check_imports(tmp, mutation, rc)
        if rc is None:
            outcome, detail = "caught (error)", f"timed out after {args.timeout:.0f} s"
        elif rc == 0:
            outcome, detail = "survived" if mutation else "passed", f"{counts.get('tests', '?')} tests passed"
        elif rc == 1 and failed:
            outcome, detail = "caught", failed[0]
        elif rc == 1 and counts.get("tests") and _STRAYS in output:
            # tests/conftest.py fails a session when it sees a worker-like process anywhere on the
            # machine; with the multiprocess tests left out they are other sessions' (the log lists them).
            outcome = "survived" if mutation else "passed"
            detail = f"{counts['tests']} tests passed (conftest's stray-process check saw other runs' processes)"
        elif rc == 1:
            outcome, detail = "inconclusive", "pytest exit 1 with no failed test (see the log)"
        elif rc == 2:
            outcome, detail = "caught (error)", "collection error or interrupted: " + (failed[0] if failed else "see the log")
        elif rc == 5:
            raise ToolError(f"{name}: pytest collected no tests from {args.tests} with -m {args.markers!r}")
        else:
            outcome, detail = "caught (error)", f"pytest exit status {rc} (internal error or crash)"
        return Result(name, mutation.description if mutation else "no mutation", outcome, detail, seconds, rc, failed)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _check_imports(tmp: pathlib.Path, mutation: Mutation | None, rc) -> None:
    """Every jax_cgx module the tests imported came from the copy (and the mutated one was imported)."""
    record = tmp / "modules.json"
    if not record.is_file():
        if rc in (0, 1):  # the session finished, so the guard must have written it
            raise ToolError(f"{tmp}: the guard plugin recorded no imports")
        return
    files = json.loads(record.read_text())
    outside = {n: f for n, f in files.items() if f and not pathlib.Path(f).is_relative_to(tmp)}
    if outside:
        raise ToolError(f"the tests imported jax_cgx modules from outside the copy: {outside}")
    if mutation is not None and rc == 0:
        module = mutation.path[:-3].replace("/", ".")
        if module not in files:
            raise ToolError(f"{mutation.name}: the tests never imported {module}, so the mutation was not run")


def render(results: list[dict], title: str, markdown: bool = False) -> None:
    headers = ("mutation", "outcome", "detail", "s")
    rows = [(r["name"], r["outcome"], r["detail"], f"{r['seconds']:.0f}") for r in results]
    if markdown:
        print(f"{title}\n")
        print("| " + " | ".join(headers) + " |\n|" + "---|" * len(headers))
        for row in rows:
            print("| " + " | ".join(c.replace("|", "\\|") for c in (row[0], f"**{row[1]}**" if row[1] == "survived"
                                                                    else row[1], f"`{row[2]}`" if "::" in row[2]
                                                                    else row[2], row[3])) + " |")
        return
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
        print(title)
        for row in (headers, *rows):
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        return
    table = Table(title=title)
    for h in headers:
        table.add_column(h, overflow="fold")
    style = {"survived": "bold red", "inconclusive": "yellow"}
    for r, row in zip(results, rows):
        table.add_row(*(Text(c) for c in row), style=style.get(r["outcome"]))  # Text: node ids' [...] are no markup
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def _title(report: dict) -> str:
    return f"mutations of {report['repo']} (tests: {' '.join(report['tests'])}; -m {report['markers']!r})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=pathlib.Path, default=ROOT,
                        help="the tree whose jax_cgx/, tests/ and pyproject.toml are copied (default: this one)")
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS),
                        help=f"pytest paths, relative to the repo (default: {' '.join(DEFAULT_TESTS)})")
    parser.add_argument("-m", "--markers", default=DEFAULT_MARKERS, help="pytest -m expression (default: %(default)r)")
    parser.add_argument("--ignore", nargs="*", default=list(DEFAULT_IGNORE),
                        help=f"test files left out (default: {' '.join(DEFAULT_IGNORE)})")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run (it must pass)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (default: %(default)s)")
    parser.add_argument("--log-dir", type=pathlib.Path, help="where each run's pytest output goes (default: a temp folder)")
    parser.add_argument("--compilation-cache", type=pathlib.Path,
                        help="JAX's persistent compilation cache, shared by the runs (default: a new temporary "
                             "folder; 'none': no cache)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--from-json", type=pathlib.Path, metavar="FILE",
                        help="print the table of a saved --json-file report and exit")
    parser.add_argument("--json-file", type=pathlib.Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)

    if args.from_json:
        report = json.loads(args.from_json.read_text())
        render(report["results"], _title(report), args.markdown)
        return 0
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:24} {m.path:38} {m.description}")
        return 0
    names = {m.name for m in MUTATIONS}
    if args.only and set(args.only) - names:
        parser.error(f"unknown mutation(s) {sorted(set(args.only) - names)}; --list shows them")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    repo = args.repo.resolve()
    args.log_dir = args.log_dir or pathlib.Path(tempfile.mkdtemp(prefix="jax_cgx_mutation_logs_"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    own_cache = args.compilation_cache is None
    if own_cache:
        args.compilation_cache = pathlib.Path(tempfile.mkdtemp(prefix="jax_cgx_mutation_cache_"))
    elif str(args.compilation_cache) == "none":
        args.compilation_cache = None
    try:
        return _run(args, chosen, repo)
    finally:
        if own_cache:
            shutil.rmtree(args.compilation_cache, ignore_errors=True)


def _run(args, chosen: list[Mutation], repo: pathlib.Path) -> int:
    try:
        for m in chosen:  # every mutation must still apply before anything runs
            mutated_text(m, repo)
        missing = [t for t in args.tests if not (repo / t.split("::")[0]).exists()]
        args.tests = [t for t in args.tests if t not in missing]
        if missing:
            print(f"not in {repo}, left out: {' '.join(missing)}", file=sys.stderr)
        if not args.tests:
            raise ToolError(f"none of the test paths exist in {repo}")
        extensions = extension_modules()
        print(f"repo {repo}; tests {' '.join(args.tests)} -m {args.markers!r}, ignoring {args.ignore}; "
              f"logs in {args.log_dir}",
              file=sys.stderr)
        results = []
        for m in ([None] if not args.no_baseline else []) + chosen:
            result = run_one(repo, extensions, m, args)
            print(f"{result.name}: {result.outcome} ({result.detail}, {result.seconds:.0f} s)", file=sys.stderr)
            if m is None and result.outcome != "passed":
                raise ToolError(f"the unmutated baseline does not pass ({result.detail}); log: "
                                f"{args.log_dir / 'baseline.log'}")
            results.append(result)
    except ToolError as e:
        print(f"mutation_check: {e}", file=sys.stderr)
        return 2
    report = {"repo": str(repo), "tests": args.tests, "markers": args.markers, "ignore": args.ignore,
              "results": [dataclasses.asdict(r) for r in results]}
    if args.json_file:
        args.json_file.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report["results"], _title(report), args.markdown)
    mutated = [r for r in results if r.name != "baseline"]
    return 0 if all(r.outcome.startswith("caught") for r in mutated) else 1


if __name__ == "__main__":
    sys.exit(main())
