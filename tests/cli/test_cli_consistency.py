"""One CLI: one name for the trusted key, an example in every --help, help text on every option."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from feta_release.cli import cli


def _commands() -> Iterator[tuple[str, click.Command]]:
    ctx = click.Context(cli)

    def walk(cmd: click.Command, path: list[str]) -> Iterator[tuple[str, click.Command]]:
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None
                yield from walk(sub, [*path, name])
        else:
            yield " ".join(path), cmd

    yield from walk(cli, [])


COMMANDS = dict(_commands())


def _visible_options(cmd: click.Command) -> list[click.Option]:
    return [p for p in cmd.params if isinstance(p, click.Option) and not p.hidden]


def test_the_trusted_key_option_has_one_name_everywhere():
    """Every visible option naming a key to trust for the site-administrator role is spelled --trusted."""
    spellings = {
        o for cmd in COMMANDS.values() for p in _visible_options(cmd) for o in p.opts if "trust" in o
    }
    assert spellings == {"--trusted"}
    users = sorted(
        name for name, cmd in COMMANDS.items() if any("--trusted" in p.opts for p in _visible_options(cmd))
    )
    for name in (
        "node start",
        "node status",
        "policy check",
        "policy verify",
        "job verify",
        "verify",
        "report",
        "synthesize",
        "verify-synthetic",
    ):
        assert name in users


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_help_has_an_example_whose_options_exist(name: str):
    cmd = COMMANDS[name]
    text = cmd.help or ""
    assert "Example" in text, f"`feta-release {name} --help` has no example"
    example = text[text.index("Example") :]
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    lines = re.sub(r"\\\n\s*", " ", example).splitlines()
    runs = [ln.split("#")[0].strip() for ln in lines if ln.strip().startswith("feta-release ")]
    assert runs, f"{name}: the example shows no feta-release command"
    for run in runs:
        words = shlex.split(run)
        assert " ".join(words[1 : 1 + len(name.split())]) == name, run
        unknown = [w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in known]
        assert not unknown, f"{name}: the example uses {unknown}, which the command does not have"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help_text(name: str):
    missing = [p.opts[0] for p in _visible_options(COMMANDS[name]) if not p.help]
    assert not missing, f"{name}: {missing} without help text"


def _keys(tmp_path: Path) -> tuple[Path, Path]:
    from feta_release.signing import generate_keypair

    _, admin = generate_keypair(tmp_path, "admin")
    _, coord = generate_keypair(tmp_path, "coordinator")
    return admin, coord


def test_old_spellings_are_hidden_deprecated_aliases(tmp_path: Path):
    admin, _ = _keys(tmp_path)
    from edge.cli import node

    for cmd in ("node start", "node status", "job verify"):
        assert "--trusted-policy-key" not in COMMANDS[cmd].get_help(click.Context(COMMANDS[cmd]))
        assert "--policy-trusted" not in COMMANDS[cmd].get_help(click.Context(COMMANDS[cmd]))
    # The old spelling still reaches the same check (here: node start's list of what is missing), with a
    # warning.
    res = CliRunner().invoke(node, ["start", "--trusted-policy-key", str(admin)])
    assert "--trusted-policy-key is deprecated; use --trusted" in res.output
    assert "needs --data, --policy, --ledger" in str(res.exception) and "--trusted" not in str(res.exception)
    res = CliRunner().invoke(node, ["start", "--trusted", str(admin)])
    assert "deprecated" not in res.output and "--trusted" not in str(res.exception)
    res = CliRunner().invoke(node, ["start", "--data", str(admin)])
    assert "--trusted," in str(res.exception)  # the missing key is named by its one spelling


def test_job_verify_keeps_roles_apart(tmp_path: Path):
    """--trusted once named COORDINATOR keys in `job verify`: now it is the site administrator's key (with
    --policy) everywhere, so a coordinator key given the old way is refused with the fix, never trusted for
    another role."""
    admin, coord = _keys(tmp_path)
    job = tmp_path / "job.signed.json"
    job.write_text("{}")
    res = CliRunner().invoke(cli, ["job", "verify", str(job), "--trusted", str(coord)])
    assert res.exit_code == 2 and "--coordinator COORDINATOR.pub" in res.output
    res = CliRunner().invoke(cli, ["job", "verify", str(job)])
    assert res.exit_code == 2 and "give --coordinator" in res.output


PROGRESS_WORDS = ("quiet", "progress", "silent", "verbose", "spinner")


def test_the_progress_option_has_one_name_everywhere():
    """Every visible option about progress output is click's --progress/--no-progress pair (on by default),
    and every command that draws bars, spinners or streamed progress lines has it."""
    found: dict[str, click.Option] = {}
    for name, cmd in COMMANDS.items():
        for p in _visible_options(cmd):
            names = (*p.opts, *p.secondary_opts)
            if any(w in o for o in names for w in PROGRESS_WORDS):
                assert (p.opts, p.secondary_opts) == (["--progress"], ["--no-progress"]), f"{name}: {names}"
                assert p.default is True and p.help, name
                found[name] = p
    assert {"train", "synthesize", "audit", "coordinator run", "demo"} <= set(found)


@pytest.mark.parametrize("name", ["synthesize", "audit", "coordinator run", "demo"])
def test_progress_flag_reaches_the_command(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """--no-progress arrives as progress=False, --progress and the default as True."""
    cmd = COMMANDS[name]
    seen: list[bool] = []

    def spy(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        seen.append(kw.get("progress"))

    monkeypatch.setattr(cmd, "callback", spy)
    (tmp_path / "job.toml").write_text("")
    (tmp_path / "k").write_text("")
    required = {
        "synthesize": ["--release", "r", "--out", "o"],
        "audit": ["--preset", "tiny", "--out", "a.json"],
        "coordinator run": [
            str(tmp_path / "job.toml"),
            "--sites",
            "a",
            "--key",
            str(tmp_path / "k"),
            "--out",
            "o",
        ],
        "demo": [],
    }[name]
    for flag, want in (([], True), (["--no-progress"], False), (["--progress"], True)):
        res = CliRunner().invoke(cmd, [*required, *flag])
        assert res.exit_code == 0, res.output
        assert seen[-1] is want, (name, flag)


def test_train_no_progress_and_its_deprecated_quiet_alias(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """train's progress bars follow --progress/--no-progress; the old --quiet still works (hidden, with a
    warning)."""
    import coordinator.local_run as local_run

    enabled: list[bool] = []

    def fake_run(cfg, data, out, opts):  # noqa: ANN001, ANN202
        enabled.append(opts.reporter.enabled)
        raise click.exceptions.Exit(0)

    monkeypatch.setattr(local_run, "run_train", fake_run)
    cmd = COMMANDS["train"]
    for flag, want in (([], True), (["--no-progress"], False), (["--progress"], True), (["--quiet"], False)):
        res = CliRunner().invoke(cmd, ["--preset", "tiny", "--out", str(tmp_path / "r"), *flag])
        assert res.exit_code == 0, res.output
        assert enabled[-1] is want, flag
        assert ("--quiet is deprecated; use --no-progress" in res.output) == (flag == ["--quiet"])
    assert "--quiet" not in cmd.get_help(click.Context(cmd))


def test_the_device_option_has_one_form_everywhere():
    """--device auto|cpu|cuda: the same choices, default (cpu) and help wherever the computation can move (the
    local driver, the federated coordinator, a site node, the demo)."""
    found: dict[str, click.Option] = {}
    for name, cmd in COMMANDS.items():
        for p in _visible_options(cmd):
            if "--device" in p.opts:
                assert isinstance(p.type, click.Choice) and list(p.type.choices) == ["auto", "cpu", "cuda"], (
                    name
                )
                assert p.default == "cpu" and p.show_default, name
                assert (
                    p.help and p.help.startswith("Where ") and p.help.endswith("(auto: CUDA when visible).")
                ), name
                found[name] = p
    assert set(found) == {"train", "coordinator run", "node start", "demo"}
    from feta_release.training.device import DEVICES

    assert tuple(found["train"].type.choices) == DEVICES  # what resolve_device accepts
