"""The release workflow (`.github/workflows/release.yml`), checked without GitHub.

The file is a valid workflow by GitHub's published schema (the copy check-jsonschema ships)
and zizmor's security audit finds nothing in it, both offline; what it builds, pushes and
signs is the repository's (the Dockerfile, the chart, the chart's default image); and its
version check, run here, passes only when the tag, the package, the chart, the Dockerfile
and CHANGELOG.md agree. What only a release against a real registry proves is listed in
docs/install.md ("What a release proves").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "release.yml"
CHART = REPO / "deployments" / "helm" / "kubegpu"
VERSION: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
#: The files the version check reads, relative to the repository root.
VERSIONED = [
    "pyproject.toml",
    "src/kubegpu/__init__.py",
    "deployments/helm/kubegpu/Chart.yaml",
    "deployments/container/Dockerfile",
    "CHANGELOG.md",
]

Doc = dict[str, Any]


def workflow() -> Doc:
    loaded: Doc = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    return loaded


def steps(job: str) -> list[Doc]:
    found: list[Doc] = workflow()["jobs"][job]["steps"]
    return found


def uses(job: str, action: str) -> Doc:
    """The one step of `job` that runs `action` (owner/name, any pinned version)."""
    (step,) = [s for s in steps(job) if s.get("uses", "").partition("@")[0] == action]
    return step


def run_text(job: str) -> str:
    return "\n".join(s.get("run", "") for s in steps(job))


def tool(name: str) -> str:
    """A console script of this environment (the dev extra installs the linters)."""
    found = shutil.which(name, path=sysconfig.get_path("scripts"))
    if found is None:
        pytest.skip(f"{name} is not installed: `make venv` installs the dev extra")
    return found


# -- the linters, offline ----------------------------------------------------------------


def schema_check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )


def zizmor(path: Path) -> subprocess.CompletedProcess[str]:
    # Pedantic: also the findings zizmor's default persona leaves out (an undocumented
    # permission, ...). --offline: no GitHub API, so it runs the same here and on CI.
    return subprocess.run(
        [
            tool("zizmor"),
            "--offline",
            "--persona=pedantic",
            "--no-progress",
            "--color=never",
            str(path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_workflow_is_valid_by_githubs_schema() -> None:
    result = schema_check(WORKFLOW)
    assert result.returncode == 0, result.stdout + result.stderr


def test_zizmor_finds_nothing_in_the_workflow() -> None:
    result = zizmor(WORKFLOW)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    """A copy of the workflow with a misspelt key and a tag name expanded into a script."""
    text = WORKFLOW.read_text(encoding="utf-8")
    text = text.replace("timeout-minutes: 5", "timeout-minute: 5", 1)
    text = text.replace('cosign sign --yes "${IMAGE}@${DIGEST}"', "echo ${{ github.ref_name }}")
    assert text != WORKFLOW.read_text(encoding="utf-8")
    path = tmp_path / "release.yml"
    path.write_text(text, encoding="utf-8")
    return path


def test_the_linters_see_a_broken_workflow(broken: Path) -> None:
    schema = schema_check(broken)
    assert schema.returncode != 0 and "timeout-minute" in schema.stdout + schema.stderr
    audit = zizmor(broken)
    assert audit.returncode != 0 and "template-injection" in audit.stdout + audit.stderr


# -- what it runs, in which order, with which rights ---------------------------------------


def test_it_runs_on_version_tags_only() -> None:
    # YAML 1.1 (PyYAML) reads the bare key `on` as true.
    loaded: dict[object, Any] = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    assert loaded[True] == {"push": {"tags": ["v*"]}}


def _ancestors(jobs: Doc, name: str) -> set[str]:
    needs = jobs[name].get("needs", [])
    direct = {needs} if isinstance(needs, str) else set(needs)
    return direct.union(*(_ancestors(jobs, n) for n in direct))


def test_nothing_is_published_before_the_versions_and_the_suite_pass() -> None:
    jobs = workflow()["jobs"]
    for name, job in jobs.items():
        needs = job.get("needs", [])
        assert ({needs} if isinstance(needs, str) else set(needs)) <= set(jobs), name
    publishing = {n for n, j in jobs.items() if j["permissions"].get("packages") == "write"}
    assert publishing == {"image", "chart"}
    for name in publishing:
        assert {"version", "test"} <= _ancestors(jobs, name), name
    # A published chart never names an image that is not there yet.
    assert "image" in _ancestors(jobs, "chart")
    # The suite is the CI entry point: `make test` with its coverage gate, then `make lint`.
    assert run_text("test").strip() == "bash .ci/run"
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert "make test" in ci and "make lint" in ci


def test_every_job_asks_for_its_own_rights_and_only_publishing_jobs_write() -> None:
    loaded = workflow()
    assert loaded["permissions"] == {}
    for name, job in loaded["jobs"].items():
        rights = job["permissions"]
        assert rights.get("contents") == "read", name
        if name in {"image", "chart"}:
            assert rights == {"contents": "read", "packages": "write", "id-token": "write"}
        else:
            assert rights == {"contents": "read"}, name
        for step in job["steps"]:
            if step.get("uses", "").startswith("actions/checkout@"):
                assert step["with"]["persist-credentials"] is False, name


def test_every_action_is_pinned_to_a_commit_with_its_version_beside_it() -> None:
    lines = [line for line in WORKFLOW.read_text().splitlines() if "uses:" in line]
    assert len(lines) > 5
    for line in lines:
        assert re.search(r"uses: [\w.-]+/[\w.-]+@[0-9a-f]{40} # v\d+\.\d+\.\d+$", line), line


# -- what it builds and where it puts it ----------------------------------------------------


def test_the_image_is_the_dockerfile_for_two_platforms_with_sbom_and_provenance() -> None:
    build = uses("image", "docker/build-push-action")["with"]
    assert (REPO / build["file"]).is_file()
    assert build["file"] == "deployments/container/Dockerfile"
    assert build["context"] == "."
    assert set(build["platforms"].split(",")) == {"linux/amd64", "linux/arm64"}
    assert build["push"] is True and build["sbom"] is True
    assert build["provenance"] == "mode=max"
    assert build["tags"] == "${{ env.IMAGE }}:${{ needs.version.outputs.version }}"
    # arm64 is emulated, set up before the build.
    names = [s.get("uses", "").partition("@")[0] for s in steps("image")]
    assert names.index("docker/setup-qemu-action") < names.index("docker/build-push-action")


def test_the_image_is_the_one_the_chart_installs_by_default() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert workflow()["env"]["IMAGE"] == values["image"]["repository"]
    # The chart's default tag is its appVersion, which the version check ties to the tag.
    assert values["image"]["tag"] == ""


def test_the_chart_is_the_repositorys_and_not_pushed_onto_the_images_name() -> None:
    env = workflow()["env"]
    assert (REPO / env["CHART_PATH"] / "Chart.yaml").is_file()
    chart_name = yaml.safe_load((REPO / env["CHART_PATH"] / "Chart.yaml").read_text())["name"]
    assert env["CHART_REPOSITORY"].startswith("oci://")
    chart_ref = f"{env['CHART_REPOSITORY'].removeprefix('oci://')}/{chart_name}"
    assert chart_ref != env["IMAGE"], "the chart would overwrite the image's tags"
    text = run_text("chart")
    assert 'helm package "$CHART_PATH" --version "$VERSION" --app-version "$VERSION"' in text
    assert f'helm push "dist/{chart_name}-${{VERSION}}.tgz" "$CHART_REPOSITORY"' in text


def test_the_chart_packages_as_the_workflow_packages_it(tmp_path: Path) -> None:
    """`helm lint --strict` and `helm package --version --app-version`, through the same Helm
    library the chart tests render with: the archive the push step names is what comes out."""
    helm_python = pytest.importorskip("helm_python")
    report = helm_python.lint(str(CHART), strict=True)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2]
    archive = Path(
        helm_python.package(CHART, destination=tmp_path, version=VERSION, app_version=VERSION)
    )
    assert archive.name == f"kubegpu-{VERSION}.tgz"
    helm_python.expand(tmp_path / "out", archive)
    packaged = yaml.safe_load((tmp_path / "out" / "kubegpu" / "Chart.yaml").read_text())
    assert packaged["version"] == packaged["appVersion"] == VERSION
    assert (tmp_path / "out" / "kubegpu" / "values.schema.json").is_file()


def test_the_image_and_the_chart_are_signed_by_digest() -> None:
    for job in ("image", "chart"):
        names = [s.get("uses", "").partition("@")[0] for s in steps(job)]
        assert "sigstore/cosign-installer" in names, job
    assert 'cosign sign --yes "${IMAGE}@${DIGEST}"' in run_text("image")
    (digest_step,) = [s for s in steps("image") if "cosign sign" in s.get("run", "")]
    assert digest_step["env"]["DIGEST"] == "${{ steps.build.outputs.digest }}"
    assert 'cosign sign --yes "${CHART_REPOSITORY#oci://}/kubegpu@${digest}"' in run_text("chart")


# -- the version check, run here --------------------------------------------------------------


def version_check(root: Path, tag: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the workflow's version step as GitHub would (`shell: python`) in `root`."""
    (step,) = [s for s in steps("version") if s.get("id") == "check"]
    assert step["shell"] == "python"
    script = root / "check.py"
    script.write_text(step["run"], encoding="utf-8")
    output = root / "github-output"
    output.write_text("")
    env = {**os.environ, "GITHUB_REF_NAME": tag, "GITHUB_OUTPUT": str(output)}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True
    )
    return result, output.read_text()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The files the check reads, as in the repository, with a CHANGELOG section for the
    package's version (at a release it is there; until then the entries are Unreleased)."""
    for name in VERSIONED:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    changelog = tmp_path / "CHANGELOG.md"
    text = changelog.read_text(encoding="utf-8")
    if f"## [{VERSION}]" not in text:
        text = text.replace("## [Unreleased]", f"## [Unreleased]\n\n## [{VERSION}] - 2026-01-01")
    changelog.write_text(text, encoding="utf-8")
    return tmp_path


def errors(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("::error::")]


def test_the_repositorys_versions_agree_and_a_release_of_them_passes(tree: Path) -> None:
    result, output = version_check(tree, f"v{VERSION}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert output == f"version={VERSION}\n"


def test_a_release_without_its_changelog_section_is_refused(tree: Path) -> None:
    changelog = tree / "CHANGELOG.md"
    text = changelog.read_text(encoding="utf-8")
    changelog.write_text(text.replace(f"## [{VERSION}]", "## [0.0.0]"), encoding="utf-8")
    result, output = version_check(tree, f"v{VERSION}")
    assert result.returncode == 1 and output == ""
    assert errors(result) == [
        f"::error::CHANGELOG.md has no '## [{VERSION}]' section:"
        " move the Unreleased entries under it"
    ]


def test_a_tag_that_is_not_the_trees_version_names_every_file(tree: Path) -> None:
    result, _ = version_check(tree, "v99.0.0")
    assert result.returncode == 1
    found = errors(result)
    for name in VERSIONED[:-1]:
        assert any(name in line and "'99.0.0'" in line for line in found), name
    assert any("CHANGELOG.md" in line for line in found)


def test_one_file_left_behind_is_named_alone(tree: Path) -> None:
    chart = tree / "deployments/helm/kubegpu/Chart.yaml"
    text = chart.read_text(encoding="utf-8")
    chart.write_text(text.replace(f'appVersion: "{VERSION}"', 'appVersion: "0.0.9"'))
    result, _ = version_check(tree, f"v{VERSION}")
    assert result.returncode == 1
    assert errors(result) == [
        f"::error::deployments/helm/kubegpu/Chart.yaml appVersion is '0.0.9';"
        f" the tag 'v{VERSION}' says '{VERSION}'"
    ]


@pytest.mark.parametrize("tag", [f"v{VERSION}-rc.1", VERSION, f"v{VERSION}.1"])
def test_a_tag_that_is_not_vxyz_is_refused(tree: Path, tag: str) -> None:
    result, output = version_check(tree, tag)
    assert result.returncode == 1 and output == ""
    assert f"::error::tag {tag!r} is not vX.Y.Z" in errors(result)
