"""tests/run_gpu.py, the GPU host's suite runner: what it reads from a shard's log."""

from run_gpu import collect, outcomes


def test_gpu_runner_reads_every_outcome_from_a_verbose_log():
    """tests/run_gpu.py counts a shard's outcomes from its `pytest -v` log: ids with spaces, setup errors, a test
    failing in its call and then its teardown, and none from the summary lines."""
    log = "\n".join([
        "tests/test_a.py::test_x[missing-does not exist] PASSED                     [ 10%]",
        "tests/test_a.py::test_y ERROR                                               [ 20%]",
        "tests/test_b.py::test_z[4] SKIPPED (needs 4 GPUs)                          [ 30%]",
        "tests/test_b.py::test_w FAILED                                             [ 40%]",
        "tests/test_b.py::test_w ERROR                                              [ 40%]",
        "FAILED tests/test_b.py::test_w - AssertionError",
        "ERROR tests/test_a.py::test_y",
    ])
    assert outcomes(log) == {"tests/test_a.py::test_x[missing-does not exist]": "PASSED",
                             "tests/test_a.py::test_y": "ERROR", "tests/test_b.py::test_z[4]": "SKIPPED",
                             "tests/test_b.py::test_w": "ERROR"}


def test_gpu_runner_reports_a_file_that_fails_to_collect(tmp_path):
    """A test file that fails to import has no test ids to deal to the shards: the runner names it among the
    failures instead of leaving its tests out of the counts."""
    (tmp_path / "test_imports.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "test_breaks_on_import.py").write_text("import a_module_that_is_not_there\n\n\ndef test_b():\n"
                                                       "    pass\n")
    ids, errors, output = collect("not distributed", [str(tmp_path)])
    assert [i.split("::")[-1] for i in ids] == ["test_a"]
    assert [e.rsplit("/", 1)[-1] for e in errors] == ["test_breaks_on_import.py"], output
