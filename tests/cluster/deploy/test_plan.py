"""What a wheelhouse keeps: the target's package list, markers for the target, stand-ins, and the drop rules."""

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from specserve.cluster.deploy.plan import (
    Resolved,
    parse_have,
    plan,
    runtime_requirements,
    stand_in_version,
    stub_version,
    target_environment,
)
from specserve.workers.errors import SpecServeError

ENV_312 = target_environment("3.12", ["manylinux_2_28_x86_64"])


def test_parse_have_reads_freeze_columns_and_bare_names():
    text = """# pip list --format=freeze
torch==2.11.0+cu128
Transformers==4.46.0
-e git+https://example.org/x.git#egg=x
ray @ file:///wheels/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
Package    Version
---------- -------
numpy      1.26.4
specserve  0.1.0   /work/main
nvidia_cublas_cu12 grpcio,protobuf
weird==not-a-version
"""
    have = parse_have(text)
    assert have == {
        "torch": Version("2.11.0+cu128"),
        "transformers": Version("4.46.0"),
        "ray": None,
        "numpy": Version("1.26.4"),
        "specserve": Version("0.1.0"),
        "nvidia-cublas-cu12": None,
        "grpcio": None,
        "protobuf": None,
        "weird": None,
    }


def test_parse_have_reads_a_line_of_bare_names():
    assert parse_have("absl-py accelerate torch\n\ntriton") == dict.fromkeys(
        ["absl-py", "accelerate", "torch", "triton"]
    )


def test_parse_have_names_the_bad_line():
    with pytest.raises(SpecServeError, match=r"gpu.txt, line 2: '>=1.0'"):
        parse_have("torch==2.11\n>=1.0\n", "gpu.txt")


def test_target_environment_is_the_targets_not_this_interpreters():
    assert ENV_312["python_version"] == "3.12"
    assert (ENV_312["sys_platform"], ENV_312["platform_machine"]) == ("linux", "x86_64")
    assert target_environment("3.11", ["manylinux2014_aarch64"])["platform_machine"] == "aarch64"
    assert Requirement("tomli; python_version < '3.12'").marker.evaluate(ENV_312) is False


@pytest.mark.parametrize(
    ("requirement", "have", "expected"),
    [
        ("torch>=2.11,<=2.13.0", "2.11.0+cu128", "2.11.0+cu128"),  # the target's own version
        ("transformers>=5.24,<5.25", "4.46.0", None),  # too old: resolved, and kept
        ("torch>=2.11,<=2.13.0", None, "2.13.0"),  # a bare name: the version pip would pick
        ("ray==2.60.0", None, "2.60.0"),
        ("numpy>=1.26", None, None),  # an open range: resolved for real, dropped afterwards
        ("ray[serve]==2.60.0", "2.60.0", None),  # extras: the target may lack their dependencies
    ],
)
def test_stand_in_version(requirement, have, expected):
    got = stand_in_version(Requirement(requirement), Version(have) if have else None)
    assert got == (Version(expected) if expected else None)


def test_stub_versions_are_local_versions_no_index_has():
    assert stub_version(Version("2.13.0")) == "2.13.0+have"
    assert stub_version(Version("2.11.0+cu128")) == "2.11.0+cu128.have"
    assert Version(stub_version(Version("2.11.0+cu128"))) in Requirement("torch>=2.11,<=2.13.0").specifier


def test_runtime_requirements_skip_the_extras():
    got = runtime_requirements(["torch==2.13.0", 'pytest>=8; extra == "dev"', "ray[serve]==2.60.0"], "x")
    assert [str(r) for r in got] == ["torch==2.13.0", "ray[serve]==2.60.0"]


def _resolved(name: str, version: str, *requires: str) -> Resolved:
    return Resolved(name, Version(version), tuple(Requirement(r) for r in requires))


def test_plan_drops_what_the_target_has_and_what_only_that_needed():
    roots = [
        Requirement(r)
        for r in ("torch>=2.11,<=2.13.0", "transformers>=5.24,<5.25", "ray[serve]==2.60.0", "numpy>=1.26")
    ]
    resolved = {
        r.name: r
        for r in (
            _resolved("transformers", "5.24.0", "huggingface-hub>=1.3,<2", "regex", "numpy>=1.17"),
            _resolved("huggingface-hub", "1.5.0", "filelock"),
            _resolved("filelock", "3.0"),
            _resolved("regex", "2024.1"),
            _resolved("ray", "2.60.0", "click>=7", "fastapi; extra == 'serve'", "uvicorn; extra == 'serve'"),
            _resolved("click", "8.1", "tomli; python_version < '3.12'"),
            _resolved("tomli", "2.0"),
            _resolved("fastapi", "0.115", "starlette"),
            _resolved("starlette", "0.40"),
            _resolved("uvicorn", "0.30"),
            _resolved("numpy", "2.4.0"),
        )
    }
    have = {
        "torch": Version("2.11.0+cu128"),
        "transformers": Version("4.46.0"),
        "numpy": Version("1.26.4"),
        "ray": Version("2.60.0"),
        "regex": None,
    }
    got = plan(roots, resolved, have, ENV_312)
    assert [r.name for r in got.kept] == [
        "fastapi",
        "filelock",
        "huggingface-hub",
        "starlette",
        "transformers",
        "uvicorn",
    ]
    why = {name: (version, reason) for name, version, reason in got.dropped}
    assert why == {
        "click": ("8.1", "needed only by packages the target has"),
        "numpy": ("2.4.0", "the target has 1.26.4"),
        "ray": ("2.60.0", "the target has 2.60.0"),
        "regex": ("2024.1", "the target has it (bare name: version not checked)"),
        "tomli": ("2.0", "not needed on Python 3.12 (linux)"),
        "torch": ("-", "the target has 2.11.0+cu128"),  # stood in during resolution: never resolved
    }
    assert got.missing == []


def test_a_kept_requirer_can_keep_what_the_target_has():
    roots = [Requirement("a>=1"), Requirement("b")]
    resolved = {"a": _resolved("a", "2.0"), "b": _resolved("b", "1.0", "a>=2")}
    got = plan(roots, resolved, {"a": Version("1.0")}, ENV_312)
    assert [r.name for r in got.kept] == ["a", "b"]  # b is shipped and asks a>=2: the target's a 1.0 is not enough
    # once b is dropped too, only the root asks for a, and the target's 1.0 satisfies it (a fixpoint, not one pass)
    got = plan(roots, resolved, {"a": Version("1.0"), "b": Version("1.0")}, ENV_312)
    assert got.kept == [] and {name for name, _, _ in got.dropped} == {"a", "b"}


def test_plan_names_what_the_target_needs_and_nothing_resolved():
    got = plan([Requirement("x"), Requirement("y")], {"x": _resolved("x", "1", "z")}, {}, ENV_312)
    assert got.missing == ["y (required by specserve)", "z (required by x)"]
