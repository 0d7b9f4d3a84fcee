"""The agent's tools: the ast calculator, tool-call parsing, custom tools by dotted path,
and the Python sandbox's limits (CPU, memory, wall clock, no network, fresh directory)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from gpu_runtime.rollout.agent import calculator
from gpu_runtime.rollout.agent.python_sandbox import PythonSandbox, net_isolation_prefix
from gpu_runtime.rollout.agent.tools import ToolNotFound, load_tool, load_tools, parse_tool_call, run_tool


@pytest.mark.parametrize("expr,value", [
    ("4837261*9182736", 4837261 * 9182736), ("(2+3)*4", 20), ("-7//2", -4), ("2**10", 1024), ("7/2", 3.5),
    ("8/2", 4.0), ("10 % 3", 1), (" 3 ^ 2 ", 9), ("3×4", 12),
])
def test_calculator_evaluates_arithmetic(expr: str, value: float) -> None:
    assert calculator.evaluate(expr) == value


@pytest.mark.parametrize("expr,why", [
    ("__import__('os').system('true')", "Call"), ("x+1", "Name"), ("(1).real", "Attribute"), ("1/0", "division"),
    ("9**9**9", "exponent"), ("10**59*10**5", "digits"), ("", "empty"), ("1+", "parse"), ("[1]", "List"),
    ("1" * 201, "longer"), ("'a'*3", "Constant"),
])
def test_calculator_refuses_anything_else(expr: str, why: str) -> None:
    with pytest.raises(calculator.CalculatorError, match=why):
        calculator.evaluate(expr)


def test_calculator_tool_formats_and_reports_errors() -> None:
    tool = load_tool("calculator", 5)
    assert run_tool(tool, "8/2", 5).output == "4"
    bad = run_tool(tool, "2+", 5)
    assert bad.error and bad.observation().startswith("error: cannot parse")


def test_parse_tool_call() -> None:
    names = ["calculator", "python"]
    assert parse_tool_call("no call here", names) is None
    call = parse_tool_call("so <calculator> 12*3 </calculator> then <python>x</python>", names)
    assert (call.tool, call.arguments, call.error) == ("calculator", "12*3", "")
    cut = parse_tool_call("<python>print(1)", names)
    assert cut is not None and cut.error == "<python> is not closed by </python>"
    assert parse_tool_call("<other>1</other>", names) is None


def test_custom_tool_by_dotted_path_and_its_errors() -> None:
    tools = load_tools(["calculator", "tests.agent_tools:make_upper"], 5)
    assert set(tools) == {"calculator", "upper"}
    assert run_tool(tools["upper"], "abc", 5).output == "ABC"  # a plain string is a success
    with pytest.raises(ToolNotFound, match="cannot import"):
        load_tool("tests.agent_tools:missing", 5)
    with pytest.raises(ToolNotFound, match="needs a name"):
        load_tool("tests.agent_tools.not_a_tool", 5)
    with pytest.raises(ToolNotFound, match="two tools"):
        load_tools(["tests.agent_tools:make_upper", "tests.agent_tools:Upper"], 5)


def test_a_hung_custom_tool_times_out() -> None:
    from gpu_runtime.rollout.agent import tools as tools_mod

    tool = load_tool("tests.agent_tools:Sleeper", 0.2)
    grace, tools_mod.GRACE_S = tools_mod.GRACE_S, 0.0
    try:
        t0 = time.monotonic()
        res = run_tool(tool, "3", 0.2)
    finally:
        tools_mod.GRACE_S = grace
    assert res.timed_out and "timed out" in res.error and time.monotonic() - t0 < 3


# ---- the Python sandbox ------------------------------------------------------------------
def test_sandbox_runs_code_in_a_fresh_directory() -> None:
    box = PythonSandbox(timeout_s=20)
    res = box("import os\nopen('f.txt', 'w').write('x')\nprint(sorted(os.listdir('.')), os.getcwd())")
    assert res.error == "", res
    listed, cwd = res.output.strip().split(" ", 1)
    assert listed == "['f.txt',", listed and "milestone-python-" in cwd
    again = box("import os\nprint(sorted(os.listdir('.')))")
    assert again.output.strip() == "['main.py']"  # nothing of the previous call is left
    import pathlib
    assert not pathlib.Path(cwd).exists()


def test_sandbox_reports_exceptions() -> None:
    res = PythonSandbox(timeout_s=20)("print('before')\nraise ValueError('bad input')")
    assert res.output.strip() == "before" and res.error == "ValueError: bad input"


def test_sandbox_enforces_the_cpu_limit() -> None:
    t0 = time.monotonic()
    res = PythonSandbox(timeout_s=60, cpu_s=1)("while True:\n    pass")
    assert res.error and "CPU limit" in res.error, res
    assert not res.timed_out and time.monotonic() - t0 < 30


def test_sandbox_enforces_the_memory_limit() -> None:
    res = PythonSandbox(timeout_s=30, memory_mb=200)("x = bytearray(1 << 30)\nprint(len(x))")
    assert "MemoryError" in res.error and res.output == "", res


def test_sandbox_kills_on_the_wall_clock() -> None:
    t0 = time.monotonic()
    res = PythonSandbox(timeout_s=1, cpu_s=30)("import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert res.timed_out and "timed out after 1 s" in res.error
    assert time.monotonic() - t0 < 15


def test_sandbox_refuses_network_access() -> None:
    """A real TCP server listens on this machine's loopback; code in the sandbox cannot reach it."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[object] = []
    server.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except TimeoutError:
                continue
            except OSError:
                return

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('connected')"
        res = PythonSandbox(timeout_s=20)(code)
        assert "connected" not in res.output and res.error, res
        assert "not allowed" in res.error or "refused" in res.error.lower() or "unreachable" in res.error.lower()
        # also the audit hook alone (where no network namespace can be made) refuses the socket
        hooked = PythonSandbox(timeout_s=20)("import subprocess\nsubprocess.run(['true'])")
        assert "subprocess.Popen is not allowed" in hooked.error, hooked
    finally:
        stop.set()
        server.close()
        t.join(timeout=5)
    assert accepted == []


def test_network_namespace_is_used_where_the_kernel_allows_it() -> None:
    prefix = net_isolation_prefix()
    if not prefix:
        pytest.skip("this machine allows no unprivileged network namespace: the audit hook is the only guard")
    code = "lines = open('/proc/self/net/dev').read().splitlines()[2:]\nprint(sorted(l.split(':')[0].strip() for l in lines))"
    res = PythonSandbox(timeout_s=20)(code)
    assert res.output.strip() == "['lo']", res  # a fresh namespace holds only a loopback
