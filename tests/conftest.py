"""Helpers shared by the CLI-level tests."""


def assert_user_error(result, *fragments):
    """A bad-input exit: code 2, only `error: ` lines on stderr, no traceback, each fragment present."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("error: ") for line in lines), result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
