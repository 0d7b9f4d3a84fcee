"""Check recorded requests against SGLang's own source (tests/integration/test_sglang_contract.py).

    python tests/sglang_contract_check.py SGLANG_DIR REQUESTS.json

SGLANG_DIR: the ``sglang`` package of the pinned wheel, installed ``--no-deps`` by ``make
sglang-contract`` (with ``msgspec``, on this process's ``PYTHONPATH``). The package itself does
not import on a CPU machine (``sglang/__init__`` and ``io_struct`` pull in triton, a CUDA
torchvision, ...), so its files are used directly:

- ``sglang/api/v1/api_types.py`` (generated from SGLang's API schema, needs only msgspec) is
  loaded as it is: the server's contract gate for a ``/generate`` body (``GenerateRequest``;
  its ``SamplingParams`` rejects unknown keys);
- ``srt/entrypoints/http_server.py`` is read for its routes and their methods;
- ``srt/managers/io_struct.py`` is read for each route's request class: its fields, their types
  and defaults become the pydantic model SGLang's FastAPI route validates the body with
  (``msgspec_struct_pydantic_core_schema``: required fields, unknown ones ignored). A field we
  send that the class lacks is reported: SGLang would drop it silently;
- ``srt/arg_groups/fields/*.py`` is read for the launch flags (``--`` + field name, ``_`` -> ``-``).

REQUESTS.json: {"requests": [[method, path, body], ...], "launch_args": [...]}. Prints one JSON
line: {"checked": [...], "problems": [...]}.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, ValidationError, create_model

BODY_CLASS = {
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/get_weights_by_name": "GetWeightsByNameReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
}
BASE_FIELDS = {"rid", "http_worker_ipc"}  # io_struct.BaseReq's, inherited by every request class


def server_routes(http_server: Path) -> dict[str, set[str]]:
    """{path: methods} of every ``@app.get/post/api_route`` in SGLang's HTTP server source."""
    routes: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(http_server.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args
                    and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
                continue
            kind, path = dec.func.attr, dec.args[0].value
            methods = {kind.upper()} if kind in ("get", "post", "put") else set()
            for kw in dec.keywords:
                if kw.arg == "methods" and isinstance(kw.value, ast.List):
                    methods |= {str(e.value) for e in kw.value.elts if isinstance(e, ast.Constant)}
            routes.setdefault(path, set()).update(methods)
    return routes


def request_model(io_struct: Path, name: str) -> type:
    """The pydantic model of io_struct class ``name``: its annotated fields (types evaluated with
    ``typing``'s names) and their defaults (a field without one is required); extra keys ignored."""
    cls = next(n for n in ast.walk(ast.parse(io_struct.read_text())) if isinstance(n, ast.ClassDef) and n.name == name)
    ns = {k: getattr(typing, k) for k in dir(typing) if not k.startswith("_")}
    fields: dict[str, Any] = {f: (str | None, None) for f in BASE_FIELDS}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            tp = eval(ast.unparse(stmt.annotation), ns)  # noqa: S307 - SGLang's own annotation text
            default = ... if stmt.value is None else ast.literal_eval(stmt.value)
            fields[stmt.target.id] = (tp, default)
    return create_model(name, __config__=ConfigDict(extra="ignore"), **fields)


def _api_types(sglang_dir: Path) -> Any:
    spec = importlib.util.spec_from_file_location("sglang_api_v1_types", sglang_dir / "api" / "v1" / "api_types.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # msgspec resolves the module's annotations through it
    spec.loader.exec_module(mod)
    return mod


def check_generate(body: dict[str, Any], api: Any) -> list[str]:
    """The contract gate, and what ``GenerateReqInput._normalize_sampling_params`` makes of it:
    a list is used as it is (one dict per prompt), a dict is copied to every prompt."""
    problems = []
    try:
        api.GenerateRequest.from_json_value(body)
    except api.JsonContractError as e:
        problems.append(f"/generate: the server's contract gate refuses the body: {e}")
    sps = body.get("sampling_params")
    if not (isinstance(sps, list) and len(sps) == len(body["input_ids"])):
        problems.append(f"/generate: sampling_params {sps!r:.120} is not one dict per prompt "
                        "(SGLang copies a single dict, sampling_seed included, to every prompt)")
    return problems


def check_body(path: str, body: Any, io_struct: Path) -> list[str]:
    model = request_model(io_struct, BODY_CLASS[path])
    try:
        model.model_validate(body or {})
    except ValidationError as e:
        return [f"{path}: {BODY_CLASS[path]} refuses {body!r:.200}: {e}"]
    unknown = sorted(set(body or {}) - set(model.model_fields))
    return [f"{path}: fields {unknown} are not in {BODY_CLASS[path]} (SGLang drops them)"] if unknown else []


def launch_flags(fields_dir: Path) -> dict[str, bool]:
    """{--flag: takes no value (a bool field)} of every server argument."""
    flags: dict[str, bool] = {}
    for f in sorted(fields_dir.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        flag = "--" + stmt.target.id.replace("_", "-")
                        flags[flag] = ast.unparse(stmt.annotation).startswith(("A[bool,", "bool"))
    return flags


def check_launch(args: list[str], fields_dir: Path) -> list[str]:
    flags, problems = launch_flags(fields_dir), []
    for i, a in enumerate(args):
        if not a.startswith("--"):
            continue
        if a not in flags:
            problems.append(f"launch_server: no flag {a}")
        elif flags[a] and i + 1 < len(args) and not args[i + 1].startswith("--"):
            problems.append(f"launch_server: {a} takes no value, got {args[i + 1]!r}")
    return problems


def main() -> None:
    sglang_dir, recorded = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    srt = sglang_dir / "srt"
    api = _api_types(sglang_dir)
    routes = server_routes(srt / "entrypoints" / "http_server.py")
    checked: set[str] = set()
    problems: list[str] = []
    for method, path, body in recorded["requests"]:
        if method not in routes.get(path, set()):
            problems.append(f"{method} {path}: no such route in SGLang's HTTP server")
            continue
        if path == "/generate":
            problems += check_generate(body, api)
        elif path in BODY_CLASS:
            problems += check_body(path, body, srt / "managers" / "io_struct.py")
        elif body:
            problems.append(f"{method} {path}: SGLang's route takes no body, got {body!r:.200}")
        checked.add(f"{method} {path}")
    if recorded.get("launch_args"):
        problems += check_launch(recorded["launch_args"], srt / "arg_groups" / "fields")
        checked.add("launch_server arguments")
    print(json.dumps({"checked": sorted(checked), "problems": problems}))


if __name__ == "__main__":
    main()
