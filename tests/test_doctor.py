"""`tapelm doctor`'s law-test runs, on a folder of tests made here: a test that kills its process, one that stalls
and one that faults fail alone, the others run on in fresh processes (a plain failure needs none), and the record on
disk is whole after each result."""

import json
import os

import torch

from tapelm.doctor import device_tests, doctor

CONFTEST = (
    "def pytest_addoption(parser):\n    parser.addoption('--device', default='cpu')\n"
    "def pytest_configure(config):\n"
    "    config.addinivalue_line('markers', 'device: a law test')\n"
    "    config.addinivalue_line('markers', 'own_process: its own process')\n"
)
KERNELS = """import json, os, signal, time
import pytest, state
pytestmark = [pytest.mark.device, pytest.mark.own_process]

def test_first():
    pass

def test_the_record_holds_the_first_result_while_this_process_runs():
    path, record = os.environ["DOCTOR_RECORD"], {}
    for _ in range(100):
        record = json.loads(open(path).read()) if os.path.exists(path) else {}
        if record.get("parts", {}).get("tests", {}).get("outcomes", {}).get("tests/test_kernels.py::test_first"):
            return
        time.sleep(0.1)
    raise AssertionError(record)

def test_fails_plainly():
    assert 1 == 2

def test_killed():
    os.kill(os.getpid(), signal.SIGKILL)

def test_stalls():
    time.sleep(60)

def test_a_fault():
    state.corrupted = True
    raise RuntimeError('an illegal memory access')

def test_after_it():
    assert not state.corrupted
"""


def test_a_test_that_kills_stalls_or_faults_its_process_fails_alone(tmp_path, monkeypatch):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(CONFTEST)
    (tests / "state.py").write_text("corrupted = False\n")
    (tests / "test_shared.py").write_text(
        "import pytest\npytestmark = pytest.mark.device\ndef test_plain():\n    pass\n"
    )
    (tests / "test_kernels.py").write_text(KERNELS)
    monkeypatch.setattr(doctor, "source_tests", lambda: tests)
    monkeypatch.setattr(device_tests, "TEST_SECONDS", 1.0)
    out = tmp_path / "out"
    monkeypatch.setenv("DOCTOR_RECORD", str(out / "doctor-cpu.json"))
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # these tests need no plugin: processes start in 0.5 s
    record = doctor.run_doctor(
        out, tiny=False, skip=("speed", "training", "generation"), tests=doctor.DeviceTestSettings(processes=2)
    )
    assert json.loads((out / "doctor-cpu.json").read_text()) == json.loads(json.dumps(record))
    result = record["parts"]["tests"]
    assert result["status"] == "failed" and result["own_process"] == 7
    assert result["counts"] == {"passed": 4, "failed": 4}, result
    assert sorted(line.split(" - ")[0] for line in result["failures"]) == [
        f"FAILED tests/test_kernels.py::{name}"
        for name in ("test_a_fault", "test_fails_plainly", "test_killed", "test_stalls")
    ]
    messages = {line.split("::")[1].split(" - ")[0]: line.split(" - ", 1)[1] for line in result["failures"]}
    assert messages["test_killed"] == "its process ended (exit -9) while it ran"
    assert messages["test_stalls"].startswith("stopped after 1 s (a stall)")
    assert messages["test_a_fault"] == "RuntimeError: an illegal memory access"
    own = [process["name"] for process in result["processes"] if process["name"] != "shared"]
    assert own == ["own-1", "own-1+1", "own-1+2", "own-1+3"]  # one file: one lane; a fresh one after each end
    assert os.path.exists(out / "doctor-cpu-tests.log") and not result["running"]
    assert result["outcomes"]["tests/test_shared.py::test_plain"] == "passed" and len(result["outcomes"]) == 8


def test_own_process_tests_go_in_whole_files_to_the_fewest_processes_that_even_them_out():
    tests = [
        f"tests/test_{name}.py::test_{i}"
        for name, count in (("a", 5), ("b", 3), ("c", 2), ("d", 1))
        for i in range(count)
    ]
    groups = device_tests.lanes(tests, 3)
    assert [sorted({test.split("::")[0][-4] for test in group}) for group in groups] == [["a"], ["b"], ["c", "d"]]
    assert sorted(sum(groups, [])) == sorted(tests)
    assert device_tests.lanes(tests, 8) == [[test for test in tests if f"_{name}." in test] for name in "abcd"]
    assert device_tests.lanes([], 4) == []


def test_the_first_calls_time_every_fast_path_and_record_which_ran():
    """On the CPU the paths that run there (the rotation's autograd function, SDPA's CPU flash kernel for TAPE) run;
    no Triton or fla path does, nothing is autotuned, and decoding at a new length tunes nothing."""
    from tapelm.doctor.first_calls import run_first_calls
    from tapelm.fast_paths import NAMES

    saved = []
    result = run_first_calls(torch.device("cpu"), True, lambda partial: saved.append(len(partial["paths"])))
    assert result["status"] == "passed" and list(result["paths"]) == list(NAMES)
    assert saved == list(range(1, len(NAMES) + 1))  # handed on after each path
    ran = {path for path, timing in result["paths"].items() if timing["ran"]}
    assert {"rotation-autograd", "attention-cpu-flash"} <= ran
    assert not [path for path in ran if path.endswith(("-fla", "-triton"))]
    for timing in result["paths"].values():
        assert timing["first_step_seconds"] > 0 and timing["second_step_seconds"] > 0
        assert timing["first_step_autotunings"] == timing["second_step_autotunings"] == 0
        assert timing["retuned_in_generate"] == []
