"""The README is the user's door: its config reference is exactly the config's keys, defaults and
descriptions, it stays short, and it points to nothing a user does not have."""

import os

from jobs.spec import config_reference

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end > 0 else None]


def test_readme_config_reference_is_the_configs_own():
    text = open(README).read()
    rows = [line for line in section(text, "Config reference").splitlines() if line.startswith("| `")]
    assert rows == config_reference()


def test_every_config_key_is_described():
    for row in config_reference():
        key, default, meaning = (cell.strip() for cell in row.strip("|").split(" | "))
        assert meaning and meaning != "None", key


def test_readme_is_short_and_self_contained():
    text = open(README).read()
    assert len(text.splitlines()) <= 250
    assert "../shared" not in text  # the team's folder, not the user's
