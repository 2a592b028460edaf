"""Reading a matrix: a YAML file or a mapping → a validated, expanded :class:`Matrix`, or one
readable :class:`MatrixError` line naming the key."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import ValidationError

from gaeq.matrix.cell import Matrix, Reference
from gaeq.matrix.expand import Expander
from gaeq.matrix.schema import MatrixError, MatrixSpec, describe
from gaeq.problem.dsconfig import ConfigError, read_config


def load_matrix(path: str | Path) -> Matrix:
    """Read, validate and expand a matrix file. Raises :class:`MatrixError` with one readable line."""
    path = Path(path)
    if path.is_dir():
        raise MatrixError(f"{path}: is a directory, not a matrix file")
    if not path.is_file():
        raise MatrixError(f"{path}: no such file")
    try:
        raw = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise MatrixError(f"{path}: not valid YAML ({_first_line(exc)})") from None
    except OSError as exc:
        raise MatrixError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        return matrix_from_dict(raw, plugin_dirs=(str(path.resolve().parent), str(Path.cwd())), base_dir=path.parent)
    except MatrixError as exc:
        raise MatrixError(f"{path}: {exc}") from None


def matrix_from_dict(
    raw: object, *, plugin_dirs: tuple[str, ...] | None = None, base_dir: Path | None = None
) -> Matrix:
    """Validate and expand a matrix given as data (what a YAML file parses to). Plugins are
    imported from `plugin_dirs` (default: the working directory); a `deepspeed_config` path is read
    relative to `base_dir` (default: the working directory)."""
    if not isinstance(raw, dict):
        raise MatrixError("the top level must be a mapping of keys (name, problem, axes, ...)")
    raw = _script_matrix(raw, base_dir or Path.cwd()) if "script" in raw else raw
    raw = _inline_deepspeed_configs(raw, base_dir or Path.cwd())
    try:
        spec = MatrixSpec.model_validate(raw)
        matrix = expand(spec, plugin_dirs=plugin_dirs if plugin_dirs is not None else (str(Path.cwd()),))
        return dataclasses.replace(matrix, source=copy.deepcopy(raw))
    except ValidationError as exc:
        raise MatrixError(describe(exc)) from None


SCRIPT_PROBLEM_KEYS = ("steps", "train_batch_size", "seed")
"""What a script matrix writes beside `script:` at its top level: the problem's keys a script has too."""


def _script_matrix(raw: dict, base_dir: Path) -> dict:
    """A script matrix as the schema reads every matrix: `script` (its path and folder made absolute,
    so that the run directory's copy runs from anywhere, its DeepSpeed config read), `steps`,
    `train_batch_size` and `seed` as its problem, and `trainer: script` wherever a split names one."""
    raw = copy.deepcopy(raw)
    if "problem" in raw:
        raise MatrixError("a script matrix has no problem: the script is the problem (steps, train_batch_size, seed)")
    script = raw.pop("script")
    if not isinstance(script, dict) or not isinstance(script.get("path"), str):
        raise MatrixError("script: a mapping with at least path: <your training script>")
    path = (base_dir / script["path"]).resolve()
    if not path.is_file():
        raise MatrixError(f"script.path: {script['path']}: {'is a directory' if path.is_dir() else 'no such file'}")
    script = script | {"path": str(path), "cwd": str((base_dir / script.get("cwd", path.parent)).resolve())}
    if isinstance(script.get("deepspeed_config"), str):
        try:
            script["deepspeed_config"] = read_config(base_dir / script["deepspeed_config"])
        except ConfigError as exc:
            raise MatrixError(f"script.deepspeed_config: {exc}") from None
    if isinstance(script.get("files"), list):  # read here: the run directory's copy holds what ran
        script["files"] = _read_files(script["files"], base_dir)
    raw["problem"] = {"script": script} | {k: raw.pop(k) for k in SCRIPT_PROBLEM_KEYS if k in raw}
    if isinstance(raw.get("axes"), dict):
        raw["axes"].setdefault("trainer", ["script"])
    given = raw.get("baseline") or {}
    said = {"auto": {"auto": True}, "none": {"none": True}}  # (the schema reads the words; with the trainer, a mapping)
    raw["baseline"] = {"trainer": "script"} | (said[given] if isinstance(given, str) and given in said else given)
    raw["cells"] = [{"trainer": "script"} | c if isinstance(c, dict) else c for c in raw.get("cells") or []]
    return raw


def _read_files(paths: list, base_dir: Path) -> dict[str, str]:
    """`script.files` as written (paths relative to the matrix file) → name → content."""
    files: dict[str, str] = {}
    for path in paths:
        if not isinstance(path, str):
            raise MatrixError(f"script.files: {path!r}: a path to a config file the script reads")
        found = base_dir / path
        if not found.is_file():
            raise MatrixError(f"script.files: {path}: no such file")
        if found.name in files:
            raise MatrixError(f"script.files: two files named {found.name}: each cell's copy is its name")
        files[found.name] = found.read_text()
    return files


def _inline_deepspeed_configs(raw: dict, base_dir: Path) -> dict:
    """Every `deepspeed_config: path` of the problem and its variants, read and written in place:
    the run directory's copy of the matrix then holds the config that ran."""
    raw = copy.deepcopy(raw)
    places = [("problem", raw.get("problem"))]
    variants = raw.get("variants")
    if isinstance(variants, dict):
        places += [
            (f"variants.{name}.problem", v.get("problem")) for name, v in variants.items() if isinstance(v, dict)
        ]
    for where, problem in places:
        if isinstance(problem, dict) and isinstance(problem.get("deepspeed_config"), str):
            try:
                problem["deepspeed_config"] = read_config(base_dir / problem["deepspeed_config"])
            except ConfigError as exc:
                raise MatrixError(f"{where}.deepspeed_config: {exc}") from None
    return raw


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def expand(
    spec: MatrixSpec, *, plugin_dirs: tuple[str, ...] = (), references: Mapping[str, Reference] | None = None
) -> Matrix:
    """Baselines + axes × variants + explicit cells + resume experiments → a :class:`Matrix`. `references`:
    the splits `baseline: auto` chose, by group (gaeq.results.reference); a group of an auto baseline has
    its instruments once its reference is chosen."""
    if spec.axes is None and not spec.cells and not spec.resume:
        raise MatrixError("no cells: give axes, cells or resume (or several)")
    if spec.axes and spec.axes.dtype and "dtype" in spec.problem.model_fields_set:
        raise MatrixError("set dtype either in problem.dtype or in axes.dtype, not both")
    ex = Expander(spec, references=references or {})
    if spec.axes is not None:
        ex.add_axes()
    for c in spec.cells:
        ex.add(
            ex.split_of(c), bug=c.bug, expect=c.expect, fault=c.fault, args=tuple(c.args), weight_error=c.weight_error
        )
    for r in spec.resume:
        ex.add_resume(r)
    ex.add_instruments(twins=spec.floor_twins if spec.noise_floor else 0, detection_limit=spec.detection_limit)
    return ex.matrix(plugin_dirs=plugin_dirs)


def with_references(m: Matrix, references: Mapping[str, Reference]) -> Matrix:
    """`m` expanded again with the references its `baseline: auto` chose (group → split): each such group's
    baseline is that split, and its instruments are on it."""
    expanded = expand(m.spec, plugin_dirs=m.plugin_dirs, references=references)
    return dataclasses.replace(expanded, source=m.source)
